"""The layout planner behind ``compare.py plan``: which layout to train *this* model on *these* GPUs.

The formulas are shared.theory's, the same functions the tiny runs' ledgers are checked against
(``Model``, ``Layout``: shared/theory/layout.py; ``comm``, ``state``: shared/theory/mesh.py;
``activations``: shared/theory/recompute.py), evaluated at full size (ZeRO-1/2 on the data axis,
Megatron's sequence parallelism, mixed precision, MoE layers inside a pipeline); this module adds
the GPUs and links, the time model, the search and the calibration.

A layout: the data axis (``dp`` replicated weights with ZeRO stage 0/1/2, or ``fsdp`` = ZeRO-3) × pp × cp
× tp, devices in that order (pp outermost, tp innermost, torchtitan's order); MoE models add ep inside the
data axis (experts sharded over ep, replicated over dp/ep = "edp", tp = cp = 1, DeepSeek-V3's layout:
PP × EP × ZeRO-1 DP, arXiv:2412.19437 §3.2). M micro-batches per step run the 1F1B schedule over pp
(bubble (pp−1)/(M+pp−1); stage s holds min(pp−s, M) micro-batches' activations).

Per GPU, per training step:
  memory   parameters, gradients, optimizer state (``state``: one dtype as the runs, or mixed precision:
           bf16 params + grads, fp32 master + Adam m, v = 2 + 2 + 12 bytes, the ZeRO paper's K = 12,
           Rajbhandari et al. 2020 arXiv:1910.02054 §3), sharded by the ZeRO stage over the gradient
           group; activations (``activations``: derived for this model from what each op saves, as
           Korthikanti et al. 2022 arXiv:2205.05198 §4 do for GPT: no dropout and no biases here, fused
           RMSNorm, FlashAttention unless ``attention="math"``); ZeRO-3's gathered-block buffers.
  bytes    per mesh axis and collective (``comm``, nccl-tests' payload S, as the ledgers count).
  time     every matmul of a stage's micro-batch from its sharded shape (a roofline with a size table:
           ``matmul_seconds``), the attention core, the memory-bound ops at HBM bandwidth (``block_seconds``;
           ``matmul="flat"``: FLOPs at ``efficiency`` × peak), plus tp/cp/ep/pp messages on the critical
           path (α–β per link: t = α + S·busbw_factor/β); the step is (M + (pp − 1)/v) slowest micro-batches
           plus the data axis' traffic not hidden behind the backward pass and the optimizer step.
  framework  what Megatron's or DeepSpeed's runtime sends and waits for beyond the ledgers' bytes
           (``Cluster.framework``: shared/plan_framework.py, each from the framework's source).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shared import efficiency
from shared.plan_framework import FRAMEWORKS, accumulate_seconds, check, critical_recv, framework_view  # noqa: F401
from shared.theory import BUSBW_FACTOR
from shared.theory.dp import zero_state  # noqa: F401 - the formulas the runs are checked against, re-exported:
from shared.theory.layout import Layout, Model  # noqa: F401   plan.comm is theory.mesh.comm, one form
from shared.theory.mesh import comm, comm_bytes, stage_params, state  # noqa: F401
from shared.theory.pp import in_flight  # noqa: F401
from shared.theory.recompute import activation_elements, activations  # noqa: F401

GiB = 1024 ** 3
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("mixed", "mixed-fp32-grads", "pure")  # mixed-fp32-grads: Megatron's fp32 main grads, 18 B/param
OVERLAPS = ("backward", "last", "none")  # the data axis' traffic under the whole backward (DDP buckets, FSDP2
#   prefetch), under the last micro-batch's backward only (Megatron --overlap-grad-reduce), or after it
FLOPS = ("causal", "full", "megatron")  # model-FLOP conventions (model_flops)

def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus factor of ``op`` over ``n`` ranks (a point-to-point send: sendrecv's 1)."""
    return BUSBW_FACTOR.get({"send": "sendrecv"}.get(op, op), lambda n: 1.0)(n)


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per collective call
    beta: float  # bus bandwidth, bytes/s (nccl-tests' busbw: t = α + S·factor/β)
    per_op: dict = field(default_factory=dict, compare=False)  # op -> (α, β) measured (--calibrate)

    def time(self, op: str, count: int, nbytes: int, n: int) -> float:
        alpha, beta = self.per_op.get(op, (self.alpha, self.beta))
        factor = bus_factor(op, n)
        return count * alpha + nbytes * factor / beta


