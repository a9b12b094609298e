"""Communication and state per rank from the parameters a wrapper actually sees, for any module.

shared/theory/ derives these from a ``Config``: right for the project's MLP and transformer, wrong
for a model it does not describe (biases, LayerNorm, frozen or tied parameters, row counts not
divisible by N). Here they come from ``describe(module)``: each parameter once (tied ones under
their first name) with its full shape, element size, ``requires_grad`` and the modules that hold
it. The wrappers (dp.BucketedDDP, dp.Zero1Optimizer, fsdp.Zero2, fsdp.FSDP) describe the module
when they wrap it and answer ``comm_theory()`` / ``state_theory()`` from that. Results are what
the ledger records — op -> (count, payload bytes S as nccl-tests counts it; torch_impl/ledger.py)
— and {params, grads, optimizer} bytes per rank with AdamW's two moments. On the project's models
they equal shared.theory's formulas (tests/test_own_model_torch.py checks both).

    dp_comm        naive DP / DDP: all-reduce every trainable gradient, Φ·b (naive: one call each)
    bucketed_comm  BucketedDDP: one all-reduce per bucket
    zero1_comm     ZeRO-1: reduce-scatter + all-gather of the flat trainable Φ, padded to N
    zero2_comm     ZeRO-2: per trainable unit a reduce-scatter + an all-gather (rows padded to N),
                   ONE all-reduce of the trainable vectors
    zero3_comm     FSDP: per holder an all-gather in forward and a reduce-scatter in backward, a
                   re-gather for each unit whose weight backward needs, the vectors' all-reduce

A "unit" is a parameter with >= 2 dims, split along dim 0 and padded to N·⌈R/N⌉ rows (fsdp.Unit);
a "vector" has < 2 dims (replicated). A "holder" is a module that has the parameter directly: a
tied parameter has two, and FSDP gathers (and reduce-scatters) it in each one's forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

import torch.nn as nn

Comm = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    itemsize: int
    trainable: bool
    holders: tuple[type, ...]  # classes of the modules holding it directly

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.itemsize

    @property
    def unit(self) -> bool:
        return len(self.shape) >= 2

    def padded_bytes(self, n: int) -> int:
        """A unit's bytes with dim 0 padded to N·⌈R/N⌉ rows (the buffers the ledger sees)."""
        rows = self.shape[0]
        return -(-rows // n) * n * prod(self.shape[1:]) * self.itemsize


def describe(model) -> list[ParamInfo]:
    """Every parameter of a module once (named_parameters() order), or of an iterable of
    parameters (an optimizer's; unnamed, holders unknown), as ParamInfos."""
    if not isinstance(model, nn.Module):
        ps = list({id(p): p for p in model}.values())
        return [ParamInfo(f"[{k}]", tuple(p.shape), p.element_size(), p.requires_grad, ()) for k, p in enumerate(ps)]
    held: dict[int, list[type]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                held.setdefault(id(p), []).append(type(m))
    return [ParamInfo(name, tuple(p.shape), p.element_size(), p.requires_grad, tuple(held[id(p)]))
            for name, p in model.named_parameters()]


def _infos(model) -> list[ParamInfo]:
    """A module, an iterable of parameters, or ParamInfos already."""
    if isinstance(model, nn.Module):
        return describe(model)
    items = list(model)
    return items if all(isinstance(p, ParamInfo) for p in items) else describe(items)


def comm_bytes(comm: Comm) -> int:
    return sum(b for _, b in comm.values())


# --- data parallel --------------------------------------------------------------------------------


def dp_comm(model) -> Comm:
    """Naive DP (one all-reduce per trainable gradient); DDP's bytes (its call count: its buckets)."""
    ps = [p for p in _infos(model) if p.trainable]
    return {"all_reduce": (len(ps), sum(p.nbytes for p in ps))} if ps else {}


def bucketed_comm(bucket_bytes: Iterable[int]) -> Comm:
    sizes = list(bucket_bytes)
    return {"all_reduce": (len(sizes), sum(sizes))} if sizes else {}


def _flat_bytes(ps: list[ParamInfo], n: int) -> int:
    numel = sum(prod(p.shape) for p in ps)
    return -(-numel // n) * n * ps[0].itemsize


def zero1_comm(model, n: int) -> Comm:
    """Zero1Optimizer: one reduce-scatter of the flat gradient and one all-gather of the flat
    parameters, Φ padded to a multiple of N (the ledger counts the padded buffer)."""
    ps = [p for p in _infos(model) if p.trainable]
    return {"reduce_scatter": (1, _flat_bytes(ps, n)), "all_gather": (1, _flat_bytes(ps, n))} if ps else {}


def dp_state(model) -> dict[str, int]:
    """Replicated DP with AdamW: every parameter, every trainable gradient, 2 moments of each."""
    infos = _infos(model)
    g = sum(p.nbytes for p in infos if p.trainable)
    return {"params": sum(p.nbytes for p in infos), "grads": g, "optimizer": 2 * g}


def zero1_state(model, n: int) -> dict[str, int]:
    """Zero1Optimizer: the flat padded trainable parameters and the frozen ones, full gradients,
    AdamW state of this rank's 1/N slice of the flat vector."""
    infos = _infos(model)
    ps = [p for p in infos if p.trainable]
    flat = _flat_bytes(ps, n) if ps else 0
    return {"params": flat + sum(p.nbytes for p in infos if not p.trainable),
            "grads": sum(p.nbytes for p in ps), "optimizer": 2 * flat // n}


# --- ZeRO-2 / ZeRO-3 (parallel/fsdp.py) -------------------------------------------------------------


def zero2_comm(model, n: int) -> Comm:
    infos = _infos(model)
    units = [p for p in infos if p.unit and p.trainable]
    vec = sum(p.nbytes for p in infos if not p.unit and p.trainable)
    s = sum(p.padded_bytes(n) for p in units)
    out = {"reduce_scatter": (len(units), s), "all_gather": (len(units), s)} if units else {}
    return out | ({"all_reduce": (1, vec)} if vec else {})


def default_regathered(model) -> list[str]:
    """Units FSDP gathers again in backward when nothing else is known: those whose op keeps the
    weight for the input's gradient — every unit not held only by nn.Embeddings (an embedding's
    backward is a scatter-add over the indices). A Linear whose input needs no gradient (a first
    layer fed by the data) keeps none either: pass ``regathered``, or ask ``FSDP.comm_theory()``,
    which knows what its last forward kept."""
    return [p.name for p in _infos(model) if p.unit and not all(issubclass(h, nn.Embedding) for h in p.holders)]


def zero3_comm(model, n: int, regathered: Iterable[str] | None = None, gather_itemsize: int | None = None) -> Comm:
    """FSDP: per holder of a unit an all-gather in forward (+ one per ``regathered`` unit in
    backward) and, if it is trainable, a reduce-scatter (each use's gradient leaves on its own);
    one all-reduce of the trainable vectors. ``gather_itemsize``: FSDP's compute_dtype (weights are
    cast before the gather; gradients are reduced in the parameters' dtype)."""
    infos = _infos(model)
    again = set(default_regathered(infos) if regathered is None else regathered)
    units = [p for p in infos if p.unit]
    g = lambda p: p.padded_bytes(n) * (gather_itemsize or p.itemsize) // p.itemsize
    ag = [(p, len(p.holders) + (p.name in again)) for p in units]
    rs = [(p, len(p.holders)) for p in units if p.trainable]
    vec = sum(p.nbytes for p in infos if not p.unit and p.trainable)
    out = {"all_gather": (sum(k for _, k in ag), sum(g(p) * k for p, k in ag))} if units else {}
    if rs:
        out["reduce_scatter"] = (sum(k for _, k in rs), sum(p.padded_bytes(n) * k for p, k in rs))
    return out | ({"all_reduce": (1, vec)} if vec else {})


def zero2_state(model, n: int) -> dict[str, int]:
    """Zero2: full parameters; gradients and AdamW state of the trainable units' ⌈R/N⌉-row shards
    and of the trainable vectors."""
    infos = _infos(model)
    trained = sum(p.padded_bytes(n) // n if p.unit else p.nbytes for p in infos if p.trainable)
    return {"params": sum(p.nbytes for p in infos), "grads": trained, "optimizer": 2 * trained}


def zero3_state(model, n: int) -> dict[str, int]:
    """FSDP: every unit as its ⌈R/N⌉-row shard, the vectors whole; gradients and AdamW state of the
    trainable ones."""
    infos = _infos(model)
    size = lambda p: p.padded_bytes(n) // n if p.unit else p.nbytes
    trained = sum(size(p) for p in infos if p.trainable)
    return {"params": sum(size(p) for p in infos), "grads": trained, "optimizer": 2 * trained}
