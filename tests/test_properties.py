"""Property test: random valid configurations, every pattern's parity against its reference.

Hypothesis draws world size, layers, dim, batch, micro-batches, dtype (float64, float32, bfloat16)
and seed, constrained to what each pattern accepts (``Config.check``). Derandomized: CI sees the
same examples every run (a reproducible failure, never a flaky one). Bounded in time: JAX runs a
few examples per pattern; torch draws one list of configurations and runs them all in a single
launch (process start-up is the expensive part).
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.config import Config
from shared.results import parity, within
from torch_impl.harness import run_pattern as torch_run_pattern
from torch_impl.launch import launch

PATTERNS = ("dp", "fsdp", "tp", "pp")


@st.composite
def configs(draw, pattern: str, world_size: int | None = None) -> Config:
    n = world_size or draw(st.sampled_from([2, 3, 4]))
    layers = draw(st.integers(1, 4))
    dim = draw(st.integers(2, 12))
    batch = draw(st.integers(1, 4)) * n
    microbatches = 1
    if pattern in ("fsdp", "tp"):
        dim = n * draw(st.integers(1, 4))
    if pattern == "pp":
        layers = n * draw(st.integers(1, 2))
        microbatches = draw(st.integers(1, 2 * n))
        batch = microbatches * draw(st.integers(1, 3))
    cfg = Config(world_size=n, layers=layers, dim=dim, batch=batch, microbatches=microbatches, steps=3,
                 seed=draw(st.integers(0, 2**16)), dtype=draw(st.sampled_from(["float64", "float32", "bfloat16"])))
    return cfg.check(pattern)


def _assert_parity(entry, framework):
    cfg = entry["cfg"]
    for style, variant, run in entry["runs"]:
        errors = parity(run, entry["reference"])
        assert within(errors, cfg.dtype), (framework, style, variant, cfg, errors)


# dp in the default tier; fsdp and tp random configs in the slow tier (issue 37's budget)
@pytest.mark.parametrize("pattern", [p if p == "dp" else pytest.param(p, marks=pytest.mark.slow)
                                     for p in PATTERNS if p != "pp"])
@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_jax_parity_on_random_configs(pattern, data):
    from jax_impl.harness import run_pattern as jax_run_pattern  # here: the torch ranks import this module

    cfg = data.draw(configs(pattern))
    for entry in jax_run_pattern(pattern, [cfg]):
        _assert_parity(entry, "jax")


@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_jax_pipeline_parity_on_a_random_config(data):
    """pp: one random (S, M, L, D, B, dtype) per run: each draw compiles five schedules (circular in both
    styles, 1F1B, ZB-H1, interleaved when M % S == 0), ~2 s each (suite budget)."""
    from jax_impl.harness import run_pattern as jax_run_pattern

    cfg = data.draw(configs("pp"))
    for entry in jax_run_pattern("pp", [cfg]):
        _assert_parity(entry, "jax")


def _torch_random_jobs(ctx, jobs):
    return [torch_run_pattern(ctx, pattern, [cfg]) for pattern, cfg in jobs]


@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cfgs=st.tuples(*(configs(p, world_size=2) for p in PATTERNS)))
def test_torch_parity_on_random_configs(cfgs):
    results = launch(_torch_random_jobs, 2, list(zip(PATTERNS, cfgs)))[0]
    for entries in results:
        for entry in entries:
            _assert_parity(entry, "torch")
