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

Per mesh axis (``comm_by_axis(hlo_text, mesh)``, the N-D layouts): every op's replica groups (or a
collective-permute's source → target pairs) name devices by their position in ``mesh.devices.flat``
(the SPMD partition id of a jit / shard_map over that mesh); the mesh axes along which the devices
of one group differ label the op, joined by "+" in mesh order ("dp+cp"). Forms read:
``{{0,1},{2,3}}``, iota ``[2,2]<=[4]`` / ``[2,2]<=[2,2]T(1,0)``, XLA's mesh-axes form
``mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_0'}`` (its own axis names: read by
position), and ``{}`` (all devices).
"""

from __future__ import annotations

import math
import re

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


def _iota(dims: str, perm: str | None):
    """``[d0,d1,…]T(p…)``: arange over the dims, transposed by p (NumPy array of device ids)."""
    import numpy as np

    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


_IOTA = re.compile(r"replica_groups=\[(?P<g>\d+),(?P<s>\d+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
# XLA's mesh-axes form: a mesh of (its own) named axes over the device ids (iota, or device_ids=…),
# the group spanning the listed axes: mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_0'}
_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
                   r"(?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?[^()]*)\))?\s*\{(?P<names>[^}]*)\}")


def _mesh_groups(m: re.Match) -> list[list[int]]:
    import numpy as np

    axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group("axes"))]
    sizes = [n for _, n in axes]
    ids = m.group("ids")
    if ids is None:
        devs = np.arange(math.prod(sizes))
    elif it := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids.strip()):
        devs = _iota(it.group(1), it.group(2)).reshape(-1)
    else:
        devs = np.array([int(d) for d in re.findall(r"\d+", ids)])
    named = re.findall(r"'([^']+)'", m.group("names"))
    assert ":" not in m.group("names"), f"sub-axes in replica groups are not read: {m.group(0)}"
    order = [a for a, _ in axes]
    inside = [order.index(a) for a in named]
    outside = [k for k in range(len(order)) if k not in inside]
    grid = devs.reshape(sizes).transpose(outside + inside)
    return grid.reshape(-1, math.prod(sizes[k] for k in inside)).tolist()


def _groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of one collective line (a collective-permute: its source → target pairs)."""
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line):
        groups = [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return groups or [list(range(num_devices))]  # {}: every device
    if m := _IOTA.search(line):
        return _iota(m.group("dims"), m.group("perm")).reshape(int(m.group("g")), int(m.group("s"))).tolist()
    if m := _MESH.search(line):
        return _mesh_groups(m)
    return [list(range(num_devices))]


def _group_size(line: str, default: int) -> int:
    return len(_groups(line, default)[0])


def _collectives(hlo_text: str, num_devices: int | None = None):
    """(op, payload bytes S, line, device count) for every collective of the module."""
    default = num_devices or 1
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    if num_devices is None and m:
        default = int(m.group(1))
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m or m.group("suffix") == "-done":
            continue
        op, arrays = m.group("op"), _arrays(m.group("shape"))
        if not arrays:
            continue
        if m.group("suffix") == "-start":  # GPU async forms: the shape lists inputs, then outputs
            if op == "collective-permute":  # (inputs…, outputs…, u32[], u32[]): the message
                kinds = _ARRAY.findall(m.group("shape"))
                while len(arrays) > 2 and kinds[-1] == ("u32", ""):  # the two u32[] contexts only: a
                    arrays, kinds = arrays[:-1], kinds[:-1]  # scalar message (f32[]) keeps its 4 bytes
                arrays = arrays[: max(1, len(arrays) // 2)]
            elif op != "all-reduce":  # all-gather, reduce-scatter, all-to-all: keep the outputs
                arrays = arrays[len(arrays) // 2:]
        size = sum(arrays)
        if op == "reduce-scatter":
            size *= _group_size(line, default)
        yield _OPS[op], size, line, default


def _add(ops: dict, op: str, size: int) -> None:
    entry = ops.setdefault(op, {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += size


def comm_from_hlo(hlo_text: str, num_devices: int | None = None) -> dict[str, dict[str, int]]:
    ops: dict[str, dict[str, int]] = {}
    for op, size, _, _ in _collectives(hlo_text, num_devices):
        _add(ops, op, size)
    return dict(sorted(ops.items()))


def axis_label(line: str, mesh, num_devices: int | None = None) -> str:
    """The mesh axes one collective runs along, "+"-joined in mesh order ("none": within one device)."""
    import numpy as np

    names = list(mesh.axis_names)
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T  # id -> coords
    varying = {names[k] for g in _groups(line, num_devices or mesh.devices.size) if len(g) > 1
               for k in np.flatnonzero((coords[g] != coords[g[0]]).any(axis=0))}
    return "+".join(a for a in names if a in varying) or "none"


def comm_by_axis(hlo_text: str, mesh) -> dict[str, dict[str, dict[str, int]]]:
    """{axis label: {op: {"count", "bytes"}}}: ``comm_from_hlo`` split by the mesh axes each op's
    groups span (device id = position in ``mesh.devices.flat``; ``axis_label``)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for op, size, line, n in _collectives(hlo_text, mesh.devices.size):
        _add(out.setdefault(axis_label(line, mesh, n), {}), op, size)
    return {label: dict(sorted(ops.items())) for label, ops in out.items()}


def compiled_text(jitted, *args, **kwargs) -> str:
    return jitted.lower(*args, **kwargs).compile().as_text()


def comm_of(jitted, *args, **kwargs) -> dict[str, dict[str, int]]:
    """Collectives of the compiled ``jitted(*args)`` (a ``jax.jit``-wrapped function)."""
    return comm_from_hlo(compiled_text(jitted, *args, **kwargs))
