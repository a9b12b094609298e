"""A model's weights as a checkpoint, framework-neutral (NumPy only): what a compose trainer's state
(torch ``Trainer.full_state_dict()``, JAX ``Composed.params()``) becomes on disk, so that the same model
in the OTHER framework reads it (torch_impl/checkpoint.py and jax_impl/checkpoint.py: ``save_weights`` /
``load_weights``; docs/checkpoint.md, "A model's weights").

    path = save_weights(run_dir, step, trainer.full_state_dict(), model)   # torch: every rank (DCP)
    path = save_weights(run_dir, step, trainer.params())                    # JAX (Orbax)
    load_weights(path, twin)                                                # either framework, either writer

Names and orientation are the canonical state's (shared/checkpoint.py): torch's parameter names, every
matrix ``x @ W`` — torch's ``nn.Linear`` weight (out, in) stored transposed, an NNX kernel as it is. The NNX
leaf names map to torch's (``NNX_LEAVES``): ``kernel`` (nnx.Linear), ``embedding`` (nnx.Embed) and
``scale`` (nnx.LayerNorm / RMSNorm) are stored as ``weight``; every other leaf (``bias``, a model's own
``weight``) by its own name. So transformers' Llama (torch_impl/parallel/llama.py) and its NNX twin
(jax_impl/parallel/llama.py), which share transformers' module paths, read each other's weights.

On disk: the canonical layout's ``params/<name>`` group only, written by the framework's own writer (DCP
safetensors, Orbax zarr), its manifest ``"kind": "weights"`` with every array's shape and no optimizer
state. ``verify_weights`` makes the checks every checkpoint passes (files confined, sizes, SHA-256,
nothing else; the byte budget from the manifest's own shapes); the training runs' ``verify`` refuses such
a checkpoint in one line (no AdamW moments to resume). Refused, one line naming the parameter: a name the
target model lacks or one it has that the checkpoint lacks, a shape that differs (e.g. an
nnx.LinearGeneral kernel (D, H, dh) against a torch Linear), two NNX leaves mapping to one name.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from shared.checkpoint_io import FORMAT, CheckpointError
from shared.checkpoint_verify import check_files, read_manifest
from shared.dcp_files import read_dcp

KIND = "weights"
NNX_LEAVES = {"kernel": "weight", "embedding": "weight", "scale": "weight"}  # NNX leaf -> torch's name


def weights_manifest(step: int, framework: str, writer: str, shapes: dict, layout: dict | None = None) -> dict:
    """What ``shared.checkpoint.commit`` writes for a weights checkpoint (its files are added there)."""
    return {"format": FORMAT, "kind": KIND, "step": int(step), "framework": framework, "writer": writer,
            "shapes": {k: [int(n) for n in s] for k, s in shapes.items()}, "layout": layout or {},
            "optimizer": None, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def verify_weights(path: str) -> dict:
    """The manifest of the weights checkpoint at ``path`` after the checks every checkpoint passes;
    CheckpointError (one line) otherwise, or when it is a run's training state (``verify``'s)."""
    mpath, info = read_manifest(path)
    shapes = info.get("shapes")
    if info.get("kind") != KIND or not isinstance(shapes, dict):
        raise CheckpointError(f"{mpath}: a run's training state, not a model's weights: load it with the run "
                              "(compare.py --resume / Plan(load=...)), not load_weights")
    if not all(isinstance(s, list) and all(isinstance(n, int) and n >= 0 for n in s) for s in shapes.values()):
        raise CheckpointError(f"{mpath}: its shapes are not {{name: [int, ...]}}")
    elements = sum(math.prod(s) for s in shapes.values())
    check_files(path, mpath, info, lambda n: 2 * 8 * elements + 65536 * n + (1 << 20))
    return info


def read_weights(path: str) -> dict[str, np.ndarray]:
    """{canonical name: whole array} of a verified weights checkpoint, whichever framework wrote it
    (torch's DCP safetensors or JAX's Orbax zarr), read with NumPy."""
    info = verify_weights(path)
    if info["writer"] == "dcp":
        arrays = read_dcp(os.path.join(path, "dcp"))
    else:
        from shared.orbax_files import read_orbax

        arrays = read_orbax(os.path.join(path, "orbax"))
    out = {}
    for key, a in arrays.items():
        group, _, name = key.partition("/")
        if group != "params":
            raise CheckpointError(f"{path}: array {key} is not params/<name>: not a weights checkpoint")
        out[name] = a
    check_names(out, {k: tuple(s) for k, s in info["shapes"].items()}, f"{path} (against its manifest)")
    return out


def check_names(arrays: dict, want: dict[str, tuple], where: str) -> None:
    """Refuse (one line) ``arrays`` whose names or shapes are not ``want``'s (the target model's)."""
    missing, extra = [k for k in want if k not in arrays], [k for k in arrays if k not in want]
    if missing:
        raise CheckpointError(f"{where}: no {missing[0]!r} ({len(missing)} of the model's {len(want)} parameters "
                              "missing): another model, or names that do not map (docs/checkpoint.md)")
    if extra:
        raise CheckpointError(f"{where}: {extra[0]!r} is not a parameter of this model ({len(extra)} such)")
    for k, shape in want.items():
        if tuple(arrays[k].shape) != tuple(shape):
            why = " (stored x @ W: a torch nn.Linear weight transposed)" if len(shape) >= 2 else ""
            raise CheckpointError(f"{where}: {k} has shape {tuple(arrays[k].shape)}, this model needs "
                                  f"{tuple(shape)}{why}")


def canonical_nnx(path: str) -> str:
    """The canonical name of an NNX Param path (``model.layers.0.self_attn.q_proj.kernel`` ->
    ``….q_proj.weight``)."""
    head, _, leaf = path.rpartition(".")
    return f"{head}.{NNX_LEAVES[leaf]}" if head and leaf in NNX_LEAVES else path


def from_nnx(params: dict) -> dict[str, np.ndarray]:
    """{NNX Param path: array} -> {canonical name: array}; two leaves of one module mapping to one name
    (a ``kernel`` beside a ``weight``) are refused."""
    out, seen = {}, {}
    for path, a in params.items():
        name = canonical_nnx(path)
        if name in seen:
            raise CheckpointError(f"weights: NNX Params {seen[name]!r} and {path!r} both map to {name!r}; rename one")
        seen[name], out[name] = path, np.asarray(a)
    return out
