"""Checkpoints, torch side (torch_impl/checkpoint.py): save with DCP under every pattern, resume bit for
bit on the same layout, load under other layouts and world sizes, refuse what cannot load.

One launch per world size runs every pattern's variants: each trains ``steps`` steps saving at half (the
uninterrupted run), then resumes from that checkpoint (the same layout, the same arithmetic from the
same state: the same bits, on any machine — no batch is split differently).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shared.checkpoint import CheckpointError, Plan, read_dcp, read_state, verify
from shared.config import Config
from shared.problem import param_names
from shared.results import parity, within
from torch_impl.launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = Config(world_size=2, layers=4, dim=16, batch=16, steps=4, dtype="float64")
GPT = Config(world_size=2, model="transformer", layers=2, dim=16, heads=4, seq=8, vocab=32, batch=8, steps=4,
             dtype="float64")
# Default tier: each pattern by hand and through torch's own API (ZeRO-1 too); the slow tier: every
# variant and pp schedule, the transformer, cp, ep (and the mesh layouts below).
DEFAULT = [("dp", MLP, [("explicit", "naive"), ("explicit", "zero1"), ("builtin", "ddp")]),
           ("fsdp", MLP, [("explicit", "zero3"), ("builtin", "fsdp2")]),
           ("tp", MLP, [("explicit", "megatron"), ("builtin", "dtensor")]),
           ("pp", MLP, [("explicit", "1f1b"), ("builtin", "gpipe")])]
SLOW = [("dp", MLP), ("fsdp", MLP), ("tp", MLP), ("pp", MLP), ("dp", GPT), ("fsdp", GPT), ("tp", GPT), ("pp", GPT),
        ("cp", GPT), ("ep", GPT.replace(experts=4))]


def _save_and_resume(ctx, folder, jobs):
    """Every (pattern, cfg): every variant saved at half, then resumed from it; rank 0's pairs."""
    from torch_impl.harness import run_pattern

    out = []
    for pattern, cfg, *variants in jobs:
        plan = Plan(dir=os.path.join(folder, f"{pattern}-{cfg.model}"), save_at=(cfg.steps // 2,))
        chosen = variants[0] if variants else None
        full = run_pattern(ctx, pattern, [cfg], chosen, checkpoint=plan)
        resumed = run_pattern(ctx, pattern, [cfg], chosen, checkpoint=Plan(dir=plan.dir, resume=True))
        if ctx.rank == 0:
            out += [(pattern, cfg, s, v, a, b, full[0]["reference"])
                    for (s, v, a), (_, _, b) in zip(full[0]["runs"], resumed[0]["runs"], strict=True)]
    return out if ctx.rank == 0 else None


def _save_resume_and_lock(ctx, folder, jobs):
    """The pairs above; then, in the same launch, a run whose folder rank 0 already holds (as a second
    run writing it would): every rank's one-line refusal, before training, and no folder written."""
    import torch.distributed as dist

    from shared.checkpoint import RunLock
    from torch_impl.harness import run_pattern

    pairs = _save_and_resume(ctx, folder, jobs)
    plan = Plan(dir=os.path.join(folder, "held"), every=1)
    held = RunLock(plan.run_dir("torch", "dp", "explicit", "naive", MLP))
    if ctx.rank == 0:
        held.__enter__()
    try:
        run_pattern(ctx, "dp", [MLP], [("explicit", "naive")], checkpoint=plan)
        line = None
    except CheckpointError as exc:
        line = str(exc)
    finally:
        held.__exit__()
    lines = [None] * ctx.world_size
    dist.all_gather_object(lines, line)
    linked = []  # the run folder a symlink to the user's folder (issue 47): saving with --keep, resuming
    for plan in (Plan(dir=os.path.join(folder, "linked"), every=1, keep=1),
                 Plan(dir=os.path.join(folder, "linked"), resume=True)):
        try:
            run_pattern(ctx, "dp", [MLP], [("explicit", "naive")], checkpoint=plan)
            line = None
        except CheckpointError as exc:
            line = str(exc)
        got = [None] * ctx.world_size
        dist.all_gather_object(got, line)
        linked.append(got)
    return pairs, lines, linked


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ckpt"))
    target = os.path.join(folder, "users")
    os.makedirs(os.path.join(target, "step_000001"))
    with open(os.path.join(target, "step_000001", "notes.txt"), "w") as f:
        f.write("mine")
    os.makedirs(os.path.join(folder, "linked"))
    os.symlink(target, os.path.join(folder, "linked", "torch-dp-explicit-naive-mlp"))
    from fs_helpers import tree_hash

    before = tree_hash(target)
    out = launch(_save_resume_and_lock, 2, folder, DEFAULT)[0]
    return (*out, tree_hash(target) == before)


@pytest.fixture(scope="module")
def pairs(launched):
    return launched[0]


def test_a_linked_run_folder_is_refused_where_it_is_used(launched):
    """Without compare.py's check: a run folder that is a symlink is refused on every rank with one
    line, saving (with keep) and resuming, and the link's target is byte for byte as it was."""
    *_, linked, unchanged = launched
    for lines in linked:
        assert len(set(lines)) == 1 and lines[0] is not None and "\n" not in lines[0], lines
        assert "torch-dp-explicit-naive-mlp: the run's checkpoint folder is a symlink" in lines[0]
    assert unchanged


def test_a_held_run_folder_is_refused_on_every_rank(launched):
    lines = launched[1]
    assert len(set(lines)) == 1 and lines[0] is not None, lines
    assert "torch-dp-explicit-naive-mlp: another run is writing this checkpoint folder (pid " in lines[0]
    assert "\n" not in lines[0]


def _check_pairs(pairs):
    assert pairs
    for pattern, cfg, style, variant, full, resumed, ref in pairs:
        what = f"{pattern} {cfg.model} {style}/{variant}"
        half = cfg.steps // 2
        assert resumed.start_step == half and full.start_step == 0, what
        assert resumed.losses == full.losses[half:], what  # bit for bit: same state, same arithmetic
        assert all(np.array_equal(a, b) for a, b in zip(resumed.params, full.params, strict=True)), what
        assert within(parity(resumed, ref), cfg.dtype), what  # and the resumed run against the reference
        assert full.extra["checkpoints"][0]["step"] == half and resumed.extra["resumed_from"].endswith("step_000002")


def test_resume_is_bitwise_under_every_pattern(pairs):
    _check_pairs(pairs)
    assert {(p, v) for p, _, _, v, *_ in pairs} >= {("dp", "zero1"), ("fsdp", "fsdp2"), ("tp", "dtensor")}


@pytest.mark.slow
def test_resume_is_bitwise_on_the_transformer_and_moe(tmp_path):
    _check_pairs(launch(_save_and_resume, 2, str(tmp_path), SLOW)[0])


def test_dcp_files_hold_the_canonical_state(pairs, tmp_path):
    """One safetensors file per rank, each its Shard(0) chunk; NumPy reassembles the whole arrays, equal
    to the run's parameters at the step saved, in fixture orientation."""
    *_, full, _, _ = next(p for p in pairs if p[0] == "fsdp" and p[3] == "zero3")
    path = full.extra["checkpoints"][0]["path"]
    files = sorted(os.listdir(os.path.join(path, "dcp")))
    assert files == ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    info = verify(path, MLP)
    assert info["step"] == 2 and info["writer"] == "dcp" and info["layout"]["variant"] == "zero3"
    state = read_state(path, info)
    state.check(MLP)
    assert list(state.params) == param_names(MLP) or set(state.params) == set(param_names(MLP))
    assert all(np.all(state.adam_v[n] >= 0) for n in state.adam_v)  # second moments
    whole = read_dcp(os.path.join(path, "dcp"))
    assert set(whole) == {f"{g}/{n}" for g in ("params", "adam_m", "adam_v") for n in param_names(MLP)}


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_refusals_name_the_file_and_the_mismatch(pairs, tmp_path):
    *_, full, _, _ = next(p for p in pairs if p[0] == "dp" and p[3] == "naive")
    src = full.extra["checkpoints"][0]["path"]
    shard = "dcp/shard-00001-model-00001-of-00001.safetensors"
    bad = _copy(src, tmp_path / "flipped" / "step_000002")
    blob = bytearray((bad / shard).read_bytes())
    blob[-3] ^= 0xFF
    (bad / shard).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"shard-00001.*SHA-256 differs.*corrupted"):
        verify(str(bad), MLP)
    cut = _copy(src, tmp_path / "cut" / "step_000002")
    (cut / shard).write_bytes((cut / shard).read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"shard-00001.*100 bytes, the manifest says .*truncated"):
        verify(str(cut), MLP)
    with pytest.raises(CheckpointError, match=r"manifest.json: saved with dim=16, this run has dim=32"):
        verify(src, MLP.replace(dim=32))
    with pytest.raises(CheckpointError, match=r"saved with model='mlp', this run has model='transformer'"):
        verify(src, GPT)
    gone = _copy(src, tmp_path / "noopt" / "step_000002")
    info = json.loads((gone / "manifest.json").read_text())
    info["optimizer"] = None
    (gone / "manifest.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match=r"no optimizer state"):
        verify(str(gone), MLP)
    state = read_state(src, verify(src, MLP))
    with pytest.raises(CheckpointError, match=r"adam_m: no optimizer state"):
        type(state)(step=2, params=state.params, adam_m={}, adam_v=state.adam_v).check(MLP, where=src)


def _compare(*args, env=None):
    return subprocess.run([sys.executable, "compare.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def _fsdp_zero3(ctx, cfg, plan):
    from torch_impl.harness import run_pattern

    out = run_pattern(ctx, "fsdp", [cfg], [("explicit", "zero3")], checkpoint=plan)
    return out[0]["runs"][0][2] if ctx.rank == 0 else None


def test_a_rank_killed_in_a_save_then_resumed_is_bitwise(pairs, tmp_path, monkeypatch):
    """Rank 1 dies (SIGKILL) in the middle of saving step 2 — its files written, no manifest: the launch
    fails, the save stays a .tmp- folder, resume continues from step 1 and ends on the uninterrupted
    run's bits (losses of the steps it ran, final parameters)."""
    from torch_impl.launch import LaunchError

    folder = str(tmp_path / "ckpt")
    monkeypatch.setenv("PARALLEL_TWINS_FAULT", "step=2,phase=save,rank=1")  # the spawned ranks inherit it
    with pytest.raises(LaunchError, match="rank 1"):
        launch(_fsdp_zero3, 2, MLP, Plan(dir=folder, every=1))
    monkeypatch.delenv("PARALLEL_TWINS_FAULT")
    run = os.path.join(folder, "torch-fsdp-explicit-zero3-mlp")
    assert sorted(os.listdir(run)) == [".lock", ".tmp-step_000002", "step_000001"]
    resumed = launch(_fsdp_zero3, 2, MLP, Plan(dir=folder, resume=True))[0]
    *_, whole, _, _ = next(p for p in pairs if p[0] == "fsdp" and p[3] == "zero3")  # never interrupted
    assert resumed.start_step == 1 and resumed.losses == whole.losses[1:]
    assert all(np.array_equal(a, b) for a, b in zip(resumed.params, whole.params, strict=True))


@pytest.mark.slow
def test_kill_in_a_save_then_resume_is_bitwise(tmp_path):
    """compare.py --checkpoint-dir: rank 0 dies in the middle of saving step 2 (its files written, no
    manifest); --resume skips that save, continues from step 1, and ends on the very bits of a run that
    was never interrupted (its last checkpoint's arrays, every one)."""
    args = ["--frameworks", "torch", "--patterns", "fsdp", "--model", "mlp", "--world-size", "2", "--steps", "4",
            "--layers", "4", "--dim", "16", "--batch", "16", "--quiet"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    r = _compare(*args, "--checkpoint-dir", str(whole), "--json", str(tmp_path / "whole.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    r = _compare(*args, "--checkpoint-dir", str(cut), env={"PARALLEL_TWINS_FAULT": "step=2,phase=save,rank=0"})
    assert r.returncode == 1, r.stdout + r.stderr
    run = cut / "torch-fsdp-explicit-zero3-mlp"
    assert sorted(os.listdir(run)) == [".lock", ".tmp-step_000002", "step_000001"]  # the killed save: never complete
    r = _compare(*args, "--checkpoint-dir", str(cut), "--resume", "--json", str(tmp_path / "cut.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = (json.loads((tmp_path / f"{n}.json").read_text())["runs"] for n in ("whole", "cut"))
    by = lambda rows: {(x["style"], x["variant"]): x for x in rows}
    assert by(b)["explicit", "zero3"]["start_step"] == 1 and by(b)["builtin", "fsdp2"]["start_step"] == 0
    for key, row in by(b).items():
        assert row["losses"] == by(a)[key]["losses"][row["start_step"]:], key
    for name in os.listdir(whole):
        x, y = (read_dcp(os.path.join(d, name, "step_000004", "dcp")) for d in (whole, cut))
        assert all(np.array_equal(x[k], y[k]) for k in x), name


def test_resume_refuses_a_checkpoint_of_another_model(pairs, tmp_path):
    """compare.py --resume checks the checkpoint each run would load before any process starts: one of
    another width is refused in one line, exit 2."""
    *_, full, _, _ = next(p for p in pairs if p[0] == "dp" and p[3] == "naive")
    folder = os.path.dirname(os.path.dirname(full.extra["checkpoints"][0]["path"]))  # --checkpoint-dir
    r = _compare("--frameworks", "torch", "--patterns", "dp", "--model", "mlp", "--world-size", "2", "--steps",
                 "4", "--layers", "4", "--dim", "24", "--batch", "16", "--checkpoint-dir", folder, "--resume")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "manifest.json: saved with dim=16, this run has dim=24" in r.stderr
    r = _compare("--frameworks", "torch", "--resume")
    assert r.returncode == 2 and "need --checkpoint-dir" in r.stderr


def _mesh_jobs(ctx, folder, cfgs):
    """Every layout saved at half and resumed; then the first layout's checkpoint loaded under the others."""
    from torch_impl.harness import run_pattern

    plan = Plan(dir=folder, save_at=(cfgs[0].steps // 2,))
    full = run_pattern(ctx, "mesh", cfgs, checkpoint=plan)
    resumed = run_pattern(ctx, "mesh", cfgs, checkpoint=Plan(dir=folder, resume=True))
    path = full[0]["runs"][0][2].extra["checkpoints"][0]["path"] if ctx.rank == 0 else None
    obj = [path]
    import torch.distributed as dist

    dist.broadcast_object_list(obj, src=0)
    moved = run_pattern(ctx, "mesh", cfgs[1:], checkpoint=Plan(dir=folder + "-moved", load=obj[0]))
    if ctx.rank != 0:
        return None
    pairs = [("mesh", e["cfg"], s, v, a, b, e["reference"])
             for e, r in zip(full, resumed) for (s, v, a), (_, _, b) in zip(e["runs"], r["runs"], strict=True)]
    return pairs, [(e["cfg"], t, e["reference"]) for e in moved for *_, t in e["runs"]]


@pytest.mark.slow
def test_mesh_layouts_resume_bitwise_and_reshard(tmp_path):
    base = GPT.replace(world_size=4, microbatches=2)
    cfgs = [base.replace(mesh=m) for m in ((("dp", 2), ("tp", 2)), (("fsdp", 2), ("tp", 2)), (("pp", 2), ("tp", 2)))]
    pairs, moved = launch(_mesh_jobs, 4, str(tmp_path / "mesh"), cfgs)[0]
    _check_pairs(pairs)
    assert len(moved) == 4
    for cfg, trained, ref in moved:  # dp=2,tp=2's checkpoint continued under fsdp=2,tp=2 and pp=2,tp=2
        assert trained.start_step == 2 and within(parity(trained, ref), cfg.dtype), cfg.mesh


def test_a_failed_dcp_write_is_one_line():
    """DCP raises CheckpointException (a BaseException whose text is every rank's traceback) on every
    rank when one rank's write fails: the save's line names the folder, the step and that rank's reason."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from shared.checkpoint import save_error
    from torch_impl.checkpoint import dcp_failure

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/run/.tmp-step_000002/dcp/shard-00002")
    exc = CheckpointException("save", {1: (full, None)})
    line = str(save_error("/ckpt/run", 2, dcp_failure(exc)))
    assert line == "/ckpt/run: cannot save step 2: no space left on the device (the earlier checkpoints are kept)"
