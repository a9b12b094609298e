"""The parts of a training recipe that a sharded layout changes, for every wrapper and plan of this
package: the GLOBAL gradient norm and clipping by it (what ``torch.nn.utils.clip_grad_norm_``
computes on one process, wherever the gradient lives). docs/recipe.md ("## torch") has what a user
writes per wrapper for clipping, decay masks, frozen parameters, schedules and accumulation.

    total = clip_(sharded, replicated, max_norm, group)   # the hand-written layouts
    total = clip_dtensor_(params, max_norm)               # DTensors (FSDP2, DTensor TP) + plain tensors
    refuse_stale(params_by_name, wrapper, fix)           # an optimizer over parameters a wrapper replaced
    seal(grads, wrapper, fix); refresh(grads)            # refuse a gradient changed in place before the step

The global norm: ‖g‖ = sqrt(Σ_ranks Σ_{sharded} g² + Σ_{replicated} g²) — the sums of squares of the
local shards all-reduced over the group that shards them, a parameter replicated over that group
(norm gains and rowwise biases under tp, vectors under ZeRO, tied weights held once) counted ONCE
(Megatron-LM's rule, Shoeybi et al. 2019, ``clip_grad_norm_fp32``), pipeline stages summed (each
stage's parameters are "sharded" over the pp group). Then torch's formula: every gradient times
min(1, max_norm / (‖g‖ + 1e-6)). Collective: ONE all-reduce of a scalar per group (b bytes;
``clip_comm``), which the ledger records as it records every c10d call.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def clip_comm(itemsize: int, groups: int = 1) -> dict[str, tuple[int, int]]:
    """The norm's collective per optimizer step per rank: one all-reduce of one scalar per group."""
    return {"all_reduce": (groups, groups * itemsize)}


def with_clip(comm: dict[str, tuple[int, int]], itemsize: int, clipped: bool) -> dict[str, tuple[int, int]]:
    """A wrapper's comm_theory plus the norm's all-reduce when its last step clipped."""
    if not clipped:
        return comm
    k, b = comm.get("all_reduce", (0, 0))
    return {**comm, "all_reduce": (k + 1, b + itemsize)}


