"""What XLA issued for the typed style (sharding in types, jax_impl/parallel/typed.py) — its choice, not a
theory: recorded per platform and asserted, as the jit style's is (tests/test_dp.py, test_fsdp.py,
test_tp.py). Kept free of JAX imports (spawned torch ranks import the test modules)."""

from __future__ import annotations

import numpy as np

from shared.config import Config
from shared.problem import make_problem


def split_params(cfg: Config, variant: str) -> list[np.ndarray]:
    """The arrays the typed ZeRO step holds as row blocks for its moments (zero1: every array whose
    dim 0 N divides; zero2/zero3: the >= 2-D ones; dp: none) — parallel.tree.rule."""
    if variant == "dp":
        return []
    least = 1 if variant == "zero1" else 2
    return [w for w in make_problem(cfg).params.values() if w.ndim >= least and w.shape[0] % cfg.world_size == 0]


def zero_ledger(cfg: Config, variant: str, platform: str = "cpu") -> dict | None:
    """XLA:CPU, every ZeRO stage in types: ONE all-reduce of every gradient and the loss (Φ·b + b: the
    contraction over the dp-split batch; the stated P() -> P('dp') of a gradient is a slice, never a
    reduce-scatter on CPU), and one all-gather per row-split array — zero1/zero2: the updated rows
    resharded back to P(); zero3: the forward's reshard(w, P()) — no re-gather in backward. None: a
    platform not recorded yet (GPU: run tests/test_gpu.py and record it here)."""
    if platform != "cpu":
        return None
    b = cfg.bytes_per_element
    split = split_params(cfg, variant)
    out = {"all_reduce": {"count": 1, "bytes": cfg.n_params * b + b}}
    if split:
        out["all_gather"] = {"count": len(split), "bytes": sum(w.size for w in split) * b}
    return out


def stated_kinds(run) -> dict[str, int]:
    """{moves: count} of a run's extra["stated"] (gather / slice / none)."""
    out: dict[str, int] = {}
    for e in run.extra["stated"]:
        out[e["moves"]] = out.get(e["moves"], 0) + 1
    return out


def tp_ledger(cfg: Config, variant: str, platform: str = "cpu") -> dict | None:
    """XLA:CPU, tensor parallelism in types. megatron (MLP and transformer): the theory op for op
    (shared.theory.tp_comm: the stated unreduced -> reduced steps and their transposes as
    all-reduces, the vocab-parallel loss's (B, T) sums). allgather: theory's backward reduce-scatters
    as all-reduces (+ a local slice). megatron_sp: each stated reduce-scatter (unreduced -> P(None,
    'tp', None)) an all-reduce of A = B·T·D·b; the (4L+2) all-gathers of A as theory's; wpe's
    gradient (its rows resharded to P('tp', None) in forward) comes back by an all-gather of (T, D),
    not an all-reduce; the loss's three (B, T) sums and the (2L+1) norm gains' gradients."""
    from shared.theory import tp_comm

    if platform != "cpu":
        return None
    if variant != "megatron_sp":
        out: dict = {}
        for op, (c, b) in tp_comm(cfg, variant).items():
            e = out.setdefault("all_reduce" if op == "reduce_scatter" else op, {"count": 0, "bytes": 0})
            e["count"], e["bytes"] = e["count"] + c, e["bytes"] + b
        return dict(sorted(out.items()))
    b, l = cfg.bytes_per_element, cfg.layers
    act, rows = cfg.batch * cfg.seq * cfg.dim * b, cfg.batch * cfg.seq * b
    return {"all_gather": {"count": 4 * l + 3, "bytes": (4 * l + 2) * act + cfg.seq * cfg.dim * b},
            "all_reduce": {"count": 4 * l + 5, "bytes": (4 * l + 2) * act + 3 * rows + (2 * l + 1) * cfg.dim * b}}


def mesh_ledger(cfg: Config, platform: str = "cpu") -> dict | None:
    """XLA:CPU, data (dp | fsdp) × tp in types, per mesh axis (jax_impl/mesh_typed.py): on "tp"
    hand-written Megatron's all-reduces exactly (shared.theory.mesh_comm_jax(cfg, "typed")); on the data
    axis ONE all-reduce of every tp-local gradient and the loss — under fsdp after one all-gather per unit (each
    stated reshard(w, <spec without fsdp>)), no reduce-scatter and no re-gather in backward."""
    from shared.theory import mesh_comm_jax

    if platform != "cpu":
        return None
    theory = mesh_comm_jax(cfg, "typed")
    to_dict = lambda ops: {op: {"count": c, "bytes": nbytes} for op, (c, nbytes) in ops.items()}
    out = {"tp": to_dict(theory["tp"])} if "tp" in theory else {}
    data = theory.get(cfg.data_axis, {})
    summed = sum(nbytes for op, (_, nbytes) in data.items() if op in ("all_reduce", "reduce_scatter"))
    out[cfg.data_axis] = {"all_reduce": {"count": 1, "bytes": summed + cfg.bytes_per_element}}
    if "reduce_scatter" in data:
        out[cfg.data_axis]["all_gather"] = to_dict({"x": data["reduce_scatter"]})["x"]
    return {a: dict(sorted(ops.items())) for a, ops in out.items()}
