"""Communication ledger for JAX: the collectives in the compiled HLO of a step.

``comm_of(jitted, *args)`` compiles the step for those arguments and reads every
``all-reduce``, ``all-gather``, ``reduce-scatter``, ``collective-permute`` and ``all-to-all``
(and their async ``-start`` forms on GPU) with its shapes. Bytes follow nccl-tests' size S per
call, like torch_impl.ledger: all-reduce: the buffer; all-gather: the gathered output;
reduce-scatter: the full input (output × group size); all-to-all: the buffer;
collective-permute: the message.

bfloat16 on CPU: XLA:CPU runs bf16 collectives in f32, so the ledger shows 4 bytes per element
where theory (and torch) count 2; GPU keeps bf16 on the wire.

The count is static: an op inside a while-loop body (``lax.scan`` / ``fori_loop``) is counted
once, so steps whose ledger matters unroll their loops in Python.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

_ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
         "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_OPS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
        "collective-permute": "collective_permute", "all-to-all": "all_to_all"}
_LINE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?P<suffix>-start|-done)?\("
)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")


def _arrays(shape: str) -> list[int]:
    """Bytes of each array in an HLO shape (a tuple or a single array)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(n * _ITEM.get(dtype, 4))
    return out


def _group_size(line: str, default: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        named = re.findall(r"'([^']+)'", m.group(2))
        return math.prod(int(sizes[a]) for a in named if a in sizes) or default
    return default


def comm_from_hlo(hlo_text: str, num_devices: int | None = None) -> dict[str, dict[str, int]]:
    default = num_devices or 1
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    if num_devices is None and m:
        default = int(m.group(1))
    ops: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m or m.group("suffix") == "-done":
            continue
        op, arrays = m.group("op"), _arrays(m.group("shape"))
        if not arrays:
            continue
        if m.group("suffix") == "-start":  # GPU async forms: the shape lists inputs, then outputs
            if op == "collective-permute":  # ((inputs…), (outputs…), u32[], u32[]): the message
                arrays = [a for a, dt in zip(arrays, _ARRAY.findall(m.group("shape"))) if dt[1]]  # drop u32[]
                arrays = arrays[: max(1, len(arrays) // 2)]
            elif op != "all-reduce":  # all-gather, reduce-scatter, all-to-all: keep the outputs
                arrays = arrays[len(arrays) // 2:]
        size = sum(arrays)
        if op == "reduce-scatter":
            size *= _group_size(line, default)
        entry = ops[_OPS[op]]
        entry["count"] += 1
        entry["bytes"] += size
    return {k: dict(v) for k, v in sorted(ops.items())}


def compiled_text(jitted, *args, **kwargs) -> str:
    return jitted.lower(*args, **kwargs).compile().as_text()


def comm_of(jitted, *args, **kwargs) -> dict[str, dict[str, int]]:
    """Collectives of the compiled ``jitted(*args)`` (a ``jax.jit``-wrapped function)."""
    return comm_from_hlo(compiled_text(jitted, *args, **kwargs))
