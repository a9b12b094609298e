"""The ledger of a compiled step: every collective it ran, read from torch's profiler, each attributed to the
compiled program that issued it or to eager code. No JAX twin: JAX's compiled rows read the collectives from the
compiled HLO (jax_impl/ledger.py).

    with compiled_ledger.recording(list_dtype=torch.float64) as rec:
        step()                                   # a step of compiled units (after the first, compiling one)
    rec.comm          # {"all_reduce": {"count": 12, "bytes": 41728}, ...}: nccl-tests' size S, as torch_impl/ledger.py
    rec.compiled      # the same, only what the compiled programs issued
    rec.eager         # the rest: FSDP2's hooks, DDP's reducer, the pipeline's send/recv, the loss outside the units
    rec.programs      # [{"program": key, "collectives": ["all_reduce", …], "runs": 2}]: per compiled program

Why not the eager ledger (torch_impl/ledger.py, a TorchDispatchMode): dynamo does not run compiled code under
a Python dispatch mode (it falls back to eager, or recompiles: a mode adds the Python dispatch key that its
guards check), so a mode would measure another program than the one timed. torch's profiler records every
dispatched op (RecordFunction, in C++) without touching the dispatch keys: the compiled programs run as they
are. A compiled program runs inside a "## Call CompiledFxGraph <key> ##" range (inductor's, one per graph
call); an op inside it was issued by compiled code.

What the profiler does not record: the process group (so no per-axis split: a compiled mesh layout is not
built) and the element type of a tensor LIST (c10d's allreduce_ / send / recv take lists: DDP's bucket, the
pipeline's messages); ``list_dtype`` gives it (the parameters' dtype: DDP buckets and pipeline messages are
in it, float32 under mixed precision).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

_ITEM = {"double": 8, "float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1,
         "signed char": 1, "unsigned char": 1, "short int": 2}
# op -> (ledger op, which argument's bytes, × group size from the int argument at this index or None)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, None), "all_reduce_": ("all_reduce", 0, None),
    "all_reduce_coalesced": ("all_reduce", 0, None), "all_reduce_coalesced_": ("all_reduce", 0, None),
    "all_gather_into_tensor": ("all_gather", 0, 1), "all_gather_into_tensor_out": ("all_gather", 0, 1),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0, None),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, None),
    "all_to_all_single": ("all_to_all", 0, None), "broadcast": ("broadcast", 0, None),
    "broadcast_": ("broadcast", 0, None),
}
_C10D = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0), "broadcast_": ("broadcast", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1), "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
}
CALL = "## Call CompiledFxGraph "  # inductor's range around one call of a compiled program


def _numel(shape) -> int:
    """Elements of a (structured) profiler shape: [d0, d1, …], or a list of such (a tensor list)."""
    if shape and isinstance(shape[0], list):
        return sum(_numel(s) for s in shape)
    n = 1
    for d in shape or []:
        n *= int(d)
    return n


class Recording:
    """The collectives of the profiled block: ``comm``, ``compiled``, ``eager`` ({op: {count, bytes}}) and
    ``programs`` (see the module docstring)."""

    def __init__(self, list_dtype: torch.dtype):
        self.list_item = torch.empty((), dtype=list_dtype).element_size()
        self.comm: dict = {}
        self.compiled: dict = {}
        self.eager: dict = {}
        self.programs: list[dict] = []

    def read(self, events) -> None:
        calls: dict[int, tuple[str, list[str]]] = {}  # id(call range) -> (program key, its collectives in order)
        for e in events:
            op = self._op(e)
            if op is None:
                continue
            name, nbytes = op
            call = self._compiled_call(e)
            for table in (self.comm, self.compiled if call is not None else self.eager):
                entry = table.setdefault(name, {"count": 0, "bytes": 0})
                entry["count"] += 1
                entry["bytes"] += nbytes
            if call is not None:
                backward = any("Backward" in a.name for a in _ancestors(call))
                key = (call.name[len(CALL):].split(" ")[0][:12], "backward" if backward else "forward")
                calls.setdefault(id(call), (key, []))[1].append(name)
        runs: dict[tuple, int] = {}
        for key, ops in calls.values():
            runs[key, tuple(ops)] = runs.get((key, tuple(ops)), 0) + 1
        self.programs = [{"program": key, "pass": kind, "collectives": list(ops), "runs": n}
                         for ((key, kind), ops), n in runs.items()]
        self.comm, self.compiled, self.eager = (dict(sorted(t.items())) for t in (self.comm, self.compiled, self.eager))

    def _op(self, e) -> tuple[str, int] | None:
        """(ledger op, bytes S) of one profiler event, or None: not a collective, or a c10d op that a functional
        collective dispatched (counted once, as the functional one)."""
        ns, _, op = e.name.partition("::")
        shapes, dtypes = e.structured_input_shapes or e.input_shapes or [], e.input_dtypes or []
        if ns == "_c10d_functional" and op in _FUNCTIONAL:
            name, arg, times = _FUNCTIONAL[op]
        elif ns == "c10d" and op in _C10D and not self._under_functional(e):
            (name, arg), times = _C10D[op], None
        else:
            return None
        dtype = dtypes[arg] if arg < len(dtypes) else ""
        item = self.list_item if dtype in ("TensorList", "") else _ITEM.get(dtype, 4)
        nbytes = _numel(shapes[arg] if arg < len(shapes) else []) * item
        if times is not None:  # all_gather_into_tensor: the input times the group size (the gathered output)
            nbytes *= int((e.concrete_inputs or [None] * (times + 1))[times] or 1)
        return name, nbytes

    @staticmethod
    def _under_functional(e) -> bool:
        return any(a.name.startswith("_c10d_functional::") for a in _ancestors(e))

    @staticmethod
    def _compiled_call(e):
        return next((a for a in _ancestors(e) if a.name.startswith(CALL)), None)


def _ancestors(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


@contextlib.contextmanager
def recording(list_dtype: torch.dtype = torch.float32):
    """Profile the block (CPU events with their input shapes) and read its collectives into a ``Recording``
    when it ends."""
    rec = Recording(list_dtype)
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    with _quiet_stderr():
        prof.__enter__()
    try:
        yield rec
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    rec.read(prof.events())


@contextlib.contextmanager
def _quiet_stderr():
    """kineto writes a "profiler_start" / "profiler_stop" line to file descriptor 2 as the profiler starts and
    stops, whatever KINETO_LOG_LEVEL or TORCH_CPP_LOG_LEVEL say (torch 2.13): fd 2 goes to /dev/null meanwhile."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
