"""Checkpoints, framework-neutral (NumPy only): the canonical training state both frameworks save and
load, the manifest, the atomic commit, and the checks that refuse a checkpoint before it is used.

    tmp = aside(run_dir, step)               # run_dir/.tmp-step_000003, empty (a stale one is removed)
    ... the framework writes its files into tmp: torch DCP (each rank its shards), JAX Orbax ...
    final = commit(tmp, manifest(cfg, step, "torch", "dcp", layout))   # checksums, then one rename
    path = latest(run_dir)                   # the newest COMPLETE checkpoint (an interrupted save has
    info = verify(path, cfg)                 # no manifest.json and is never chosen); CheckpointError
                                             # (one line: the file and the mismatch) when it cannot load

The canonical state (``State``) is what makes a checkpoint loadable under any layout and by the other
framework: every array under its fixture name and orientation (shared.problem.param_names /
param_shapes; torch's nn.Linear (out, in) weights transposed to (in, out), as the fixtures already are),
whole (unsharded) in meaning — how a framework splits it into files is its own business (DCP: a
Shard(0) chunk per rank; Orbax: the array's shards per device). Names written:
``params/<name>``, ``adam_m/<name>`` (torch exp_avg, optax mu), ``adam_v/<name>`` (exp_avg_sq, nu);
the step count (AdamW's bias correction, and the next step to run) is in the manifest.

A checkpoint is complete or absent: written into a hidden ``.tmp-`` folder, its manifest written last
(step, config, layout, framework, and the size and SHA-256 of every file), then renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass

import numpy as np

from shared.checkpoint_base import GROUPS, CheckpointError

FORMAT = "parallel-twins-checkpoint/1"
MANIFEST = "manifest.json"
# What must be equal for a checkpoint to load (the model's shapes and numerics). The layout (world size,
# pattern, mesh) may differ: loading reshards.
MODEL_FIELDS = ("model", "layers", "dim", "heads", "seq", "vocab", "experts", "dtype")
_STEP = re.compile(r"^step_(\d{6,})$")


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

    def __post_init__(self):
        if not self.dir:
            raise ValueError("checkpoint: a folder is needed (--checkpoint-dir DIR)")
        if self.every < 0 or any(s < 1 for s in self.save_at):
            raise ValueError(f"checkpoint: --checkpoint-every {self.every} / save at {self.save_at}: "
                             "steps are counted from 1")
        if self.resume and self.load:
            raise ValueError("checkpoint: resume (newest in the run's folder) or load (one path), not both")

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
    written, its manifest not) — as a crash or a lost node would."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want = dict(kv.split("=", 1) for kv in spec.split(","))
    if want.get("phase", "step") == phase and int(want["step"]) == step and int(want.get("rank", 0)) == rank:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


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
    stale one (a save that was killed) is removed first. Every rank may call it: only call it on one
    rank before the others write (torch: rank 0, then a barrier)."""
    tmp = os.path.join(run_dir, ".tmp-" + step_name(step))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(f for f in out if f != MANIFEST)


def manifest(cfg, step: int, framework: str, writer: str, layout: dict) -> dict:
    """What ``commit`` writes (files are added there): ``layout`` = {"pattern", "style", "variant",
    "world_size", "mesh"} of the run that saved."""
    return {"format": FORMAT, "step": int(step), "framework": framework, "writer": writer,
            "config": {k: getattr(cfg, k) for k in MODEL_FIELDS} | {"seed": cfg.seed, "lr": cfg.lr,
                                                                     "weight_decay": cfg.weight_decay},
            "layout": layout, "optimizer": "adamw", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def commit(tmp: str, info: dict) -> str:
    """Checksum every file in ``tmp``, write the manifest last (fsynced), rename ``tmp`` to its final
    name (an older checkpoint of the same step is replaced). Returns the final path. One process only."""
    paths = {f: os.path.join(tmp, f) for f in _files(tmp)}
    info = dict(info, files={f: {"bytes": os.path.getsize(p), "sha256": _sha256(p)} for f, p in paths.items()})
    path = os.path.join(tmp, MANIFEST)
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    final = os.path.join(os.path.dirname(tmp), step_name(info["step"]))
    if os.path.exists(final):  # a re-save of the same step: the old one leaves first (complete or absent)
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def complete(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints in ``run_dir`` that have a manifest, oldest first. A save that
    was interrupted is still a ``.tmp-`` folder (or lacks its manifest): never listed."""
    if not os.path.isdir(run_dir):
        return []
    out = []
    for name in os.listdir(run_dir):
        m = _STEP.match(name)
        if m and os.path.isfile(os.path.join(run_dir, name, MANIFEST)):
            out.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(out)


def latest(run_dir: str) -> str | None:
    found = complete(run_dir)
    return found[-1][1] if found else None


def verify(path: str, cfg=None) -> dict:
    """The manifest of the checkpoint at ``path``, after checking it: complete, every file present
    with its size and SHA-256, and (with ``cfg``) saved by a model of the same shapes and dtype.
    CheckpointError (one line: file and mismatch) otherwise."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{path}: no {MANIFEST}: not a checkpoint, or a save that did not finish")
    try:
        with open(mpath) as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{mpath}: unreadable manifest ({exc})") from None
    if info.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: format {info.get('format')!r}, this reads {FORMAT!r}")
    if not info.get("optimizer"):
        raise CheckpointError(f"{mpath}: no optimizer state in this checkpoint: it cannot resume AdamW")
    for name, meta in info.get("files", {}).items():
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath}: missing (the manifest lists it)")
        size = os.path.getsize(fpath)
        if size != meta["bytes"]:
            raise CheckpointError(f"{fpath}: {size} bytes, the manifest says {meta['bytes']} (truncated or grown)")
        if _sha256(fpath) != meta["sha256"]:
            raise CheckpointError(f"{fpath}: SHA-256 differs from the manifest's (corrupted)")
    extra = [f for f in _files(path) if f not in info.get("files", {})]
    if extra:
        raise CheckpointError(f"{os.path.join(path, extra[0])}: not in the manifest (written after the commit?)")
    if cfg is not None:
        saved = info.get("config", {})
        for k in MODEL_FIELDS:
            if saved.get(k) != getattr(cfg, k):
                raise CheckpointError(f"{mpath}: saved with {k}={saved.get(k)!r}, this run has {k}={getattr(cfg, k)!r}")
    return info


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
    except ValueError as exc:
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
        except ValueError:
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
