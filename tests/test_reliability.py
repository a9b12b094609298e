"""Issue 38's launcher, up-front and library checks: each a fault or a hostile input, answered in
one line before anything trains (docs/reliability.md). All in-process or one tiny launch."""

import os
import signal
import sys
import time

import pytest
from procs import grandchildren  # tests/procs.py

from parallel_twins import cli as compare

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- the JAX launcher watches every process -----------------------------------------------------

_DIE_ON_1 = """
import os, signal, time
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"pid{os.environ['JAX_PROCESS_ID']}"), "w") as f:
    f.write(str(os.getpid()))
if os.environ["JAX_PROCESS_ID"] == "1":
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)  # process 0: a peer blocked in a collective that will never complete
"""


def test_jax_launch_ends_every_process_when_process_1_dies(tmp_path, capsys):
    """Process 1 is SIGKILLed while process 0 runs on: the launch used to poll process 0 first and
    noticed 94 s later. Now it ends process 0 within seconds, exits 128 + 9, and says so in one line."""
    from jax_impl.launch import run_command

    script = tmp_path / "job.py"
    script.write_text(_DIE_ON_1)
    t0 = time.monotonic()
    rc = run_command([str(script)], 2, 1, timeout_s=60)
    elapsed = time.monotonic() - t0
    assert rc == 128 + signal.SIGKILL
    assert elapsed < 30, elapsed  # the children's start (JAX imported twice) plus the 2 s grace, not the 60 s timeout
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "jax_impl.launch: process 1 of 2 ended with signal SIGKILL; stopped processes [0]", err
    pid0 = int((tmp_path / "pid0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)


# --- up-front: the machine can hold the run ----------------------------------------------------

def _one_line_exit_2(argv, capsys) -> str:
    assert compare.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_world_size_beyond_the_machine_is_refused_before_any_process(capsys):
    err = _one_line_exit_2(["--world-size", "100000", "--patterns", "collectives"], capsys)
    assert "--world-size 100000" in err and "--no-resource-check" in err, err


@pytest.mark.parametrize("dim", ["30000", "200000"])
def test_sizes_beyond_the_memory_are_refused_before_any_rank(dim, capsys):
    err = _one_line_exit_2(["--dim", dim, "--model", "mlp", "--patterns", "dp"], capsys)
    assert f"dim={dim}" in err and "GiB" in err and "--no-resource-check" in err, err


def test_the_estimate_counts_processes_and_the_flag_overrides(monkeypatch):
    from parallel_twins import preflight
    from shared.config import Config

    cfg = Config(world_size=4, dim=1024, model="mlp")  # Φ = 4·1024² = 4.2e6: 8·Φ·8 B = 268 MB per rank
    per_rank = preflight.rank_bytes(cfg)
    assert per_rank == 8 * cfg.n_params * 8 + 4 * 32 * 1024 * 4 * 8  # + the MLP's 4 B×D tensors per layer
    need = preflight.estimate([cfg], ["torch"], 4)
    assert need == 4 * (preflight.PROCESS_BYTES + per_rank)
    preflight.check_resources([cfg], ["torch"], available=need)  # exactly enough: accepted
    with pytest.raises(ValueError, match="needs about"):
        preflight.check_resources([cfg], ["torch"], available=need - 1)
    preflight.check_resources([cfg], ["torch"], under_torchrun=True, available=need // 2)  # one rank here
    # --no-resource-check: the check is not called at all
    seen = []
    monkeypatch.setattr(preflight, "check_resources", lambda *a, **k: seen.append(a))
    monkeypatch.setattr(compare, "simulate_host_devices", lambda n: None)  # not 100000 devices for a later JAX
    assert compare.main(["--world-size", "100000", "--patterns", "collectives", "--no-resource-check",
                         "--frameworks", "torch", "--device", "gpu"]) == 2  # stopped by the GPU check, not by us
    assert seen == []


@pytest.mark.parametrize("argv,says", [
    (["bench", "--world-size", "100000"], "--world-size 100000: more ranks"),
    (["bench", "--world-size", "2", "--max-bytes", str(10**11)], "messages up to 93.1 GiB"),
    (["checkpoint", "--dim", "200000"], "mlp dim=200000"),
])
def test_the_subcommands_check_ranks_and_memory_up_front(argv, says, capsys):
    """bench and checkpoint make the main command's check (plan makes nothing: it sizes on paper)."""
    cmd = f"compare.py {argv[0]}: error: "
    err = _one_line_exit_2(argv, capsys)
    assert err.startswith(cmd) and says in err and "--no-resource-check" in err, err


def test_the_subcommands_override_flag_skips_the_check(monkeypatch):
    from parallel_twins import preflight

    seen = []
    monkeypatch.setattr(preflight, "check_bench_resources", lambda *a, **k: seen.append(a))
    monkeypatch.setattr(preflight, "check_resources", lambda *a, **k: seen.append(a))
    assert compare.main(["bench", "--world-size", "100000", "--no-resource-check", "--frameworks", "torch",
                         "--device", "gpu"]) == 2  # stopped by the GPU check, after the check we skipped
    assert seen == []
    from parallel_twins import checkpoint_matrix

    monkeypatch.setattr(checkpoint_matrix, "simulate_host_devices", lambda n: None)
    monkeypatch.setattr(checkpoint_matrix, "matrix", lambda *a: ([], {}))  # no saves: what runs before them
    assert compare.main(["checkpoint", "--dim", "200000", "--no-resource-check", "--quiet"]) == 0
    assert seen == []
    assert compare.main(["checkpoint", "--quiet"]) == 0 and len(seen) == 1  # without the flag: checked
    assert preflight.bench_bytes(["torch"], 4, 2**20, 10, 4) == 4 * (preflight.PROCESS_BYTES + 3 * 2**20)
    assert preflight.bench_bytes(["jax"], 4, 2**20, 10, 4) == preflight.PROCESS_BYTES + 4 * 12 * 2**20


# --- up-front: the distributed environment -------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch):
    from parallel_twins.preflight import INT_VARS, RANK_VARS, TORCHRUN_MARKS

    for name in {*RANK_VARS, *INT_VARS, *TORCHRUN_MARKS}:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_stale_torchrun_environment_is_named_in_one_line(clean_env, capsys):
    """RANK/WORLD_SIZE/MASTER_* exported without torchrun: used to wait 905 s for a peer."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        clean_env.setenv(k, v)
    t0 = time.monotonic()
    err = _one_line_exit_2(["--frameworks", "torch", "--patterns", "dp"], capsys)
    assert time.monotonic() - t0 < 5
    assert "RANK=0, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT=29500" in err and "torchrun" in err, err


@pytest.mark.parametrize("name,value,says", [("WORLD_SIZE", "abc", "WORLD_SIZE='abc' is not an integer"),
                                             ("JAX_PROCESS_ID", "x", "JAX_PROCESS_ID='x'"),
                                             ("WORLD_SIZE", "0", "WORLD_SIZE='0' is out of range"),
                                             ("MASTER_PORT", "99999", "MASTER_PORT='99999' is out of range")])
def test_a_bad_environment_variable_is_named(clean_env, capsys, name, value, says):
    clean_env.setenv(name, value)
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    assert says in _one_line_exit_2(["--patterns", "dp"], capsys)


@pytest.mark.parametrize("value", ["-1", "0", "nan", "1e300"])  # 1e300: was an OverflowError in a rank
def test_a_timeout_not_positive_is_refused(value, capsys):
    assert f"--timeout {float(value):g}" in _one_line_exit_2(["--timeout", value, "--patterns", "dp"], capsys)


def test_held_out_paths_are_refused_in_one_line(capsys, tmp_path):
    """Held-out hostile inputs (second audit): a checkpoint folder nothing can be created in (/proc: os.access
    said yes to root, then a CheckpointError traceback in a rank); a --baseline that never ends (/dev/zero:
    read until the machine ran out of memory, killed at 42 s)."""
    import os

    if os.path.isdir("/proc"):
        assert "/proc: the folder is not writable" in _one_line_exit_2(
            ["--patterns", "dp", "--frameworks", "torch", "--checkpoint-dir", "/proc"], capsys)
        assert "cannot create it in /proc" in _one_line_exit_2(  # was exit 3 after every run, plots lost
            ["--patterns", "dp", "--frameworks", "torch", "--plots", "/proc/nope"], capsys)
    if os.path.exists("/dev/zero"):
        assert "/dev/zero: a device or socket, not a file" in _one_line_exit_2(  # refused at once (issue 47)
            ["--patterns", "dp", "--baseline", "/dev/zero"], capsys)


def test_jax_environment_mistakes_are_named_before_jax_starts(monkeypatch):
    """JAX_PLATFORMS=gpu with no GPU, XLA_FLAGS that is not --flags or names a flag XLA does not know:
    each used to be JAX's traceback or a C++ abort; now one line naming the variable."""
    from parallel_twins.preflight import check_jax_environment, probe_xla_flags

    probe = lambda flags: "Unknown flag in XLA_FLAGS: --xla_nope=1" if "nope" in flags else None  # noqa: E731
    for platforms in ("gpu", "cpu,cuda"):
        with pytest.raises(ValueError, match=f"JAX_PLATFORMS='{platforms}': this machine has no GPU"):
            check_jax_environment({"JAX_PLATFORMS": platforms}, gpus=0, probe=probe)
    check_jax_environment({"JAX_PLATFORMS": "gpu"}, gpus=1, probe=probe)  # a GPU: JAX's to start
    with pytest.raises(ValueError, match="XLA_FLAGS='garbage': 'garbage' is not a --flag"):
        check_jax_environment({"XLA_FLAGS": "garbage"}, probe=probe)
    with pytest.raises(ValueError, match="XLA_FLAGS=.*Unknown flag in XLA_FLAGS: --xla_nope=1 .XLA would abort"):
        check_jax_environment({"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_nope=1"}, probe=probe)
    check_jax_environment({"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "PARALLEL_TWINS_XLA_PROBED": "1"},
                          probe=lambda f: pytest.fail(f))  # the suite's own flags, probed by conftest: no probe
    asked = []  # the compile-time flags without that mark (a user's own): probed, jaxlib 0.11 dropped one
    check_jax_environment({"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"}, probe=lambda f: asked.append(f))
    assert asked == ["--xla_cpu_use_fusion_emitters=false"]
    # the real probe: XLA's own words, from a child that aborts (not this process)
    assert probe_xla_flags("--xla_bogus_flag=1") == "Unknown flag in XLA_FLAGS: --xla_bogus_flag=1"


def test_the_suites_compile_time_flags_are_only_those_this_xla_knows():
    """tests/conftest.py passes XLA two compile-time flags; jaxlib 0.11 dropped one, and XLA's abort on it ended
    pytest with exit 1 and no word on a lent GPU machine. known_xla_flags keeps those the installed XLA knows:
    one probe of all, one per flag only when that fails."""
    from parallel_twins.preflight import known_xla_flags

    asked = []

    def probe(flags):
        asked.append(flags)
        return "Unknown flag in XLA_FLAGS: --xla_gone=1" if "gone" in flags else None

    assert known_xla_flags(["--xla_a=0", "--xla_b=1"], probe) == ["--xla_a=0", "--xla_b=1"] and len(asked) == 1
    assert known_xla_flags(["--xla_a=0", "--xla_gone=1"], probe) == ["--xla_a=0"] and len(asked) == 4
    assert known_xla_flags([], probe) == [] and len(asked) == 4
    assert known_xla_flags(["--xla_bogus_flag=1", "--xla_backend_optimization_level=0"]) == [
        "--xla_backend_optimization_level=0"]  # the real probe
    assert os.environ.get("PARALLEL_TWINS_XLA_PROBED") == "1"  # conftest probed once for the session


def test_an_unknown_jax_platform_is_one_line(tmp_path):
    """JAX_PLATFORMS=bogus: JAX's RuntimeError where it starts (args.check_devices) becomes one line, exit 2."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="bogus", PYTHONPATH=_ROOT)
    done = subprocess.run([sys.executable, "compare.py", "--frameworks", "jax", "--patterns", "dp", "--model", "mlp",
                           "--world-size", "2"], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("compare.py: error: environment variable JAX_PLATFORMS='bogus': "), done.stderr


# --- data-parallel wrappers refuse uneven batches; library misuse is one line (one 2-rank launch) ---

def _misuse_on_2_ranks(ctx):
    """Every check below on one launch of 2 gloo ranks; returns {case: message or result}."""
    import torch
    import torch.nn as nn

    from torch_impl.parallel import tp
    from torch_impl.parallel.dp import BucketedDDP
    from torch_impl.parallel.fsdp import FSDP

    def refusal(fn):
        try:
            fn()
        except (ValueError, tp.PlanError) as exc:
            return str(exc)
        return None

    torch.manual_seed(0)
    out = {}
    rows = 3 if ctx.rank == 0 else 2  # 5 rows over 2 ranks: the case
    x = torch.randn(rows, 8, dtype=torch.float64)
    ddp = BucketedDDP(nn.Linear(8, 8, dtype=torch.float64))
    out["ddp uneven"] = refusal(lambda: ddp(x))
    even = torch.randn(2, 8, dtype=torch.float64)
    with ctx.ledger.recording():  # the check's all-reduce is not the model's communication
        ddp(even).sum().backward()
        ddp.finish_gradient_synchronization()
    out["ddp even comm"] = ctx.ledger.summary()
    fsdp = FSDP(nn.Sequential(nn.Linear(8, 8, dtype=torch.float64)))
    out["fsdp uneven"] = refusal(lambda: fsdp(x))
    out["fsdp twice"] = refusal(lambda: FSDP(fsdp))
    model = nn.Sequential(nn.Linear(8, 8, dtype=torch.float64), nn.Linear(8, 8, dtype=torch.float64))
    plan = {"0": "colwise", "1": "rowwise"}
    tp.apply_plan(model, plan, ctx.group)
    out["plan twice"] = refusal(lambda: tp.apply_plan(model, plan, ctx.group))
    return out


@pytest.fixture(scope="module")
def misuse():
    from torch_impl.launch import launch

    return launch(_misuse_on_2_ranks, 2, timeout_s=120)


def test_bucketed_ddp_and_fsdp_refuse_uneven_local_batches(misuse):
    """BucketedDDP used to train 3 + 2 rows without a word, 5.9e-2 from single-device training.
    Both ranks raise (no rank left waiting in a collective), each naming its own rows."""
    for who in ("ddp", "fsdp"):
        for rank, r in enumerate(misuse):
            msg = r[f"{who} uneven"]
            assert msg is not None and "local batches differ (2 to 3 rows" in msg and "Fix:" in msg, msg
            assert f"this rank has {3 - rank}" in msg, msg
    # an even batch: only the gradient's all-reduce is counted (8·8 + 8 float64 in one bucket)
    assert misuse[0]["ddp even comm"]["all_reduce"] == {"count": 1, "bytes": 72 * 8}, misuse[0]["ddp even comm"]


def test_local_batch_refuses_rows_that_do_not_split():
    import torch

    from torch_impl.parallel.dp import local_batch

    with pytest.raises(ValueError, match="5 rows do not split evenly over 2 ranks"):
        local_batch(torch.zeros(5, 3), 0, 2)
    assert local_batch(torch.arange(6), 1, 2).tolist() == [3, 4, 5]


def test_fsdp_twice_and_apply_plan_twice_are_refused_in_one_line(misuse):
    assert "already wrapped by FSDP" in misuse[0]["fsdp twice"], misuse[0]
    assert "already planned" in misuse[0]["plan twice"], misuse[0]
    assert all("\n" not in r[k] for r in misuse for k in ("fsdp twice", "plan twice"))


# --- Ctrl-C: one line, exit 130, the finished rows kept ----------------------------------------------

def _fake_torch_collectives(cfgs, patterns, *a, **k):
    """What run_torch returns for --patterns collectives on 2 ranks (no launch): per rank, its checks."""
    check = {"variant": "all_reduce", "ok": True, "comm": {"all_reduce": {"count": 1, "bytes": 64}},
             "max_abs_err": 0.0, "expected_bytes": 64}
    return [{"collectives": [dict(check)]} for _ in range(cfgs[0].world_size)]


@pytest.mark.parametrize("during", ["jax", "torch"])
def test_ctrl_c_is_one_line_exit_130_and_keeps_the_finished_rows(during, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the JAX phase used to lose the torch rows and print a 32-line traceback."""
    import json

    from parallel_twins import runs
    from shared.schema import check as check_schema

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "run_torch", interrupt if during == "torch" else _fake_torch_collectives)
    monkeypatch.setattr(runs, "run_jax", interrupt)
    out = tmp_path / "out.json"
    rc = compare.main(["--frameworks", "torch,jax", "--patterns", "collectives", "--world-size", "2",
                       "--quiet", "--json", str(out), "--sequential"])
    assert rc == 130
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and f"interrupted (Ctrl-C) during the {during} runs" in err, err
    data = json.loads(out.read_text())
    assert check_schema(data) == []
    assert data["interrupted"] == during and data["ok"] is False
    kept = [(r["framework"], r["variant"]) for r in data["runs"]]
    assert kept == ([("torch", "all_reduce")] if during == "jax" else [])


def test_ctrl_c_side_by_side_stops_the_torch_launch_and_keeps_jax_rows(tmp_path, monkeypatch, capsys):
    """On the CPU the torch launch runs in a thread while JAX runs here (runs.collect side_by_side): Ctrl-C (in
    this thread, during JAX) cancels the launch, which stops its ranks; one line, exit 130, no torch row."""
    import json
    import threading

    from parallel_twins import runs

    stopped = threading.Event()

    def slow_torch(*a, cancel=None, **k):  # a launch that runs until it is cancelled, as launch() does
        assert cancel is not None and cancel.wait(timeout=60), "the launch was never cancelled"
        stopped.set()
        raise RuntimeError("launch cancelled")

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "run_torch", slow_torch)
    monkeypatch.setattr(runs, "run_jax", interrupt)
    out = tmp_path / "out.json"
    rc = compare.main(["--frameworks", "torch,jax", "--patterns", "collectives", "--world-size", "2",
                       "--device", "cpu", "--quiet", "--json", str(out)])
    assert rc == 130 and stopped.is_set()
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "interrupted (Ctrl-C) during the jax runs" in err, err
    data = json.loads(out.read_text())
    assert data["interrupted"] == "jax" and data["runs"] == []
    assert "torch: interrupted (Ctrl-C during the other framework's runs)" in data["errors"]


def test_ctrl_c_before_the_runs_is_one_line(monkeypatch, capsys):
    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "make_configs", interrupt)
    assert compare.main(["--patterns", "dp"]) == 130
    assert capsys.readouterr().err.strip() == "compare.py: interrupted (Ctrl-C)"


# --- JAX: parallelize leaves the user's model usable ----------------------------------------------

def test_jax_parallelize_does_not_consume_the_models_arrays():
    """The step donates its params: it used to donate the model's own arrays, so after one step the
    model and a second parallelize failed with "Array has been deleted"."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jax_impl.parallel.fsdp import parallelize

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    before = np.asarray(model.kernel[...]).copy()
    mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
    loss = lambda m, x, y: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    x = jnp.ones((4, 4))
    trainer = parallelize(model, loss, optax.adamw(1e-2), mesh, "dp", "shard_map")
    trainer.train_step(x, 2 * x)
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), before)  # still there, not trained
    assert not np.array_equal(np.asarray(trainer.module().kernel[...]), before)  # the trainer's copy trained
    again = parallelize(model, loss, optax.adamw(1e-2), mesh, "dp", "shard_map")
    assert np.isfinite(again.train_step(x, 2 * x))


# --- SIGTERM with --checkpoint-dir: finish the step, save it, exit 143; --resume continues bitwise ---

def _run_json(argv, path):
    import json

    rc = compare.main([*argv, "--quiet", "--json", str(path)])
    return rc, json.loads(path.read_text())


def test_sigterm_saves_the_step_and_resume_continues_bitwise(tmp_path, monkeypatch, capsys):
    """JAX in this process (no launch): SIGTERM after step 2 of 4 saves step 2 (not on the
    --checkpoint-every schedule), exits 143 with one line; --resume runs steps 2-3 and their
    losses equal an uninterrupted run's bit for bit (same program, same state)."""
    from shared import preempt
    from shared.checkpoint import FAULT_ENV

    argv = ["--frameworks", "jax", "--patterns", "dp", "--model", "mlp", "--world-size", "2", "--steps", "4",
            "--styles", "shard_map", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "100"]
    try:
        monkeypatch.setenv(FAULT_ENV, "step=2,signal=TERM")  # this process SIGTERMs itself after step 2
        rc, stopped = _run_json(argv, tmp_path / "a.json")
    finally:
        preempt.reset()  # the default SIGTERM handler again, for the rest of the test session
    monkeypatch.delenv(FAULT_ENV)
    assert rc == 143
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "stopped by SIGTERM" in err and "--resume" in err, err
    assert stopped["ok"] is False and any("preempted (SIGTERM)" in e for e in stopped["errors"])
    saved = sorted(p.name for p in (tmp_path / "ck").glob("*/step_*"))
    assert saved == ["step_000002"], saved  # the run in flight, at the step it finished
    try:
        rc, resumed = _run_json([*argv, "--resume"], tmp_path / "b.json")
    finally:
        preempt.reset()
    assert rc == 0, resumed["errors"]
    rc, whole = _run_json(argv[:-4], tmp_path / "c.json")  # no checkpoints: steps 0-3 in one go
    assert rc == 0
    key = lambda r: (r["style"], r["variant"])  # noqa: E731
    first = {key(r): r for r in resumed["runs"] if r.get("start_step") == 2}
    assert first, [(key(r), r.get("start_step")) for r in resumed["runs"]]
    for r in whole["runs"]:
        if key(r) in first:
            assert first[key(r)]["losses"] == r["losses"][2:]  # bitwise: the same steps from the same state


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["step=2,signal=TERM,rank=1", "step=2,signal=TERM,target=parent"])
def test_sigterm_on_torch_ranks_saves_and_resumes_bitwise(fault, tmp_path, monkeypatch, capsys):
    """torch, 2 ranks: SIGTERM on rank 1 only (the ranks agree by an all-reduce of the flag), or on
    the launching process (which passes it to every rank): both ranks finish step 2, save it, stop;
    exit 143; --resume continues to step 4 bit for bit against an uninterrupted run."""
    from shared import preempt
    from shared.checkpoint import FAULT_ENV

    argv = ["--frameworks", "torch", "--patterns", "dp", "--model", "mlp", "--world-size", "2", "--steps", "4",
            "--styles", "explicit", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "100"]
    try:
        monkeypatch.setenv(FAULT_ENV, fault)
        rc, _ = _run_json(argv, tmp_path / "a.json")
    finally:
        preempt.reset()
    monkeypatch.delenv(FAULT_ENV)
    assert rc == 143
    assert "stopped by SIGTERM" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "ck").glob("*/step_*")) == ["step_000002"]
    try:
        rc, resumed = _run_json([*argv, "--resume"], tmp_path / "b.json")
    finally:
        preempt.reset()
    assert rc == 0, resumed["errors"]
    rc, whole = _run_json(argv[:-4], tmp_path / "c.json")
    assert rc == 0
    first = {r["variant"]: r for r in resumed["runs"] if r.get("start_step") == 2}
    assert len(first) == 1, first
    for r in whole["runs"]:
        if r["variant"] in first:
            assert first[r["variant"]]["losses"] == r["losses"][2:]


