"""Communication ledger for torch: every collective and point-to-point call a rank makes.

A ``TorchDispatchMode`` sees each c10d op as it is dispatched — ``dist.*`` calls
(``c10d.allreduce_``, ``c10d.send``, …), the ones DDP / FSDP2 issue from C++, and the
functional collectives DTensor uses (``_c10d_functional.*``). Unlike ``CommDebugMode`` it also
counts ``send`` / ``recv`` (including ``batch_isend_irecv``).

Bytes follow nccl-tests' size S per call: all-reduce / broadcast / reduce: the buffer;
all-gather / gather: the gathered output; reduce-scatter / scatter: the full input;
all-to-all: the buffer; send / recv: the message.

    ledger = CommLedger(world_size)
    with ledger.recording():          # resets, then records until the block ends
        train_step()
    ledger.summary()                  # {"all_reduce": {"count": 4, "bytes": 8192}, ...}

Per mesh axis (the N-D "mesh" pattern): ``ledger.label_groups({pg_or_group_name: "tp", …})`` names
the process groups; every op is then also recorded under the label of the group it ran on (found
in the dispatched arguments: c10d ops carry the ProcessGroup, functional collectives — DTensor,
FSDP2 — its name), and ``by_axis()`` gives {label: {op: {"count", "bytes"}}}. An op on a group
without a label goes under "world" (the default group) or "group:<name>". ``label_groups({})``
clears the labels (the 1-D patterns never set any).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _dtype(args) -> str | None:
    """The dtype of a collective's first tensor argument ("bfloat16", …), None when it has none."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                return str(t.dtype).removeprefix("torch.")
    return None


def _group_size(group, default: int) -> int:
    """Size of the process group an op runs on (a subgroup may be smaller than the world)."""
    try:
        return int(group.size())
    except (AttributeError, RuntimeError, TypeError):
        return default


# op name -> (ledger label, size S from (args, world size))
_C10D = {
    "allreduce_": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "broadcast_": ("broadcast", lambda a, n: _nbytes(a[0])),
    "reduce_": ("reduce", lambda a, n: _nbytes(a[0])),
    "allgather_": ("all_gather", lambda a, n: _nbytes(a[0])),
    "_allgather_base_": ("all_gather", lambda a, n: _nbytes(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a, n: _nbytes(a[0])),
    "allgather_coalesced_": ("all_gather", lambda a, n: _nbytes(a[0])),
    "reduce_scatter_": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "gather_": ("gather", lambda a, n: _nbytes(a[1]) * _group_size(a[2], n)),
    "scatter_": ("scatter", lambda a, n: _nbytes(a[0]) * _group_size(a[2], n)),
    "alltoall_base_": ("all_to_all", lambda a, n: _nbytes(a[1])),
    "alltoall_": ("all_to_all", lambda a, n: _nbytes(a[1])),
    "send": ("send", lambda a, n: _nbytes(a[0])),
    "recv_": ("recv", lambda a, n: _nbytes(a[0])),
    "recv_any_source_": ("recv", lambda a, n: _nbytes(a[0])),
    "barrier": ("barrier", lambda a, n: 0),
    "monitored_barrier_": ("barrier", lambda a, n: 0),
}
# Dispatcher op names (not the deprecated Python APIs of the same name): DTensor and FSDP2 issue
# these functional collectives internally, so the ledger has to recognise them.
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "all_reduce_": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "all_reduce_coalesced": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "all_gather_into_tensor": ("all_gather", lambda a, n: _nbytes(a[0]) * a[1]),
    "all_gather_into_tensor_out": ("all_gather", lambda a, n: _nbytes(a[0]) * a[1]),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a, n: _nbytes(a[0]) * a[1]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, n: _nbytes(a[0])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a, n: _nbytes(a[0])),
    "all_to_all_single": ("all_to_all", lambda a, n: _nbytes(a[0])),
    "broadcast": ("broadcast", lambda a, n: _nbytes(a[0])),
}
_TABLES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL}


def _group_name(func, args) -> str | None:
    """The name of the process group a dispatched c10d / functional op runs on: the first
    ProcessGroup argument (a ScriptObject: unboxed) or, for functional collectives, the group-name
    string that their schema calls ``group_name``."""
    for arg, value in zip(func._schema.arguments, args):
        if arg.name == "group_name" and isinstance(value, str):
            return value
        if isinstance(value, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(value).group_name
            except (RuntimeError, TypeError):  # another custom class (e.g. the ReduceOp)
                continue
    return None


# The dtypes NCCL reduces and moves (ncclInt8 … ncclBfloat16; torch sends bool as uint8).
NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32,
                         torch.float64, torch.bfloat16, torch.bool})
