"""The parts of a training recipe that a sharded layout changes, for every wrapper and plan of this
package: the GLOBAL gradient norm and clipping by it (what ``torch.nn.utils.clip_grad_norm_``
computes on one process, wherever the gradient lives). docs/recipe.md ("## torch") has what a user
writes per wrapper for clipping, decay masks, frozen parameters, schedules and accumulation.

    total = clip_(sharded, replicated, max_norm, group)   # the hand-written layouts
    total = clip_dtensor_(params, max_norm)               # DTensors (FSDP2, DTensor TP) + plain tensors
    refuse_stale(params_by_name, wrapper, fix)           # an optimizer over parameters a wrapper replaced
    scaler = LossScaler(group)                            # float16: dynamic loss scaling, the skip AGREED
    seal(grads, wrapper, fix); refresh(grads)            # refuse a gradient changed in place before the step

The global norm: ‖g‖ = sqrt(Σ_ranks Σ_{sharded} g² + Σ_{replicated} g²) — the sums of squares of the
local shards all-reduced over the group that shards them, a parameter replicated over that group
(norm gains and rowwise biases under tp, vectors under ZeRO, tied weights held once) counted ONCE
(Megatron-LM's rule, Shoeybi et al. 2019, ``clip_grad_norm_fp32``), pipeline stages summed (each
stage's parameters are "sharded" over the pp group). Then torch's formula: every gradient times
min(1, max_norm / (‖g‖ + 1e-6)). Collective: ONE all-reduce of a scalar per group (b bytes;
``clip_comm``), which the ledger records as it records every c10d call.

Dynamic loss scaling (float16; Micikevicius et al. 2018): ``LossScaler`` has torch.amp.GradScaler's
API (scale, unscale_, step, update, get_scale) and defaults. Sharded, each rank unscales only ITS
gradients (shards, slices, a stage's), so an overflow may show on one rank only: the found-inf flag
is all-reduced (MAX) over the group that shards them (default: the world) — ONE all-reduce of one
float32 (4 bytes; ``scaler_comm``) per step — and every rank skips the same steps (the optimizer and
the LR schedule not stepped), as FSDP's ShardedGradScaler does. DTensor gradients (FSDP2, DTensor TP)
are unscaled on their local tensors, so DTensor adds no collective of its own. Ours everywhere, not
torch's, because (torch 2.13, checked on 2 gloo ranks with an inf on rank 1 only): torch.amp.GradScaler
reduces nothing itself — DTensor's handler of its unscale kernel (torch/distributed/tensor/_dispatch.py
``found_inf_reduce_handler``) all-reduces the flag over the mesh of the FIRST gradient of each (device,
dtype) list, and only if that one is not Replicate. So it agrees under FSDP2 (every gradient Shard(0))
and a DTensor plan whose first gradient is sharded, but NOT when a replicated gradient (a rowwise bias)
comes first: rank 0 stepped at scale 2^16 while rank 1 skipped; plain tensors (ZeRO, our TP, pp stages)
are never agreed. ShardedGradScaler agrees over its process group in all three DTensor cases (and both crashed on
a mix of DTensor and plain parameters, "got mixed torch.Tensor and DTensor", which
apply_dtensor_plan no longer leaves: tp.replicate_unplanned). One rule for every layout: ours.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

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
    tensors (compose's builtin tp, ``apply_dtensor_plan(..., replicate_rest=False)``, leaves unplanned
    parameters plain: replicated over the mesh, equal on every rank, so counted once). DTensor norms
    are reduced by DTensor itself (its Partial → Replicate all-reduce); the result is a plain 0-dim
    tensor."""
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


# --- dynamic loss scaling (float16) ---------------------------------------------------------------


def scaler_comm(applied: bool = True) -> dict[str, tuple[int, int]]:
    """The found-inf flag's collective per optimizer step per rank: one all-reduce of one float32."""
    return {"all_reduce": (1, 4)} if applied else {}


