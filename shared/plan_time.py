"""The planner's time model (shared/plan.py): every matmul of a micro-batch from its sharded shape (a roofline
with a size table: ``matmul_seconds``), the attention core and the memory-bound ops (``block_seconds``), a
stage's micro-batch with its critical-path traffic (``stage_seconds``), the messages' α–β time per mesh axis
(``comm_time``) and a step's model and hardware FLOPs (``model_flops``, ``hardware_flops``).
"""

from __future__ import annotations

from shared.plan_cluster import SIZE_FACTOR, Cluster
from shared.plan_framework import critical_recv
from shared.theory.layout import Layout, Model

FLOPS = ("causal", "full", "megatron")  # model-FLOP conventions (model_flops)


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
# SIZE_FACTOR and ATTENTION_EFFICIENCY (shared/plan_cluster.py, the Cluster's defaults): the step table
# on the smallest side, and FlashAttention's fraction of peak without a measured table.


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
