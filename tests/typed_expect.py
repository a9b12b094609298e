"""What XLA issued for the typed style (sharding in types, jax_impl/typed.py) — its choice, not a
theory: recorded per platform and asserted, as the jit style's is (tests/test_dp.py, test_fsdp.py,
test_tp.py). Kept free of JAX imports (spawned torch ranks import the test modules)."""

from __future__ import annotations

import numpy as np

from shared.config import Config
from shared.problem import make_problem


def split_params(cfg: Config, variant: str) -> list[np.ndarray]:
    """The arrays the typed ZeRO step holds as row blocks for its moments (zero1: every array whose
    dim 0 N divides; zero2/zero3: the >= 2-D ones; dp: none) — fsdp_wrapper.rule."""
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
