"""Multi-controller JAX (jax_impl/launch.py): 2 processes × 2 CPU devices, joined by
jax.distributed over gloo, run the same harness call as one process with 4 devices and must give
the same losses, gradients, parameters, collectives (per mesh axis too) and state bytes — the path
a multi-node user takes.

Default run: the N-D layout dp=2,tp=2 (dp across the two processes, tp inside each: "tp inside a
node"), shard_map: its explicit psums cross processes. ``-m slow`` adds jit (GSPMD's placement
across processes) on the same layout.
One launch (the processes start, import JAX and compile once); the 1-process run of the same call
happens here, on 4 of the suite's 8 simulated devices. ``-m slow``: dp and tp variants (SLOW_JOBS), and
compare.py itself under ``python -m jax_impl.launch``.
"""

import os
import subprocess
import sys
import time

import pytest

from jax_impl.launch import LaunchError, launch
from shared.config import Config, parse_mesh
from shared.results import make_result, parity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = Config(world_size=4, model="transformer", layers=2, dim=16, heads=4, seq=16, vocab=32, batch=8,
             microbatches=2, steps=2, dtype="float64")
MESH_CFG = CFG.replace(mesh=parse_mesh("dp=2,tp=2"))
MESH_JOBS = [("mesh", MESH_CFG, [("shard_map", MESH_CFG.mesh_name)])]  # (pattern, cfg, variants; None: all)
# -m slow: a flat ZeRO-1 shard and GSPMD's placement of dp, both tp styles, and jit on the N-D layout — the
# variants whose collectives differ in kind across processes (each compiles three times: in both processes
# and here; every variant of both patterns ran 93 s on 2 cores, issue 37's budget)
SLOW_JOBS = [("dp", CFG, [("shard_map", "zero1"), ("jit", "dp")]),
             ("tp", CFG, [("shard_map", "megatron_sp"), ("jit", "megatron")]),
             ("mesh", MESH_CFG, [("jit", MESH_CFG.mesh_name)])]


def _run_jobs(jobs):
    """Every process runs this (SPMD across controllers); process 0's answer comes back."""
    import jax

    from jax_impl import harness, mesh

    out = {pattern: harness.run_pattern(pattern, [cfg], variants)[0] for pattern, cfg, variants in jobs}
    out["topology"] = {"processes": jax.process_count(), "devices": jax.device_count(),
                       "local": jax.local_device_count(),  # the process owning each (dp, tp) slot:
                       "owner": [[d.process_index for d in row] for row in mesh.mesh_for(MESH_JOBS[0][1]).devices]}
    return out


def _raise_on_process_1():
    import jax
    from jax.experimental import multihost_utils

    if jax.process_index() == 1:
        raise RuntimeError("deliberate failure on process 1")
    multihost_utils.sync_global_devices("never")  # process 0 waits for 1 forever: the launcher ends it


def _multi_and_single(jobs):
    return launch(_run_jobs, 2, 2, jobs, timeout_s=300), _run_jobs(jobs)


@pytest.fixture(scope="module")
def mesh_runs():
    return _multi_and_single(MESH_JOBS)


def _check_parity(multi, single, jobs):
    for pattern, cfg, _ in jobs:
        m, s = multi[pattern], single[pattern]
        # Each process computes the single-device reference on its own device: bit for bit the same
        # (one machine, the same XLA program, flags and inputs: nothing differs but the process).
        assert parity(m["reference"], s["reference"]) == dict.fromkeys(parity(s["reference"], s["reference"]), 0.0)
        assert [(st, v) for st, v, _ in m["runs"]] == [(st, v) for st, v, _ in s["runs"]]
        for (style, variant, a), (_, _, b) in zip(m["runs"], s["runs"], strict=True):
            errs = parity(a, b)
            # float64: gloo sums across processes in another order than XLA's in-process all-reduce,
            # so not bit-identical: a few ulps (measured ≤ 1e-15), far below 1e-12.
            assert max(errs.values()) <= 1e-12, (pattern, style, variant, errs)
            assert a.comm == b.comm, (pattern, style, variant)  # the same HLO collectives
            assert a.extra.get("comm_by_axis") == b.extra.get("comm_by_axis"), (pattern, style, variant)
            assert a.state_bytes == b.state_bytes
            row = make_result(pattern, "jax", style, variant, cfg, a, m["reference"])  # vs one device
            assert row.ok, (pattern, style, variant, row.max_rel_err_loss, row.max_rel_err_grad)


def test_two_processes_own_two_devices_each(mesh_runs):
    multi, single = mesh_runs
    assert multi["topology"] == {"processes": 2, "devices": 4, "local": 2, "owner": [[0, 0], [1, 1]]}
    assert single["topology"] == {"processes": 1, "devices": 8, "local": 8, "owner": [[0, 0], [0, 0]]}


def test_mesh_parity_with_one_process(mesh_runs):
    multi, single = mesh_runs
    assert {st for st, _, _ in multi["mesh"]["runs"]} == {"shard_map"}
    assert multi["mesh"]["runs"][0][2].extra["comm_by_axis"]  # dp and tp each move bytes
    _check_parity(multi, single, MESH_JOBS)


def test_a_raising_process_ends_the_launch(measured):
    """Process 0 waits for process 1 forever: only the launcher acting on process 1's error ends the
    launch before its deadline, however fast the machine. How soon after the start is the two
    processes' start-up (importing JAX), the machine's: reported ("measured, not asserted"), and
    bounded by half the deadline."""
    timeout_s = 120
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="(?s)process 1 raised.*deliberate failure on process 1"):
        launch(_raise_on_process_1, 2, 1, timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    measured(f"2 JAX processes, process 1 raises: the launch ended {elapsed:.1f} s after it started "
             f"(deadline {timeout_s} s)")
    assert elapsed < timeout_s / 2, elapsed  # not the deadline


@pytest.mark.slow
def test_dp_and_tp_parity_with_one_process():
    multi, single = _multi_and_single(SLOW_JOBS)
    _check_parity(multi, single, SLOW_JOBS)


@pytest.mark.slow
def test_compare_py_under_a_multiprocess_launch(tmp_path):
    """The README's command: two JAX processes, only process 0 prints and writes the JSON."""
    out = subprocess.run(
        [sys.executable, "-m", "jax_impl.launch", "-n", "2", "-d", "2", "compare.py", "--frameworks", "jax",
         "--model", "transformer", "--mesh", "dp=2,tp=2", "--layers", "2", "--dim", "16", "--vocab", "32",
         "--batch", "8", "--steps", "2", "--json", str(tmp_path / "out.json"), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("verdict: all") == 1  # process 0's table only
    assert (tmp_path / "out.json").exists()
