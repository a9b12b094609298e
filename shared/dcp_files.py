"""torch's DCP checkpoints read without torch: NumPy and JSON only, so the JAX side (and any NumPy tool) can
load what torch_impl/checkpoint.py wrote (the twin of shared/orbax_files.py, which reads JAX's Orbax files).

The format torch_impl/checkpoint.py asks DCP for (``HuggingFaceStorageWriter(save_distributed=True)``): one
safetensors file per rank (``read_safetensors``: an 8-byte header length, a JSON header, the bytes), each
holding that rank's chunk of every array, with each chunk's offset in the whole array in its header's
``__metadata__["DCP_SHARDING_INFO"]``; ``read_dcp`` puts the chunks back together.
"""

from __future__ import annotations

import json
import os

import numpy as np

from shared.checkpoint_io import CheckpointError

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
