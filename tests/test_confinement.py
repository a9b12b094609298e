"""Nothing written, read, renamed or deleted outside a checkpoint folder, even through a symlink
(issue 47): a run folder, the --checkpoint-dir itself, or a folder of the project's inside a run
folder (step_N, .tmp-step_N, .old-step_N) that is a link is refused up front by compare.py, in both
frameworks, with and without --keep and --resume (exit 2, one line, the link's target byte for byte
as it was), and again at the moment of use (shared/checkpoint.py, shared/checkpoint_io.py); retention
deletes only complete checkpoints this project provably wrote. No rank is launched here: the
frameworks' own point-of-use refusals run inside test_checkpoint_torch.py's and
test_checkpoint_jax.py's launches."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from fs_helpers import tree_hash

from parallel_twins import cli as compare
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
    owned,
    prune,
)
from shared.config import Config

CFG = Config(world_size=2, layers=2, dim=8, batch=8, steps=4)
SHARD = "dcp/shard-00001-model-00001-of-00001.safetensors"


def _save(run_dir, step, keep=0) -> str:
    tmp = aside(str(run_dir), step)
    os.makedirs(os.path.join(tmp, "dcp"))
    np.arange(64, dtype=np.float64).tofile(os.path.join(tmp, SHARD))
    return commit(tmp, manifest(CFG, step, "torch", "dcp", {"pattern": "fsdp"}), keep=keep)


@pytest.fixture
def target(tmp_path):
    """A user's folder that looks like a run folder: old step folders holding the user's files, one
    of them a complete checkpoint of this project's (copied there), and files of its own."""
    where = tmp_path / "users"
    _save(where, 1)
    _save(where, 2)
    (where / "step_000001" / "notes.txt").write_text("mine")  # no longer exactly a checkpoint's files
    os.makedirs(where / "step_000003")
    (where / "step_000003" / "data.bin").write_bytes(b"\0" * 100)
    (where / "README").write_text("keep me")
    return where


ARGS = ["--patterns", "dp", "--model", "mlp", "--world-size", "2", "--steps", "2", "--layers", "2", "--dim", "8",
        "--batch", "8", "--quiet"]
RUN = {"torch": "torch-dp-explicit-naive-mlp", "jax": "jax-dp-shard_map-dp-mlp"}


def _refused(argv, capsys) -> str:
    assert compare.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("flags", [[], ["--keep", "1"], ["--resume"], ["--resume", "--keep", "1"]])
def test_a_symlinked_run_folder_is_refused_up_front(framework, flags, tmp_path, target, capsys):
    """The issue's case: D/<run folder> links to the user's folder. Before: saves went into it, a
    re-save deleted its step folder, --keep 1 deleted its old steps with the user's files, --resume
    read through it; exit 0. Now: one line, exit 2, before any process starts; the target unchanged."""
    ck = tmp_path / "ck"
    os.makedirs(ck)
    os.symlink(target, ck / RUN[framework])
    before = tree_hash(target)
    err = _refused(["--frameworks", framework, *ARGS, "--checkpoint-dir", str(ck), *flags], capsys)
    assert f"{ck / RUN[framework]}: the run's checkpoint folder is a symlink (to {target})" in err
    assert tree_hash(target) == before


@pytest.mark.parametrize("where", ["dir", "step", "tmp", "old", "lock"])
def test_a_symlink_anywhere_the_project_writes_is_refused_up_front(where, tmp_path, target, capsys):
    """--checkpoint-dir itself a link; a step_N, .tmp-step_N, .old-step_N or .lock inside a real run
    folder a link: refused before any process starts (a .tmp- link used to lose every run of the
    launch with a 20-line traceback); the target unchanged."""
    ck = tmp_path / "ck"
    if where == "dir":
        os.symlink(target, ck)
    else:
        run = ck / RUN["torch"]
        os.makedirs(run)
        name = {"step": "step_000001", "tmp": ".tmp-step_000001", "old": ".old-step_000002", "lock": ".lock"}[where]
        os.symlink(target / "step_000001" if where != "lock" else target / "README", run / name)
    before = tree_hash(target)
    err = _refused(["--frameworks", "torch", *ARGS, "--checkpoint-dir", str(ck), "--keep", "1"], capsys)
    assert "is a symlink (to " in err and str(target) in err
    assert tree_hash(target) == before


