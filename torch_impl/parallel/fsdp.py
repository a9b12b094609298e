"""The hand-written ZeRO wrappers, for ANY nn.Module (ZeRO: Rajbhandari et al. 2020,
arXiv:1910.02054; FSDP: Zhao et al. 2023, arXiv:2304.11277). The runner torch_impl/fsdp.py's
docstring has the collectives and the bytes per step.

    model = FSDP(module)          # ZeRO-3: parameters, gradients and AdamW state sharded by rows
    model = Zero2(module)         # ZeRO-2: full parameters; gradients and AdamW state sharded (parallel/zero.py)

One rule for every model: each parameter with >= 2 dims is a ``Unit`` split along dim 0 (padded to a
multiple of N) so all_gather_single / reduce_scatter_single work on contiguous rows; vectors (norm
gains, biases) stay replicated and their gradients are averaged by ONE flat all-reduce. A parameter
must be read inside the forward of a module that holds it: a read elsewhere while the wrapped
forward runs raises ``ShardReadError`` naming it and the remedy. Frozen parameters are gathered,
never reduce-scattered. ``comm_theory()`` / ``state_theory()`` come from the module wrapped
(parallel/theory.py), so "vs theory" holds for a model the project does not own.

The recipe (docs/recipe.md, "## torch"): ``clip_grad_norm_(max_norm)`` after
``finish_gradient_synchronization()`` clips by the global norm (shards' squares all-reduced, vectors
once: parallel/recipe.py); ``no_sync()`` accumulates micro-batches with one reduction per step;
reductions of several backward passes ADD; an optimizer holding a full matrix the wrapper replaced
is refused at its first step (recipe.refuse_stale).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_impl.parallel import recipe, theory
from torch_impl.parallel.dp import check_even_batch
from torch_impl.parallel.ep import refuse_split_experts
from torch_impl.parallel.zero import Unit, Zero2, average_flat, gather_full, split_params  # noqa: F401 (Zero2: users import it from here)

# --- explicit/zero3: the wrapper ---------------------------------------------------------------


class _Gathered(torch.autograd.Function):
    """shard -> the full weight this rank just gathered. Backward reduce-scatters the full
    weight's gradient into the shard asynchronously; the shard's .grad is set by
    ``FSDP.finish_gradient_synchronization`` (the reduce-scatter is still in flight here)."""

    @staticmethod
    def forward(ctx, shard, fsdp, unit):
        ctx.fsdp, ctx.unit = fsdp, unit
        return fsdp._wait(unit)[:unit.rows]  # (R, …) view into the gathered buffer

    @staticmethod
    def backward(ctx, grad):  # grad: (R, …) in the compute dtype
        ctx.fsdp._reduce_scatter(ctx.unit, grad)
        return None, None, None


class _Handle:
    """What autograd saves instead of a gathered weight: which unit, and the view it used."""

    def __init__(self, unit, t):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


class ShardReadError(RuntimeError):
    """A sharded parameter was read outside the forward of the module that holds it."""


def _find_guard(obj):
    if isinstance(obj, _ShardOnly):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return next((g for g in map(_find_guard, items) if g is not None), None)


class _ShardOnly:
    """What ``owner.<attr>`` is while FSDP runs the wrapped module's forward but not the owner's:
    the shard is all there is, so every use (a torch op, ``.shape``, indexing) raises
    ``ShardReadError`` naming the parameter and the remedy, instead of computing with 1/N of it."""

    def __init__(self, message: str):
        object.__setattr__(self, "_message", message)

    def __getattr__(self, name):
        raise ShardReadError(self._message)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise ShardReadError(_find_guard([args, kwargs or {}])._message)

    def __repr__(self):
        return f"<FSDP shard guard: {self._message}>"


def _raise_read(self, *args, **kwargs):
    raise ShardReadError(self._message)


for _name in ("__getitem__", "__len__", "__iter__", "__bool__", "__float__", "__int__", "__index__", "__array__",
              "__neg__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__matmul__",
              "__rmatmul__", "__truediv__", "__rtruediv__", "__pow__"):
    setattr(_ShardOnly, _name, _raise_read)


class FSDP(nn.Module):
    """Fully sharded data parallel over any ``nn.Module`` (see the module docstring).

    ``FSDP(module, compute_dtype=None, group=None, ignored_params=None)``: ``.module`` is the wrapped module, whose
    named_parameters() are now the shards (matrices) and the replicated vectors — give those to
    the optimizer. Call ``finish_gradient_synchronization()`` between ``backward()`` and
    ``optimizer.step()``. ``full_state_dict()`` returns {name: full tensor} keyed like
    ``module.named_parameters()``. ``compute_dtype`` (bfloat16 / float16): every weight is cast
    before its all-gather (half the bytes) and the forward runs in it (float inputs cast too, as
    FSDP2's MixedPrecisionPolicy does); master weights, gradients (reduce-scattered in the master
    dtype, FSDP2's reduce_dtype=float32) and the optimizer stay in the parameters' dtype.
    ``ignored_params`` (FSDP2's): left whole and unreduced, their gradients the caller's (compose's experts).
    Every rank must start from the same module (build it from the same fixture or seed).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, group=None,
                 ignored_params: set[nn.Parameter] | None = None):
        super().__init__()
        if any(isinstance(m, FSDP) for m in module.modules()):
            raise ValueError("FSDP: this module is already wrapped by FSDP (or holds an FSDP inside); its "
                             "parameters are shards already. Fix: wrap the plain module once")
        ignored = frozenset(id(p) for p in ignored_params or ())  # FSDP2's ignored_params: not sharded, not reduced
        refuse_split_experts(((n, p) for n, p in module.named_parameters() if id(p) not in ignored), "FSDP")
        self.module, self.compute_dtype = module, compute_dtype
        self.group = group if group is not None else dist.group.WORLD
        self.n, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        skipped = {n for n, p in module.named_parameters() if id(p) in ignored}
        self._infos = [i for i in theory.describe(module) if i.name not in skipped]  # full shapes: comm_theory()
        originals = {name: p for name, p in module.named_parameters() if p.dim() >= 2 and id(p) not in ignored}
        self.units, self.replicated = split_params(module, rank, self.n, ignored)
        recipe.refuse_stale(originals, "FSDP", "build the optimizer (and its param groups) AFTER wrapping, from "
                            "fsdp.module.named_parameters() (the shards keep the names)")
        self.unit_of_name = {}  # parameter name -> Unit (shards keep their original names)
        shard_ids = {id(u.shard): u for _, _, u in self.units}
        for name, p in module.named_parameters(remove_duplicate=False):  # a tied weight: every name
            if id(p) in shard_ids:
                self.unit_of_name[name] = shard_ids[id(p)]
        owners = {id(o): o for o, _, _ in self.units}
        paths = {id(m): path for path, m in module.named_modules()}
        self._guards = [(o, attr, _ShardOnly(self._read_message(paths.get(id(o), "?"), o, attr, u)))
                        for o, attr, u in self.units]
        if compute_dtype is not None:
            owners |= {id(o): o for o, _, _ in self.replicated}
        for owner in owners.values():  # one pre/post hook pair per module that owns parameters
            owner.register_forward_pre_hook(self._pre_forward)
            owner.register_forward_hook(self._post_forward)
        self._inflight = {}  # Unit -> (buffer, work, source): all-gathers started, not yet waited for
        self._fwd_order = [u for _, _, u in self.units]  # first step: registration order
        self._pending = []  # reduce-scatters in flight: (unit, out, work, input)
        self._forwarding = False  # inside forward(); False while backward recomputes a checkpointed block
        self.require_sync = True  # False inside no_sync(): full gradients accumulate locally, unsent
        self._held = {}  # Unit -> (N·⌈R/N⌉, …) full local gradient summed over no_sync() micro-batches

    def _read_message(self, path: str, owner: nn.Module, attr: str, unit: Unit) -> str:
        name = f"{path}.{attr}" if path else attr
        return (f"FSDP: parameter {name!r} {tuple(unit.shape)} was read outside the forward of the module that "
                f"holds it ({path or 'the root'!r}, {type(owner).__name__}), e.g. F.linear(h, self.{name}) in a "
                f"parent's forward (a tied-weight idiom). FSDP gathers a parameter only while its module runs: "
                f"here it is this rank's ({unit.shard_rows}, …) shard of {unit.n}, and any result would be wrong. "
                f"Fix: make the reader a module that holds the parameter, e.g. tie it (head = nn.Linear(...); "
                f"head.weight = self.{name}; logits = head(h)), or compute inside the forward of "
                f"{path or 'its module'!r}")

    def _guard(self, on: bool) -> None:
        """Install (on) or remove the shard guards of every unit in its owners' instance dicts."""
        for owner, attr, guard in self._guards:
            if on:
                owner.__dict__[attr] = guard
            elif owner.__dict__.get(attr) is guard:
                del owner.__dict__[attr]

    # all-gathers with prefetch
    def _start(self, unit: Unit) -> None:
        if unit in self._inflight:
            return
        src = unit.shard.detach()
        if self.compute_dtype is not None:
            src = src.to(self.compute_dtype)  # cast BEFORE the gather: b_compute bytes on the wire
        buf = src.new_empty((unit.shard_rows * self.n, *src.shape[1:]))  # (N·⌈R/N⌉, …)
        self._inflight[unit] = (buf, dist.all_gather_single(buf, src, group=self.group, async_op=True), src)

    def _wait(self, unit: Unit) -> torch.Tensor:
        self._start(unit)  # nothing to do when prefetched
        buf, work, _ = self._inflight.pop(unit)
        work.wait()
        return buf

    def _prefetch_after(self, order: list, unit: Unit, pos: int) -> int:
        """Start the gather of the unit after ``unit`` in ``order``; returns the new position."""
        while pos < len(order) and order[pos] is not unit:
            pos += 1
        if pos + 1 < len(order):
            self._start(order[pos + 1])
        return pos + 1

    # forward: hooks on the modules that own units
    def _pre_forward(self, owner, args):
        for o, attr, unit in self.units:
            if o is owner and not self._forwarding:  # activation recomputation in backward (a checkpointed
                # block runs again): gather, no prefetch, no bookkeeping; its saves go to the checkpoint
                owner.__dict__[attr] = _Gathered.apply(unit.shard, self, unit)
            elif o is owner:
                full = _Gathered.apply(unit.shard, self, unit)  # (R, …), compute dtype
                self._fwd_pos = self._prefetch_after(self._fwd_order, unit, self._fwd_pos)
                self._seen.append(unit)
                self._live[full.untyped_storage().data_ptr()] = unit
                owner.__dict__[attr] = full  # found before nn.Module.__getattr__'s _parameters
        for o, attr, p in self.replicated if self.compute_dtype is not None else ():
            if o is owner:
                owner.__dict__[attr] = p.to(self.compute_dtype)  # differentiable: grad in p.dtype

    def _post_forward(self, owner, args, out):
        for attr in [a for o, a, _ in self.units + self.replicated if o is owner and a in owner.__dict__]:
            full = owner.__dict__.pop(attr)  # the full weight is dropped
            if isinstance(full, torch.Tensor):
                self._live.pop(full.untyped_storage().data_ptr(), None)
        if self._forwarding:  # until the wrapped forward ends, a read of the shard raises
            for o, attr, guard in self._guards:
                if o is owner:
                    owner.__dict__[attr] = guard

    # backward: saved-tensor hooks turn every saved gathered weight into a re-gather
    def _pack(self, t: torch.Tensor):
        unit = self._live.get(t.untyped_storage().data_ptr())
        if unit is None:
            return t
        if unit not in self._saves:
            self._saves[unit] = 0
        self._saves[unit] += 1
        return _Handle(unit, t)

    def _unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        unit = h.unit
        if unit not in self._regathered:  # first use in backward: wait (prefetched) and prefetch next
            self._regathered[unit] = self._wait(unit)
            self._bwd_pos = self._prefetch_after(self._bwd_order, unit, self._bwd_pos)
        buf = self._regathered[unit]
        self._saves[unit] -= 1
        if self._saves[unit] == 0:
            del self._regathered[unit]  # freed once the op that unpacked it is done
        return buf.as_strided(h.size, h.stride, h.offset)

    def forward(self, *args, **kwargs):
        check_even_batch(args, kwargs, self.group, "FSDP")  # every rank as many rows (dp.py)
        if self.compute_dtype is not None:
            args = [a.to(self.compute_dtype) if torch.is_floating_point(a) else a for a in args]
        self._fwd_pos, self._seen, self._live, self._saves, self._regathered = 0, [], {}, {}, {}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            self._forwarding = True
            self._guard(True)
            try:
                out = self.module(*args, **kwargs)
            finally:
                self._forwarding = False
                self._guard(False)
        for unit in list(self._inflight):  # a prefetch nobody used (the order changed): finish it
            self._wait(unit)
        self._fwd_order = self._seen  # next step prefetches in the order this forward ran
        self._bwd_order, self._bwd_pos = list(reversed(self._saves)), 0  # re-gathers: reverse order
        return out

    def _reduce_scatter(self, unit: Unit, grad: torch.Tensor) -> None:
        g = unit.pad(grad.to(unit.shard.dtype))  # (N·⌈R/N⌉, …) reduced in the master dtype
        if unit in self._held:
            g = g + self._held.pop(unit)  # the no_sync() micro-batches' sum joins this reduction
        if not self.require_sync:
            self._held[unit] = g  # FSDP's no_sync: the full (unsharded) gradient is kept, nothing sent
            return
        out = torch.empty_like(unit.shard)  # (⌈R/N⌉, …)
        work = dist.reduce_scatter_single(out, g, group=self.group, async_op=True)
        self._pending.append((unit, out, work, g))  # g must live until the work is done

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter (shard.grad = Σ ranks / N; accumulates over calls) and
        average the replicated vectors' gradients with one flat all-reduce."""
        if not self.require_sync:
            return  # inside no_sync(): the vectors' gradients accumulate in p.grad, unsent
        if self._held:
            raise RuntimeError("FSDP: the last backward ran inside no_sync(), so its gradients were never reduced. "
                               "Fix: run the last micro-batch's backward outside the no_sync() block")
        for unit, out, work, _ in self._pending:
            work.wait()
            out.div_(self.n)
            unit.shard.grad = out if unit.shard.grad is None else unit.shard.grad.add_(out)
        self._pending.clear()
        average_flat([p.grad for _, _, p in self.replicated if p.grad is not None], self.group)
        recipe.seal([u.shard.grad for _, _, u in self.units] + [p.grad for _, _, p in self.replicated], "FSDP",
                    "clip with w.clip_grad_norm_(max_norm) (the global norm) after finish_gradient_synchronization()")

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication (torch FSDP's no_sync): backward passes inside
        keep each unit's full local gradient (the memory of an unsharded gradient); the first
        backward outside reduce-scatters their sum with its own. Exact: the reduction is linear."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """After ``finish_gradient_synchronization()``: the global norm (torch's clip_grad_norm_ on
        one process) — units' shards' squares all-reduced (their padding rows are zero), the
        replicated vectors counted once — and every gradient clipped by it. One scalar all-reduce."""
        units = {id(u): u for _, _, u in self.units}.values()  # a tied unit once
        self.clipped = True
        return recipe.clip_([u.shard.grad for u in units], [p.grad for _, _, p in self.replicated],
                            max_norm, self.group, self._dtype())

    def _dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.module.parameters())

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """Per step per rank, from the module wrapped (theory.zero3_comm): an all-gather per
        holder of each unit in forward, a reduce-scatter per holder of each trainable one, one
        all-reduce of the trainable vectors, and a re-gather in backward of each unit whose weight
        the last forward kept for backward (before any forward: every unit not held by an
        nn.Embedding — theory.default_regathered)."""
        regathered = None
        if hasattr(self, "_bwd_order"):
            names = {}
            for name, u in self.unit_of_name.items():  # a tied unit: its first name (theory's)
                names.setdefault(id(u), name)
            regathered = [names[id(u)] for u in self._bwd_order if id(u) in names]
        itemsize = torch.empty((), dtype=self.compute_dtype).element_size() if self.compute_dtype else None
        comm = theory.zero3_comm(self._infos, self.n, regathered, itemsize)
        return recipe.with_clip(comm, self._dtype().itemsize, getattr(self, "clipped", False))

    def state_theory(self) -> dict[str, int]:
        """Per rank with AdamW: shards of every unit (⌈R/N⌉ rows), vectors whole; gradients and 2
        moments of the trainable ones (theory.zero3_state)."""
        return theory.zero3_state(self._infos, self.n)

    def full_tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's tensor of parameter ``name`` (shard or replicated; parameter or gradient)
        -> the full tensor (an all-gather for units: call on every rank)."""
        unit = self.unit_of_name.get(name)
        return gather_full(unit, t, self.group) if unit is not None else t.detach().clone()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole under every name it has (a tied weight under each: ``load_state_dict``
        of the model takes it, strict)."""
        return {name: self.full_tensor(name, p) for name, p in self.module.named_parameters(remove_duplicate=False)}
