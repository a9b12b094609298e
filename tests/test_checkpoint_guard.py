"""Checkpoints under hostile input and faults (shared/checkpoint.py, shared/checkpoint_io.py), on folders
written here with NumPy (no rank launched): nothing outside a checkpoint folder is read, measured or
named; one writer per run folder; another run's checkpoint refused; retention; save failures as one
line that leave earlier checkpoints intact."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from shared.checkpoint import (
    CheckpointError,
    Plan,
    RunLock,
    aside,
    check_runs,
    commit,
    complete,
    lock_holder,
    manifest,
    verify,
)
from shared.config import Config

CFG = Config(world_size=2, layers=2, dim=8, batch=8, steps=4)
SHARD = "dcp/shard-00001-model-00001-of-00001.safetensors"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save(run_dir, step, cfg=CFG, keep=0) -> str:
    """A checkpoint as torch's save leaves it (a shard under dcp/, a manifest), written with NumPy."""
    tmp = aside(str(run_dir), step)
    os.makedirs(os.path.join(tmp, "dcp"))
    np.arange(64, dtype=np.float64).tofile(os.path.join(tmp, SHARD))  # 512 bytes
    return commit(tmp, manifest(cfg, step, "torch", "dcp", {"pattern": "fsdp"}), keep=keep)


def _edit(path, **files):
    """Rewrite the manifest's file list: {name: (bytes, sha256)} replacing / adding entries."""
    mpath = os.path.join(path, "manifest.json")
    info = json.load(open(mpath))
    for name, (size, sha) in files.items():
        info["files"][name] = {"bytes": size, "sha256": sha}
    json.dump(info, open(mpath, "w"))


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


@pytest.fixture
def ckpt(tmp_path):
    return _save(tmp_path / "run", 2)


def test_a_checkpoint_written_here_verifies(ckpt):
    assert verify(ckpt, CFG)["step"] == 2 and verify(ckpt)["files"][SHARD]["bytes"] == 512


