"""The ZeRO building blocks of the hand-written wrappers (torch_impl/parallel/fsdp.py's FSDP, ZeRO-3, uses
them too) and ZeRO-2 (Rajbhandari et al. 2020, arXiv:1910.02054 §5.2): each parameter with >= 2 dims a ``Unit``
split along dim 0 (padded to a multiple of N) so all_gather_single / reduce_scatter_single work on contiguous
rows; vectors replicated and averaged by ONE flat all-reduce.

    model = Zero2(module)         # full parameters; gradients and AdamW state sharded (reduce-scatter + all-gather)

The twin of jax_impl/parallel/zero.py (JAX's ZeRO steps). The runner torch_impl/fsdp.py's docstring has the
collectives and the bytes per step; the recipe (clip, no_sync, refuse_stale) as fsdp.py's docstring says.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_impl.parallel import recipe, theory
from torch_impl.parallel.ep import refuse_split_experts


class Unit:
    """One sharded parameter: ``rows`` of dim 0 padded to ``n·shard_rows``; ``shard`` is this rank's rows."""

    def __init__(self, full: torch.Tensor, rank: int, n: int):
        self.shape, self.rows, self.n = tuple(full.shape), full.shape[0], n
        self.shard_rows = -(-self.rows // n)  # ⌈R/N⌉
        padded = full.new_zeros((self.shard_rows * n, *self.shape[1:]))
        padded[:self.rows] = full.detach()
        self.shard = nn.Parameter(padded[rank * self.shard_rows:(rank + 1) * self.shard_rows].clone(),
                                  requires_grad=full.requires_grad)  # (⌈R/N⌉, …)

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """(R, …) -> (N·⌈R/N⌉, …) contiguous, zero rows appended if R is not a multiple of N."""
        extra = self.shard_rows * self.n - self.rows
        return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) if extra else t.contiguous()


def split_params(module: nn.Module, rank: int, n: int, ignored: frozenset[int] = frozenset()):
    """-> ([(owner module, attribute, Unit)], [(owner, attribute, replicated Parameter)]), in
    module-registration order. A tied parameter (the same object in two modules) is one Unit.
    ``ignored``: ids of parameters left alone (neither split nor replicated: their owner reduces them)."""
    units, replicated, seen = [], [], {}
    for owner in module.modules():
        for attr, p in list(owner._parameters.items()):
            if p is None or id(p) in ignored:
                continue
            if p.dim() < 2:
                replicated.append((owner, attr, p))
                continue
            if id(p) not in seen:
                seen[id(p)] = Unit(p, rank, n)
            owner._parameters[attr] = seen[id(p)].shard  # same key, same position: names unchanged
            units.append((owner, attr, seen[id(p)]))
    return units, replicated


def gather_full(unit: Unit, t: torch.Tensor, group) -> torch.Tensor:
    """A (⌈R/N⌉, …) shard (parameter or gradient) -> the full (R, …) tensor (synchronous)."""
    buf = t.new_empty((unit.shard_rows * unit.n, *t.shape[1:]))
    dist.all_gather_single(buf, t.detach().contiguous(), group=group)
    return buf[:unit.rows]


