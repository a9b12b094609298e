"""Communication and state per device from the parameters ``parallel.fsdp.parallelize`` actually
wraps, for any NNX model: the twin of torch_impl/parallel/theory.py.

shared/theory/ derives these from a ``Config`` (right for the project's MLP and transformer only).
Here they come from ``describe``: each Param once (a tied one under its first path) with its shape,
element size, whether it is split in row blocks (>= 2 dims, dim 0 divisible by N: the wrapper's
``rule``) and the zero3 unit that gathers it (None: the root). Results are what the HLO ledger
records — op -> (count, payload bytes S as nccl-tests counts it: an all-gather's output, a
reduce-scatter's input, an all-reduce's buffer; jax_impl/ledger.py) — and {params, grads,
optimizer} bytes per device with AdamW's two moments. On the project's models they equal
shared.theory's formulas (tests/test_own_model_jax.py checks both).

    dp     one all-reduce of every gradient                          Φ·b
    zero1  reduce-scatter + all-gather of the flat Φ padded to N      2·Φ_pad·b
    zero2  per row-split param a reduce-scatter and an all-gather, ONE all-reduce of the vectors
    zero3  per row-split param an all-gather per call of its unit (+ one per re-gather: a call whose
           input is not the data, not an Embed's) and a reduce-scatter per call; the root's
           row-split params one each; ONE all-reduce of the vectors

``compose_comm``: parallel.compose's shard_map step per mesh axis (its own docstring and compose's), from
its arrays as placed (``placed``), the plan's widths (``tp_widths``) and the last trace; ``seam_comm``:
parallel.cp's seam, shared with cp.Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

Comm = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    itemsize: int
    split: bool  # row blocks over the axis
    unit: str | None  # zero3 shard_map: the unit that gathers it; None: the root

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.itemsize


def describe(params: dict, sharded: set[str], units: list[str]) -> list[ParamInfo]:
    """{path: array} (the wrapper's flat params), which are split, and the zero3 units."""
    unit_of = lambda k: next((u for u in units if k.startswith(u + ".")), None)
    return [ParamInfo(k, tuple(a.shape), a.dtype.itemsize, k in sharded, unit_of(k)) for k, a in params.items()]


def _flat_bytes(infos: list[ParamInfo], n: int) -> int:
    numel = sum(prod(p.shape) for p in infos)
    return -(-numel // n) * n * infos[0].itemsize


def comm(infos: list[ParamInfo], variant: str, n: int, unit_calls: dict[str, tuple[int, int]] | None = None) -> Comm:
    """The step's collectives. zero3: ``unit_calls`` {unit: (calls, re-gathers)} as the wrapper's
    last trace saw them; without it (jit, or not traced yet) every unit is called once and
    re-gathered once."""
    if not infos:
        return {}
    if variant == "dp":
        return {"all_reduce": (len(infos), sum(p.nbytes for p in infos))}
    if variant == "zero1":
        return {"reduce_scatter": (1, _flat_bytes(infos, n)), "all_gather": (1, _flat_bytes(infos, n))}
    split = [p for p in infos if p.split]
    vec = sum(p.nbytes for p in infos if not p.split)
    out: Comm = {}
    if split and variant == "zero2":
        out = {"reduce_scatter": (len(split), sum(p.nbytes for p in split)),
               "all_gather": (len(split), sum(p.nbytes for p in split))}
    elif split:
        untraced = (1, 1) if unit_calls is None else (0, 0)
        calls = lambda p: (1, 0) if p.unit is None else (unit_calls or {}).get(p.unit, untraced)
        ag = [(p, sum(calls(p))) for p in split]
        rs = [(p, calls(p)[0]) for p in split]
        out = {"all_gather": (sum(k for _, k in ag), sum(p.nbytes * k for p, k in ag)),
               "reduce_scatter": (sum(k for _, k in rs), sum(p.nbytes * k for p, k in rs))}
    return out | ({"all_reduce": (1, vec)} if vec else {})


def state(infos: list[ParamInfo], variant: str, n: int, style: str = "shard_map") -> dict[str, int]:
    """Per device: parameters as placed, gradients and AdamW's two moments as the variant keeps them."""
    full = sum(p.nbytes for p in infos)
    rows = sum(p.nbytes // n if p.split else p.nbytes for p in infos)
    if variant == "dp":
        return {"params": full, "grads": full, "optimizer": 2 * full}
    if variant == "zero1":
        if style == "shard_map":  # AdamW over this device's 1/N of the flat padded vector
            return {"params": full, "grads": full, "optimizer": 2 * _flat_bytes(infos, n) // n}
        moments = sum(p.nbytes // n if p.shape and p.shape[0] % n == 0 else p.nbytes for p in infos)
        return {"params": full, "grads": full, "optimizer": 2 * moments}
    return {"params": rows if variant == "zero3" else full, "grads": rows, "optimizer": 2 * rows}


# --- parallel.compose (shard_map): {axis label: Comm} per step and device ----------------------------


@dataclass(frozen=True)
class Placed:
    """One of compose's arrays: ``part`` first | tied (a first module's, read by the head too) | blocks |
    last; ``use_bytes`` what one call of its module
    reads (one layer, tp-local, fsdp-gathered); ``layers`` the stacked layers this device holds (1 outside
    the blocks); ``axes`` the mesh axes it is split on."""
    part: str
    use_bytes: int
    layers: int
    axes: frozenset[str]
    trains: bool = True  # False: frozen (its gradient stopped: no psum, no reduce-scatter; still gathered)


def seam_comm(calls: list[tuple[int, int]], n: int, variant: str) -> Comm:
    """parallel.cp's seam over n devices, ``calls`` (K elements, itemsize) per attention call: ring /
    ring_zigzag 3n − 2 permutes of K|V per call (n − 1 forward, n − 1 backward, n of dK|dV: float32
    when K is 16-bit, the ring's accumulators); ulysses 8 all-to-alls (q, k, v, out and their transposes)."""
    if n == 1 or not calls:
        return {}
    a = sum(size * b for size, b in calls)
    if variant == "ulysses":
        return {"all_to_all": (8 * len(calls), 8 * a)}
    wide = sum(size * max(b, 4) for size, b in calls)
    return {"collective_permute": ((3 * n - 2) * len(calls), (2 * n - 2) * 2 * a + n * 2 * wide)}


def tp_widths(rel_plan: dict[str, str], block: dict, f_inputs: tuple[int, int]) -> tuple[int, int]:
    """One block call's tp all-reduces (count, Σ widths): g after each rowwise module (its output width),
    f on each distinct input array of the colwise modules (q|k|v, gate|up read one: compose's f cache,
    which the trace counts: ``f_inputs`` = (f casts, Σ their widths) per block call).
    ``block`` {Param path in one block: array} (kernels (in, out); an nnx.LinearGeneral's (H, dh, out))."""
    row = [block[f"{r}.kernel"].shape[-1] for r, st in rel_plan.items() if st == "rowwise"]  # (…, out)
    return len(row) + f_inputs[0], sum(row) + f_inputs[1]


def placed(params: dict, specs: dict, layout: dict[str, int], first: tuple[str, ...],
           tied: frozenset[str] = frozenset(), frozen: dict | None = None) -> list[Placed]:
    """compose's {"rest" | "blocks": {path: global array}} and their PartitionSpecs as ``Placed``: blocks
    (S, L/S, …) with "pp" on the stage dim; a use reads one layer split by tp, gathered over fsdp.
    ``tied``: the first modules the head reads too (a tied embedding)."""
    names = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
    out = []
    for part, arrays in params.items():
        for k, a in arrays.items():
            spec = tuple(specs[part][k]) + (None,) * a.ndim
            own = spec[2:a.ndim] if part == "blocks" else spec[:a.ndim]  # the Param's own dims
            split = prod(layout[x] for e in own for x in names(e) if x != "fsdp")
            shape = a.shape[2:] if part == "blocks" else a.shape
            own_first = next((p for p in first if k.startswith(p + ".")), None)
            where = part if part == "blocks" else "last" if own_first is None else \
                "tied" if own_first in tied else "first"
            out.append(Placed(where, prod(shape) * a.dtype.itemsize // split, a.shape[1] if part == "blocks" else 1,
                              frozenset(x for e in spec for x in names(e)), k not in (frozen or {}).get(part, ())))
    return out


def compose_comm(layout: dict[str, int], arrays: list[Placed], *, microbatches: int, tp_call: tuple[int, int],
                 stream: int, seam: list[tuple[int, int]], cp_variant: str, loss: int,
                 ep: list[tuple] = ()) -> dict[str, Comm]:
    """compose's shard_map step (its module docstring), by axis label (jax_impl/ledger.py: the axes a group
    spans, "+"-joined in mesh order). S stages, M micro-batches, I = M + S − 1 iterations (M at S = 1),
    every local block runs I times; ``tp_call`` (all-reduces, bytes) of one block call (g per rowwise
    module, f per colwise input); ``stream`` one micro-batch's (m, T/c, D) bytes (the stage message);
    ``seam`` the attention calls of one trace; ``loss`` the loss's itemsize.

    Every array is cast to varying once over the axes its inputs vary on that it is not split on (dp /
    fsdp, cp; pp but for the first modules): the cast's transpose psums its gradient once per step, the
    array as this device holds it (gathered over fsdp). A first module's array the head reads too (a
    tied embedding) meets the last stage's pp-varying stream there: one more psum over pp (its own
    cast). pp also sums the embedding's output once (M·stream: the micro-batches meet the pipeline's
    pp-varying state) and the last stage's loss; dp / fsdp / cp sum
    the loss mean. XLA's all-reduce combiner merges these per group into ONE all-reduce (a tuple: they are
    independent); tp's g / f chain through the blocks and stay one each. fsdp: one all-gather and one
    reduce-scatter (its transpose) of every array split over "fsdp", bytes the device's gathered layers.

    ep (parallel/compose_ep.py) is a data axis: the dense arrays' psum spans it, the experts' (split on
    it) the other data axes. ``ep`` the trace's seam calls: ("dispatch", in, out bytes of the (E, C, ·)
    buffers) is 4 all-to-alls over "ep" (dispatch, combine, their transposes); ("counts", bytes) the
    balancing counts' psums over the data axes, independent of each other (a layer's counts come from
    its routing, not from an earlier layer's counts): XLA combines them into ONE all-reduce, apart from
    the gradients' (which depend on them through the balancing loss)."""
    big = [a for a, n in layout.items() if n > 1]
    S = layout.get("pp", 1)
    I = microbatches + S - 1  # S = 1: the M row chunks of accumulation (1 without), each through every block
    data = {a for a in big if a in ("dp", "fsdp", "ep", "cp")}
    label = lambda axes: "+".join(a for a in big if a in axes)
    out: dict[str, Comm] = {}
    summed: dict[str, int] = {}  # label -> bytes of the combined gradient / loss all-reduce

    def add(lab, op, n, nbytes):
        c, b = out.setdefault(lab, {}).get(op, (0, 0))
        out[lab][op] = (c + n, b + nbytes)

    def psum(axes, nbytes):
        if axes and nbytes:
            summed[label(axes)] = summed.get(label(axes), 0) + nbytes

    layers = max((p.layers for p in arrays if p.part == "blocks"), default=0)
    for p in arrays:
        varying = data | ({"pp"} if p.part not in ("first", "tied") and S > 1 else set())
        if p.trains:
            psum(varying - p.axes, p.layers * p.use_bytes)
        if p.trains and p.part == "tied" and S > 1:
            psum({"pp"} - p.axes, p.use_bytes)
        if "fsdp" in p.axes:
            add("fsdp", "all_gather", 1, p.layers * p.use_bytes)
            if p.trains:
                add("fsdp", "reduce_scatter", 1, p.layers * p.use_bytes)
    if layout.get("tp", 1) > 1 and tp_call[0]:
        add("tp", "all_reduce", I * layers * tp_call[0], I * layers * tp_call[1])
    if S > 1:
        add("pp", "collective_permute", 2 * (microbatches + S - 2), 2 * (microbatches + S - 2) * stream)
        psum({"pp"}, microbatches * stream + loss)  # the embedding's output, the last stage's loss
    psum(data, loss)  # the mean over the data / cp coordinates' losses
    for op, (n, nbytes) in seam_comm(seam, layout.get("cp", 1), cp_variant).items():
        add("cp", op, n, nbytes)
    for lab, nbytes in summed.items():
        add(lab, "all_reduce", 1, nbytes)
    for kind, *nbytes in ep:
        if kind == "dispatch":
            add("ep", "all_to_all", 4, 2 * sum(nbytes))
    counts = sum(nbytes[0] for kind, *nbytes in ep if kind == "counts")
    if counts and data:
        add(label(data), "all_reduce", 1, counts)
    return out
