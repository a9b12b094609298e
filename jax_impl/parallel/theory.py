"""Communication and state per device from the parameters ``parallel.fsdp.parallelize`` actually
wraps, for any NNX model: the twin of torch_impl/parallel/theory.py.

shared/theory/ derives these from a ``Config`` (right for the project's MLP and transformer only).
Here they come from ``describe``: each Param once (a tied one under its first path) with its shape,
element size, whether it is split in row blocks (>= 2 dims, dim 0 divisible by N: the wrapper's
``rule``) and the zero3 unit that gathers it (None: the root). Results are what the HLO ledger
records — op -> (count, payload bytes S as nccl-tests counts it: an all-gather's output, a
reduce-scatter's input, an all-reduce's buffer; jax_impl/ledger.py) — and {params, grads,
optimizer} bytes per device with AdamW's two moments. On the project's models they equal
shared.theory's formulas (tests/test_own_model_jax.py checks both).

    dp     one all-reduce of every gradient                          Φ·b
    zero1  reduce-scatter + all-gather of the flat Φ padded to N      2·Φ_pad·b
    zero2  per row-split param a reduce-scatter and an all-gather, ONE all-reduce of the vectors
    zero3  per row-split param an all-gather per call of its unit (+ one per re-gather: a call whose
           input is not the data, not an Embed's) and a reduce-scatter per call; the root's
           row-split params one each; ONE all-reduce of the vectors
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

Comm = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    itemsize: int
    split: bool  # row blocks over the axis
    unit: str | None  # zero3 shard_map: the unit that gathers it; None: the root

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.itemsize


def describe(params: dict, sharded: set[str], units: list[str]) -> list[ParamInfo]:
    """{path: array} (the wrapper's flat params), which are split, and the zero3 units."""
    unit_of = lambda k: next((u for u in units if k.startswith(u + ".")), None)
    return [ParamInfo(k, tuple(a.shape), a.dtype.itemsize, k in sharded, unit_of(k)) for k, a in params.items()]


def _flat_bytes(infos: list[ParamInfo], n: int) -> int:
    numel = sum(prod(p.shape) for p in infos)
    return -(-numel // n) * n * infos[0].itemsize


def comm(infos: list[ParamInfo], variant: str, n: int, unit_calls: dict[str, tuple[int, int]] | None = None) -> Comm:
    """The step's collectives. zero3: ``unit_calls`` {unit: (calls, re-gathers)} as the wrapper's
    last trace saw them; without it (jit, or not traced yet) every unit is called once and
    re-gathered once."""
    if not infos:
        return {}
    if variant == "dp":
        return {"all_reduce": (len(infos), sum(p.nbytes for p in infos))}
    if variant == "zero1":
        return {"reduce_scatter": (1, _flat_bytes(infos, n)), "all_gather": (1, _flat_bytes(infos, n))}
    split = [p for p in infos if p.split]
    vec = sum(p.nbytes for p in infos if not p.split)
    out: Comm = {}
    if split and variant == "zero2":
        out = {"reduce_scatter": (len(split), sum(p.nbytes for p in split)),
               "all_gather": (len(split), sum(p.nbytes for p in split))}
    elif split:
        untraced = (1, 1) if unit_calls is None else (0, 0)
        calls = lambda p: (1, 0) if p.unit is None else (unit_calls or {}).get(p.unit, untraced)
        ag = [(p, sum(calls(p))) for p in split]
        rs = [(p, calls(p)[0]) for p in split]
        out = {"all_gather": (sum(k for _, k in ag), sum(p.nbytes * k for p, k in ag)),
               "reduce_scatter": (sum(k for _, k in rs), sum(p.nbytes * k for p, k in rs))}
    return out | ({"all_reduce": (1, vec)} if vec else {})


def state(infos: list[ParamInfo], variant: str, n: int, style: str = "shard_map") -> dict[str, int]:
    """Per device: parameters as placed, gradients and AdamW's two moments as the variant keeps them."""
    full = sum(p.nbytes for p in infos)
    rows = sum(p.nbytes // n if p.split else p.nbytes for p in infos)
    if variant == "dp":
        return {"params": full, "grads": full, "optimizer": 2 * full}
    if variant == "zero1":
        if style == "shard_map":  # AdamW over this device's 1/N of the flat padded vector
            return {"params": full, "grads": full, "optimizer": 2 * _flat_bytes(infos, n) // n}
        moments = sum(p.nbytes // n if p.shape and p.shape[0] % n == 0 else p.nbytes for p in infos)
        return {"params": full, "grads": full, "optimizer": 2 * moments}
    return {"params": rows if variant == "zero3" else full, "grads": rows, "optimizer": 2 * rows}