def average_flat(tensors: list[torch.Tensor], group) -> None:
    """One all-reduce of every replicated gradient, flattened; then / N (sum first: see the docstring)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])  # ((2L+1)·D,) for the transformer
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))
    recipe.refresh(tensors)


# --- explicit/zero2 ----------------------------------------------------------------------------


class Zero2:
    """ZeRO-2 over any module: full params on every rank; each matrix's gradient is reduce-
    scattered the moment autograd has accumulated it (a post-accumulate-grad hook), so the full
    gradient never exists all at once; ``params`` (row shards + replicated vectors) go to the
    optimizer; ``all_gather_params()`` after its step puts the updated rows back. Frozen
    parameters are skipped (no hook, no shard, not in ``params``). It never sees the batch: equal
    local batches are the caller's (``dp.local_batch`` refuses B % N)."""

    def __init__(self, module: nn.Module, group=None):
        refuse_split_experts(module.named_parameters(), "Zero2")
        self.module, self.group = module, group if group is not None else dist.group.WORLD
        self.n, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.names, self.params, self.units, self._pending = [], [], {}, []
        self.require_sync = True
        self._infos = theory.describe(module)
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue  # frozen: no gradient to reduce, nothing to update (as BucketedDDP / Zero1 / FSDP)
            self.names.append(name)
            if p.dim() < 2:
                self.params.append(p)  # replicated vector: its optimizer state is full too
                continue
            unit = Unit(p, rank, self.n)
            unit.full = p  # (R, …) the parameter the model computes with
            self.units[name] = unit
            self.params.append(unit.shard)
            p.register_post_accumulate_grad_hook(lambda p, u=unit: self._reduce_scatter(u, p))
        recipe.refuse_stale({n: u.full for n, u in self.units.items()}, "Zero2",
                            "build the optimizer (and its param groups) from Zero2's named_parameters() / params")

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """Per step per rank (theory.zero2_comm): a reduce-scatter and an all-gather per
        trainable unit (rows padded to N), one all-reduce of the trainable vectors."""
        comm = theory.zero2_comm(self._infos, self.n)  # + the norm's scalar all-reduce if the last step clipped
        return recipe.with_clip(comm, self.params[0].dtype.itemsize, getattr(self, "clipped", False))

    def state_theory(self) -> dict[str, int]:
        return theory.zero2_state(self._infos, self.n)

    def named_parameters(self):
        """(name, what the optimizer gets) in the module's order: row shards of the matrices (still
        >= 2-D, so ``p.dim() >= 2`` masks work), the vectors themselves. Build param groups (decay
        masks) from THIS, not from ``module.named_parameters()``: those full matrices get no gradient."""
        return list(zip(self.names, self.params))

    def _reduce_scatter(self, unit: Unit, p: nn.Parameter) -> None:
        if not self.require_sync:
            return  # no_sync(): p.grad keeps accumulating on the full matrix, unsent
        out = torch.empty_like(unit.shard)  # (⌈R/N⌉, …)
        g = unit.pad(p.grad)
        self._pending.append((unit, out, dist.reduce_scatter_single(out, g, group=self.group, async_op=True), g))
        p.grad = None  # the full gradient is not kept

    def finish_gradient_synchronization(self) -> None:
        """shard.grad += Σ ranks / N for every reduce-scatter of this step (ADDS: micro-batches
        reduced one by one accumulate), then the vectors' one flat all-reduce."""
        if not self.require_sync:
            return
        self.check_optimizer_params()
        for unit, out, work, _ in self._pending:
            work.wait()
            out.div_(self.n)
            unit.shard.grad = out if unit.shard.grad is None else unit.shard.grad.add_(out)
        self._pending.clear()
        average_flat([p.grad for p in self.params if p.dim() < 2 and p.grad is not None], self.group)
        recipe.seal([p.grad for p in self.params], "Zero2", "clip with z.clip_grad_norm_(max_norm) (the global "
                    "norm) after finish_gradient_synchronization()")

    def check_optimizer_params(self) -> None:
        """Refuse a full matrix still holding a gradient at the synchronisation: the last backward
        ran inside no_sync(), so nothing was reduced."""
        for name, unit in self.units.items():
            if unit.full.grad is not None:
                raise RuntimeError(f"Zero2: {name!r} {tuple(unit.shape)} kept a full gradient: its backward ran "
                                   "inside no_sync() with no synced backward after it. Fix: run the last "
                                   "micro-batch's backward outside no_sync()")

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication: matrices' gradients accumulate on the full
        parameters (the first backward outside reduce-scatters their sum); vectors' in p.grad."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """After ``finish_gradient_synchronization()``: the global norm (shards' squares all-reduced,
        the replicated vectors once) and every gradient the optimizer sees clipped by it."""
        shards = [u.shard.grad for u in self.units.values()]
        vectors = [p.grad for p in self.params if p.dim() < 2]
        self.clipped = True
        return recipe.clip_(shards, vectors, max_norm, self.group, self.params[0].dtype)

    def all_gather_params(self) -> None:
        works = []
        for unit in self.units.values():
            buf = unit.shard.new_empty((unit.shard_rows * self.n, *unit.shape[1:]))
            works.append((unit, buf, dist.all_gather_single(buf, unit.shard.detach(), group=self.group,
                                                            async_op=True)))
        with torch.no_grad():
            for unit, buf, work in works:
                work.wait()
                unit.full.copy_(buf[:unit.rows])

