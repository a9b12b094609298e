"""The layout planner behind ``compare.py plan``: which layout to train *this* model on *these* GPUs.

The formulas are shared.theory's, the same functions the tiny runs' ledgers are checked against
(``Model``, ``Layout``: shared/theory/layout.py; ``comm``, ``state``: shared/theory/mesh.py;
``activations``: shared/theory/recompute.py), evaluated at full size (ZeRO-1/2 on the data axis,
Megatron's sequence parallelism, mixed precision, MoE layers inside a pipeline). The GPUs and links are
shared/plan_cluster.py's, the time model shared/plan_time.py's (both re-exported here); this module adds
the prediction (``predict``: memory, bytes and step time of one layout), the search and the calibration.

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

from dataclasses import dataclass, replace

from shared.plan_cluster import ATTENTION_EFFICIENCY, GPUS, SIZE_FACTOR, Cluster, Link, bus_factor, gpu  # noqa: F401
from shared.plan_framework import FRAMEWORKS, accumulate_seconds, framework_view  # noqa: F401
from shared.plan_time import (  # noqa: F401
    FLOPS,
    _strides,
    block_seconds,
    comm_time,
    hardware_flops,
    matmul_seconds,
    model_flops,
    size_factor,
    stage_seconds,
    train_matmul_seconds,
)
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