# GPU presets (``--gpu NAME``): peak dense (no 2:4 sparsity) BF16 = FP16 tensor-core FLOP/s, HBM bytes and
# bandwidth, NVLink (the datasheets give both directions summed: each way is half) and the inter-node
# network per GPU. SXM parts, as the published runs used.
#  A100 40 GB / 80 GB SXM: 312 TFLOP/s BF16 and FP16 dense (624 with sparsity); HBM2 1 555 GB/s (40 GB),
#    HBM2e 2 039 GB/s (80 GB); NVLink 3 600 GB/s = 300 GB/s each way (NVIDIA A100 Tensor Core GPU datasheet,
#    2021, the specifications table). Across nodes: DGX A100 has 8 single-port ConnectX-6 HDR 200 Gb/s
#    InfiniBand HCAs, one per GPU = 25 GB/s (NVIDIA DGX A100 datasheet; Narayanan et al. 2021, arXiv:2104.04473
#    §5: Selene's nodes, "eight NVIDIA 80-GB A100 GPUs … eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs").
#  H100 SXM5: 989 TFLOP/s dense BF16 and FP16 (1 979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 4
#    900 GB/s = 450 GB/s each way (NVIDIA H100 Tensor Core GPU datasheet, 2023, the H100 SXM column).
#  H200 SXM: 989 TFLOP/s dense BF16/FP16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (NVIDIA H200 Tensor Core
#    GPU datasheet, 2024, the H200 SXM column).
#  H100/H200 across nodes: one ConnectX-7 NDR InfiniBand port per GPU, 400 Gb/s = 50 GB/s (NVIDIA DGX H100
#    user guide: 8 × single-port ConnectX-7 for the compute fabric; the Llama 3 paper's 405B run, Grattafiori
#    et al. 2024 arXiv:2407.21783 §3.3.1: "400 Gbps interconnects between GPUs").
#  α (per-call latency): no vendor figure; 5 µs inside a node, 10 µs across, the order of nccl-tests'
#    small-message times on NVSwitch / InfiniBand systems — an assumption.
#  fp32 (--dtype float32) runs on the same tensor cores as TF32 here: not modelled separately.
GPUS = {
    "a100-40gb": {"memory": 40 * 10 ** 9, "flops": 312e12, "hbm": 1555e9, "intra": Link(5e-6, 300e9),
                  "inter": Link(10e-6, 25e9)},
    "a100-80gb": {"memory": 80 * 10 ** 9, "flops": 312e12, "hbm": 2039e9, "intra": Link(5e-6, 300e9),
                  "inter": Link(10e-6, 25e9)},
    "h100": {"memory": 80 * 10 ** 9, "flops": 989e12, "hbm": 3.35e12, "intra": Link(5e-6, 450e9),
             "inter": Link(10e-6, 50e9)},
    "h200": {"memory": 141 * 10 ** 9, "flops": 989e12, "hbm": 4.8e12, "intra": Link(5e-6, 450e9),
             "inter": Link(10e-6, 50e9)},
}


