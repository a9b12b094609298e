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
save is one line (shared.checkpoint_io; docs/reliability.md). The checks a load passes are
shared/checkpoint_verify.py's (``verify``, ``check_runs``), the NumPy reader of torch's DCP files
shared/dcp_files.py's (``read_dcp``; JAX's Orbax files: shared/orbax_files.py); re-exported here.
"""

from __future__ import annotations

import json
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
from shared.checkpoint_verify import (  # noqa: F401 - re-exported: the checks a load passes
    IDENTITY_FIELDS,
    MODEL_FIELDS,
    WRITERS,
    check_identity,
    check_runs,
    data_files,
    file_sha256,
    verify,
)
from shared.dcp_files import read_dcp, read_safetensors  # noqa: F401

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
        for f in data_files(tmp):
            fd, size = open_confined(tmp, f)
            files[f] = {"bytes": size, "sha256": file_sha256(fd)}
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