def _squares(grads: list[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
    """Σ g² over the tensors, as a 0-dim tensor of ``dtype`` (zero when there are none)."""
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.stack([torch.linalg.vector_norm(g, 2).to(dtype) ** 2 for g in grads]).sum()


def scale_(grads: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """torch's clip: g ← g · min(1, max_norm / (total + 1e-6))."""
    coef = torch.clamp(max_norm / (total + EPS), max=1.0)
    grads = list(grads)
    for g in grads:
        g.mul_(coef.to(g.dtype) if not isinstance(g, DTensor) else float(coef))
    refresh(grads)


@torch.no_grad()
def global_norm(sharded: Iterable[torch.Tensor | None], replicated: Iterable[torch.Tensor | None], group,
                dtype: torch.dtype, device=None, reduce: bool = True) -> torch.Tensor:
    """sqrt(all-reduce(Σ sharded g²) + Σ replicated g²): ``sharded`` are this rank's pieces of
    gradients split over ``group`` (None: the world; disjoint across ranks), ``replicated`` gradients
    every rank of ``group`` holds whole and equal. ``None`` entries (no gradient) are skipped.
    ``reduce=False``: nothing is sharded, no collective. Otherwise call on every rank of the group."""
    sharded = [g for g in sharded if g is not None]
    replicated = [g for g in replicated if g is not None]
    device = device or next((g.device for g in sharded + replicated), torch.device("cpu"))
    s = _squares(sharded, dtype, device)
    if reduce and dist.get_world_size(group) > 1:
        dist.all_reduce(s, group=group)  # one scalar: Σ over ranks of their shards' squares
    return (s + _squares(replicated, dtype, device)).sqrt()


def clip_(sharded, replicated, max_norm: float, group, dtype: torch.dtype, device=None,
          reduce: bool = True) -> torch.Tensor:
    """``global_norm`` then ``scale_`` every gradient (sharded and replicated); returns the norm."""
    sharded = [g for g in sharded if g is not None]
    replicated = [g for g in replicated if g is not None]
    total = global_norm(sharded, replicated, group, dtype, device, reduce)
    scale_(sharded + replicated, max_norm, total)
    return total


@torch.no_grad()
def clip_dtensor_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's own ``clip_grad_norm_`` for a model whose parameters are DTensors (FSDP2's
    fully_shard, a DTensor TP plan) — and, unlike it, also for one that mixes them with plain
    tensors (apply_dtensor_plan leaves unplanned parameters plain: replicated over the mesh, equal
    on every rank, so counted once). DTensor norms are reduced by DTensor itself (its Partial →
    Replicate all-reduce); the result is a plain 0-dim tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    dts = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if not grads:
        return torch.zeros(())
    sq = torch.zeros((), dtype=grads[0].dtype, device=(plain or [g.to_local() for g in dts])[0].device)
    if dts:
        n = torch.nn.utils.get_total_norm(dts, 2.0)
        sq = sq + (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    if plain:
        sq = sq + torch.nn.utils.get_total_norm(plain, 2.0) ** 2
    total = sq.sqrt()
    scale_(grads, max_norm, total)
    return total


class StaleParameterError(RuntimeError):
    """An optimizer steps a parameter that a wrapper replaced by a shard: it never gets a gradient."""


def refuse_stale(stale: dict[str, torch.Tensor], wrapper: str, fix: str) -> None:
    """Refuse, at any optimizer's first step, a param group that still holds one of ``stale`` (the
    full parameters a wrapper replaced by shards, e.g. param groups built from the model BEFORE
    wrapping): torch skips a parameter without a gradient, so those matrices would silently never
    train. A global ``register_optimizer_step_pre_hook``; weak references, so nothing is kept alive."""
    refs = {id(p): (weakref.ref(p), name) for name, p in stale.items()}
    if not refs:
        return

    def hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                ref, name = refs.get(id(p), (None, None))
                if ref is not None and ref() is p:
                    raise StaleParameterError(
                        f"{type(optimizer).__name__} holds {name!r} {tuple(p.shape)} as {wrapper} found it before "
                        f"wrapping; {wrapper} computes with a shard of it instead, so this tensor never gets a "
                        f"gradient and would silently not train. Fix: {fix}")

    register_optimizer_step_pre_hook(hook)


# --- torch's own clip_grad_norm_ over a rank's pieces: refused at the step ---------------------------------


class LocalClipError(RuntimeError):
    """A gradient a sharded layout handed the optimizer was changed in place before the step."""


_SEALS: dict[int, tuple] = {}  # id(grad) -> (weakref(grad), its _version when sealed, wrapper, fix)
_HOOKED: list[bool] = []


def seal(grads: Iterable[torch.Tensor | None], wrapper: str, fix: str) -> None:
    """Remember each gradient's version as ``wrapper`` produced it (a shard's, a split parameter's,
    an unreduced local one). Any optimizer's step, and ``check_sealed``, refuse one changed in place
    since — ``torch.nn.utils.clip_grad_norm_`` over what a rank holds (the LOCAL norm: silently not
    the model's) or any other in-place edit the layout cannot see — with ``LocalClipError``. The
    project's own in-place operations (the wrappers' clip, averaging) call ``refresh``."""
    for g in grads:
        if g is not None:
            _SEALS[id(g)] = (weakref.ref(g), g._version, wrapper, fix)
    if len(_SEALS) > 1 << 14:  # drop the gradients that are gone
        for k in [k for k, v in _SEALS.items() if v[0]() is None]:
            del _SEALS[k]
    if not _HOOKED:
        register_optimizer_step_pre_hook(lambda opt, args, kw: check_sealed(
            p.grad for group in opt.param_groups for p in group["params"]))
        _HOOKED.append(True)


def refresh(grads: Iterable[torch.Tensor | None]) -> None:
    """The project changed these gradients in place on purpose: the sealed versions follow."""
    for g in grads:
        entry = _SEALS.get(id(g)) if g is not None else None
        if entry is not None and entry[0]() is g:
            _SEALS[id(g)] = (entry[0], g._version, *entry[2:])


def check_sealed(grads: Iterable[torch.Tensor | None]) -> None:
    for g in grads:
        entry = _SEALS.get(id(g)) if g is not None else None
        if entry is not None and entry[0]() is g and g._version != entry[1]:
            raise LocalClipError(
                f"{entry[2]}: a gradient {tuple(g.shape)} was changed in place after {entry[2]} produced it and before "
                "the optimizer step — torch.nn.utils.clip_grad_norm_ over what this rank holds computes the LOCAL "
                "norm (not the model's: silently wrong), and any other in-place edit would miss the layout. Fix: "
                f"{entry[3]}")