def gpu(name: str) -> dict:
    """The preset ``name`` (case-insensitive; "a100" = the 80 GB part), or ValueError naming the known ones."""
    key = {"a100": "a100-80gb", "h100-sxm": "h100", "h200-sxm": "h200"}.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ValueError(f"unknown GPU preset {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


# the matmul size table (smallest side, fraction of the largest GEMMs' rate): see "the matmul time model"
SIZE_FACTOR = ((64, 0.5), (128, 0.7), (256, 0.8), (512, 0.9), (1024, 0.95), (2048, 1.0))


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    memory: float = GPUS["h100"]["memory"]  # bytes per GPU
    flops: float = GPUS["h100"]["flops"]  # peak FLOP/s per GPU in the compute dtype
    efficiency: float = 0.8  # the fraction of peak the largest matmuls reach ("flat": every FLOP)
    intra: Link = GPUS["h100"]["intra"]
    inter: Link = GPUS["h100"]["inter"]

    headroom: float = 0.1  # kept free: the CUDA context, NCCL buffers, the allocator's fragmentation
    hbm: float = GPUS["h100"]["hbm"]  # HBM bytes/s (the roofline's memory bound, the elementwise ops)
    matmul: str = "shapes"  # "shapes": every matmul from its shape (roofline); "flat": FLOPs × efficiency
    size_table: tuple = SIZE_FACTOR  # (smallest side, fraction of the largest GEMMs' rate), ascending
    hbm_table: tuple = ()  # (bytes per transfer, fraction of ``hbm``), ascending; () = every size at ``hbm``
    overlap: bool | str = True  # the data axis' traffic: OVERLAPS ("backward" = True, "none" = False: after the
    #                             backward, as Megatron-LM's 2021 DDP all-reduced the gradients once it was done)
    tp_overlap: bool = False  # tensor-parallel traffic hidden behind the matmuls (torchtitan's async TP);
    #                           off by default: Megatron and plain DTensor TP run it on the critical path
    overlap_cost: tuple = (0.0, 0.0)  # (intra, inter): the fraction of an overlapped transfer's time the
    #                                   compute beside it loses (its kernels' SMs; efficiency.OVERLAP_COST)
    framework: str = "torchtitan"  # what it sends and waits for beyond the ledgers' bytes (shared/plan_framework.py)
    attention: tuple = ()  # ((heads, T, fraction of peak), ...) ascending: FlashAttention's causal forward +
    #                        backward by width (sequences × heads of a micro-batch on one rank) and sequence
    #                        length (efficiency.TABLES, a profile); () = ATTENTION_EFFICIENCY

    def __post_init__(self):
        check(self.framework)  # an unknown framework: refused, not run as the default

    @classmethod
    def preset(cls, name: str, gpus: int, dtype: str = "bfloat16", profile: dict | None = None, **kw) -> Cluster:
        """A cluster of ``gpus`` of the preset ``name`` with what it achieves (shared/efficiency.py: memory as
        the device reports it, the GEMM table by shape, HBM copy and nccl-tests busbw per op, each cited), or
        with a measured ``profile`` (efficiency.load) in their place."""
        gpu(name)  # the known names, or ValueError
        table = efficiency.TABLES[{"a100": "a100-80gb", "h100-sxm": "h100", "h200-sxm": "h200"}.get(
            name.lower(), name.lower())]
        t = {"memory": table["memory"], **(profile or table)}  # a profile without memory: the preset's
        top = max(f for _, f in t["matmul"])
        link = lambda ops: Link(*ops.get("all_gather", next(iter(ops.values()))), per_op=dict(ops))
        return cls(gpus, **{"memory": t["memory"], "flops": efficiency.peak(t, dtype),
                            "efficiency": top, "size_table": tuple((s, round(f / top, 6)) for s, f in t["matmul"]),
                            "intra": link(t["intra"]), "inter": link(t["inter"]), "hbm": t["hbm_copy"],
                            "hbm_table": tuple(t.get("hbm_table", ())),
                            "overlap_cost": tuple(t.get("overlap_cost", (0.0, 0.0))),
                            "attention": tuple(t.get("attention", ())), **kw})

    def link_cost(self, link: Link) -> float:
        """overlap_cost of ``link`` (intra or inter)."""
        return self.overlap_cost[link is self.inter and link is not self.intra]

    def hbm_at(self, nbytes: float) -> float:
        """The HBM bandwidth a transfer of ``nbytes`` streams at (hbm_table's step at its size)."""
        out = 1.0 if not self.hbm_table else self.hbm_table[0][1]
        for size, f in self.hbm_table:
            if nbytes >= size:
                out = f
        return self.hbm * out

    def attention_at(self, seq: int, width: int = 16) -> float:
        """FlashAttention's fraction of peak for ``width`` heads × sequences at sequence length ``seq``: the
        table's widest width at or below ``width`` (its narrowest below that), then its step at or below
        ``seq`` (its first below the first); ATTENTION_EFFICIENCY without a table."""
        if not self.attention:
            return ATTENTION_EFFICIENCY
        widths = sorted({h for h, _, _ in self.attention})
        w = max([h for h in widths if h <= width] or widths[:1])
        rows = [(t, f) for h, t, f in self.attention if h == w]
        out = rows[0][1]
        for t, f in rows:
            if seq >= t:
                out = f
        return out

    @property
    def overlap_mode(self) -> str:
        return {True: "backward", False: "none"}.get(self.overlap, self.overlap)

    @property
    def usable(self) -> float:
        return self.memory * (1 - self.headroom)

    def link(self, stride: int, size: int) -> Link:
        """The slowest link of a group of ``size`` ranks ``stride`` apart (nodes hold consecutive ranks)."""
        return self.intra if stride * size <= self.gpus_per_node else self.inter


# --- the matmul time model --------------------------------------------------------------------------
# Every matmul of the step is timed from its sharded shape (M × K) · (K × N), with a roofline
# (Williams et al. 2009, "Roofline: an insightful visual performance model", CACM 52(4)):
#     t = max(2·M·N·K / (peak · efficiency · size_factor(min(M, N, K))), (M·K + K·N + M·N)·b / HBM bandwidth)
# ``efficiency`` (Cluster) is the fraction of peak the largest GEMMs reach. 0.8 by default: cuBLAS's
# large bf16 GEMMs on A100 and H100 reach 75–85 % of the dense peak (NVIDIA Deep Learning Performance
# Guide, "Matrix Multiplication Background", the GEMM-size figures; this workplace's H200 runs bf16 matmuls
# at about 790 of 989 TFLOP/s). ``size_factor``: the same guide's tile and wave quantization — a GEMM whose
# smallest side is under a few thread-block tiles (128–256) leaves SMs idle or tiles half empty — as a
# step table on the smallest side (below 128 the roofline's memory bound takes over as well). The table's
# values are an assumption, not a measurement; `compare.py bench --json` + `plan --calibrate --matmul shapes`
# replaces them with the machine's own (its square matmuls' rate per size over the largest's: measured_table).
# SIZE_FACTOR (defined above Cluster, its default): the step table on the smallest side.
# FlashAttention's fused core: 50–73 % of peak forward + backward on A100 (Dao 2023, FlashAttention-2,
# arXiv:2307.08691 §4.1, Figure 5: 225 TFLOP/s of 312 at best, head dim 128); 0.5: causal, backward-heavy.
ATTENTION_EFFICIENCY = 0.5


def size_factor(smallest: int, table=SIZE_FACTOR) -> float:
    """``table``'s step for a matmul whose smallest side is ``smallest`` (SIZE_FACTOR: monotone, 1 from
    2048 up); below the table's first side, its first factor scaled down in proportion."""
    out = table[0][1] * min(1.0, smallest / table[0][0])
    for side, f in table:
        if smallest >= side:
            out = f
    return out


def matmul_seconds(m: int, n: int, k: int, cluster: Cluster, b: int = 2, batch: int = 1) -> float:
    """One (m×k)·(k×n) matmul (``batch`` of them): the roofline of its FLOPs at the size's efficiency and
    the bytes it reads and writes once at HBM bandwidth. ``cluster.matmul == "flat"``: FLOPs at
    efficiency × peak, as before (and after --calibrate, whose rate is measured)."""
    flops = 2 * m * n * k * batch
    if cluster.matmul == "flat":
        return flops / (cluster.flops * cluster.efficiency)
    compute = flops / (cluster.flops * cluster.efficiency * size_factor(min(m, n, k), cluster.size_table))
    return max(compute, (m * k + k * n + m * n) * b * batch / cluster.hbm)


def train_matmul_seconds(m: int, n: int, k: int, cluster: Cluster, b: int = 2, batch: int = 1,
                         forwards: int = 1) -> float:
    """Forward Y = X·W (m, n, k), and backward's dX = dY·Wᵀ (m, k, n) and dW = Xᵀ·dY (k, n, m);
    ``forwards`` = 2 with full recomputation."""
    fwd = matmul_seconds(m, n, k, cluster, b, batch)
    return forwards * fwd + matmul_seconds(m, k, n, cluster, b, batch) + matmul_seconds(k, n, m, cluster, b, batch)


# --- what one rank holds -----------------------------------------------------------------------














# --- what one rank sends -----------------------------------------------------------------------








# --- time ----------------------------------------------------------------------------------------


def _strides(layout: Layout) -> dict[str, tuple[int, int]]:
    """Axis label -> (stride, size) on the device order pp, data, cp, tp (ep: the innermost part of data)."""
    t, c, d = layout.tp, layout.cp, layout.dp
    out = {"tp": (1, t), "cp": (t, c), layout.data_axis: (t * c, d), "pp": (t * c * d, layout.pp),
           "ep": (t * c, layout.ep), "edp": (t * c * layout.ep, d // layout.ep)}
    if layout.grad_label and "+" in layout.grad_label:  # data and cp together: the wider of the two
        out[layout.grad_label] = (t, c * d)
    return out


def comm_time(view: dict, layout: Layout, cluster: Cluster) -> dict[str, float]:
    """Seconds per axis label: Σ over ops of count·α + bytes·busbw_factor/β on the axis' slowest link."""
    strides, out = _strides(layout), {}
    for label, ops in view.items():
        stride, size = strides[label]
        link = cluster.link(stride, size)
        out[label] = sum(link.time("send" if op == "recv" else op, cnt, nb, size) for op, (cnt, nb) in ops.items()
                         if op != "recv" or critical_recv(cluster.framework, label))
    return out


@dataclass
class Prediction:
    layout: Layout
    memory: dict[str, int]  # params, grads, optimizer, activations, buffers, total (the fullest stage)
    comm: dict[str, dict[str, tuple[int, int]]]  # the busiest stage's view
    bubble: float
    time: dict[str, float]  # compute, exposed comm per label, step
    mfu: float
    fits: bool
    reason: str = ""
    hfu: float = 0.0  # hardware FLOPs (recomputation, and math attention's whole T×T) over the step at peak

    def to_json(self) -> dict:
        return {"layout": self.layout.name, **{k: getattr(self.layout, k) for k in (
            "dp", "tp", "pp", "cp", "ep", "zero", "microbatches", "sp", "recompute", "virtual", "trim", "cp_style",
            "pp_scatter")},
            "memory": self.memory, "comm": {a: {op: list(v) for op, v in ops.items()} for a, ops in self.comm.items()},
            "bubble": self.bubble, "time": self.time, "mfu": self.mfu, "hfu": self.hfu, "fits": self.fits,
            "reason": self.reason}


def model_flops(model: Model, batch: int, convention: str = "causal") -> float:
    """A step's model FLOPs (batch × T tokens) in one of FLOPS' conventions. causal: 6 per matmul parameter
    + causal attention 6·L·T·D per token (each query meets T/2 keys; this planner's MFU column); full:
    attention over all T keys, 12·L·T·D (PaLM, Chowdhery et al. 2022 arXiv:2204.02311 App. B; Korthikanti
    et al. 2022 eq. 7; torchtitan's get_num_flop_per_token); megatron: full plus the recomputed forward of every block
    (Narayanan et al. 2021 arXiv:2104.04473 eq. 3: 96·B·s·l·h²·(1 + s/6h + V/16lh), what their TFLOP/s count)."""
    if convention not in FLOPS:
        raise ValueError(f"unknown FLOP convention {convention!r}; choose from {', '.join(FLOPS)}")
    per = model.flops_per_token("none")
    attn = 6 * model.layers * model.seq * model.dim
    full = per + attn
    if convention == "megatron":  # a second forward: 2 per block matmul parameter + full attention's 4·L·T·D
        full += (full - 6 * model.dim * model.vocab) / 3
    return batch * model.seq * (per if convention == "causal" else full)


def hardware_flops(model: Model, layout: Layout, batch: int, attention: str = "flash") -> float:
    """The FLOPs the GPUs execute: the layout's recomputation included (Model.flops_per_token); unfused
    (math) attention computes the whole T×T, twice the causal half."""
    per = model.flops_per_token(layout.recompute)
    if attention == "math":
        per += (3 + (layout.recompute != "none")) * 2 * model.layers * model.seq * model.dim
    return batch * model.seq * per


def block_seconds(model: Model, layout: Layout, m: int, cluster: Cluster, b: int = 2,
                  attention: str = "flash") -> dict[str, float]:
    """One block's training (forward, backward, a full recomputation's second forward) for one micro-batch
    of m sequences × T/cp tokens on one rank, by part: "matmul" (W_qkv, W_o, the MLP's, each from its
    sharded shape: train_matmul_seconds), "attention" (FlashAttention: its causal FLOPs at
    ATTENTION_EFFICIENCY × peak; math: QKᵀ and ·V as batched matmuls over the whole T×T, as Megatron's
    unfused kernels compute them, and the softmax's scores through HBM) and "elementwise" (the
    memory-bound ops: each reads and writes its tensors once forward, twice backward: 2 norms, 2 residual
    adds, GELU | SwiGLU, RoPE on q and k, dropout's masked copies)."""
    d, t, f = model.dim, layout.tp, model.ffn
    n = m * model.seq // layout.cp
    fw = 2 if layout.recompute == "full" else 1
    out = {}
    if model.moe:  # the router, then E/ep local experts with k·n·ep/E tokens each (balanced routing)
        local = model.experts // layout.ep
        tok = max(1, model.topk * n * layout.ep // model.experts)
        mlp = train_matmul_seconds(n, model.experts, d, cluster, b, 1, fw) + \
            train_matmul_seconds(tok, (model.mlp_matrices - 1) * f, d, cluster, b, local, fw) + \
            train_matmul_seconds(tok, d, f, cluster, b, local, fw)
    else:
        mlp = train_matmul_seconds(n, (model.mlp_matrices - 1) * f // t, d, cluster, b, 1, fw) + \
            train_matmul_seconds(n, d, f // t, cluster, b, 1, fw)
    out["matmul"] = train_matmul_seconds(n, (d + 2 * model.kv_dim) // t, d, cluster, b, 1, fw) + \
        train_matmul_seconds(n, d, d // t, cluster, b, 1, fw) + mlp
    heads, hd, T = model.heads // t, model.head_dim, model.seq
    again = 2 if layout.recompute in ("full", "selective") else 1
    if attention == "flash":  # causal: each query meets T/2 keys on average (the ring included)
        flops = (2 + again) * 2 * n * T * heads * hd
        out["attention"] = flops / (cluster.flops * cluster.attention_at(T, m * heads))  # heads on this rank
        scores = 0
    else:
        tq = model.seq // layout.cp
        out["attention"] = train_matmul_seconds(tq, T, hd, cluster, b, m * heads, again) + \
            train_matmul_seconds(tq, hd, T, cluster, b, m * heads, again)
        scores = 2 * heads * T * (1 + model.dropout)  # scale-mask-softmax (and dropout) in and out, per token
    rep = d / t if layout.sp else d
    per_token = 4 * rep + 6 * rep + model.mlp_matrices * f / t + \
        model.rope * 2 * (d + model.kv_dim) / t + model.dropout * 5 * rep
    # each memory-bound op streams tensors of about n × (D or D/t) elements (the scores: n × T per head):
    # their size sets the bandwidth. The scores' softmax and dropout belong to the attention core, which
    # selective recomputation runs again (``again``) as full recomputation does (Korthikanti et al. 2022 §5)
    out["elementwise"] = (2 + fw) * per_token * n * b / cluster.hbm_at(n * rep * b) + \
        (2 + again) * scores * n * b / cluster.hbm_at(n * heads * T * b)
    return out


def stage_seconds(model: Model, layout: Layout, stage: int, batch: int, view: dict, cluster: Cluster,
                  b: int = 2, attention: str = "flash") -> dict:
    """One micro-batch on one rank of ``stage``: compute (its L/pp blocks, block_seconds; the head's matmul
    and the fp32 loss on the last stage) and the critical-path traffic (tp, cp, ep, pp: a share 1/M of the
    step's); and the step's data-axis traffic; seconds per axis label. ``cluster.matmul == "flat"``: the
    blocks' training FLOPs at efficiency × peak (the calibrated runs)."""
    m = batch // (layout.dp * layout.microbatches)
    n = m * model.seq // layout.cp  # tokens per micro-batch
    per = layout.stage_layers(model.layers, stage)
    if cluster.matmul == "flat":
        head = 6 * model.dim * model.vocab
        blocks = (model.flops_per_token(layout.recompute) - head) * per / model.layers
        compute = n * (blocks + (stage == layout.pp - 1) * head) / layout.tp / (cluster.flops * cluster.efficiency)
        parts = {"flat": compute}
    else:
        blk = block_seconds(model, layout, m, cluster, b, attention)
        parts = {k: per * v for k, v in blk.items()}
        if stage == layout.pp - 1:  # the head (n × V/t logits) and the fp32 loss (write, read, write, read)
            parts["head"] = train_matmul_seconds(n, model.vocab // layout.tp, model.dim, cluster, b) + \
                4 * n * model.vocab // layout.tp * 4 / cluster.hbm
        compute = sum(parts.values())
    seconds = comm_time(view, layout, cluster)
    critical = sum(v for k, v in seconds.items() if k in ("tp", "cp", "ep", "pp")) / layout.microbatches
    if cluster.tp_overlap and "tp" in seconds:  # async TP: hidden behind the block matmuls it feeds, the
        hid = min(seconds["tp"] / layout.microbatches, parts.get("matmul", 0.0))  # SMs its kernels take
        critical -= hid * (1 - cluster.link_cost(cluster.link(*_strides(layout)["tp"])))  # slowing them
    return {"compute_mb": compute, "critical_mb": critical, "parts_mb": parts,
            "data": sum(v for k, v in seconds.items() if k not in ("tp", "cp", "ep", "pp")), "axes": seconds}


def predict(model: Model, layout: Layout, cluster: Cluster, batch: int, b: int = 2, precision: str = "mixed",
            style: str = "builtin", attention: str = "flash", time_if_over: bool = True) -> Prediction:
    """Memory, traffic and step time of ``layout``, each from the stage that needs most of it (the first
    stage holds most activations, the last the head, a middle one sends both ways; the others are alike).
    Step = (M + (pp−1)/v) × the slowest stage's micro-batch (compute + critical traffic) + the data-axis
    traffic not hidden behind the backward pass (2/3 of the compute). ``time_if_over=False`` skips the
    time of a layout that does not fit (the search's fast path)."""
    S, M = layout.pp, layout.microbatches
    stages = sorted({0, min(1, S - 1), S - 1})
    mems = []
    for s in stages:
        st = state(model, layout, s, b, style, precision)
        act = activations(model, layout, s, batch, b, attention)
        buffers = zero3_buffers(model, layout, s, b)
        mems.append({**st, "activations": act, "buffers": buffers, "total": sum(st.values()) + act + buffers})
    memory = max(mems, key=lambda x: x["total"])
    fits = memory["total"] <= cluster.usable
    largest = max(("params", "grads", "optimizer", "activations"), key=memory.get)
    reason = "" if fits else (f"needs {memory['total'] / GiB:.2f} GiB > {cluster.usable / GiB:.2f} GiB usable "
                              f"(largest: {largest} {memory[largest] / GiB:.1f} GiB)")
    if not (fits or time_if_over):
        return Prediction(layout, memory, {}, layout.bubble, {}, 0.0, fits, reason)
    views = [comm(model, layout, s, batch, b, style) for s in stages]
    if precision == "mixed-fp32-grads":  # the gradients reduced as they are kept: fp32, twice the bf16 bytes
        views = [fp32_grads(v, layout) for v in views]
    if cluster.framework != "torchtitan":
        views = [framework_view(v, model, layout, s, batch, b, cluster.framework, precision)
                 for s, v in zip(stages, views)]
    times = [stage_seconds(model, layout, s, batch, v, cluster, b, attention) for s, v in zip(stages, views)]
    for s, x in zip(stages, times):  # the framework's own per-micro-batch work (DeepSpeed's fp32 accumulation)
        extra = 0.0 if cluster.matmul == "flat" else accumulate_seconds(model, layout, s, cluster.framework,
                                                                         precision, cluster.hbm_at(1e9))
        if extra:
            x["compute_mb"] += extra
            x["parts_mb"]["accumulate"] = extra
    slow = max(times, key=lambda x: x["compute_mb"] + x["critical_mb"])
    ticks = M + (S - 1) / layout.virtual  # the slowest stage's micro-batches, plus the fill and drain
    # the data axis' traffic hides behind the backward (2/3 of a micro-batch's compute): every micro-batch's
    # (DDP buckets, FSDP2 prefetch), the last one's (Megatron's --overlap-grad-reduce), or none. ZeRO-3
    # gathers the next block's weights during the forward as well (FSDP's forward prefetch: Zhao et al.
    # 2023, arXiv:2304.11277 §3.3; FSDP2's implicit prefetch), so its traffic hides behind the whole compute
    window = 1.0 if layout.zero == 3 else 2 / 3
    hidden = window * slow["compute_mb"] * {"backward": M, "last": 1, "none": 0}[cluster.overlap_mode]
    data = max(x["data"] for x in times)
    exposed = max(0.0, data - hidden)
    if data > exposed:  # what hides still takes SMs from the compute it runs beside (Calculon's processor_usage)
        label = layout.grad_label or layout.data_axis
        exposed += (data - exposed) * cluster.link_cost(cluster.link(*_strides(layout).get(label, (1, 1))))
    # the optimizer step: memory-bound, every state byte read and written once (Adam: no matmul)
    optimizer = 0.0 if cluster.matmul == "flat" else 2 * sum(
        memory[k] for k in ("params", "grads", "optimizer")) / cluster.hbm
    step = ticks * (slow["compute_mb"] + slow["critical_mb"]) + exposed + optimizer
    mfu = model_flops(model, batch) / (step * layout.gpus * cluster.flops)
    hfu = hardware_flops(model, layout, batch, attention) / (step * layout.gpus * cluster.flops)
    return Prediction(layout, memory, max(views, key=lambda v: sum(comm_bytes(v).values())), layout.bubble,
                      {"compute": ticks * slow["compute_mb"], "critical": ticks * slow["critical_mb"],
                       "exposed_data": exposed, "optimizer": optimizer, "step": step,
                       **{f"compute_{k}": ticks * v for k, v in slow["parts_mb"].items()},
                       **{f"comm_{k}": v for k, v in slow["axes"].items()}},
                      mfu, fits, reason, hfu)


def zero3_buffers(model: Model, layout: Layout, stage: int, b: int) -> int:
    """ZeRO-3's gathered weights on one rank: two blocks (the one in use and the prefetched one); under a
    pipeline the stage's whole gathered weights, kept while its micro-batches are in flight (Llama 3,
    arXiv:2407.21783 §3.3.2: "for model weights, we do not reshard after forward computation";
    torchtitan's FSDP2 with PP: reshard_after_forward=False). The traffic stays counted per micro-batch, as
    the repository's runs gather (comm): more than those frameworks send, and hidden behind the compute."""
    if layout.zero != 3:
        return 0
    sp = stage_params(model, layout, stage)
    return (sp["units"] + sp["vectors"]) * b if layout.pp > 1 else 2 * sp["block"] * b


def fp32_grads(view: dict, layout: Layout) -> dict:
    """``view`` with the gradient group's reductions (all-reduce, reduce-scatter) at fp32: twice the bytes
    of the bf16 gradients the ledgers count (Megatron's fp32 main grads with
    --accumulate-allreduce-grads-in-fp32; torchtitan's default mixed_precision_reduce = float32)."""
    label = layout.grad_label or layout.data_axis
    if label not in view:
        return view
    ops = {op: (cnt, 2 * nb if op in ("all_reduce", "reduce_scatter") else nb) for op, (cnt, nb) in view[label].items()}
    return {**view, label: ops}


# --- the search ------------------------------------------------------------------------------------


def _divisors(n: int, cap: int | None = None) -> list[int]:
    return [k for k in range(1, (cap or n) + 1) if n % k == 0]


def invalid(model: Model, layout: Layout, batch: int, cluster: Cluster | None = None) -> str | None:
    """Why ``layout`` cannot run this model (one line), or None."""
    checks = [(batch % (layout.dp * layout.microbatches), f"global batch {batch} % (dp·M = "
               f"{layout.dp}·{layout.microbatches})"),
              ((model.layers + 2 * layout.trim) % layout.pp, f"layers {model.layers} % pp {layout.pp}" + (
                  f" (with {layout.trim} fewer on the first and last stage)" if layout.trim else "")),
              (layout.trim and (layout.pp < 2 or layout.stage_layers(model.layers, 0) < 1),
               f"trim={layout.trim}: needs pp > 1 and a block left on the first and last stage"),
              (model.heads % layout.tp or model.vocab % layout.tp, f"heads/vocab % tp {layout.tp}"),
              (model.seq % layout.cp, f"seq {model.seq} % cp {layout.cp}"),
              (layout.pp > 1 and layout.microbatches < layout.pp, f"M={layout.microbatches} < pp={layout.pp} (1F1B)"),
              (layout.virtual > 1 and (layout.pp == 1 or layout.microbatches % layout.pp or
                                       (model.layers + 2 * layout.trim) % (layout.pp * layout.virtual)),
               f"interleaved v={layout.virtual}: pp > 1, M % pp, layers % (pp·v)"),
              (model.moe and (model.experts % layout.ep or layout.dp % layout.ep), f"experts/dp % ep {layout.ep}"),
              (model.moe and (layout.tp > 1 or layout.cp > 1 or layout.zero > 1),
               "MoE layouts here: dp × ep × pp with ZeRO 0/1"),
              (not model.moe and layout.ep > 1, "ep needs experts"),
              (layout.sp and layout.tp == 1, "sp needs tp"),
              (layout.dp == 1 and layout.zero > 0, "ZeRO needs a data axis"),
              (cluster is not None and layout.gpus != cluster.gpus, f"{layout.gpus} GPUs, not the cluster's")]
    return next((why for bad, why in checks if bad), None)


PINS = {"zero": int, "recompute": str, "sp": bool, "microbatches": int, "virtual": int, "trim": int, "cp_style": str,
        "pp_scatter": bool}


def layouts(model: Model, cluster: Cluster, batch: int, recompute=RECOMPUTE, zero=(0, 1, 2, 3), pins=None):
    """Every valid layout on exactly cluster.gpus GPUs: tp up to two nodes (powers of two), cp powers of two,
    pp dividing the layers, ep dividing the experts, the rest data; micro-batches of 1, 2, 4, … sequences;
    1F1B or interleaved with v = 2, 4 model chunks per rank. ``pins`` ({name: value}, names of PINS) fix
    the ZeRO stage, the recompute policy, sequence parallelism, the micro-batch count M or v (any v whose
    chunks divide the layers: v = 3 included)."""
    pins = pins or {}
    n = cluster.gpus
    zero = (pins["zero"],) if "zero" in pins else zero
    recompute = (pins["recompute"],) if "recompute" in pins else recompute
    tps = [t for t in (1, 2, 4, 8, 16, 32) if t <= 2 * cluster.gpus_per_node and n % t == 0]  # one node, or two
    for t in ([1] if model.moe else tps):
        for c in ([1] if model.moe else [c for c in (1, 2, 4, 8, 16, 32) if n % (t * c) == 0]):
            trim = pins.get("trim", 0)
            for p in _divisors(model.layers + 2 * trim, min(model.layers, n // (t * c))):
                if n % (t * c * p) or (trim and p == 1):
                    continue
                d = n // (t * c * p)
                if "microbatches" in pins:
                    M = pins["microbatches"]
                    sizes = (batch // (d * M),) if batch % (d * M) == 0 else ()
                else:
                    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32) if batch % (d * s) == 0)
                vs = (pins["virtual"],) if "virtual" in pins else (1, 2, 4) if p > 1 and \
                    cluster.framework != "deepspeed" else (1,)  # DeepSpeed's TrainSchedule: 1F1B only
                for e in (_divisors(model.experts) if model.moe else [1]):
                    for z in zero:
                        for mbs in sizes:
                            for rc in recompute:
                                for v in vs:
                                    sp = pins.get("sp", True) and t > 1
                                    lay = Layout(dp=d, tp=t, pp=p, cp=c, ep=e, zero=z, sp=sp, recompute=rc,
                                                 microbatches=batch // (d * mbs), virtual=v, trim=trim,
                                                 cp_style=pins.get("cp_style", "ring"),
                                                 pp_scatter=pins.get("pp_scatter", False))
                                    if invalid(model, lay, batch) is None:
                                        yield lay


def policies(attention: str) -> tuple[str, ...]:
    """Recompute policies worth trying: under FlashAttention selective recompute keeps what none keeps
    (there are no attention scores to drop) and only costs time."""
    return ("none", "full") if attention == "flash" else RECOMPUTE


def plan(model: Model, cluster: Cluster, batch: int, b: int = 2, precision: str = "mixed", style: str = "builtin",
         attention: str = "flash", pins=None) -> tuple[list[Prediction], list[Prediction]]:
    """(fitting layouts fastest first, the rest closest to fitting first)."""
    fit, over = [], []
    for lay in layouts(model, cluster, batch, policies(attention), pins=pins):
        pred = predict(model, lay, cluster, batch, b, precision, style, attention, time_if_over=False)
        (fit if pred.fits else over).append(pred)
    fit.sort(key=rank_key)
    over.sort(key=lambda p: p.memory["total"])
    return fit, over


def wire_bytes(view: dict) -> float:
    """Bytes one rank puts on the wire (payload × the nccl-tests bus factor, with the group's size)."""
    return sum(nb * bus_factor(op, 2)
               for ops in view.values() for op, (_, nb) in ops.items() if op != "recv")


def rank_key(p: Prediction) -> tuple:
    """Fastest first; at equal time (the data axis' traffic hidden behind the backward) less traffic,
    then less memory: so ZeRO-1 beats ZeRO-0 and ZeRO-3 only wins where memory asks for it."""
    return round(p.time["step"], 6), round(wire_bytes(p.comm)), p.memory["total"]


def measured_table(bench: dict, dtype: str) -> tuple:
    """The size table of this machine from ``compare.py bench --json``'s ``compute`` (FLOP/s per rank of an
    n×n×n matmul, every rank at once): ((n, rate(n) / the fastest rate), …) ascending in n; () if none."""
    rates = {int(n): r for n, r in bench.get("compute", {}).get(dtype, {}).items()}
    top = max(rates.values(), default=0)
    return tuple((n, rates[n] / top) for n in sorted(rates)) if top else ()


def calibrated(cluster: Cluster, bench: dict, dtype: str = "float64", framework: str = "torch",
               shapes: bool = False) -> Cluster:
    """Both links from ``compare.py bench --json``'s α–β fits (one machine: intra = inter), per op; the
    compute rate from its ``compute`` measurement (every rank multiplying at once: the median over sizes
    of the FLOP/s per rank in ``dtype``) when present. ``shapes``: instead, every matmul from its shape
    with the machine's measured size table (measured_table) under its fastest measured rate."""
    n = bench["world_size"]
    per_op = {}
    for fit in bench["fits"]:
        if fit["framework"] == framework and fit["beta_bytes_per_s"] not in (None, float("inf")):
            per_op[fit["op"]] = (fit["alpha_s"], fit["beta_bytes_per_s"] * BUSBW_FACTOR[fit["op"]](n))
    if not per_op:
        raise ValueError(f"calibrate: no {framework} α–β fits in the bench file")
    alpha = sorted(a for a, _ in per_op.values())[len(per_op) // 2]
    beta = sorted(bb for _, bb in per_op.values())[len(per_op) // 2]
    link = Link(alpha, beta, per_op | ({"send": per_op["sendrecv"]} if "sendrecv" in per_op else {}))
    rates = sorted(bench.get("compute", {}).get(dtype, {}).values())
    flops = rates[len(rates) // 2] if rates else cluster.flops * cluster.efficiency
    table = measured_table(bench, dtype)
    if shapes and table:
        top = max(bench["compute"][dtype].values())
        return replace(cluster, intra=link, inter=link, flops=top, efficiency=1.0, matmul="shapes", size_table=table)
    return replace(cluster, intra=link, inter=link, flops=flops, efficiency=1.0, matmul="flat")