def test_every_use_refuses_a_linked_run_folder(tmp_path, target):
    """At the moment of use too (a link made after compare.py's check, or a library caller that
    never ran it): lock, lock check, listing (resume), aside, commit and prune refuse; the target
    is as it was."""
    ck = tmp_path / "ck"
    os.makedirs(ck)
    run = ck / "torch-dp-explicit-naive-mlp"
    os.symlink(target, run)
    before = tree_hash(target)
    for attempt in (lambda: RunLock(str(run)).__enter__(), lambda: lock_holder(str(run)),
                    lambda: complete(str(run)), lambda: aside(str(run), 4), lambda: prune(str(run), 1, ""),
                    lambda: Plan(dir=str(ck), resume=True).source(str(run)),
                    lambda: check_runs(Plan(dir=str(ck), every=1, keep=1),
                                       [("torch", "dp", "explicit", "naive", CFG)])):
        with pytest.raises(CheckpointError, match="symlink") as e:
            attempt()
        assert "\n" not in str(e.value)
    real = tmp_path / "real"
    tmp = aside(str(real), 4)  # a save under way when its run folder is swapped for a link
    os.makedirs(os.path.join(tmp, "dcp"))
    os.rename(real, tmp_path / "moved")
    os.symlink(target, real)
    with pytest.raises(CheckpointError, match="symlink"):
        commit(os.path.join(str(real), ".tmp-step_000004"), manifest(CFG, 4, "torch", "dcp", {}), keep=1)
    linked = tmp_path / "linked-ck"
    os.symlink(ck, linked)  # the --checkpoint-dir itself a link
    with pytest.raises(CheckpointError, match="the checkpoint folder is a symlink"):
        RunLock(str(linked / "other-run")).__enter__()
    assert not os.path.exists(ck / "other-run")  # nothing created through the link
    assert tree_hash(target) == before


def test_retention_deletes_only_what_it_provably_wrote(tmp_path):
    """--keep 1 in a real run folder that also holds step folders the project did not write (a
    user's folder, a checkpoint with an extra file, a manifest of another format, a link): only the
    complete checkpoints it wrote go; a re-save onto a folder it did not write is refused."""
    run = tmp_path / "run"
    _save(run, 1)
    (run / "step_000001" / "extra.txt").write_text("added later")  # no longer exactly its files
    os.makedirs(run / "step_000002")
    (run / "step_000002" / "manifest.json").write_text(json.dumps({"format": "someone else's", "step": 2,
                                                                   "files": {}}))
    _save(run, 3)
    os.makedirs(run / "step_000005")  # no manifest: not listed as complete, not deleted
    before = {n: tree_hash(run / n) for n in ("step_000001", "step_000002", "step_000005")}
    assert not owned(str(run / "step_000001")) and not owned(str(run / "step_000002"))
    assert owned(str(run / "step_000003"))
    _save(run, 4, keep=1)
    assert sorted(os.listdir(run)) == [".lock", "step_000001", "step_000002", "step_000004", "step_000005"] or \
        sorted(os.listdir(run)) == ["step_000001", "step_000002", "step_000004", "step_000005"]
    assert {n: tree_hash(run / n) for n in before} == before  # the user's folders as they were
    with pytest.raises(CheckpointError, match="a folder this project did not write") as e:
        aside(str(run), 5)  # step_000005 is not a checkpoint of its own: not replaced
    assert "\n" not in str(e.value) and tree_hash(run / "step_000005") == before["step_000005"]
    assert not owned(str(tmp_path / "nowhere")) and not owned(str(run))