@pytest.mark.parametrize("name", ["dcp/../../outside.bin", "../outside.bin", "/OUTSIDE", "dcp//x", "dcp/./x", ""])
def test_entries_outside_the_folder_refused_without_their_size(ckpt, tmp_path, name):
    """A manifest entry naming a file outside the checkpoint (by '..' or an absolute path) is refused
    by its name, even with the right size and hash, and the message never says the outside size."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 12345)
    import hashlib

    if name == "/OUTSIDE":
        name = str(outside)
    _edit(ckpt, **{name: (12345, hashlib.sha256(b"x" * 12345).hexdigest())})
    with pytest.raises(CheckpointError, match="refused|not a relative|not under dcp/") as e:
        verify(ckpt, CFG)
    assert "12345" not in _one_line(e)


def test_symlinks_refused(ckpt, tmp_path):
    """The file a symlink (to a copy with the same bytes), or a folder on the way a symlink."""
    outside = tmp_path / "copy"
    os.makedirs(outside)
    os.replace(os.path.join(ckpt, SHARD), outside / "shard")
    os.symlink(outside / "shard", os.path.join(ckpt, SHARD))
    with pytest.raises(CheckpointError, match="a symlink, not a regular file") as e:
        verify(ckpt, CFG)
    assert "512" not in _one_line(e)
    os.remove(os.path.join(ckpt, SHARD))
    os.replace(outside / "shard", outside / os.path.basename(SHARD))
    os.rmdir(os.path.join(ckpt, "dcp"))
    os.symlink(outside, os.path.join(ckpt, "dcp"))  # the folder on the way
    with pytest.raises(CheckpointError, match="dcp: a symlink where the checkpoint needs a folder"):
        verify(ckpt, CFG)


def test_a_symlinked_checkpoint_folder_and_extra_links_refused(ckpt, tmp_path):
    os.symlink(ckpt, tmp_path / "run" / "step_000009")
    with pytest.raises(CheckpointError, match="step_000009: a symlink"):
        verify(str(tmp_path / "run" / "step_000009"), CFG)
    os.symlink("/etc/passwd", os.path.join(ckpt, "dcp", "extra"))  # listed nowhere: still refused
    with pytest.raises(CheckpointError, match="extra: a symlink inside a checkpoint"):
        verify(ckpt, CFG)


def test_a_fifo_is_refused_at_once(ckpt):
    os.remove(os.path.join(ckpt, SHARD))
    os.mkfifo(os.path.join(ckpt, SHARD))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="not a regular file"):
        verify(ckpt, CFG)
    assert time.perf_counter() - t0 < 1.0


def test_a_16_gb_sparse_file_is_refused_at_once(ckpt, tmp_path):
    """Inside the folder with the size the manifest claims: over what a checkpoint of this model can
    hold, refused before a byte is hashed; outside (through '..' or a symlink): refused by name."""
    big = os.path.join(ckpt, "dcp", "big.safetensors")
    with open(big, "wb") as f:
        f.truncate(16 << 30)
    _edit(ckpt, **{"dcp/big.safetensors": (16 << 30, "0" * 64)})
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"its files hold \d+ bytes, a checkpoint of this model at most"):
        verify(ckpt, CFG)
    with pytest.raises(CheckpointError, match="at most"):
        verify(ckpt)  # no run config: the budget of the model the manifest describes
    os.replace(big, tmp_path / "big")
    os.symlink(tmp_path / "big", big)
    with pytest.raises(CheckpointError, match="a symlink"):
        verify(ckpt, CFG)
    assert time.perf_counter() - t0 < 2.0


def test_a_manifest_nested_past_the_stack_is_one_line(ckpt):
    """Held-out: 100 000 nested brackets made json raise RecursionError, a traceback in every rank."""
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="unreadable manifest"):
        verify(ckpt, CFG)


def test_an_edited_step_or_writer_refused(ckpt):
    mpath = os.path.join(ckpt, "manifest.json")
    info = json.load(open(mpath))
    json.dump(info | {"step": 3}, open(mpath, "w"))
    with pytest.raises(CheckpointError, match="step 3 does not match the folder 'step_000002'"):
        verify(ckpt, CFG)
    json.dump(info | {"writer": "orbax"}, open(mpath, "w"))
    with pytest.raises(CheckpointError, match="writer 'orbax' / framework 'torch'"):
        verify(ckpt, CFG)


def test_a_symlinked_tmp_folder_is_one_line(tmp_path):
    run = tmp_path / "run"
    os.makedirs(run)
    os.symlink(tmp_path, run / ".tmp-step_000002")
    with pytest.raises(CheckpointError, match=r"\.tmp-step_000002: a symlink or a file") as e:
        aside(str(run), 2)
    _one_line(e)
    assert os.path.isdir(tmp_path)  # the link's target untouched


# --- one writer, the run's identity ---

def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    run = str(tmp_path / "run")
    with RunLock(run):
        with pytest.raises(CheckpointError, match=rf"{run}: another run is writing .*pid {os.getpid()} on ") as e:
            RunLock(run).__enter__()
        _one_line(e)
        assert f"pid {os.getpid()}" in lock_holder(run)
    assert lock_holder(run) is None
    with RunLock(run):  # released: taken again
        pass


def test_the_lock_of_another_process_and_its_death(tmp_path):
    """A lock another process holds refuses this one; it goes with its process (no stale lock)."""
    plan = Plan(dir=str(tmp_path), every=1)
    run = plan.run_dir("torch", "fsdp", "explicit", "zero3", CFG)
    code = (f"import sys, time; sys.path.insert(0, {ROOT!r}); from shared.checkpoint_io import RunLock\n"
            f"with RunLock({run!r}):\n print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=rf"pid {proc.pid} "):
            RunLock(run).__enter__()
        with pytest.raises(CheckpointError, match=rf"pid {proc.pid} "):  # the check before any rank starts
            check_runs(plan, [("torch", "fsdp", "explicit", "zero3", CFG)])
    finally:
        proc.kill()
        proc.wait()
    with RunLock(run):
        pass


def test_a_symlinked_lock_refused(tmp_path):
    run = tmp_path / "run"
    os.makedirs(run)
    os.symlink(tmp_path / "elsewhere", run / ".lock")
    with pytest.raises(CheckpointError, match=r"cannot lock .*a symlink"):
        RunLock(str(run)).__enter__()
    assert not os.path.exists(tmp_path / "elsewhere")


def test_another_runs_checkpoint_refused_naming_the_field(ckpt):
    for field, value in (("seed", 7), ("lr", 2e-3), ("batch", 16), ("weight_decay", 0.0)):
        with pytest.raises(CheckpointError, match=rf"another run's checkpoint: saved with {field}=") as e:
            verify(ckpt, CFG.replace(**{field: value}))
        assert f"{field}={value!r}" in _one_line(e)
    with pytest.raises(CheckpointError, match="saved with dim=8, this run has dim=16"):
        verify(ckpt, CFG.replace(dim=16))


def test_check_runs_looks_only_at_the_runs_it_makes(tmp_path):
    """--resume over seed 7's checkpoints with --seed 0: refused before any rank (naming the seed);
    another run's folder in the same --checkpoint-dir (another --dim, unreadable even) is not looked at."""
    plan = Plan(dir=str(tmp_path), every=1, resume=True)
    mine = ("torch", "fsdp", "explicit", "zero3", CFG)
    _save(plan.run_dir(*mine), 2, CFG.replace(seed=7))
    with pytest.raises(CheckpointError, match=r"saved with seed=7, this run has seed=0"):
        check_runs(plan, [mine])
    check_runs(plan, [("torch", "dp", "explicit", "naive", CFG)])  # nothing saved for it: from step 0
    other = ("torch", "tp", "explicit", "megatron", CFG.replace(dim=16))  # an earlier --patterns tp --dim 16
    bad = _save(plan.run_dir(*other), 2, other[-1])
    os.remove(os.path.join(bad, SHARD))  # broken, and another width: not this invocation's business
    check_runs(plan, [("torch", "fsdp", "builtin", "fsdp2", CFG)])
    with pytest.raises(CheckpointError, match="missing"):
        check_runs(plan, [other])  # (it is looked at when it is one of the runs)
    _save(plan.run_dir(*mine), 3)  # seed 0's own checkpoint, newer: the one resumed, accepted
    check_runs(plan, [mine])


