"""Test set-up. JAX's simulated CPU devices must be requested before JAX starts, so this runs
first: 8 devices cover the world sizes 2, 3, 4 and 8 the tests use."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.env import simulate_host_devices, use_compile_cache  # noqa: E402

simulate_host_devices(8)
# JAX's persistent compilation cache, as compare.py keeps it (shared/env.py; PARALLEL_TWINS_CACHE=off: none):
# the slow tier and a second run load the programs an earlier one compiled.
use_compile_cache()
# XLA:CPU compiles with LLVM at -O0 in the tests, and with its element-wise IR emitters instead of the
# MLIR fusion emitters (half the compile time of a small step: 5.8 s -> 3.3 s for fsdp's six), and with LLVM's
# module in one piece instead of split over threads (two workers keep both cores busy anyway: tp's runs compile
# in 8.1 s instead of 9.0, 5 % less CPU, measured 3 times each way): compilation
# of the transformer's steps dominates the suite's time, and at these tiny sizes run time does not matter.
# No fast-math either way (XLA:CPU's default), so the IEEE results, and every parity check, are the
# same; compare.py keeps XLA's defaults unless asked (PARALLEL_TWINS_XLA=fast: parallel_twins/preflight.py), since
# its time column would change (steps 1.8x slower at -O0).
# Only the flags this jaxlib knows (XLA aborts on an unknown one, and pytest then ends with exit 1 and no
# word: jaxlib 0.11 dropped the second), probed once per session: pytest's workers inherit the result.
if not os.environ.get("PARALLEL_TWINS_XLA_PROBED"):  # preflight.PROBED_MARK: compare.py then trusts them
    from parallel_twins.preflight import CPU_COMPILE_FLAGS, known_xla_flags  # noqa: E402

    _want = [f for f in CPU_COMPILE_FLAGS if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
    for _flag in known_xla_flags(_want):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
    os.environ["PARALLEL_TWINS_XLA_PROBED"] = "1"
# The suite's JAX runs use 2-4 devices: on a machine with fewer GPUs than that, "auto" would pick
# the GPU and fail. Tests run JAX on the simulated CPU devices unless asked otherwise.
os.environ.setdefault("JAX_PLATFORMS", os.environ.get("PARALLEL_TWINS_TEST_JAX_PLATFORMS", "cpu"))
# The device audit in every torch launch of the suite (spawned ranks inherit it): each collective the
# ledger records is checked for the rank's device, contiguity and an NCCL dtype (torch_impl.ledger).
# "meta" (the default device meta too) runs in tests/test_gpu_readiness.py under -m slow: tp's
# heads_perm builds its index without device= and fails it (reported, not fixed there).
os.environ.setdefault("PARALLEL_TWINS_AUDIT", "ledger")
# The torch ranks' forkserver (one per pytest worker) imports transformers' Llama and Qwen2 once: the
# compose, llama and cp-seam modules' ranks would each import them after the fork (~3-5 CPU-s a rank).
# In xdist's workers only (not its controller, which imports no torch; not a compare.py the tests start
# as a subprocess; a run with -n 0 just skips this).
if os.environ.get("PYTEST_XDIST_WORKER"):
    from torch_impl.launch import preload  # noqa: E402

    preload("transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2")


# --- figures a test measures but does not assert (they depend on the machine) ----------------------
# A test takes the ``measured`` fixture and calls it with one line of text; the line is kept as a
# user property of the test's report (so it crosses from pytest-xdist's workers to the controller)
# and printed in the run's terminal summary, section "measured, not asserted", pass or fail.
_MEASURED: list[tuple[str, str]] = []


@pytest.fixture
def measured(record_property):
    """``measured(text)``: report a machine-dependent figure in the run's summary instead of asserting it."""
    return lambda text: record_property("measured", str(text))


def pytest_runtest_logreport(report):
    if report.when == "call":
        _MEASURED.extend((report.nodeid, value) for key, value in report.user_properties if key == "measured")


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured, not asserted (machine-dependent figures)")
        for nodeid, text in _MEASURED:
            terminalreporter.write_line(f"{nodeid}: {text}")


# The modules that take longest in each tier (seconds on 2 cores, summed --durations), run first: the
# suite distributes whole files over its two workers (--dist loadfile: one torch launch per module), in
# collection order, so a heavy module collected last would run alone at the end. Re-measure with
# ``pytest [-m slow] --durations=0`` when a module grows; the rest keep their order.
HEAVY_FIRST = {  # measured 2026-11-29 (idle, 2 cores, cold JAX cache): every module of >= 14 s, heaviest first
    "slow": ("test_checkpoint_jax", "test_pp", "test_gpu_readiness", "test_examples", "test_cli",
             "test_compose_models_jax", "test_compose_torch", "test_mesh", "test_checkpoint_torch", "test_signals",
             "test_recipe_cli", "test_restarts", "test_multiprocess", "test_compiled", "test_checkpoint_xfw",
             "test_recompute", "test_compose_ep_jax", "test_recipe_audit", "test_cpu_paths", "test_ep_recipe",
             "test_ep", "test_cp", "test_tp", "test_compose_jax", "test_pp_seam_jax", "test_dp", "test_fsdp",
             "test_properties", "test_reliability", "test_gpu", "test_own_model_jax", "test_recipe_jax"),
    "default": ("test_recipe_jax", "test_cli", "test_pp", "test_compose_torch", "test_recipe_cli", "test_mixed_jax",
                "test_dp", "test_mesh", "test_compose_jax", "test_timing", "test_tp", "test_own_model_jax",
                "test_multiprocess", "test_fsdp", "test_cp", "test_reliability", "test_checkpoint_jax",
                "test_tp_plan_jax", "test_ep_recipe", "test_ep", "test_compose_models_jax", "test_plan",
                "test_checkpoint_torch", "test_properties", "test_pp_seam_jax", "test_gpu_readiness", "test_examples",
                "test_cp_seam_jax"),
}


def _heaviest_first(items, tier: str) -> None:
    rank = {name: k for k, name in enumerate(HEAVY_FIRST[tier])}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module's own order kept


def pytest_collection_modifyitems(config, items):
    """A plain ``pytest`` stays the quick tier (budget <= 6 min on 2 cores; ~10 min measured, issue 46): tests
    marked slow (heavier sweeps, speed measurements) run only when asked for, e.g. ``pytest -m slow``."""
    if "slow" in (config.getoption("markexpr") or ""):
        _heaviest_first(items, "slow")
        return
    _heaviest_first(items, "default")
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)
