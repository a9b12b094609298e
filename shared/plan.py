"""The layout planner behind ``compare.py plan``: which layout to train *this* model on *these* GPUs.

The formulas are the ones shared.theory checks against the ledgers of the tiny runs, written for any
size and one more time generally (ZeRO-1/2 on the data axis, Megatron's sequence parallelism, mixed
precision, MoE layers inside a pipeline); for every layout the mesh and ep patterns can run, ``comm``
and ``state`` give exactly what those runs measure (tests/test_plan.py, tests/test_mesh.py).

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
  time     FLOPs at ``efficiency`` × peak per stage and micro-batch, plus tp/cp/ep/pp messages on the
           critical path (α–β per link: t = α + S·busbw_factor/β); the step is (M + pp − 1) slowest
           micro-batches (1F1B) plus the data axis' traffic not hidden behind the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shared.theory import BUSBW_FACTOR, fsdp2_pipeline_gathers

GiB = 1024 ** 3
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("mixed", "pure")


@dataclass(frozen=True)
class Model:
    """The repo's GPT-style decoder (shared/problem.py) at any size: learned positions, RMSNorm gains,
    no biases, MLP D → r·D → D with GELU, untied head; MoE: a router and E such MLPs per block."""

    layers: int
    dim: int
    heads: int
    vocab: int
    seq: int
    mlp_ratio: int = 4
    experts: int = 0
    topk: int = 1

    def __post_init__(self) -> None:
        for name in ("layers", "dim", "heads", "vocab", "seq", "mlp_ratio", "topk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} is not divisible by heads={self.heads}")
        if self.experts == 1 or self.experts < 0 or self.topk > max(self.experts, 1):
            raise ValueError(f"experts must be 0 or >= 2 and topk <= experts, got E={self.experts}, k={self.topk}")

    @classmethod
    def from_config(cls, cfg) -> Model:
        return cls(cfg.layers, cfg.dim, cfg.heads, cfg.vocab, cfg.seq, 4, cfg.experts, cfg.topk)

    @property
    def ffn(self) -> int:
        return self.mlp_ratio * self.dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def block_units(self, t: int = 1, ep: int = 1) -> tuple[int, int]:
        """(count, elements) of one block's ≥2-D parameters on one rank: W_qkv 3D²/t, W_o D²/t, and
        W_up, W_down D·F/t — or the router D·E and the E/ep local experts' stacked W_up, W_down."""
        d, f = self.dim, self.ffn
        if self.moe:
            return 5, 4 * d * d // t + d * self.experts + 2 * (self.experts // ep) * d * f
        return 4, (4 * d * d + 2 * d * f) // t

    def expert_elements(self, ep: int = 1) -> int:
        """Elements of one block's local experts (0 when dense)."""
        return 2 * (self.experts // ep) * self.dim * self.ffn if self.moe else 0

    @property
    def params(self) -> int:
        """Φ, every parameter: (V + T)·D + L·(block + 2D) + D + D·V."""
        return (self.vocab + self.seq) * self.dim + self.layers * (self.block_units()[1] + 2 * self.dim) + \
            self.dim + self.dim * self.vocab

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies by (k of the E experts)."""
        return self.params - self.layers * self.expert_elements() * (self.experts - self.topk) // max(self.experts, 1)

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token: 6 × the matmul parameters it uses (2 fwd + 4 bwd; the embedding
        lookups are not matmuls) + causal attention 6·L·T·D (QKᵀ and ·V over half the positions);
        full recompute runs the blocks' forward again (+2·blocks), selective the attention core (+2LTD)."""
        d, L = self.dim, self.layers
        blocks = self.active_params - (self.vocab + self.seq) * d - L * 2 * d - d - d * self.vocab
        attn = 2 * L * self.seq * d
        extra = {"none": 0, "selective": attn, "full": 2 * blocks + attn}[recompute]
        return 6 * (blocks + d * self.vocab) + 3 * attn + extra


@dataclass(frozen=True)
class Layout:
    """One way to lay the model out: axis sizes (their product is the GPU count), the ZeRO stage of the
    data axis, M micro-batches per step (each of B/(dp·M) sequences per rank), sequence parallelism,
    the recompute policy and the model chunks per pipeline rank. ``invalid`` says what it cannot run."""

    dp: int = 1  # the data axis' size ("dp" with zero 0/1/2, "fsdp" with zero 3)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # MoE: experts sharded over ep ranks of the data axis
    zero: int = 0
    microbatches: int = 1
    sp: bool = False  # Megatron sequence parallelism with tp
    recompute: str = "none"
    virtual: int = 1  # model chunks per pp rank (interleaved 1F1B, Narayanan et al. 2021 arXiv:2104.04473 §2.2)

    @property
    def bubble(self) -> float:
        """1F1B (p−1)/(M+p−1); interleaved (p−1)/(v·M+p−1)."""
        return (self.pp - 1) / (self.virtual * self.microbatches + self.pp - 1)

    @property
    def data_axis(self) -> str:
        return "fsdp" if self.zero == 3 else "dp"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """Axes of size > 1, outermost first (pp, data, cp, tp)."""
        axes = (("pp", self.pp), (self.data_axis, self.dp), ("cp", self.cp), ("tp", self.tp))
        return tuple((a, n) for a, n in axes if n > 1)

    @property
    def name(self) -> str:
        parts = [f"{a}={n}" for a, n in self.mesh] + ([f"ep={self.ep}"] if self.ep > 1 else [])
        return ",".join(parts) or "1 GPU"

    @property
    def grad_label(self) -> str | None:
        """The group the gradients are averaged / sharded over: data and cp (theory.mesh_grad_axes)."""
        return "+".join(a for a, n in ((self.data_axis, self.dp), ("cp", self.cp)) if n > 1) or None

    @classmethod
    def from_config(cls, cfg, pattern: str = "mesh", variant: str = "") -> Layout:
        """The layout a runnable config trains: the mesh pattern (cfg.mesh) or ep (ep = dp = N)."""
        if pattern == "ep":
            return cls(dp=cfg.world_size, ep=cfg.world_size)
        fsdp = cfg.data_axis == "fsdp"
        return cls(dp=cfg.data_size, tp=cfg.axis("tp"), pp=cfg.axis("pp"), cp=cfg.axis("cp"),
                   zero=3 if fsdp else 0, microbatches=cfg.pipeline_microbatches)


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


# Public figures (each a default; override on the command line or measure with --calibrate):
#  H100 SXM5: 989 TFLOP/s dense BF16, 80 GB HBM3, NVLink 4 900 GB/s per GPU both directions = 450 GB/s
#    each way (NVIDIA H100 Tensor Core GPU datasheet, 2023).
#  H200 SXM: 989 TFLOP/s dense BF16, 141 GB HBM3e, NVLink 900 GB/s (NVIDIA H200 datasheet, 2024).
#  Across nodes: one ConnectX-7 NDR InfiniBand port per GPU, 400 Gb/s = 50 GB/s (NVIDIA DGX H100 user
#    guide: 8 × single-port ConnectX-7 for the compute fabric; the Llama 3 paper's 405B run: 400 Gbps per GPU).
#  α (per-call latency): no vendor figure; 5 µs inside a node, 10 µs across, the order of nccl-tests'
#    small-message times on NVSwitch / InfiniBand systems — an assumption, as is the matmul efficiency
#    (the fraction of peak the kernels reach: 0.6; Llama 3 405B reports 38–43 % MFU end to end, Table 4).
GPUS = {
    "h100": {"memory": 80 * 10 ** 9, "flops": 989e12, "intra": Link(5e-6, 450e9), "inter": Link(10e-6, 50e9)},
    "h200": {"memory": 141 * 10 ** 9, "flops": 989e12, "intra": Link(5e-6, 450e9), "inter": Link(10e-6, 50e9)},
}


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    memory: float = GPUS["h100"]["memory"]  # bytes per GPU
    flops: float = GPUS["h100"]["flops"]  # peak FLOP/s per GPU in the compute dtype
    efficiency: float = 0.6
    intra: Link = GPUS["h100"]["intra"]
    inter: Link = GPUS["h100"]["inter"]

    headroom: float = 0.1  # kept free: the CUDA context, NCCL buffers, the allocator's fragmentation

    @property
    def usable(self) -> float:
        return self.memory * (1 - self.headroom)

    def link(self, stride: int, size: int) -> Link:
        """The slowest link of a group of ``size`` ranks ``stride`` apart (nodes hold consecutive ranks)."""
        return self.intra if stride * size <= self.gpus_per_node else self.inter


# --- what one rank holds -----------------------------------------------------------------------


def stage_params(model: Model, layout: Layout, stage: int) -> dict[str, int]:
    """Elements on one rank of stage ``stage`` before any ZeRO sharding: "units" (≥2-D: wte V·D/t and wpe
    T·D on stage 0, L/pp blocks, the head D·V/t on the last), "n_units", "regathered" (units but the
    embeddings: what ZeRO-3 gathers again for backward), "vectors" (norm gains), "experts" (inside units)
    and "block" (one block with its gains). theory.mesh_stage_units_torch / mesh_stage_param_count."""
    d, t, per = model.dim, layout.tp, model.layers // layout.pp
    first, last = stage == 0, stage == layout.pp - 1
    n_block, block = model.block_units(t, layout.ep)
    embed = first * (model.vocab * d // t + model.seq * d)
    units = per * block + embed + last * (d * model.vocab // t)
    return {"units": units, "n_units": per * n_block + 2 * first + last, "regathered": units - embed,
            "n_regathered": per * n_block + last, "vectors": per * 2 * d + last * d,
            "experts": per * model.expert_elements(layout.ep), "block": block + 2 * d, "per": per}


def state(model: Model, layout: Layout, stage: int, b: int, style: str = "builtin",
          precision: str = "pure") -> dict[str, int]:
    """Bytes of params, grads and optimizer on one rank of ``stage`` (theory.mesh_state_bytes_torch,
    ep_state_bytes_torch; ZeRO-1/2 and mixed precision beyond them). g = dp·cp ranks share the ZeRO
    shards (experts: dp·cp/ep). pure: b, b, 2b per element; mixed: 2, 2, 12 (bf16 + fp32 master, m, v)."""
    sp = stage_params(model, layout, stage)
    total = sp["units"] + sp["vectors"]
    g = layout.dp * layout.cp
    if layout.zero == 3:
        held = total // g if style == "builtin" else sp["units"] // g + sp["vectors"]
        return zero_state(held, 1, 0, precision, b)
    experts = sp["experts"]
    sharded = (total - experts) // g + experts // max(g // layout.ep, 1)  # ZeRO-1/2: experts over edp
    out = zero_state(total, total / sharded if sharded else 1, layout.zero, precision, b)
    out = {k: int(round(v)) for k, v in out.items()}
    if style == "builtin" and stage == 0 and layout.dp == 1 and precision == "pure":
        out["grads"] += model.vocab * model.dim * b * (layout.tp - 1) // layout.tp  # DTensor keeps wte's grad whole
    return out


def zero_state(params: float, shards: float, zero: int, precision: str = "mixed", b: int = 2) -> dict[str, float]:
    """Bytes of ``params`` parameters' state, ZeRO stage ``zero`` over ``shards`` ranks (the ZeRO paper's
    Figure 1): stage 1 shards the optimizer, 2 also the gradients, 3 also the parameters. pure: b, b, 2b
    bytes per parameter (one dtype, as the runs); mixed: 2 (bf16), 2 (bf16), K = 12 (fp32 master, m, v)."""
    pb, gb, ob = (b, b, 2 * b) if precision == "pure" else (2, 2, 12)
    cut = lambda k: params / shards if zero >= k else params
    return {"params": cut(3) * pb, "grads": cut(2) * gb, "optimizer": cut(1) * ob}


def activation_elements(model: Model, layout: Layout, policy: str, attention: str = "flash") -> float:
    """Elements saved for backward per token per block on one rank (b bytes each). Derived from what
    every op of the block saves (the Korthikanti et al. count for this model: no dropout masks, no biases):
    norm1's input D, W_qkv's input D, q, k, v 3D/t, the attention output (W_o's input) D/t; norm2's input
    D, W_up's input D, GELU's input F/t, W_down's input F/t. The norms and the matmul inputs outside the
    tp region are replicated (D each) unless sequence parallelism splits them (D/t). FlashAttention keeps
    only a log-sum-exp per head (2·H/t, fp32); math attention also the (H/t)·T softmax per token.
    MoE (tp = 1): the router's probabilities E, then per routed copy (k) its input D, GELU's input and
    W_down's input 2F, and the expert output D the gate multiplies.
    selective: the attention core (QKᵀ, softmax, ·V) is recomputed: no scores (= none under flash);
    full: only the block's input, D (D/t with sp), is kept."""
    d, f, t = model.dim, model.ffn, layout.tp
    rep = d / t if layout.sp else d  # a replicated (B, T, D) activation
    if policy == "full":
        return rep
    attn = 2 * rep + 4 * d / t + 2 * model.heads / t
    if attention == "math" and policy == "none":
        attn += model.heads * model.seq / t
    mlp = 2 * rep + (model.experts + model.topk * (2 * d + 2 * f) if model.moe else 2 * f / t)
    return attn + mlp


def in_flight(layout: Layout, stage: int) -> int:
    """Most (micro-batch, chunk)s whose activations stage ``stage`` holds at once: 1F1B min(pp − s, M)
    (warm-up pp − s − 1 forwards, then one in, one out); interleaved Megatron's warm-up
    (pp − s − 1)·2 + (v − 1)·pp chunk forwards + 1, at most v·M (= shared.schedule's simulator)."""
    p, v, m = layout.pp, layout.virtual, layout.microbatches
    return min(p - stage, m) if v == 1 else min((p - stage - 1) * 2 + (v - 1) * p + 1, v * m)


def activations(model: Model, layout: Layout, stage: int, batch: int, b: int, attention: str = "flash") -> int:
    """Bytes of activations on one rank of ``stage`` at its peak: min(pp − s, M) micro-batches (1F1B) of
    L/pp blocks (interleaved: Megatron's warm-up count of L/(pp·v)-block chunks) × n = m·T/cp tokens
    (m = B/(dp·M) sequences); with full recompute plus one block's whole set while it is recomputed;
    the last stage adds the micro-batch's fp32 logits n·V/t (the loss)."""
    m = batch // (layout.dp * layout.microbatches)
    n = m * model.seq // layout.cp
    blocks = in_flight(layout, stage) * (model.layers // (layout.pp * layout.virtual))
    elems = blocks * activation_elements(model, layout, layout.recompute, attention)
    if layout.recompute == "full":
        elems += activation_elements(model, layout, "none", attention)
    logits = (stage == layout.pp - 1) * n * model.vocab // layout.tp * 4
    return int(elems * n * b) + logits


# --- what one rank sends -----------------------------------------------------------------------


def comm(model: Model, layout: Layout, stage: int, batch: int, b: int,
         style: str = "builtin") -> dict[str, dict[str, tuple[int, int]]]:
    """{axis label: {op: (count, payload bytes)}} per step on one rank of ``stage`` (recv listed, as the
    ledgers; theory.mesh_comm_torch, ep_comm_torch under balanced routing). M micro-batches of
    m = B/(dp·M) sequences × Tc = T/cp tokens; A = m·Tc·D·b.
    tp: per micro-batch Megatron's 4 all-reduces of A per block, the embedding's and the head's, and the
        vocab-parallel loss' 3·m·Tc·b (2 calls explicit, 3 DTensor); with sp each all-reduce becomes an
        all-gather + a reduce-scatter of A, and the sequence-split gains' and wpe's gradients are
        all-reduced once (theory.tp_sp_comm).
    cp: the ring, 3·cp − 2 sends of K|V (2·m·Tc·D/t) per block and micro-batch.
    pp: A (A/t with sp) to the next stage and its gradient back, per micro-batch (and model chunk).
    ep: per MoE block and micro-batch an all-gather of the (E,) int64 counts from ep ranks and 4
        all-to-alls of k·n·D·b each way (dispatch, combine, their transposes; balanced routing).
    gradient group (dp·cp ranks; experts: edp = dp/ep): ZeRO-0 one all-reduce of the stage's gradients
        (DDP's one bucket; HSDP with tp: one per block + root); ZeRO-1 a reduce-scatter of the gradients
        and an all-gather of the updated parameters; ZeRO-2 the same, but the reduce-scatter runs after
        every micro-batch (the full gradient is never kept: why Megatron's distributed optimizer is ZeRO-1);
        ZeRO-3 explicit: per micro-batch every unit gathered forward, again backward (but the
        embeddings), reduce-scattered, the gains all-reduced once;
        FSDP2 (builtin): theory.mesh_builtin_grad_comm_torch."""
    d, t, c, S = model.dim, layout.tp, layout.cp, layout.pp
    first, last = int(stage == 0), int(stage == S - 1)
    M = layout.microbatches
    m = batch // (layout.dp * M)
    tc = model.seq // c
    act = m * tc * d * b
    sp = stage_params(model, layout, stage)
    per = sp["per"]
    out: dict[str, dict[str, tuple[int, int]]] = {}
    if t > 1:
        loss_calls = 3 if style == "builtin" else 2
        n_act = 4 * per + first + last
        loss = (M * loss_calls * last, M * last * 3 * m * tc * b)
        if layout.sp:
            gains = (2 * per + last) * d + first * model.seq * d
            out["tp"] = {"all_gather": (M * n_act, M * n_act * act), "reduce_scatter": (M * n_act, M * n_act * act),
                         "all_reduce": (loss[0] + 1, loss[1] + gains * b)}
        else:
            out["tp"] = {"all_reduce": (M * n_act + loss[0], M * n_act * act + loss[1])}
    if c > 1:
        hops = M * per * (3 * c - 2)
        msg = 2 * m * tc * (d // t) * b
        out["cp"] = {"send": (hops, hops * msg), "recv": (hops, hops * msg)}
    if S > 1:  # interleaved: every chunk's output goes on, but the last virtual stage's (and back, but the first)
        n = (2 * layout.virtual - (stage == S - 1) - (stage == 0)) * M
        msg = act // t if layout.sp else act
        out["pp"] = {"send": (n, n * msg), "recv": (n, n * msg)}
    if model.moe and layout.ep > 1:
        k_n = model.topk * m * tc
        out["ep"] = {"all_gather": (M * per, M * per * layout.ep * model.experts * 8),
                     "all_to_all": (4 * M * per, 4 * M * per * k_n * d * b)}
    label = layout.grad_label
    if label is not None:
        out.setdefault(label, {}).update(_grad_comm(model, layout, stage, b, style, sp))
    edp = layout.dp // layout.ep
    if model.moe and layout.ep > 1 and edp > 1 and sp["experts"]:
        op = "all_reduce" if layout.zero == 0 else None
        out["edp"] = {op: (1, sp["experts"] * b)} if op else {"reduce_scatter": (1, sp["experts"] * b),
                                                                "all_gather": (1, sp["experts"] * b)}
    return out


def _grad_comm(model: Model, layout: Layout, stage: int, b: int, style: str, sp: dict) -> dict:
    M, total = layout.microbatches, sp["units"] + sp["vectors"]
    dense = total - (sp["experts"] if layout.ep > 1 else 0)  # ep: the experts' gradients go over edp
    if layout.zero in (1, 2):  # ZeRO-2 keeps only its shard of the gradients: it reduces every micro-batch's
        rs = layout.microbatches if layout.zero == 2 else 1
        return {"reduce_scatter": (rs, rs * dense * b), "all_gather": (1, dense * b)}
    if layout.zero == 0:
        root = total - sp["per"] * sp["block"]
        calls = 1 if style != "builtin" or layout.tp == 1 else sp["per"] + (root > 0)
        return {"all_reduce": (calls, dense * b)}
    if style == "builtin":  # FSDP2: fully_shard per block + the stage as root
        root = total - sp["per"] * sp["block"]
        gathers = fsdp2_pipeline_gathers(M, layout.pp, stage)
        return {"all_gather": (sp["per"] * gathers + (root > 0), (sp["per"] * gathers * sp["block"] + root) * b),
                "reduce_scatter": (sp["per"] + (root > 0), total * b)}
    return {"all_gather": (M * (sp["n_units"] + sp["n_regathered"]), M * (sp["units"] + sp["regathered"]) * b),
            "reduce_scatter": (M * sp["n_units"], M * sp["units"] * b),
            "all_reduce": (1, sp["vectors"] * b)}


def comm_bytes(view: dict) -> dict[str, int]:
    """Payload bytes per axis label, a message counted once (recv skipped: results.comm_bytes' rule)."""
    return {a: sum(nb for op, (_, nb) in ops.items() if op != "recv") for a, ops in view.items()}


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
        out[label] = sum(link.time(op, cnt, nb, size) for op, (cnt, nb) in ops.items() if op != "recv")
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

    def to_json(self) -> dict:
        return {"layout": self.layout.name, **{k: getattr(self.layout, k) for k in (
            "dp", "tp", "pp", "cp", "ep", "zero", "microbatches", "sp", "recompute", "virtual")},
            "memory": self.memory, "comm": {a: {op: list(v) for op, v in ops.items()} for a, ops in self.comm.items()},
            "bubble": self.bubble, "time": self.time, "mfu": self.mfu, "fits": self.fits, "reason": self.reason}


def stage_seconds(model: Model, layout: Layout, stage: int, batch: int, view: dict, cluster: Cluster) -> dict:
    """One micro-batch on one rank of ``stage``: compute (its L/pp blocks' training FLOPs, 1/t of each,
    the head's on the last stage, at efficiency × peak) and the critical-path traffic (tp, cp, ep, pp: a
    share 1/M of the step's); and the step's data-axis traffic; seconds per axis label."""
    n = batch // (layout.dp * layout.microbatches) * model.seq // layout.cp  # tokens per micro-batch
    head = 6 * model.dim * model.vocab
    blocks = (model.flops_per_token(layout.recompute) - head) * (model.layers // layout.pp) / model.layers
    flops = n * (blocks + (stage == layout.pp - 1) * head) / layout.tp
    seconds = comm_time(view, layout, cluster)
    critical = sum(v for k, v in seconds.items() if k in ("tp", "cp", "ep", "pp")) / layout.microbatches
    return {"compute_mb": flops / (cluster.flops * cluster.efficiency), "critical_mb": critical,
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
        buffers = 2 * stage_params(model, layout, s)["block"] * b if layout.zero == 3 else 0  # gathered + prefetched
        mems.append({**st, "activations": act, "buffers": buffers, "total": sum(st.values()) + act + buffers})
    memory = max(mems, key=lambda x: x["total"])
    fits = memory["total"] <= cluster.usable
    largest = max(("params", "grads", "optimizer", "activations"), key=memory.get)
    reason = "" if fits else (f"needs {memory['total'] / GiB:.2f} GiB > {cluster.usable / GiB:.2f} GiB usable "
                              f"(largest: {largest} {memory[largest] / GiB:.1f} GiB)")
    if not (fits or time_if_over):
        return Prediction(layout, memory, {}, layout.bubble, {}, 0.0, fits, reason)
    views = [comm(model, layout, s, batch, b, style) for s in stages]
    times = [stage_seconds(model, layout, s, batch, v, cluster) for s, v in zip(stages, views)]
    slow = max(times, key=lambda x: x["compute_mb"] + x["critical_mb"])
    ticks = M + (S - 1) / layout.virtual  # the slowest stage's micro-batches, plus the fill and drain
    exposed = max(0.0, max(x["data"] for x in times) - 2 / 3 * M * slow["compute_mb"])
    step = ticks * (slow["compute_mb"] + slow["critical_mb"]) + exposed
    mfu = batch * model.seq * model.flops_per_token("none") / (step * layout.gpus * cluster.flops)
    return Prediction(layout, memory, max(views, key=lambda v: sum(comm_bytes(v).values())), layout.bubble,
                      {"compute": ticks * slow["compute_mb"], "critical": ticks * slow["critical_mb"],
                       "exposed_data": exposed, "step": step, **{f"comm_{k}": v for k, v in slow["axes"].items()}},
                      mfu, fits, reason)


# --- the search ------------------------------------------------------------------------------------


def _divisors(n: int, cap: int | None = None) -> list[int]:
    return [k for k in range(1, (cap or n) + 1) if n % k == 0]


def invalid(model: Model, layout: Layout, batch: int, cluster: Cluster | None = None) -> str | None:
    """Why ``layout`` cannot run this model (one line), or None."""
    checks = [(batch % (layout.dp * layout.microbatches), f"global batch {batch} % (dp·M = "
               f"{layout.dp}·{layout.microbatches})"),
              (model.layers % layout.pp, f"layers {model.layers} % pp {layout.pp}"),
              (model.heads % layout.tp or model.vocab % layout.tp, f"heads/vocab % tp {layout.tp}"),
              (model.seq % layout.cp, f"seq {model.seq} % cp {layout.cp}"),
              (layout.pp > 1 and layout.microbatches < layout.pp, f"M={layout.microbatches} < pp={layout.pp} (1F1B)"),
              (layout.virtual > 1 and (layout.pp == 1 or layout.microbatches % layout.pp or
                                       model.layers % (layout.pp * layout.virtual)),
               f"interleaved v={layout.virtual}: pp > 1, M % pp, layers % (pp·v)"),
              (model.moe and (model.experts % layout.ep or layout.dp % layout.ep), f"experts/dp % ep {layout.ep}"),
              (model.moe and (layout.tp > 1 or layout.cp > 1 or layout.zero > 1),
               "MoE layouts here: dp × ep × pp with ZeRO 0/1"),
              (not model.moe and layout.ep > 1, "ep needs experts"),
              (layout.sp and layout.tp == 1, "sp needs tp"),
              (layout.dp == 1 and layout.zero > 0, "ZeRO needs a data axis"),
              (cluster is not None and layout.gpus != cluster.gpus, f"{layout.gpus} GPUs, not the cluster's")]
    return next((why for bad, why in checks if bad), None)


def layouts(model: Model, cluster: Cluster, batch: int, recompute=RECOMPUTE, zero=(0, 1, 2, 3)):
    """Every valid layout on exactly cluster.gpus GPUs: tp up to two nodes (powers of two), cp powers of two,
    pp dividing the layers, ep dividing the experts, the rest data; micro-batches of 1, 2, 4, … sequences;
    1F1B or interleaved with v = 2, 4 model chunks per rank."""
    n = cluster.gpus
    tps = [t for t in (1, 2, 4, 8, 16, 32) if t <= 2 * cluster.gpus_per_node and n % t == 0]  # one node, or two
    for t in ([1] if model.moe else tps):
        for c in ([1] if model.moe else [c for c in (1, 2, 4, 8, 16, 32) if n % (t * c) == 0]):
            for p in _divisors(model.layers, min(model.layers, n // (t * c))):
                if n % (t * c * p):
                    continue
                d = n // (t * c * p)
                for e in (_divisors(model.experts) if model.moe else [1]):
                    for z in zero:
                        for mbs in (1, 2, 4, 8, 16, 32):
                            if batch % (d * mbs):
                                continue
                            for rc in recompute:
                                for v in ((1, 2, 4) if p > 1 else (1,)):
                                    lay = Layout(dp=d, tp=t, pp=p, cp=c, ep=e, zero=z, sp=t > 1, recompute=rc,
                                                 microbatches=batch // (d * mbs), virtual=v)
                                    if invalid(model, lay, batch) is None:
                                        yield lay


def policies(attention: str) -> tuple[str, ...]:
    """Recompute policies worth trying: under FlashAttention selective recompute keeps what none keeps
    (there are no attention scores to drop) and only costs time."""
    return ("none", "full") if attention == "flash" else RECOMPUTE


def plan(model: Model, cluster: Cluster, batch: int, b: int = 2, precision: str = "mixed", style: str = "builtin",
         attention: str = "flash") -> tuple[list[Prediction], list[Prediction]]:
    """(fitting layouts fastest first, the rest closest to fitting first)."""
    fit, over = [], []
    for lay in layouts(model, cluster, batch, policies(attention)):
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


def calibrated(cluster: Cluster, bench: dict, dtype: str = "float64", framework: str = "torch") -> Cluster:
    """Both links from ``compare.py bench --json``'s α–β fits (one machine: intra = inter), per op; the
    compute rate from its ``compute`` measurement (every rank multiplying at once: the median over sizes
    of the FLOP/s per rank in ``dtype``) when present."""
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
    return replace(cluster, intra=link, inter=link, flops=flops, efficiency=1.0)