# --- retention, save failures ---

def test_keep_n_deletes_the_oldest_never_the_one_just_written(tmp_path):
    run = tmp_path / "run"
    for step in range(1, 6):
        _save(run, step, keep=2)
    os.makedirs(run / ".tmp-step_000009")  # a live writer's save: never touched
    assert [s for s, _ in complete(str(run))] == [4, 5]
    _save(run, 1, keep=2)  # older than the newest two, but just written: kept beside them
    assert [s for s, _ in complete(str(run))] == [1, 4, 5]
    _save(run, 2, keep=2)  # the next save: step 1 is beyond the newest two now
    assert sorted(os.listdir(run)) == [".tmp-step_000009", "step_000002", "step_000004", "step_000005"]
    with pytest.raises(ValueError, match="--keep -1"):
        Plan(dir=str(tmp_path), keep=-1)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_a_failed_commit_is_one_line_and_keeps_the_earlier_ones(tmp_path, monkeypatch, err):
    run = tmp_path / "run"
    first = _save(run, 1)
    again = _save(run, 2)

    def full(*a, **k):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(json, "dump", full)
    with pytest.raises(CheckpointError, match=rf"{run}: cannot save step 3: ") as e:
        _save(run, 3)
    assert ("no space left" if err == errno.ENOSPC else "Read-only") in _one_line(e)
    with pytest.raises(CheckpointError, match="cannot save step 2"):
        _save(run, 2)  # a re-save of step 2 fails: the step 2 already there stays
    monkeypatch.undo()
    assert [p for _, p in complete(str(run))] == [first, again] and verify(again, CFG)
    assert sorted(os.listdir(run)) == ["step_000001", "step_000002"]  # no .tmp- left behind


def test_an_unwritable_run_folder_is_one_line(tmp_path, monkeypatch):
    run = tmp_path / "run"
    first = _save(run, 1)
    if os.geteuid() == 0:  # root writes anywhere: the refusal the kernel would give, simulated
        real = os.makedirs

        def readonly(path, *a, **k):
            if str(path).startswith(str(run)):
                raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real(path, *a, **k)

        monkeypatch.setattr(os, "makedirs", readonly)
    else:
        os.chmod(run, 0o555)
    try:
        with pytest.raises(CheckpointError, match=rf"{run}: cannot save step 2: Permission denied") as e:
            aside(str(run), 2)
        _one_line(e)
    finally:
        os.chmod(run, 0o755)
    assert verify(first, CFG)


def test_two_compare_runs_on_one_folder_the_second_refused_before_it_starts(tmp_path):
    """Issue 46: compare.py takes its run folders' locks before any process starts and keeps them, so a second
    compare.py on the same --checkpoint-dir is refused at once (exit 2, one line naming the holder), never
    after its ranks are up; its own runs (torch ranks it launched, JAX in its process) write under its locks."""
    argv = ["compare.py", "--frameworks", "torch", "--patterns", "dp", "--model", "mlp", "--size", "tiny",
            "--world-size", "2", "--steps", "200", "--checkpoint-dir", str(tmp_path), "--quiet"]
    first = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        lock = tmp_path / "torch-dp-explicit-naive-mlp" / ".lock"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (lock.exists() and lock.read_text().startswith(f"pid {first.pid}")):
            time.sleep(0.1)
        assert lock.read_text().startswith(f"pid {first.pid} "), lock.read_text() if lock.exists() else "no lock"
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        err = second.stderr.strip()
        assert len(err.splitlines()) == 1 and "another run is writing" in err and f"pid {first.pid} " in err, err
        assert time.monotonic() - t0 < 30  # refused before any rank started
        assert first.poll() is None  # the first goes on
    finally:
        first.kill()
        first.wait()
