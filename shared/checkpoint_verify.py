"""What a checkpoint must be before it is loaded (shared/checkpoint.py): the checks that refuse one, each
CheckpointError one line (the file and the mismatch; docs/reliability.md).

    verify(path, cfg)       # complete, every file listed, confined, of its size and SHA-256, nothing else,
                            # within the bytes a model of cfg can hold, and written by this run (check_identity)
    check_runs(plan, runs)  # compare.py, before any process: no folder held by another writer, each run's
                            # resume checkpoint verified against its own cfg
"""

from __future__ import annotations

import hashlib
import json
import math
import os

from shared.checkpoint_io import (
    FORMAT,
    MANIFEST,
    STEP,
    CheckpointError,
    check_run_folder,
    entry_parts,
    lock_holder,
    open_confined,
    walk_files,
)

# What must be equal for a checkpoint to load (the model's shapes and numerics). The layout (world size,
# pattern, mesh) may differ: loading reshards.
MODEL_FIELDS = ("model", "layers", "dim", "heads", "seq", "vocab", "experts", "dtype")
# The run's identity beyond its shapes: what makes its numbers (the data and weights from the seed and
# batch, AdamW's hyperparameters, MoE routing). A checkpoint of another run is refused, not continued.
IDENTITY_FIELDS = ("seed", "batch", "lr", "beta1", "beta2", "eps", "weight_decay", "topk")
WRITERS = {"dcp": "torch", "orbax": "jax"}  # writer -> framework; the writer's files are under <writer>/


def file_sha256(fd: int) -> str:
    """The SHA-256 of the open file ``fd`` (read to its end, then closed)."""
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def data_files(folder: str) -> list[str]:
    """The files of a checkpoint folder (relative names), its manifest left out."""
    return [f for f in walk_files(folder) if f != MANIFEST]


def read_manifest(path: str) -> tuple[str, dict]:
    mpath = os.path.join(path, MANIFEST)
    if os.path.islink(os.path.normpath(path)):
        raise CheckpointError(f"{path}: a symlink: a checkpoint is a folder of its run, not a link to one")
    if not os.path.lexists(mpath):
        raise CheckpointError(f"{path}: no {MANIFEST}: not a checkpoint, or a save that did not finish")
    try:
        fd, size = open_confined(path, MANIFEST)
        if size > 1 << 24:
            os.close(fd)
            raise CheckpointError(f"{mpath}: {size} bytes: not a manifest of this project")
        with os.fdopen(fd, "rb") as f:
            info = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested past Python's stack
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{mpath}: unreadable manifest ({exc})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: format {info.get('format') if isinstance(info, dict) else None!r}, "
                              f"this reads {FORMAT!r}")
    return mpath, info


def _byte_budget(cfg, nfiles: int) -> int:
    """The most bytes a checkpoint of ``cfg``'s model can hold: 3 arrays per parameter in float64,
    twice over for the formats' own layout, plus 64 KiB of headers and metadata per file and 1 MiB."""
    from shared.problem import param_shapes

    return 2 * 3 * 8 * sum(math.prod(s) for s in param_shapes(cfg).values()) + 65536 * nfiles + (1 << 20)


def _model_of(mpath: str, saved: dict):
    """A Config of the model the manifest describes (for its byte budget when no run's cfg is given)."""
    from shared.config import Config

    try:
        return Config(**{k: saved[k] for k in MODEL_FIELDS if k in saved})
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{mpath}: its config is not a model of this project ({exc})") from None


def check_identity(info: dict, cfg, where: str = "checkpoint") -> None:
    """Refuse (one line: the field and both values) a checkpoint another run wrote: saved with other
    model shapes or dtype (MODEL_FIELDS), or another seed, batch or AdamW setting (IDENTITY_FIELDS).
    The layout (pattern, world size, mesh) may differ: loading reshards."""
    saved = info.get("config") or {}
    for k in MODEL_FIELDS:
        if saved.get(k) != getattr(cfg, k):
            raise CheckpointError(f"{where}: saved with {k}={saved.get(k)!r}, this run has {k}={getattr(cfg, k)!r}")
    for k in IDENTITY_FIELDS:
        if k not in saved:
            raise CheckpointError(f"{where}: records no {k} (saved by an older version?): cannot tell it is this "
                                  "run's; start without --resume or use another --checkpoint-dir")
        if saved[k] != getattr(cfg, k):
            raise CheckpointError(f"{where}: another run's checkpoint: saved with {k}={saved[k]!r}, this run has "
                                  f"{k}={getattr(cfg, k)!r}")


