"""Driver mirroring torch_impl.harness: train every (style, variant) of one pattern for a list
of configs. One process, all devices.

Pattern modules (``jax_impl/dp.py`` …) provide
``VARIANTS: tuple[(style, variant), …]`` and
``train(cfg, problem, style, variant, mesh) -> Trained``; ``mesh_for(cfg, device)`` builds the
mesh the pattern trains on (its axis names are the pattern's: "dp", "tp", "pp").
"""

from __future__ import annotations

import functools
import importlib

from jax_impl import reference
from jax_impl.devices import devices
from shared.config import Config
from shared.problem import make_problem


def _reference(cfg: Config, device: str):
    """The single-device run depends on none of the parallel layout (world size, micro-batches,
    buckets): compute it once per remaining configuration."""
    return _cached_reference(cfg.replace(world_size=1, microbatches=1, bucket_mb=25.0), device)


@functools.lru_cache(maxsize=8)
def _cached_reference(cfg: Config, device: str):
    return reference.train(cfg, make_problem(cfg), devices(1, device)[0])


def run_pattern(
    pattern: str, cfgs: list[Config], variants: list[tuple[str, str]] | None = None, device: str = "auto"
) -> list[dict]:
    """One entry per config: ``{"cfg", "reference": Trained, "runs": [(style, variant, Trained)]}``."""
    module = importlib.import_module(f"jax_impl.{pattern}")
    out = []
    for cfg in cfgs:
        cfg.check(pattern)
        problem = make_problem(cfg)
        ref = _reference(cfg, device)
        mesh = module.mesh_for(cfg, device)
        runs = [(style, variant, module.train(cfg, problem, style, variant, mesh))
                for style, variant in variants or module.VARIANTS]
        out.append({"cfg": cfg, "reference": ref, "runs": runs})
    return out
