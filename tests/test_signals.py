"""Signals as schedulers send them (issue 47): SIGTERM or SIGINT to the whole process group (``kill
-TERM -PGID``, GNU ``timeout``, a batch scheduler), not only to compare.py. compare.py runs in its own
session here (start_new_session=True), so the group is compare.py, the forkserver and the ranks, and
os.killpg reaches them all. Every rank finishes its step, saves it (with --checkpoint-dir), the one
line says what is on disk (checked here against the disk), --json is written with one-line errors,
and --resume continues bit for bit; without --checkpoint-dir the runs stop at once and --json is
written too.

Default tier: the no-checkpoint stop in this process, without a launch (tests/test_launch.py checks,
inside its existing launch, that the forkserver ignores SIGTERM and each rank has the default back).
Slow tier: a torch launch stopped by a group SIGTERM that rank 1 sends after step 2 (the fault hook,
so the step is known); the group killed from outside at a moment the test does not choose, in both
frameworks, with SIGTERM and SIGINT, and through GNU timeout, then resumed."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from procs import grandchildren  # tests/procs.py (pytest puts tests/ on the path)

from parallel_twins import cli as compare
from shared.checkpoint import FAULT_ENV, complete

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = ["--patterns", "dp", "--model", "mlp", "--world-size", "2", "--layers", "2", "--dim", "8", "--batch", "8",
       "--quiet"]


def _start(args, cwd, env=None, prefix=()):
    return subprocess.Popen([*prefix, sys.executable, os.path.join(ROOT, "compare.py"), *args], cwd=cwd,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _finish(proc, timeout=300):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out, err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _checked_json(path, signame):
    from shared.schema import check

    data = json.loads(open(path).read())
    assert check(data) == [], check(data)
    assert data["ok"] is False and data["signal"] == signame
    assert data["errors"] and all("\n" not in e for e in data["errors"]), data["errors"]
    return data


def _saved_as_said(line, ck):
    """The step the line says was saved is the newest complete checkpoint on disk (its manifest)."""
    import re

    m = re.search(r"step (\d+) saved to (\S+); continue with --resume", line)
    assert m, line
    step, path = int(m.group(1)), m.group(2)
    path = path if os.path.isabs(path) else os.path.join(os.path.dirname(ck), path)
    assert os.path.isfile(os.path.join(path, "manifest.json")), path
    runs = [d for d in glob.glob(os.path.join(ck, "*")) if os.path.isdir(d)]
    newest = {os.path.basename(d): complete(d)[-1][0] for d in runs if complete(d)}
    assert newest[os.path.basename(os.path.dirname(path))] == step, (newest, line)
    assert not glob.glob(os.path.join(ck, "*", ".tmp-*")), "a half-written save left behind"
    return step


@pytest.mark.slow
def test_a_group_sigterm_saves_on_every_rank_and_says_what_is_on_disk(tmp_path):
    """Rank 1 sends SIGTERM to the whole process group after step 2 (compare.py, the forkserver and
    both ranks get it): both ranks finish step 2 and save it (before: the forkserver died of it and took
    the ranks with it, leaving a half .tmp-step and a misleading line); exit 143, one line naming the
    step and its folder, the JSON written, its errors one line each."""
    ck = tmp_path / "ck"
    args = ["--frameworks", "torch", "--styles", "explicit", *MLP, "--steps", "4", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "100", "--json", str(tmp_path / "a.json")]
    rc, _, err = _finish(_start(args, tmp_path, {FAULT_ENV: "step=2,signal=TERM,rank=1,target=group"}))
    assert rc == 143, err
    line = _one_line(err)
    assert line.startswith("compare.py: stopped by SIGTERM during the torch runs; 0 finished rows written to ")
    assert _saved_as_said(line, str(ck)) == 2
    assert sorted(os.listdir(ck / "torch-dp-explicit-naive-mlp")) == [".lock", "step_000002"]
    data = _checked_json(tmp_path / "a.json", "SIGTERM")
    assert any("Preempted: preempted (SIGTERM): stopped after step 2; saved to " in e for e in data["errors"])


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_without_a_checkpoint_folder_writes_the_json(signame, tmp_path, monkeypatch, capsys):
    """No --checkpoint-dir (nothing to save): the first signal stops the runs at once; the rows that
    finished (torch's here) are written to --json, one line says nothing was saved, exit 128 + signal.
    Before: SIGTERM wrote no JSON and no line of the project's own."""
    from parallel_twins import runs
    from shared import preempt

    def fake_torch_collectives(cfgs, patterns, *a, **k):  # what 2 ranks return for --patterns collectives
        check = {"variant": "all_reduce", "ok": True, "comm": {"all_reduce": {"count": 1, "bytes": 64}},
                 "max_abs_err": 0.0, "expected_bytes": 64}
        return [{"collectives": [dict(check)]} for _ in range(cfgs[0].world_size)]

    def jax_gets_the_signal(*a, **k):
        os.kill(os.getpid(), getattr(signal, signame))
        time.sleep(30)  # the handler raises before this ends
        raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr(runs, "run_torch", fake_torch_collectives)
    monkeypatch.setattr(runs, "run_jax", jax_gets_the_signal)
    out = tmp_path / "out.json"
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    rc = compare.main(["--frameworks", "torch,jax", "--patterns", "collectives", "--world-size", "2", "--quiet",
                       "--json", str(out)])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # restored
    assert not preempt.requested()
    assert rc == preempt.exit_status(signame)
    line = _one_line(capsys.readouterr().err)
    how = "stopped by SIGTERM" if signame == "SIGTERM" else "interrupted (Ctrl-C)"
    assert line == f"compare.py: {how} during the jax runs; 1 finished rows written to {out}; nothing saved " \
                   "(no --checkpoint-dir)"
    data = _checked_json(out, signame)
    assert [r["framework"] for r in data["runs"]] == ["torch"] and data["interrupted"] == "jax"


# --- slow: the group killed from outside, at a moment the test does not choose -------------------

def _resumes_bitwise(common, ck, tmp_path, step, name):
    """--resume continues from ``step`` and its losses equal an uninterrupted run's, bit for bit. Both
    run to step + 5 only: a step's arithmetic does not depend on the run's length (constant schedule),
    and --resume takes the newest checkpoint before the end."""
    steps = ["--steps", str(step + 5)]
    rc, _, err = _finish(_start([*common, *steps, "--checkpoint-dir", str(ck), "--resume", "--json",
                                 str(tmp_path / f"{name}-resumed.json")], tmp_path))
    assert rc == 0, err
    rc, _, err = _finish(_start([*common, *steps, "--json", str(tmp_path / f"{name}-whole.json")], tmp_path))
    assert rc == 0, err
    resumed, full = (json.loads((tmp_path / f"{name}-{k}.json").read_text())["runs"] for k in ("resumed", "whole"))
    key = lambda r: (r["framework"], r["style"], r["variant"])  # noqa: E731
    first = {key(r): r for r in resumed if r.get("start_step") == step}
    assert first, [(key(r), r.get("start_step")) for r in resumed]
    for r in full:
        if key(r) in first:
            assert first[key(r)]["losses"] == r["losses"][step:], key(r)  # the same steps from the same state


@pytest.mark.slow
@pytest.mark.parametrize("framework,signame", [("torch", "SIGTERM"), ("jax", "SIGTERM"), ("torch", "SIGINT")])
def test_the_group_killed_from_outside_saves_and_resumes_bitwise(framework, signame, tmp_path):
    """os.killpg once the third checkpoint is on disk (the step the ranks are at is not chosen: every
    step is saved, so the run cannot outrun the signal): exit 128 + signal, the line's step is the
    newest checkpoint on disk, the JSON is written; --resume continues bit for bit against an
    uninterrupted run (SIGTERM; SIGINT takes the same path)."""
    ck = tmp_path / "ck"
    style = "builtin" if framework == "torch" else "shard_map"  # one torch run (DDP), two JAX ones
    common = ["--frameworks", framework, "--styles", style, *MLP]
    proc = _start([*common, "--steps", "100", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--json",
                   str(tmp_path / "a.json")], tmp_path)
    deadline = time.monotonic() + 240
    while not glob.glob(str(ck / "*" / "step_000003")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before the third checkpoint: raise --steps"
    os.killpg(proc.pid, getattr(signal, signame))
    rc, _, err = _finish(proc)
    assert rc == 128 + getattr(signal, signame), err
    step = _saved_as_said(_one_line(err), str(ck))
    assert 3 <= step < 100
    _checked_json(tmp_path / "a.json", signame)
    if signame == "SIGTERM":
        _resumes_bitwise(common, ck, tmp_path, step, framework)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["killpg", "timeout"])
def test_the_group_stopped_without_a_checkpoint_folder_writes_the_json(how, tmp_path):
    """No --checkpoint-dir, torch's ranks then JAX: a SIGTERM to the group stops everything at once;
    exit 143, one line, the JSON. os.killpg once both ranks exist; GNU timeout's (exit 124, its own)
    lands where it lands: before the runs it is one line and no JSON (there are no rows)."""
    if how == "timeout" and not shutil.which("timeout"):
        pytest.skip("no GNU timeout here")
    args = ["--frameworks", "torch,jax", "--styles", "builtin,jit", *MLP, "--steps", "100000", "--json",
            str(tmp_path / "a.json")]
    if how == "timeout":
        proc = _start(args, tmp_path, prefix=("timeout", "-s", "TERM", "25"))
    else:
        proc = _start(args, tmp_path)
        deadline = time.monotonic() + 240
        while len(grandchildren(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGTERM)
    rc, _, err = _finish(proc)
    assert rc == (124 if how == "timeout" else 143), err
    line = _one_line(err)
    if how == "timeout" and "before the runs" in line:
        assert line == "compare.py: stopped by SIGTERM before the runs: nothing ran, nothing saved"
        return
    assert "nothing saved (no --checkpoint-dir)" in line, line
    _checked_json(tmp_path / "a.json", "SIGTERM")
