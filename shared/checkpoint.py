"""Checkpoints, framework-neutral (NumPy only): the canonical training state both frameworks save and
load, the manifest, the atomic commit, and the checks that refuse a checkpoint before it is used.

    tmp = aside(run_dir, step)               # run_dir/.tmp-step_000003, empty (a stale one is removed)
    ... the framework writes its files into tmp: torch DCP (each rank its shards), JAX Orbax ...
    final = commit(tmp, manifest(cfg, step, "torch", "dcp", layout))   # checksums, then one rename
    path = latest(run_dir)                   # the newest COMPLETE checkpoint (an interrupted save has
    info = verify(path, cfg)                 # no manifest.json and is never chosen); CheckpointError
                                             # (one line: the file and the mismatch) when it cannot load
    check_runs(plan, runs)                   # compare.py, before any process: no folder held by another
                                             # writer, each run's resume checkpoint verified (its own cfg)

The canonical state (``State``) is what makes a checkpoint loadable under any layout and by the other
framework: every array under its fixture name and orientation (shared.problem.param_names /
param_shapes; torch's nn.Linear (out, in) weights transposed to (in, out), as the fixtures already are),
whole (unsharded) in meaning — how a framework splits it into files is its own business (DCP: a
Shard(0) chunk per rank; Orbax: the array's shards per device). Names written:
``params/<name>``, ``adam_m/<name>`` (torch exp_avg, optax mu), ``adam_v/<name>`` (exp_avg_sq, nu);
the step count (AdamW's bias correction, and the next step to run) is in the manifest.

A checkpoint is complete or absent: written into a hidden ``.tmp-`` folder, its manifest written last
(step, config, layout, framework, and the size and SHA-256 of every file), then renamed into place.
Files are read only inside their checkpoint folder, one run writes a run folder at a time, a checkpoint
of another run (seed, batch, learning rate, …) is refused, ``Plan.keep`` prunes old ones, and a failed
save is one line (shared.checkpoint_io; docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass

import numpy as np

from shared import preempt
from shared.checkpoint_io import (  # noqa: F401
    FORMAT,
    GROUPS,
    MANIFEST,
    CheckpointError,
    RunLock,
    check_run_folder,
    entry_parts,
    lock_holder,
    open_confined,
    own_entry,
    owned,
    run_folder,
    save_error,
    walk_files,
)

# What must be equal for a checkpoint to load (the model's shapes and numerics). The layout (world size,
# pattern, mesh) may differ: loading reshards.
MODEL_FIELDS = ("model", "layers", "dim", "heads", "seq", "vocab", "experts", "dtype")
# The run's identity beyond its shapes: what makes its numbers (the data and weights from the seed and
# batch, AdamW's hyperparameters, MoE routing). A checkpoint of another run is refused, not continued.
IDENTITY_FIELDS = ("seed", "batch", "lr", "beta1", "beta2", "eps", "weight_decay", "topk")
WRITERS = {"dcp": "torch", "orbax": "jax"}  # writer -> framework; the writer's files are under <writer>/
_STEP = re.compile(r"^step_(\d{6,})$")  # shared.checkpoint_io.STEP



@dataclass(frozen=True)
class Plan:
    """What a run does with checkpoints (compare.py's --checkpoint-dir / --checkpoint-every / --resume,
    and the matrix's save-at-half / load-this). Both harnesses take it (run_pattern(..., checkpoint=)).

    dir: each run saves under ``dir/run_name(...)``; every: save after every K steps (0: not on a
    schedule); save_at: and after these step counts; resume: start each run from the newest complete
    checkpoint in its folder (none there: from step 0); load: or from this checkpoint (any framework
    or layout that saved it) — the matrix's loads."""

    dir: str
    every: int = 0
    save_at: tuple[int, ...] = ()
    resume: bool = False
    load: str | None = None
    keep: int = 0  # after each commit keep only the newest ``keep`` complete checkpoints (0: every one)

    def __post_init__(self):
        if not self.dir:
            raise ValueError("checkpoint: a folder is needed (--checkpoint-dir DIR)")
        if self.every < 0 or any(s < 1 for s in self.save_at):
            raise ValueError(f"checkpoint: --checkpoint-every {self.every} / save at {self.save_at}: "
                             "steps are counted from 1")
        if self.resume and self.load:
            raise ValueError("checkpoint: resume (newest in the run's folder) or load (one path), not both")
        if not isinstance(self.keep, int) or self.keep < 0:
            raise ValueError(f"checkpoint: --keep {self.keep}: a number of checkpoints >= 1 (0: keep every one)")

    @property
    def writes(self) -> bool:
        """Does a run under this plan write its folder (and so hold its lock)?"""
        return self.every > 0 or bool(self.save_at)

    def due(self, done: int) -> bool:
        """Save after ``done`` optimizer steps?"""
        return (self.every > 0 and done % self.every == 0) or done in self.save_at

    def run_dir(self, framework: str, pattern: str, style: str, variant: str, model) -> str:
        """``model``: a Config (its model, and its layout for the mesh pattern: two layouts of one run
        must not share a folder) or a name."""
        if not isinstance(model, str):
            model = f"{model.model} {model.mesh_name}" if model.mesh else model.model
        return os.path.join(self.dir, run_name(framework, pattern, style, variant, model))

    def source(self, run_dir: str, steps: int | None = None) -> str | None:
        """The checkpoint this run starts from: ``load``, else (with ``resume``) the newest complete
        one in ``run_dir`` that leaves steps to run (before ``steps``: a run that had finished runs its
        last stretch again, from its last checkpoint before the end), else None (from step 0)."""
        if self.load or not self.resume:
            return self.load
        found = [path for step, path in complete(run_dir) if steps is None or step < steps]
        return found[-1] if found else None


FAULT_ENV = "PARALLEL_TWINS_FAULT"


def fault(phase: str, step: int, rank: int = 0) -> None:
    """Fault injection for the kill tests: with PARALLEL_TWINS_FAULT="step=K,phase=step|save[,rank=R]"
    the process (rank R, default 0) kills itself with SIGKILL — phase "step": once K optimizer steps
    are done, before any save of step K; phase "save": in the middle of saving step K (its files
    written, its manifest not) — as a crash or a lost node would. ``signal=TERM``: SIGTERM instead
    (preemption: shared/preempt.py), ``signal=INT``: SIGINT; ``target=parent``: sent to the parent (the
    launcher) instead; ``target=group``: to the whole process group (os.killpg).
    ``restart=N``: only in torchrun's restart N (TORCHELASTIC_RESTART_COUNT, 0 the first attempt),
    so a group that torchrun --max-restarts starts again does not die again."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want = dict(kv.split("=", 1) for kv in spec.split(","))
    if "restart" in want and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != want["restart"]:
        return
    if want.get("phase", "step") == phase and int(want["step"]) == step and int(want.get("rank", 0)) == rank:
        import signal

        # parent: the launcher (torch_impl.launch names itself: its ranks are a forkserver's children);
        # group: the whole process group, as kill -TERM -PGID, GNU timeout and batch schedulers send it
        launcher = int(os.environ.get("PARALLEL_TWINS_LAUNCHER_PID", os.getppid()))
        target = launcher if want.get("target") == "parent" else os.getpid()
        sig = getattr(signal, f"SIG{want.get('signal', 'KILL')}")  # signal=TERM: preemption
        os.killpg(os.getpgid(0), sig) if want.get("target") == "group" else os.kill(target, sig)
        if (target != os.getpid() or want.get("target") == "group") and want.get("signal") in ("TERM", "INT") \
                and preempt.installed():
            # the launcher passes SIGTERM back to this rank: wait for it, so the ranks' agreement after
            # this step sees it (else a busy machine lets the ranks run a step more before it lands)
            deadline = time.monotonic() + 60
            while not preempt.requested() and time.monotonic() < deadline:
                time.sleep(0.01)


@dataclass(frozen=True)
class State:
    """The training state after ``step`` optimizer steps, in fixture names and orientation (float64
    or the run's dtype). ``params``/``adam_m``/``adam_v``: {name: whole array}."""

    step: int
    params: dict[str, np.ndarray]
    adam_m: dict[str, np.ndarray]
    adam_v: dict[str, np.ndarray]

    def arrays(self) -> dict[str, np.ndarray]:
        """{"params/<name>": array, "adam_m/<name>": …, "adam_v/<name>": …}: the names written."""
        return {f"{g}/{k}": a for g in GROUPS for k, a in getattr(self, g).items()}

    @classmethod
    def from_arrays(cls, step: int, arrays: dict[str, np.ndarray]) -> State:
        parts = {g: {} for g in GROUPS}
        for key, a in arrays.items():
            group, _, name = key.partition("/")
            if group not in parts:
                raise CheckpointError(f"{key}: not a checkpoint array (expected {', '.join(GROUPS)}/<name>)")
            parts[group][name] = np.asarray(a)
        return cls(step=step, **parts)

    def check(self, cfg, where: str = "checkpoint") -> None:
        """Every parameter of ``cfg``'s model, with its shape, in each group, finite; nothing else."""
        from shared.problem import param_shapes

        shapes = param_shapes(cfg)
        for group in GROUPS:
            have = getattr(self, group)
            missing = [n for n in shapes if n not in have]
            if missing:
                what = "no optimizer state" if group != "params" and not have else f"{len(missing)} missing"
                raise CheckpointError(f"{where}: {group}: {what} ({', '.join(missing[:3])}…)"
                                      if len(missing) > 3 else f"{where}: {group}: {what} ({', '.join(missing)})")
            extra = [n for n in have if n not in shapes]
            if extra:
                raise CheckpointError(f"{where}: {group}/{extra[0]} is not a parameter of this {cfg.model} "
                                      f"(layers={cfg.layers}, experts={cfg.experts})")
            for name, shape in shapes.items():
                a = have[name]
                if tuple(a.shape) != tuple(shape):
                    raise CheckpointError(f"{where}: {group}/{name} has shape {tuple(a.shape)}, this model "
                                          f"needs {tuple(shape)} (another model size or vocabulary)")
                if not np.all(np.isfinite(a)):
                    raise CheckpointError(f"{where}: {group}/{name} holds NaN or inf")
        if not isinstance(self.step, int) or self.step < 0:
            raise CheckpointError(f"{where}: step {self.step!r} is not a step count")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def run_name(framework: str, pattern: str, style: str, variant: str, model: str) -> str:
    """One run's folder under --checkpoint-dir, e.g. "torch-fsdp-explicit-zero3-mlp" (layouts such as
    "dp=2,tp=2" kept readable: only characters unsafe in file names are replaced)."""
    text = "-".join((framework, pattern, style, variant, model.replace(" ", "_")))
    return re.sub(r"[^A-Za-z0-9_.=,+-]", "_", text)


def aside(run_dir: str, step: int) -> str:
    """The empty folder a save of ``step`` writes into before ``commit``: ``run_dir/.tmp-step_…``. A
    stale one (a save that was killed) is removed first; a symlink or a file in its place, or where
    the step's checkpoint goes, or a folder there that this project did not write, is refused, as is
    a run folder that is a link (shared.checkpoint_io.run_folder). Every rank may call it: only call
    it on one rank before the others write (torch: rank 0, then a barrier). A folder that cannot be
    written: CheckpointError, one line naming it."""
    run_folder(run_dir)
    tmp = os.path.join(run_dir, ".tmp-" + step_name(step))
    if os.path.islink(tmp) or (os.path.lexists(tmp) and not os.path.isdir(tmp)):
        raise CheckpointError(f"{tmp}: a symlink or a file where a save's own folder goes: remove it "
                              "(nothing was written)")
    final = own_entry(run_dir, step_name(step))
    if os.path.lexists(final) and not owned(final):
        raise CheckpointError(f"{final}: a folder this project did not write (no complete checkpoint of its own "
                              f"there) where step {step}'s checkpoint goes: move it away (nothing was written or "
                              "deleted)")
    try:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    except OSError as exc:
        raise save_error(run_dir, step, exc) from None
    return tmp


def abandon(tmp: str) -> None:
    """Remove a save's ``.tmp-`` (or a retired ``.old-``) folder after a failure (best effort: the
    folder may be unwritable). A link is never followed (rmtree refuses one at the top, and removes
    links below without following them)."""
    if not os.path.islink(tmp) and os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: str) -> list[str]:
    return [f for f in walk_files(folder) if f != MANIFEST]


def manifest(cfg, step: int, framework: str, writer: str, layout: dict) -> dict:
    """What ``commit`` writes (files are added there): ``layout`` = {"pattern", "style", "variant",
    "world_size", "mesh"} of the run that saved; the config holds the model's shapes and the run's
    identity (``check_identity``), and ``steps`` (the run's length when it saved: informative)."""
    return {"format": FORMAT, "step": int(step), "framework": framework, "writer": writer,
            "config": {k: getattr(cfg, k) for k in MODEL_FIELDS + IDENTITY_FIELDS} | {"steps": cfg.steps},
            "layout": layout, "optimizer": "adamw", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def commit(tmp: str, info: dict, keep: int = 0) -> str:
    """Checksum every file in ``tmp``, write the manifest last (fsynced), rename ``tmp`` to its final
    name (an older checkpoint of the same step is replaced). Returns the final path. One process only.
    ``keep`` > 0: then only the newest ``keep`` complete checkpoints stay (``prune``). A failure (full
    disk, read-only folder): CheckpointError naming the run folder; ``tmp`` is removed, and every
    earlier checkpoint is as it was."""
    run_dir, step = os.path.dirname(tmp), info["step"]
    try:
        run_folder(run_dir)
        if not os.path.isdir(own_entry(run_dir, os.path.basename(tmp))):
            raise CheckpointError(f"{tmp}: gone before the commit")
        final = own_entry(run_dir, step_name(step))
        old = own_entry(run_dir, ".old-" + step_name(step))
        if os.path.lexists(final) and not owned(final):
            raise CheckpointError(f"{final}: a folder this project did not write: not replaced")
    except CheckpointError:
        abandon(tmp)
        raise
    try:
        files = {}
        for f in _files(tmp):
            fd, size = open_confined(tmp, f)
            files[f] = {"bytes": size, "sha256": _sha256(fd)}
        info = dict(info, files=files)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(info, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.lexists(final):  # a re-save of the same step: the old one leaves first (complete or absent)
            abandon(old)
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except OSError:
                os.replace(old, final)  # the earlier checkpoint back in place
                raise
            abandon(old)
        else:
            os.replace(tmp, final)
    except (OSError, CheckpointError) as exc:  # a full disk; a link or device put into tmp meanwhile
        abandon(tmp)
        raise save_error(run_dir, step, exc) from None
    prune(run_dir, keep, final)
    return final


def prune(run_dir: str, keep: int, just: str) -> list[str]:
    """Retention: delete the complete checkpoints of ``run_dir`` beyond the newest ``keep`` (by step;
    0: none deleted), never ``just`` (the one just written), and only those this project provably
    wrote (shared.checkpoint_io.owned: a real folder, its manifest, exactly its files): any other
    folder, even under a ``step_`` name, is left alone. ``.tmp-`` folders are never touched (a live
    writer's save, or a killed one's that ``aside`` removes). Each goes by a rename to a hidden name
    first, so a crash mid-delete leaves no half checkpoint under a ``step_`` name. The paths gone."""
    if keep <= 0:
        return []
    victims = [path for _, path in complete(run_dir)[:-keep] if path != just and owned(path)]
    for path in victims:
        gone = own_entry(run_dir, ".old-" + os.path.basename(path))
        try:
            abandon(gone)
            os.replace(path, gone)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot delete it (--keep {keep}): {exc.strerror or exc}") from None
        abandon(gone)
    return victims


def complete(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints in ``run_dir`` that have a manifest, oldest first. A save that
    was interrupted is still a ``.tmp-`` folder (or lacks its manifest): never listed. A run folder
    that is a link, or a link under a checkpoint's name, is refused (CheckpointError): nothing is
    read through one."""
    if not os.path.isdir(run_folder(run_dir)):
        return []
    out = []
    for name in os.listdir(run_dir):
        m = _STEP.match(name)
        if m and os.path.isfile(os.path.join(own_entry(run_dir, name), MANIFEST)):
            out.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(out)


def latest(run_dir: str) -> str | None:
    found = complete(run_dir)
    return found[-1][1] if found else None


def _read_manifest(path: str) -> tuple[str, dict]:
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


def verify(path: str, cfg=None) -> dict:
    """The manifest of the checkpoint at ``path``, after checking it: complete; its step, writer and
    framework consistent with its folder; every file it lists a plain relative name inside ``path``,
    a regular file (no symlink on the way), of its size (from fstat, before hashing; the sizes within
    what a model of this config can hold) and SHA-256; no other file; and (with ``cfg``) written by
    this run (``check_identity``). CheckpointError (one line: file and mismatch) otherwise."""
    mpath, info = _read_manifest(path)
    if not info.get("optimizer"):
        raise CheckpointError(f"{mpath}: no optimizer state in this checkpoint: it cannot resume AdamW")
    step, writer = info.get("step"), info.get("writer")
    m = _STEP.match(os.path.basename(os.path.normpath(path)))
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
    budget = _byte_budget(cfg if cfg is not None else _model_of(mpath, info.get("config") or {}), len(files))
    total = sum(meta["bytes"] for meta in files.values())
    if total > budget:
        raise CheckpointError(f"{mpath}: its files hold {total} bytes, a checkpoint of this model at most {budget}")
    extra = [f for f in _files(path) if f not in files]
    if extra:
        raise CheckpointError(f"{os.path.join(path, extra[0])}: not in the manifest (written after the commit?)")
    for name, meta in files.items():
        if _sha256(open_confined(path, name)[0]) != meta["sha256"]:
            raise CheckpointError(f"{os.path.join(path, name)}: SHA-256 differs from the manifest's (corrupted)")
    if cfg is not None:
        check_identity(info, cfg, mpath)
    return info


def check_runs(plan: Plan, runs) -> None:
    """compare.py's check before any process starts, over the runs this invocation makes and only
    those (another run's folder in the same --checkpoint-dir is not looked at): ``runs`` =
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


# --- safetensors, read with NumPy: how JAX reads what torch's DCP wrote (HuggingFaceStorageWriter) ---
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """({name: array}, the header's __metadata__) of one .safetensors file (little-endian: an 8-byte
    header length, a JSON header {name: {dtype, shape, data_offsets}}, then the bytes)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise CheckpointError(f"{path}: {len(blob)} bytes: truncated")
    n = int.from_bytes(blob[:8], "little")
    if 8 + n > len(blob):
        raise CheckpointError(f"{path}: header of {n} bytes past the end of the file: truncated")
    try:
        header = json.loads(blob[8:8 + n])
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable header ({exc})") from None
    meta, out, data = header.pop("__metadata__", {}) or {}, {}, memoryview(blob)[8 + n:]
    for name, h in header.items():
        if h["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{path}: {name} has dtype {h['dtype']}, not readable with NumPy")
        begin, end = h["data_offsets"]
        if end > len(data):
            raise CheckpointError(f"{path}: {name} ends past the end of the file: truncated")
        dt = np.dtype(_ST_DTYPES[h["dtype"]]).newbyteorder("<")
        out[name] = np.frombuffer(data[begin:end], dtype=dt).reshape(h["shape"]).astype(dt.newbyteorder("="))
    return out, meta


def read_dcp(folder: str) -> dict[str, np.ndarray]:
    """The whole arrays of a DCP checkpoint written with HuggingFaceStorageWriter(save_distributed=True):
    one safetensors file per rank, each holding that rank's chunk of every array and, in its header's
    __metadata__["DCP_SHARDING_INFO"], each chunk's offset in the whole array. NumPy only (no torch)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors files (not a DCP checkpoint of this project)")
    chunks: dict[str, list] = {}
    for name in files:
        path = os.path.join(folder, name)
        arrays, meta = read_safetensors(path)
        try:
            info = json.loads(meta.get("DCP_SHARDING_INFO", "{}"))
        except (ValueError, RecursionError):
            raise CheckpointError(f"{path}: unreadable DCP_SHARDING_INFO") from None
        for key, a in arrays.items():
            offset = info.get(key, {}).get("saved_offsets", [0] * a.ndim)
            chunks.setdefault(key, []).append((tuple(offset), a))
    out = {}
    for key, parts in chunks.items():
        shape = tuple(max(o[d] + a.shape[d] for o, a in parts) for d in range(parts[0][1].ndim))
        whole, seen = np.zeros(shape, parts[0][1].dtype), np.zeros(shape, bool)
        for o, a in parts:
            where = tuple(slice(o[d], o[d] + a.shape[d]) for d in range(a.ndim))
            whole[where], seen[where] = a, True
        if not seen.all():
            raise CheckpointError(f"{folder}: {key}: chunks cover {int(seen.sum())} of {seen.size} elements")
        out[key] = whole
    return out


def read_state(path: str, info: dict) -> State:
    """The canonical State of a verified checkpoint (``info`` = verify(path, cfg)), whichever framework
    wrote it: torch's DCP safetensors (``dcp/``) or JAX's Orbax arrays (``orbax/``), read with NumPy."""
    if info["writer"] == "dcp":
        arrays = read_dcp(os.path.join(path, "dcp"))
    elif info["writer"] == "orbax":
        from shared.orbax_files import read_orbax

        arrays = read_orbax(os.path.join(path, "orbax"))
    else:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: writer {info['writer']!r}: not dcp nor orbax")
    return State.from_arrays(int(info["step"]), arrays)