# The ranks' device audit: "ledger" checks every recorded collective's tensors; "meta" also makes
# meta the default device (a factory call without device= then fails on CPU). tests/conftest.py
# sets "ledger" for the whole suite; tests/test_gpu_readiness.py runs "meta" (-m slow).
AUDIT_ENV = "PARALLEL_TWINS_AUDIT"


class AuditError(RuntimeError):
    """A collective was handed a tensor NCCL would refuse or mis-place (the device audit)."""


def audit_tensors(op: str, args, device: torch.device) -> None:
    """The device audit of one collective's arguments: every tensor on ``device`` (the rank's),
    contiguous, of a dtype NCCL takes; AuditError, one line, naming the first that is not."""
    flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
    for i, t in enumerate(flat):
        why = (f"on {t.device}, the rank's device is {device}" if t.device != device else
               "not contiguous" if not t.is_contiguous() else
               f"dtype {t.dtype} (NCCL takes none)" if t.dtype not in NCCL_DTYPES else None)
        if why:
            raise AuditError(f"device audit: {op} tensor {i} {tuple(t.shape)} is {why}")


class CommLedger:
    def __init__(self, world_size: int, audit_device: torch.device | None = None):
        self.world_size = world_size
        # The strict mode: with a device, every collective recorded is audited (audit_tensors).
        self.audit_device = audit_device
        self.audited = 0  # collectives the audit has checked
        self._ops: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
        self._axes: dict[str, dict[str, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: {"count": 0, "bytes": 0}))
        self._dtypes: dict[str, dict[str, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: {"count": 0, "bytes": 0}))  # op -> dtype -> count, bytes
        self.labels: dict[str, str] = {}  # process group name -> mesh axis label
        self.active = False

    def label_groups(self, labels: dict) -> None:
        """{ProcessGroup or group name: label}; replaces the previous labels ({} clears them)."""
        self.labels = {g if isinstance(g, str) else g.group_name: label for g, label in labels.items()}

    def label_of(self, group_name: str | None) -> str:
        if group_name in self.labels:
            return self.labels[group_name]
        world = dist.group.WORLD if dist.is_initialized() else None
        return "world" if group_name is None or (world is not None and group_name == world.group_name) \
            else f"group:{group_name}"

    def record(self, op: str, nbytes: int, group_name: str | None = None, dtype: str | None = None) -> None:
        """Add one call by hand (for communication no dispatch mode can see). ``dtype``: what it moves
        (or reduces in), e.g. "bfloat16"; by_dtype() counts it there."""
        entries = [self._ops[op], self._axes[self.label_of(group_name)][op]]
        if dtype is not None:
            entries.append(self._dtypes[op][dtype])
        for entry in entries:
            entry["count"] += 1
            entry["bytes"] += int(nbytes)

    def reset(self) -> None:
        self._ops.clear()
        self._axes.clear()
        self._dtypes.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        return {op: dict(v) for op, v in sorted(self._ops.items())}

    def by_axis(self) -> dict[str, dict[str, dict[str, int]]]:
        """{label: {op: {"count", "bytes"}}} of the recorded ops (see the module docstring)."""
        return {label: {op: dict(v) for op, v in sorted(ops.items())} for label, ops in sorted(self._axes.items())}

    def by_dtype(self) -> dict[str, dict[str, dict[str, int]]]:
        """{op: {dtype: {"count", "bytes"}}} of the recorded ops: the dtype each moved or reduced in (a
        reduction's partial sums are added in the dtype of its buffer: bf16 buffers, bf16 sums)."""
        return {op: {d: dict(v) for d, v in sorted(ds.items())} for op, ds in sorted(self._dtypes.items())}

    @contextlib.contextmanager
    def recording(self):
        """Reset, then record every c10d op dispatched inside the block."""
        self.reset()
        self.active = True
        try:
            with _LedgerMode(self):
                yield self
        finally:
            self.active = False


class _LedgerMode(TorchDispatchMode):
    def __init__(self, ledger: CommLedger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Modes run before tensor subclasses: a DTensor op would be forwarded with this mode off,
        # hiding collectives DTensor issues inside an op (e.g. loss_parallel's all-reduces in
        # log_softmax). Returning NotImplemented lets the subclass desugar it first, into plain
        # ops and collectives this mode then sees (as CommDebugMode does). Only DTensor: NotImplemented
        # would fail the op of other subclasses (a plain nn.Parameter, e.g. FSDP2's unsharded root
        # parameters in backward; the FakeTensors of DTensor's sharding propagation).
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        table = _TABLES.get(func.namespace)
        if table is not None:
            entry = table.get(func._overloadpacket.__name__)
            if entry is not None:
                label, size = entry
                if self.ledger.audit_device is not None:
                    audit_tensors(func._overloadpacket.__name__, args, self.ledger.audit_device)
                    self.ledger.audited += 1
                self.ledger.record(label, size(args, self.ledger.world_size), _group_name(func, args), _dtype(args))
        return func(*args, **(kwargs or {}))