def add_comm(comm: dict[str, tuple[int, int]], more: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Two comm_theory tables added op by op."""
    out = dict(comm)
    for op, (k, b) in more.items():
        k0, b0 = out.get(op, (0, 0))
        out[op] = (k0 + k, b0 + b)
    return out


def _flag_device(group) -> torch.device:
    """Where a rank without gradients keeps its flag: the device its backend reduces (NCCL: the GPU)."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class LossScaler:
    """torch.amp.GradScaler's dynamic loss scaling with the skip decision agreed over ``group``::

        scaler = LossScaler(group)                 # init 2**16, growth 2, backoff 0.5, interval 2000
        scaler.scale(loss).backward()              # per micro-batch
        wrapper.finish_gradient_synchronization()  # the wrapper's reduction, as without scaling
        scaler.unscale_(opt)                       # true gradients; found-inf all-reduced (MAX)
        wrapper.clip_grad_norm_(1.0)               # optional: clips the true gradients
        if scaler.step(opt) is not None: sched.step()   # None: skipped on EVERY rank
        scaler.update()                            # backoff after a skip, growth after ``interval``

    ``unscale_`` divides the gradients of ``optimizer``'s params (``grads=`` other tensors, e.g. a
    wrapper's shards) in place; a Zero1Optimizer's reduce-scatter is done first if not yet.
    ``reduce=False``: a local decision (one process: a reference run). ``skipped``: the last
    ``update``'s step was skipped; ``skipped_steps``: how many so far, ``skipped_at``: which (0 = the
    first ``update``). ``share`` N: each rank's loss is a local mean whose gradients the wrapper
    AVERAGES over N ranks (dp, FSDP, cp): ``scale`` then multiplies by scale/N and ``unscale_`` by N/scale
    (exact for N a power of 2), so each rank's float16 gradients have one process's magnitude — the same
    overflows as the single-device run (with scale alone they are N× larger: an overflow one process does not
    see)."""

    def __init__(self, group=None, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, reduce: bool = True, share: int = 1):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1 and init_scale > 0):
            raise ValueError(f"LossScaler: needs growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1, "
                             f"init_scale > 0 (got {growth_factor}, {backoff_factor}, {growth_interval}, {init_scale})")
        self.group, self.reduce, self.share = group, reduce, share
        self._scale, self.growth, self.backoff, self.interval = float(init_scale), growth_factor, backoff_factor, \
            growth_interval
        self._tracker, self._found = 0, {}  # finite steps in a row; id(optimizer) -> agreed found-inf
        self.skipped, self.skipped_steps = False, 0
        self.updates, self.skipped_at = 0, []  # update() calls so far; the indices of the skipped ones

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` · scale (/ share; backward of it gives the scaled gradients)."""
        return loss * (self._scale / self.share)

    @torch.no_grad()
    def unscale_(self, optimizer=None, grads: Iterable[torch.Tensor | None] | None = None) -> bool:
        """Divide this rank's gradients by the scale; returns the AGREED found-inf (any rank, any
        gradient). Call once per step, on every rank of the group, after the gradient reduction."""
        key = id(optimizer)
        if key in self._found:
            raise RuntimeError("LossScaler.unscale_: already called for this optimizer since the last update()")
        if grads is None:
            if hasattr(optimizer, "reduce_gradients") and not getattr(optimizer, "_reduced", True):
                optimizer.reduce_gradients()  # Zero1Optimizer: the averaged slices are the gradients
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
        grads = list(grads)
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads if g is not None]
        device = local[0].device if local else _flag_device(self.group)
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), self.share / self._scale, dtype=torch.float32, device=device)  # 2^k: exact
        by_kind: dict = {}
        for g in local:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), gs in by_kind.items():
            f = torch.zeros(1, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(gs, f, inv.to(dev))  # torch's kernel: g *= inv
            found = torch.maximum(found, f.to(device))
        refresh(grads)  # the project's own in-place edit (seal: the wrappers' gradients as they produced them)
        refresh(local)
        if self.reduce and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)  # every rank: the same decision
        self._found[key] = bool(found.item())
        return self._found[key]

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step()`` unless a gradient anywhere was inf/NaN (then None: skipped everywhere)."""
        if id(optimizer) not in self._found:
            self.unscale_(optimizer)
        return None if self._found[id(optimizer)] else (optimizer.step(*args, **kwargs) or True)

    def update(self) -> None:
        """After a skip: scale · backoff, count reset; after ``interval`` finite steps: scale · growth."""
        self.skipped = any(self._found.values())
        self._found = {}
        if self.skipped:
            self._scale, self._tracker = self._scale * self.backoff, 0
            self.skipped_steps += 1
            self.skipped_at.append(self.updates)
        else:
            self._tracker += 1
            if self._tracker == self.interval:
                self._scale, self._tracker = self._scale * self.growth, 0
        self.updates += 1

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self._scale, self._tracker = float(state["scale"]), int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
# --- torch's own clip_grad_norm_ over a rank's pieces: refused at the step ---------------------------------


class LocalClipError(RuntimeError):
    """A gradient a sharded layout handed the optimizer was changed in place before the step."""


_SEALS: dict[int, tuple] = {}  # id(grad) -> (weakref(grad), its _version when sealed, wrapper, fix)
_HOOKED: list[bool] = []
_IN_SEALED_STEP = [0]  # sealed_step checks its own step (and can undo it): the global post-hook stands aside


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
        held = lambda opt: (p.grad for group in opt.param_groups for p in group["params"])  # noqa: E731
        register_optimizer_step_pre_hook(lambda opt, args, kw: check_sealed(held(opt)))
        # a clip the global pre-hook cannot see (it runs before the optimizer's own pre-hooks and step()): after
        register_optimizer_step_post_hook(lambda opt, args, kw: None if _IN_SEALED_STEP[0] else
                                          check_sealed(held(opt), after=True))
        _HOOKED.append(True)


def refresh(grads: Iterable[torch.Tensor | None]) -> None:
    """The project changed these gradients in place on purpose: the sealed versions follow."""
    for g in grads:
        entry = _SEALS.get(id(g)) if g is not None else None
        if entry is not None and entry[0]() is g:
            _SEALS[id(g)] = (entry[0], g._version, *entry[2:])


def check_sealed(grads: Iterable[torch.Tensor | None], after: bool = False) -> None:
    """``after``: called after the optimizer's step (its own pre-hooks and ``step()`` ran, and updated)."""
    for g in grads:
        entry = _SEALS.get(id(g)) if g is not None else None
        if entry is not None and entry[0]() is g and g._version != entry[1]:
            where = " (found after the optimizer's step, whose update used it: a clip in the optimizer's own step " \
                "pre-hook or step(); stop this run)" if after else ""
            raise LocalClipError(
                f"{entry[2]}: a gradient {tuple(g.shape)} was changed in place after {entry[2]} produced it and before "
                "the optimizer step — torch.nn.utils.clip_grad_norm_ over what this rank holds computes the LOCAL "
                "norm (not the model's: silently wrong), and any other in-place edit would miss the layout. Fix: "
                f"{entry[3]}{where}")


# --- the step a trainer makes for its user (pp, compose): a clip inside the user's optimizer --------------


def _fingerprint(g: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient's local norm: DTensor's in-place ops bump no version counter (checked, torch 2.13)."""
    return torch.linalg.vector_norm(g.to_local().detach(), 2)


@torch.no_grad()
def sealed_step(optimizer, params: list[torch.Tensor], wrapper: str, fix: str, undo: bool = False) -> None:
    """``optimizer.step()`` for a trainer that steps inside its own ``train_step`` (pp.pipeline, compose),
    where the gradients are a stage's or a rank's pieces: torch's ``clip_grad_norm_`` in the user's
    optimizer — a step pre-hook, or a subclass whose ``step()`` clips before ``super().step()`` — would
    scale them by a LOCAL norm (each stage its own: silently wrong). The gradients are sealed as the trainer
    made them; a pre-hook registered after the user's checks them before the update; a change made
    inside ``step()`` itself is found after it: ``LocalClipError``. ``undo`` (the first step): the
    parameters and the optimizer state are put back first, so nothing trained."""
    grads = [p.grad for p in params if p.grad is not None]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    dts = [g for g in grads if isinstance(g, DTensor)]
    seal(plain, wrapper, fix)
    prints = [_fingerprint(g) for g in dts]

    def check(*_):
        check_sealed(plain)
        for g, n in zip(dts, prints):
            if not torch.equal(_fingerprint(g), n):
                raise LocalClipError(
                    f"{wrapper}: a gradient {tuple(g.shape)} was changed in place after {wrapper} produced it and "
                    "before the optimizer step — torch.nn.utils.clip_grad_norm_ over what this rank holds computes "
                    f"a LOCAL norm (not the model's: silently wrong). Fix: {fix}")

    saved = None
    if undo:
        saved = ([p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict()))
    handle = optimizer.register_step_pre_hook(check)  # after the user's hooks: they run first
    _IN_SEALED_STEP[0] += 1
    try:
        optimizer.step()
    finally:
        handle.remove()
        _IN_SEALED_STEP[0] -= 1
    try:
        check()
    except LocalClipError as e:
        if saved is None:
            raise LocalClipError(f"{e} (found after this step's update, which used it)") from None
        for p, w in zip(params, saved[0]):
            p.copy_(w)
        optimizer.load_state_dict(saved[1])
        raise LocalClipError(f"{e} (inside the optimizer's step(); its update was undone)") from None
