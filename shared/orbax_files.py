"""Orbax checkpoints read without JAX nor Orbax: tensorstore and JSON only, so the torch side (and any
NumPy tool) can load what jax_impl/checkpoint.py wrote.

The format jax_impl/checkpoint.py asks Orbax for (``PyTreeCheckpointHandler(use_ocdbt=False,
use_zarr3=False)``): one zarr v2 folder per array, named by its tree path joined with "." (so
``{"params": {"blocks.0.attn.qkv.weight": …}}`` is the folder ``params.blocks.0.attn.qkv.weight``),
each holding a ``.zarray`` (shape, dtype, chunk shape) and one chunk file per shard ("0.0", "1.0", …:
the shard each device wrote). ``_METADATA`` (JSON) lists every array with its tree keys: parameter
names contain dots, so the keys are taken from there, never split from the folder name.
"""

from __future__ import annotations

import json
import os

import numpy as np

from shared.checkpoint_io import GROUPS, CheckpointError

METADATA = "_METADATA"


def orbax_keys(folder: str) -> list[tuple[str, ...]]:
    """The tree keys of every array of the Orbax checkpoint in ``folder``, from its ``_METADATA``."""
    path = os.path.join(folder, METADATA)
    try:
        with open(path) as f:
            meta = json.load(f)
        entries = meta["tree_metadata"].values()
        keys = [tuple(str(k["key"]) for k in e["key_metadata"]) for e in entries]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not an Orbax checkpoint of this project)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable Orbax metadata ({type(exc).__name__}: {exc})") from None
    if meta.get("use_ocdbt"):
        raise CheckpointError(f"{path}: an OCDBT checkpoint; this reader takes use_ocdbt=False "
                              "(one zarr folder per array)")
    return keys


def read_array(path: str) -> np.ndarray:
    """One zarr v2 array folder, whole, as NumPy (tensorstore assembles the chunks)."""
    import tensorstore as ts

    try:
        store = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": path}}, open=True,
                        read=True).result()
        return np.asarray(store.read().result())
    except Exception as exc:  # tensorstore raises ValueError / its own status errors
        raise CheckpointError(f"{path}: unreadable zarr array ({str(exc).splitlines()[0][:200]})") from None


def read_orbax(folder: str) -> dict[str, np.ndarray]:
    """{"params/<name>": array, "adam_m/<name>": …, "adam_v/<name>": …} of the Orbax checkpoint in
    ``folder`` (whole arrays, in the dtype written). CheckpointError names the file and the problem."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: no such folder (not an Orbax checkpoint of this project)")
    out = {}
    for keys in orbax_keys(folder):
        if len(keys) != 2 or keys[0] not in GROUPS:
            raise CheckpointError(f"{os.path.join(folder, METADATA)}: array {'/'.join(keys)} is not "
                                  f"<{'|'.join(GROUPS)}>/<name>")
        out[f"{keys[0]}/{keys[1]}"] = read_array(os.path.join(folder, ".".join(keys)))
    return out