# --- the verdict of a long pure run: the references measure a floor (shared/tolerances.py) -----------

def test_a_long_pure_run_is_judged_by_the_floor_its_reference_measures(tmp_path, monkeypatch):
    """Past PURE_FLOOR_STEPS the JAX reference also trains with the batch split in two; each row carries
    that floor and the tolerance it gave. PURE_FLOOR_STEPS lowered to 3 so a 4-step run is "long" (seed 11:
    a config no other test caches a reference for)."""
    from shared import floors

    monkeypatch.setattr(floors, "PURE_FLOOR_STEPS", 3)
    rc, data = _run_json(["--frameworks", "jax", "--patterns", "dp", "--model", "mlp", "--world-size", "2",
                          "--steps", "4", "--seed", "11", "--styles", "shard_map"], tmp_path / "long.json")
    assert rc == 0, data["errors"]
    for row in data["runs"]:
        floor = row["extra"]["pure_floor"]
        assert floor["floor"]["max_rel_err_loss"] < 1e-14  # 4 steps: rounding only
        assert floor["tolerance"]["max_rel_err_param"] >= 1e-12


def test_jax_launch_refuses_zero_processes():
    """`python -m jax_impl.launch -n 0 -- compare.py` exited 0 having run nothing (held-out audit)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "jax_impl.launch", "-n", "0", "--", "compare.py"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "-n and -d must be >= 1" in done.stderr, done.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigkilled_compare_py_takes_its_ranks_with_it():
    """Held-out: compare.py SIGKILLed during a long run left a rank (forked by a forkserver that outlived
    it) computing for an hour at 50 % of a core. The ranks watch the launcher's pidfd: gone in seconds."""
    import signal
    import subprocess

    proc = subprocess.Popen([sys.executable, "compare.py", "--model", "mlp", "--world-size", "2", "--steps",
                             str(10**12), "--patterns", "dp", "--frameworks", "torch", "--quiet"],
                            cwd=_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(grandchildren(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = grandchildren(proc.pid)
        assert len(ranks) >= 2, "the ranks never started"
        time.sleep(2)  # past the launch: training
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, ranks)), f"ranks outlived their SIGKILLed launcher: {ranks}"


# --- JAX's runs two at a time (compare.py on a CPU): the same results, an error stops the rest -------

def test_jax_runs_taking_turns_equal_one_at_a_time_and_stop_on_an_error(monkeypatch):
    """parallel_twins.runs: two threads take turns on the simulated devices (one compiles while the other
    traces or runs): the same losses, bit for bit (the same programs on the same inputs: no batch split
    differs), every pattern in its place; a run's error reaches the caller and the other thread starts
    no further run, and no worker outlives the call."""
    from jax_impl import harness
    from parallel_twins import runs
    from shared.config import Config

    cfg = Config(model="mlp", world_size=2, layers=2, dim=4, batch=4, steps=2)
    one = runs.run_jax([cfg], ["dp", "tp"], "cpu", threads=1)
    two = runs.run_jax([cfg], ["dp", "tp"], "cpu", threads=2)
    assert set(two) == {"dp", "tp"}
    rows = lambda out, p: [(s, v, t.losses) for s, v, t in out[p][0]["runs"]]
    for p in ("dp", "tp"):
        assert rows(one, p) == rows(two, p), p

    started = []
    real = harness.run_pattern

    def failing(pattern, *a, progress=None, **kw):
        started.append(pattern)
        if pattern == "dp":
            raise RuntimeError("dp broke")
        return real(pattern, *a, progress=progress, **kw)

    monkeypatch.setattr(harness, "run_pattern", failing)
    with pytest.raises(RuntimeError, match="dp broke"):
        runs.run_jax([cfg], ["dp", "tp", "fsdp", "pp"], "cpu", threads=2)
    import threading

    assert not [t for t in threading.enumerate() if t.name.startswith("jax-runs")]  # no worker left running
