"""What the time column means (issue 46): the timed steps hold the step alone, the harness's cost is measured
(compare.py bench --overhead), each row carries the same model's plain single-device step, --size presets,
a progress estimate weighed by kind, and --json - that pipes in every subcommand.

One subprocess of compare.py bench --overhead (2 ranks / devices, the tiny MLP, dp) covers the harness, the
rows and the pipe; the rest needs no launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel_twins import cli as compare
from parallel_twins import report
from shared.results import Trained, median_step_time, needs_floor

ROOT = Path(__file__).resolve().parents[1]


def _compare(*argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "compare.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_overhead_bench_pipes_its_json_and_measures_every_row():
    """bench --overhead --json -: standard output is the JSON alone (the table went to stderr); a row per
    run with {step_s, harness_s, bare_s, plain_s}; step_s is the run's median over its steps timed alone, harness_s
    and bare_s the medians of the rounds taken in turns after it."""
    done = _compare("bench", "--overhead", "--size", "tiny", "--model", "mlp", "--patterns", "dp",
                    "--world-size", "2", "--steps", "5", "--repeats", "3", "--json", "-")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)  # nothing else on stdout
    assert "harness/bare" in done.stderr
    rows = data["rows"]
    assert {(r["framework"], r["variant"]) for r in rows} >= {("torch", "naive"), ("torch", "ddp"), ("jax", "dp")}
    for r in rows:
        assert r["step_s"] > 0 and r["harness_s"] > 0 and r["bare_s"] > 0 and r["plain_s"] > 0 and r["ok"], r
        pairs = [h / b for h, b in zip(r["harness_times_s"], r["bare_times_s"], strict=True)]
        assert len(pairs) == 3 and r["harness_over_bare"] == pytest.approx(sorted(pairs)[1])  # their median
        lo, hi = r["harness_over_bare_ci95"]
        assert min(pairs) <= lo <= r["harness_over_bare"] <= hi <= max(pairs), r
        # the same rounds in the stepping thread's CPU time: a part of each step's wall time
        cpu = [h / b for h, b in zip(r["harness_cpu_s"], r["bare_cpu_s"], strict=True)]
        assert len(cpu) == 3 and r["harness_over_bare_cpu"] == pytest.approx(sorted(cpu)[1])
        lo, hi = r["harness_over_bare_cpu_ci95"]
        assert min(cpu) <= lo <= r["harness_over_bare_cpu"] <= hi <= max(cpu), r
        assert all(0 < c <= w * 1.01 + 1e-3 for c, w in zip(r["harness_cpu_s"] + r["bare_cpu_s"],
                                                               r["harness_times_s"] + r["bare_times_s"])), r
    assert "in the stepping thread's CPU time" in done.stderr
    assert data["repeats"] == 3 and data["target"] == 1.05


@pytest.mark.parametrize("argv", [["plan", "--layers", "8", "--dim", "1024", "--heads", "8", "--gpus", "8"],
                                  ["bench", "--world-size", "2", "--frameworks", "torch", "--max-bytes", "16384",
                                   "--iters", "2", "--warmup", "1"]])
def test_json_to_stdout_is_json_alone(argv):
    done = _compare(*argv, "--json", "-")
    assert done.returncode == 0, done.stderr[-2000:]
    json.loads(done.stdout)


def test_the_interval_is_what_noise_moves_the_median_by():
    """bench --overhead's 95 % interval of a row's median ratio: none when every round agrees, wide when the
    rounds spread, the same for the same rounds (seeded)."""
    from parallel_twins.overhead import interval

    assert interval([1.02] * 20) == pytest.approx((1.02, 1.02))
    spread = [0.6, 1.0, 1.6, 0.9, 1.3] * 4
    lo, hi = interval(spread)
    assert 0.6 <= lo < 1.0 < hi <= 1.6 and interval(spread) == (lo, hi)


def test_timed_steps_leave_out_the_recorded_ones():
    """Trained.timed: the median over the steps timed alone; a run without the record (or none timed alone):
    every step but the first."""
    run = Trained(losses=[], grads0=[], params=[], step_times=[9.0, 1.0, 2.0, 3.0, 7.0],
                  timed=[False, True, True, True, False])
    assert median_step_time(run.step_times, run.timed) == 2.0
    assert median_step_time([9.0, 1.0, 7.0]) == 4.0
    assert median_step_time([9.0, 7.0], [False, False]) == 7.0


def test_size_presets_and_their_dtype(monkeypatch):
    """--size tiny|cpu|gpu: the preset's sizes and dtype; a size or --dtype given wins; the default is gpu where
    the runs take GPUs (the driver's count), else cpu. Large float32 models measure a floor (FLOAT32_FLOOR_PARAMS)."""
    def cfgs(*argv):
        return compare.make_configs(compare.build_parser().parse_args(["--model", "transformer", *argv]))

    gpu = cfgs("--size", "gpu", "--world-size", "2", "--patterns", "dp")[0]
    assert (gpu.layers, gpu.dim, gpu.heads, gpu.seq, gpu.vocab, gpu.batch, gpu.dtype) == \
        (4, 512, 8, 256, 4096, 16, "float32")
    assert needs_floor(gpu) and not needs_floor(gpu.replace(dtype="float64"))
    assert cfgs("--size", "gpu", "--dim", "256", "--dtype", "float64", "--world-size", "2")[0].dim == 256
    tiny = cfgs("--size", "tiny", "--world-size", "2")[0]
    assert (tiny.layers, tiny.dim, tiny.dtype) == (2, 16, "float64")
    monkeypatch.setattr("shared.env.local_gpu_count", lambda: 8)
    args = compare.build_parser().parse_args(["--model", "transformer", "--world-size", "4"])
    assert compare.make_configs(args)[0].dim == 512 and args.size == "gpu"
    args = compare.build_parser().parse_args(["--model", "transformer", "--world-size", "4", "--device", "cpu"])
    assert compare.make_configs(args)[0].dim == 32 and args.size == "cpu"


def test_progress_weighs_what_is_left_by_kind(monkeypatch):
    """A transformer's run costs what the transformer's runs so far cost, not the framework's mean; two
    frameworks running side by side: what is left is the longer of theirs."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    planned = {"torch": {("dp", "mlp"): 2, ("dp", "transformer"): 2}, "jax": {("dp", "mlp"): 2}}
    p = report.Progress(planned)
    for t, fw, ev in ((0, "torch", ("framework", "torch")), (0, "torch", ("start", "dp mlp explicit/naive")),
                      (1, "torch", ("done", 1)), (1, "torch", ("start", "dp transformer explicit/naive")),
                      (11, "torch", ("done", 1))):
        now[0] = t
        p.event(fw, ev)
    # torch: 1 mlp run left at 1 s, 1 transformer run at 10 s; jax: 2 runs at torch's mean (5.5 s)
    assert p.estimate() == pytest.approx(1.0 + 10.0 + 2 * 5.5)
    side = report.Progress(planned, parallel=True)
    side.kind_done, side.kind_spent = dict(p.kind_done), dict(p.kind_spent)
    side.done, side.spent = dict(p.done), dict(p.spent)
    assert side.estimate() == pytest.approx(11.0)  # max(torch 11, jax 11)


def test_every_row_carries_the_plain_step():
    """RunResult.plain_step_time_s: the reference's median step; the table's × plain is the ratio."""
    from shared.config import Config
    from shared.results import make_result

    cfg = Config(world_size=2, layers=2, dim=8, batch=4, steps=4)
    ref = Trained(losses=[1.0] * 4, grads0=[], params=[], step_times=[5.0, 0.1, 0.1, 0.1],
                  timed=[False, True, True, True])
    run = Trained(losses=[1.0] * 4, grads0=[], params=[], step_times=[5.0, 0.3, 0.3, 9.0],
                  timed=[False, True, True, False])
    row = make_result("dp", "torch", "explicit", "naive", cfg, run, ref)
    assert row.step_time_s == 0.3 and row.plain_step_time_s == 0.1
    assert report.fmt_plain(row) == "3.0x"
    assert "plain_step_time_s" in row.to_json()


def test_the_compile_cache_is_trimmed_oldest_first(tmp_path):
    """JAX's own size limit scans the folder on every write (a cold suite 4x slower): the folder is trimmed
    once per process instead, oldest first, to 3/4 of the limit; links and subfolders are never touched."""
    from shared.env import trim_compile_cache

    for i in range(10):
        f = tmp_path / f"prog{i}-cache"
        f.write_bytes(b"x" * 100)
        os.utime(f, (1000 + i, 1000 + i))
    (tmp_path / "sub").mkdir()
    outside = tmp_path.parent / "outside_file"
    outside.write_bytes(b"y" * 5000)
    (tmp_path / "link").symlink_to(outside)
    assert trim_compile_cache(str(tmp_path), 2000) == 0  # 1000 bytes: under the limit
    assert trim_compile_cache(str(tmp_path), 800) == 4  # down to 600 <= 3/4 of 800, the oldest first
    assert sorted(p.name for p in tmp_path.glob("prog*")) == [f"prog{i}-cache" for i in range(4, 10)]
    assert outside.exists() and (tmp_path / "link").is_symlink() and (tmp_path / "sub").is_dir()
    assert trim_compile_cache(str(tmp_path / "missing"), 1) == 0


def test_compare_compiles_at_o0_only_when_asked_on_the_cpu_at_small_sizes():
    """PARALLEL_TWINS_XLA=fast: compare.py's table on the CPU at --size cpu|tiny compiles at -O0 (parity only: the
    steps it times run slower); never by default, off the CPU, at --size gpu, or over a flag of the user's."""
    from parallel_twins.preflight import CPU_COMPILE_FLAGS, PROBED_MARK, fast_cpu_compile

    known = lambda flags: None  # noqa: E731 - the probe: every flag known
    assert fast_cpu_compile({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, True, "cpu", known) == []
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PARALLEL_TWINS_XLA": "fast"}
    assert fast_cpu_compile(env, True, "cpu", known) == list(CPU_COMPILE_FLAGS)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4", *CPU_COMPILE_FLAGS]
    assert env[PROBED_MARK] == "1"
    assert fast_cpu_compile(env, True, "cpu", known) == []  # already there: not twice
    for args in ((False, "cpu"), (True, "gpu")):
        assert fast_cpu_compile({"PARALLEL_TWINS_XLA": "fast"}, *args, known) == []
    mine = {"XLA_FLAGS": "--xla_backend_optimization_level=2", "PARALLEL_TWINS_XLA": "fast"}
    assert fast_cpu_compile(mine, True, "tiny", known) == []
    assert mine["XLA_FLAGS"] == "--xla_backend_optimization_level=2"
    dropped = lambda flags: "unknown flag" if "fusion" in flags else None  # noqa: E731 - jaxlib 0.11
    assert fast_cpu_compile({"PARALLEL_TWINS_XLA": "fast"}, True, "tiny", dropped) == \
        [f for f in CPU_COMPILE_FLAGS if "fusion" not in f]