def check_files(path: str, mpath: str, info: dict, budget) -> None:
    """The checks every checkpoint passes (``verify``, ``shared.checkpoint_weights.verify_weights``): its
    step and writer consistent with its folder, every listed file confined, of its size (fstat, before
    hashing; in total within ``budget(number of files)`` bytes) and SHA-256, and no other file."""
    step, writer = info.get("step"), info.get("writer")
    m = STEP.match(os.path.basename(os.path.normpath(path)))
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or (m and int(m.group(1)) != step):
        raise CheckpointError(f"{mpath}: step {step!r} does not match the folder {os.path.basename(path)!r}")
    if writer not in WRITERS or info.get("framework") != WRITERS[writer]:
        raise CheckpointError(f"{mpath}: writer {writer!r} / framework {info.get('framework')!r}: not dcp/torch "
                              "nor orbax/jax")
    files = info.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) and isinstance(v.get("bytes"), int)
                                              and isinstance(v.get("sha256"), str) for v in files.values()):
        raise CheckpointError(f"{mpath}: its file list is not {{name: {{bytes, sha256}}}}")
    for name, meta in files.items():  # every size first (fstat): nothing is hashed before all are right
        parts = entry_parts(path, name)
        if len(parts) < 2 or parts[0] != writer:
            raise CheckpointError(f"{mpath}: entry {name!r} is not under {writer}/, where its writer's files are")
        fd, size = open_confined(path, name)
        os.close(fd)
        if size != meta["bytes"]:
            raise CheckpointError(f"{os.path.join(path, name)}: {size} bytes, the manifest says {meta['bytes']} "
                                  "(truncated or grown)")
    limit = budget(len(files))
    total = sum(meta["bytes"] for meta in files.values())
    if total > limit:
        raise CheckpointError(f"{mpath}: its files hold {total} bytes, a checkpoint of this model at most {limit}")
    extra = [f for f in data_files(path) if f not in files]
    if extra:
        raise CheckpointError(f"{os.path.join(path, extra[0])}: not in the manifest (written after the commit?)")
    for name, meta in files.items():
        if file_sha256(open_confined(path, name)[0]) != meta["sha256"]:
            raise CheckpointError(f"{os.path.join(path, name)}: SHA-256 differs from the manifest's (corrupted)")


def verify(path: str, cfg=None) -> dict:
    """The manifest of the checkpoint at ``path``, after checking it: complete; its step, writer and
    framework consistent with its folder; every file it lists a plain relative name inside ``path``,
    a regular file (no symlink on the way), of its size (from fstat, before hashing; the sizes within
    what a model of this config can hold) and SHA-256; no other file; and (with ``cfg``) written by
    this run (``check_identity``). CheckpointError (one line: file and mismatch) otherwise."""
    mpath, info = read_manifest(path)
    if info.get("kind") == "weights":
        raise CheckpointError(f"{mpath}: a model's weights (a compose trainer's state, no optimizer), not a run's "
                              "training state: read it with read_weights / load_weights (docs/checkpoint.md)")
    if not info.get("optimizer"):
        raise CheckpointError(f"{mpath}: no optimizer state in this checkpoint: it cannot resume AdamW")
    check_files(path, mpath, info, lambda n: _byte_budget(
        cfg if cfg is not None else _model_of(mpath, info.get("config") or {}), n))
    if cfg is not None:
        check_identity(info, cfg, mpath)
    return info


def check_runs(plan, runs) -> None:
    """compare.py's check before any process starts, over the runs this invocation makes and only
    those (another run's folder in the same --checkpoint-dir is not looked at): ``plan`` a
    shared.checkpoint.Plan, ``runs`` =
    [(framework, pattern, style, variant, cfg)]. A run folder another process is writing is refused
    (its lock holder named); with ``plan.resume``, the checkpoint each run would start from is verified
    against its own cfg (files, shapes, identity); the checkpoint folder, a run folder, or a folder
    of the project's in it (step_N, .tmp-step_N, .old-step_N, .lock) that is a symlink is refused.
    CheckpointError, one line."""
    for framework, pattern, style, variant, cfg in runs:
        run_dir = plan.run_dir(framework, pattern, style, variant, cfg)
        check_run_folder(run_dir)  # no symlink where a folder of the run goes (nothing written through one)
        holder = lock_holder(run_dir) if plan.writes else None
        if holder:
            raise CheckpointError(f"{run_dir}: another run is writing this checkpoint folder ({holder}): wait for "
                                  "it to end, or give another --checkpoint-dir")
        path = plan.source(run_dir, cfg.steps)
        if path is not None:
            verify(path, cfg)
