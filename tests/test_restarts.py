"""Issue 38's restarts: a rank killed under torchrun --max-restarts, a JAX process killed then relaunched,
SIGTERM passed on by the JAX launcher; each continues from its last complete checkpoint with losses equal
bit for bit to an uninterrupted run (docs/reliability.md, "Restarts"). The launches are real (slow tier);
the launcher's forwarding is tested with a script that imports no JAX."""

import os
import signal
import time

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launched(cmd, tmp_path, name, fault=None, timeout=300):
    """Run ``cmd`` (a launcher and compare.py) from the repository root; returns (status, its --json)."""
    import json
    import subprocess
    import sys

    from shared.checkpoint import FAULT_ENV

    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    if fault:
        env[FAULT_ENV] = fault
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, *cmd, "--quiet", "--json", str(out)], cwd=_ROOT, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    return done.returncode, (json.loads(out.read_text()) if out.exists() else None), done.stderr


def _continues_bitwise(resumed, whole, start):
    """The rows that resumed at ``start``: their losses are the uninterrupted run's from ``start`` on, bit
    for bit (the same program from the same saved state)."""
    first = {(r["style"], r["variant"]): r for r in resumed["runs"] if r.get("start_step") == start}
    assert first, [(r["variant"], r.get("start_step")) for r in resumed["runs"]]
    for r in whole["runs"]:
        if (r["style"], r["variant"]) in first:
            assert first[r["style"], r["variant"]]["losses"] == r["losses"][start:], r["variant"]


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_a_killed_rank_bitwise(tmp_path):
    """torchrun --max-restarts 1, --resume from the start: rank 1 SIGKILLs itself after step 2 in the first
    attempt only (restart=0); torchrun restarts the group, which resumes from step 1 (the last complete
    checkpoint) and finishes; its losses equal an uninterrupted run's bit for bit. The restarted group
    needs its own store keys (torch_impl.launch._torchrun_store): it used to hang or fail to connect."""
    ck = tmp_path / "ck"
    run = ["compare.py", "--frameworks", "torch", "--patterns", "dp", "--model", "mlp", "--world-size", "2",
           "--steps", "4", "--styles", "explicit"]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1"]
    rc, resumed, err = _launched([*torchrun, *run, "--checkpoint-dir", str(ck), "--resume"], tmp_path, "restarted",
                                 fault="step=2,rank=1,restart=0")
    assert rc == 0, err[-3000:]
    assert "exitcode: -9" in err or "exitcode: 1" in err, err[-3000:]  # the first attempt did fail
    rc, whole, err = _launched([*torchrun, *run], tmp_path, "whole")
    assert rc == 0, err[-3000:]
    _continues_bitwise(resumed, whole, 1)


_TERM_ON_0 = """
import os, signal, sys, time
here = os.path.dirname(os.path.abspath(__file__))
def stop(signum, frame):
    open(os.path.join(here, f"term{os.environ['JAX_PROCESS_ID']}"), "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
if os.environ["JAX_PROCESS_ID"] == "0":
    time.sleep(0.5)
    os.kill(os.getppid(), signal.SIGTERM)  # preemption reaches the launcher
time.sleep(60)
"""


def test_jax_launch_passes_sigterm_on_to_every_process(tmp_path, capsys):
    """SIGTERM to python -m jax_impl.launch reaches every process, which stop on their own (compare.py:
    save, exit 143); the launch exits 143 and does not kill them first. It used to pass nothing on."""
    from jax_impl.launch import run_command

    script = tmp_path / "job.py"
    script.write_text(_TERM_ON_0)
    t0 = time.monotonic()
    rc = run_command([str(script)], 2, 1, timeout_s=60)
    assert rc == 143 and time.monotonic() - t0 < 30
    assert (tmp_path / "term0").exists() and (tmp_path / "term1").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the launcher's handler is gone again
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_jax_processes_killed_then_preempted_resume_bitwise(tmp_path):
    """python -m jax_impl.launch -n 2, --checkpoint-every 2: process 1 SIGKILLs itself after step 3 (the
    launch ends process 0, exit 137; step 2 is the last complete checkpoint); a relaunch with --resume
    gets SIGTERM at its launcher after step 3 (passed on: both processes finish a step, save it, 143);
    a third launch resumes from there. Its losses equal an uninterrupted launch's bit for bit."""
    ck = tmp_path / "ck"
    run = ["-m", "jax_impl.launch", "-n", "2", "-d", "1", "compare.py", "--frameworks", "jax", "--patterns", "dp",
           "--model", "mlp", "--world-size", "2", "--steps", "8", "--styles", "shard_map"]
    saving = [*run, "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
    rc, _, err = _launched(saving, tmp_path, "killed", fault="step=3,rank=1")
    assert rc == 128 + signal.SIGKILL and "process 1 of 2 ended with signal SIGKILL" in err, err[-3000:]
    folders = list(ck.iterdir())
    assert [p.name for p in folders[0].glob("step_*")] == ["step_000002"]  # dp ran first, died after step 3
    term = "step=3,rank=0,signal=TERM,target=parent"  # process 0 sends SIGTERM to the launcher
    rc, _, err = _launched([*saving, "--resume"], tmp_path, "preempted", fault=term)
    assert rc == 143 and err.count("stopped by SIGTERM") == 1, err[-3000:]
    steps = sorted(int(p.name[5:]) for p in folders[0].glob("step_*"))
    stopped = steps[-1]
    assert len(folders) == 1 and steps[0] == 2 and stopped >= 3, steps  # the step it was in, saved
    rc, resumed, err = _launched([*saving, "--resume"], tmp_path, "resumed")
    assert rc == 0, err[-3000:]
    rc, whole, err = _launched(run, tmp_path, "whole")
    assert rc == 0, err[-3000:]
    _continues_bitwise(resumed, whole, stopped if stopped < 8 else 6)
