"""Rank-side driver: train every (style, variant) of one pattern for a list of configs inside
one launch, so a test module or compare.py pays the process start-up once.

    from torch_impl.launch import launch
    from torch_impl.harness import run_pattern
    out = launch(run_pattern, 4, "dp", [cfg64, cfg32])[0]   # rank 0's answer

Pattern modules (``torch_impl/dp.py`` …) provide
``VARIANTS: tuple[(style, variant), …]`` and
``train(cfg, problem, style, variant, ctx) -> Trained`` (called on every rank; the returned
``Trained`` holds full, gathered arrays on rank 0 at least).
"""

from __future__ import annotations

import functools
import importlib

from shared.config import Config
from shared.problem import make_problem
from torch_impl import reference
from torch_impl.launch import RankContext


def _reference(cfg: Config, device):
    """The single-device run depends on none of the parallel layout (world size, micro-batches,
    buckets): compute it once per remaining configuration."""
    return _cached_reference(cfg.replace(world_size=1, microbatches=1, bucket_mb=25.0), str(device))


@functools.lru_cache(maxsize=8)
def _cached_reference(cfg: Config, device: str):
    return reference.train(cfg, make_problem(cfg), device)


def run_pattern(
    ctx: RankContext, pattern: str, cfgs: list[Config], variants: list[tuple[str, str]] | None = None
) -> list[dict] | None:
    """Returns, on rank 0, one entry per config:
    ``{"cfg": cfg, "reference": Trained, "runs": [(style, variant, Trained), …]}``; None elsewhere."""
    module = importlib.import_module(f"torch_impl.{pattern}")
    out = []
    for cfg in cfgs:
        cfg.check(pattern)
        problem = make_problem(cfg)
        ref = _reference(cfg, ctx.device) if ctx.rank == 0 else None
        runs = []
        for style, variant in variants or module.VARIANTS:
            trained = module.train(cfg, problem, style, variant, ctx)
            runs.append((style, variant, trained))
        out.append({"cfg": cfg, "reference": ref, "runs": runs})
    return out if ctx.rank == 0 else None


def run_collectives(ctx: RankContext) -> list[dict]:
    """Every collective checked on this rank (all ranks return their own list)."""
    from torch_impl import collectives

    return collectives.check_all(ctx)


def run_jobs(ctx: RankContext, jobs: list[tuple[str, list[Config]]]) -> dict[str, object]:
    """Several patterns in one launch (compare.py): {pattern: run_pattern's or
    run_collectives' answer}. Collectives answer on every rank, patterns on rank 0."""
    out: dict[str, object] = {}
    for pattern, cfgs in jobs:
        if pattern == "collectives":
            out[pattern] = run_collectives(ctx)
        else:
            out[pattern] = run_pattern(ctx, pattern, cfgs)
    return out
