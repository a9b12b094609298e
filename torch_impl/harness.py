"""Rank-side driver: train every (style, variant) of one pattern for a list of configs inside
one launch, so a test module or compare.py pays the process start-up once.

    from torch_impl.launch import launch
    from torch_impl.harness import run_pattern
    out = launch(run_pattern, 4, "dp", [cfg64, cfg32])[0]   # rank 0's answer

Pattern modules (``torch_impl/dp.py`` …) provide
``VARIANTS: tuple[(style, variant), …]`` and
``train(cfg, problem, style, variant, ctx) -> Trained`` (called on every rank; the returned
``Trained`` holds full, gathered arrays on rank 0 at least). A pattern's ``train`` builds a
``Setup`` (what is specific to it) and hands it to ``train_loop``, the one training loop every
pattern and model goes through: steps, timing, the ledger of the last step, the reported loss,
step-0 gradients, final parameters and state bytes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shared import preempt
from shared.checkpoint import Plan
from shared.config import Config
from shared.problem import make_problem
from shared.results import Trained, floor_extra, mixed_extra, needs_floor
from torch_impl import checkpoint as ckpt
from torch_impl import reference
from torch_impl.compiled import CompiledRun
from torch_impl.launch import RankContext
from torch_impl.model import autocast, optimizer_state_bytes, tensor_bytes


@dataclass
class Setup:
    """One pattern's training step, cut where the shared loop needs to look in.

    forward_backward: forward, backward and gradient synchronisation of one step; returns this
        rank's loss (a 0-d tensor) as ``loss_reduction`` says to read it.
    update: the optimizer step (and whatever the pattern does after it, e.g. an all-gather).
    grads: this rank's gradient tensors after ``forward_backward`` (local shards), in the order
        of ``params``; the loop clones them at step 0.
    fixture: local tensors (``params`` or ``grads()``, same order) -> full float64 fixture-
        orientation arrays in shared.problem.param_names order; may run collectives (it is called
        on every rank, outside the ledger); only rank 0's answer is used.
    grads_fixture: the same for ``grads()`` when its tensors are laid out unlike ``params``
        (e.g. ZeRO-1's flat gradient slice); default: ``fixture``.
    loss_reduction: "mean" (each rank's loss is the mean over its share of the batch: average over
        ``group``), "same" (every rank already holds the global loss), or "src:R" (rank R of the
        world holds it: broadcast, e.g. a pipeline's last stage).
    state: per-rank bytes {params, grads, optimizer}; default: tensor_bytes(params),
        tensor_bytes(grads()), optimizer_state_bytes(optimizer).
    before_step: called before every step, outside the timer and the ledger (e.g. a barrier
        that gives every rank's pipeline timeline a common start).
    compiled: the ``compiled`` style: the module paths compiled; the loop then runs the step as
        torch_impl.compiled.CompiledRun says (first step compiles, later ones must not recompile).
    scaler: --dtype float16: the run's LossScaler (torch_impl/recipe.loss_scaler), which
        ``forward_backward`` scales by and ``update`` unscales / skips with; the loop records its final
        scale and skipped steps (``extra["loss_scale"]``, ``extra["skipped_steps"]``).
    """

    forward_backward: Callable[[], torch.Tensor]
    update: Callable[[], None]
    grads: Callable[[], list[torch.Tensor]]
    fixture: Callable[[list[torch.Tensor]], list[np.ndarray]]
    params: list[torch.Tensor]
    optimizer: Any
    comm_theory: int | None = None
    loss_reduction: str = "mean"
    group: Any = None
    state: Callable[[], dict[str, int]] | None = None
    before_step: Callable[[], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    grads_fixture: Callable[[list[torch.Tensor]], list[np.ndarray]] | None = None
    scaler: Any = None
    compiled: list[str] | None = None  # the compiled style: the units torch.compile'd (torch_impl/compiled.py)


class _Saved:
    """What autograd holds instead of a saved tensor while the meter runs; its end is the tensor's."""

    __slots__ = ("tensor", "keys", "meter")

    def __init__(self, tensor, keys, meter):
        self.tensor, self.keys, self.meter = tensor, keys, meter

    def __del__(self):
        for key in self.keys:
            self.meter.release(key)


class SavedTensorMeter:
    """Peak bytes of the tensors autograd saves for backward (activation memory), on this rank:
    ``torch.autograd.graph.saved_tensors_hooks`` sees every saved tensor; unique storages are
    counted (q, k, v are views of one qkv output), parameters and views of them are not (nor
    DTensor parameters' local shards, nor FSDP's gathered ones, which are ``nn.Parameter``s);
    a storage leaves the count when autograd drops the last tensor saved on it. The innermost
    hooks win: a pattern that installs its own (explicit ZeRO-3 packs its gathered weights as
    handles) hides what it saves inside them, so its number counts only what is saved outside."""

    def __init__(self, params):
        self.params = {key for p in params for key, _ in self._storages(p)}
        self.live: dict[int, list[int]] = {}  # storage address -> [saved tensors on it, bytes]
        self.now = self.peak = 0

    @classmethod
    def _storages(cls, t: torch.Tensor) -> list[tuple[int, int]]:
        """(address, bytes) of the storages under ``t``: a wrapper subclass (DTensor, the
        AsyncCollectiveTensor of a functional collective) has none of its own: its inner tensors'."""
        if hasattr(t, "__tensor_flatten__"):
            inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
            return [s for x in inner if isinstance(x, torch.Tensor) for s in cls._storages(x)]
        s = t.untyped_storage()
        return [(s.data_ptr(), s.nbytes())]

    def pack(self, t: torch.Tensor) -> _Saved:
        storages = self._storages(t)
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or \
                any(key in self.params for key, _ in storages):
            storages = []
        for key, nbytes in storages:
            entry = self.live.setdefault(key, [0, nbytes])
            if entry[0] == 0:
                self.now += nbytes
                self.peak = max(self.peak, self.now)
            entry[0] += 1
        return _Saved(t.detach(), [key for key, _ in storages], self)  # detached: no cycle via grad_fn

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]

    def recording(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda saved: saved.tensor)


def reported_losses(losses: list[torch.Tensor], how: str, group=None) -> list[float]:
    """Each step's global loss from this rank's ``losses`` (0-d tensors, one a step), read after the loop
    in one collective (bookkeeping: outside the ledger and every timed step): "same" reads them, "mean"
    all-gathers every rank's and averages them on the host in rank order (exact values in, one fixed
    order: a run's losses do not depend on how many steps it took), "src:k" takes rank k's."""
    if not losses:
        return []
    local = torch.stack([loss.detach().reshape(()) for loss in losses])  # (steps,)
    if how == "same":
        return local.tolist()
    if how == "mean":
        every = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, local, group=group)
        per_rank = [t.tolist() for t in every]  # (ranks, steps)
        return [sum(step) / len(per_rank) for step in zip(*per_rank)]
    src = int(how.removeprefix("src:"))
    dist.broadcast(local, src=src, group=group)  # local: a new tensor (stack), the losses untouched
    return local.tolist()


def _preempted(ctx: RankContext) -> bool:
    """Whether any rank got SIGTERM (shared/preempt.py): one all-reduce (MAX) of a flag, outside
    the ledger's recording, so all ranks stop after the same step."""
    flag = torch.tensor([float(preempt.requested())], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def train_loop(cfg: Config, ctx: RankContext, setup: Setup) -> Trained:
    """Run ``cfg.steps`` steps of ``setup`` on this rank; the ledger records the last one (after
    warm-up: DDP rebuilds its buckets after the first iteration). Step 0 also measures the peak
    bytes saved for backward (``extra["activation_bytes"]``, this rank's: SavedTensorMeter)."""
    baseline = 0
    if ctx.device.type == "cuda":  # this run's own peak: over what earlier runs left allocated (references, caches)
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        baseline = torch.cuda.memory_allocated(ctx.device)
    losses, step_times, grads0, comm, by_axis, comm_dtypes = [], [], [], {}, None, {}
    meter = SavedTensorMeter(setup.params)
    session = ckpt.current()  # checkpoints (torch_impl/checkpoint.py): None unless a run asked
    if session and session.probe:  # the pattern built from a checkpoint's moments: their layout, no step
        raise ckpt.Probed([p.detach().clone() for p in ckpt.opt_params(setup.optimizer)])
    start = session.start if session else 0
    if session and (session.moments or session.plan):
        where = f"torch {session.layout['pattern']} {session.layout['style']}/{session.layout['variant']}"
        ckpt.restore(setup, session, where) if session.moments else ckpt.moments_fixture(setup, where)
    timed, host = [], []  # which steps' times hold the step alone; the host's share of each (time_step)
    run = CompiledRun(setup.compiled, setup.params) if setup.compiled is not None else None  # the compiled style
    for k in range(start, cfg.steps):
        last = k == cfg.steps - 1
        if setup.before_step:
            setup.before_step()
        # What the harness records (the ledger's dispatch mode on the last step; the activation meter's hooks
        # and the step-0 gradients on the first) costs time: those steps are run but not timed, so a timed
        # step holds the pattern's step and the one sync that ends it (issue 46; compare.py bench --overhead).
        # compiled: its own ledger (the profiler's: a dispatch mode would not run the compiled code)
        recording = last or k == start
        with (run.recording() if run else ctx.ledger.recording()) if last else contextlib.nullcontext(), \
                run.step(k == start) if run else contextlib.nullcontext():
            # compiled: no saved-tensor hooks while it traces (the activation meter is eager-only)
            loss, seconds, share = _step(setup, cfg, ctx, meter.recording() if k == start and run is None else None,
                                         (lambda g=grads0: g.extend(_grads0(setup))) if k == 0 else None)
        step_times.append(seconds)
        timed.append(not recording)
        host.append(share)  # ~1: the device waited on the host
        if last:
            comm = run.comm if run else ctx.ledger.summary()
            comm_dtypes = {} if run else ctx.ledger.by_dtype()
            by_axis = ctx.ledger.by_axis() if ctx.ledger.labels and not run else None  # the mesh labels its groups
        if k == 0:
            grads0 = (setup.grads_fixture or setup.fixture)(grads0)  # the check's gathers: outside every ledger
        losses.append(loss.detach())  # read in one collective after the loop (reported_losses)
        if session:
            ckpt.fault("step", k + 1, ctx.rank)  # the kill test: a rank dies after this step
            if session.plan and session.plan.due(k + 1):
                ckpt.save(cfg, ctx, setup, k + 1, session)
            if session.plan and _preempted(ctx):  # SIGTERM on any rank: every rank stops after this step
                if not session.plan.due(k + 1):
                    ckpt.save(cfg, ctx, setup, k + 1, session)
                dist.barrier()  # saved everywhere before any rank reports
                raise ckpt.preempted(session, k + 1)  # one line: the step, the folder saved
    losses = reported_losses(losses, setup.loss_reduction, setup.group)
    params = setup.fixture(setup.params)  # before any bare step (bench --overhead) moves them
    state = setup.state() if setup.state else {
        "params": tensor_bytes(setup.params), "grads": tensor_bytes(g for g in setup.grads() if g is not None),
        "optimizer": optimizer_state_bytes(setup.optimizer)}
    extra = dict(setup.extra, activation_bytes=meter.peak if run is None else None)
    compile_s = None
    if run:
        extra.update(run.extra(step_times))
        compile_s = extra.pop("compile_s")
    if _BARE.get():  # compare.py bench --overhead: the harness's timed step against the bare one, in turns
        (extra["harness_step_times"], extra["bare_step_times"], extra["harness_step_cpu"],
         extra["bare_step_cpu"]) = _paired_steps(setup, ctx, cfg, run)
    if any(timed):
        extra["host_fraction"] = float(np.median([h for h, t in zip(host, timed) if t]))
    if comm_dtypes:
        extra["comm_by_dtype"] = comm_dtypes  # {op: {dtype: {"count", "bytes"}}}: what each collective moved
    if setup.scaler is not None:  # float16: the check requires the reference's skipped steps
        extra.update(loss_scale=setup.scaler.get_scale(), skipped_steps=list(setup.scaler.skipped_at))
    if by_axis is not None:
        extra["comm_by_axis"] = by_axis  # {axis label: {op: {"count", "bytes"}}} of the last step
    if ctx.ledger.audit_device is not None:
        extra["audited_collectives"] = ctx.ledger.audited  # the device audit's checks, this launch so far
    if ctx.device.type == "cuda":
        extra["peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device) - baseline  # this run's own
        extra["peak_bytes_baseline"] = baseline  # allocated when it began (not this run's)
    return Trained(losses=losses, grads0=grads0, params=params, step_times=step_times,
                   comm=comm, comm_theory=setup.comm_theory, state_bytes=state, extra=extra, where=ctx.where,
                   start_step=start, timed=timed, compile_s=compile_s)


# compare.py bench --overhead (parallel_twins/overhead.py): after a run, this many more steps of the same
# Setup in a bare loop — the step, one sync, nothing of the harness's — so the benchmark can hold the
# harness's timed steps against them. Set per launch by ``measuring_bare``; 0 (every other run): none.
_BARE: contextvars.ContextVar[int] = contextvars.ContextVar("bare_steps", default=0)


@contextlib.contextmanager
def measuring_bare(steps: int):
    """Within the block, every train_loop also times ``steps`` bare steps (extra["bare_step_times"])."""
    token = _BARE.set(steps)
    try:
        yield
    finally:
        _BARE.reset(token)


def _step(setup: Setup, cfg: Config, ctx: RankContext, meter=None, before_update=None):
    """One step as train_loop times it: forward and backward (under autocast), the update, and the one sync
    that ends it (``loss.item()``: the device's work is done). ``meter``: a context around the forward and
    backward (the activation meter, step 0); ``before_update``: called between backward and update (step 0's
    gradients). Returns (loss, seconds, the host's share of them)."""
    t0 = time.perf_counter()
    with meter or contextlib.nullcontext(), autocast(cfg, ctx.device):
        loss = setup.forward_backward()  # mixed precision: under autocast (float32 params and grads)
    if before_update is not None:
        before_update()
    setup.update()
    issued = time.perf_counter()
    loss.item()  # waits for the device, so the step time is real on GPU too
    seconds = time.perf_counter() - t0
    return loss, seconds, (issued - t0) / max(seconds, 1e-12)


def _grads0(setup: Setup) -> list[torch.Tensor]:
    """Step 0's local gradients (unscaled under float16; a frozen parameter's: zeros), gathered later."""
    unscale = 1.0 if setup.scaler is None else setup.scaler.get_scale() / setup.scaler.share
    return [torch.zeros_like(setup.params[i]) if g is None else g.detach() / unscale
            for i, g in enumerate(setup.grads())]


def _paired_steps(setup: Setup, ctx: RankContext, cfg: Config, run) -> tuple[list[float], ...]:
    """compare.py bench --overhead, after the run (its results read; the parameters move on): ``_BARE`` rounds
    of the harness's timed step (train_loop's: ``_step`` and the loss it keeps for after the loop) and the bare
    step (``_step`` alone: no ledger, meter, checkpoint or preemption check, no loss kept), in turns and
    alternating which goes first, so both see the machine in the same state (timed apart, a busy moment of
    2 shared cores moved the ratio by 20 %). Each also in this thread's CPU time, the harness's with the loss it
    keeps: the host's own work, which no wait for another rank or core is part of. Returns (harness step
    times, bare step times, harness CPU times, bare CPU times)."""
    harness, bare, harness_cpu, bare_cpu, kept = [], [], [], [], []
    for i in range(_BARE.get()):
        for timed_by_harness in (i % 2 == 0, i % 2 == 1):
            if setup.before_step:  # a barrier that gives the pipeline's ranks a common start: outside, as in the run
                setup.before_step()
            cpu = time.thread_time()
            with run.step(False) if run else contextlib.nullcontext():
                loss, seconds, _ = _step(setup, cfg, ctx)
            if timed_by_harness:
                kept.append(loss.detach())
            (harness_cpu if timed_by_harness else bare_cpu).append(time.thread_time() - cpu)
            (harness if timed_by_harness else bare).append(seconds)
    return harness, bare, harness_cpu, bare_cpu


def _reference(cfg: Config, device, casts: str = "autocast"):
    """The single-device run depends on none of the parallel layout (world size, micro-batches,
    buckets, mesh) nor on recomputation (a run with recompute is checked against the one without):
    compute it once per remaining configuration."""
    return _cached_reference(cfg.replace(world_size=1, microbatches=1, bucket_mb=25.0, mesh=(), recompute="none",
                                         virtual_stages=1), str(device), casts)


@functools.lru_cache(maxsize=8)
def _cached_reference(cfg: Config, device: str, casts: str = "autocast"):
    ref = reference.train(cfg, make_problem(cfg), device, casts=casts)
    if cfg.precision == "mixed":  # its floor (the batch split in two) and the float64 run (shared.results.mixed_extra)
        ref.extra.update(mixed_extra(ref, reference.train(cfg, make_problem(cfg), device, split=2, casts=casts),
                                     reference.train(cfg.replace(dtype="float64", precision="pure"),
                                                     make_problem(cfg), device)))
    elif needs_floor(cfg):  # a long pure run: its measured floor, the batch split in two (shared/tolerances.py)
        ref.extra.update(floor_extra(ref, reference.train(cfg, make_problem(cfg), device, split=2), cfg))
    return ref


def run_pattern(
    ctx: RankContext, pattern: str, cfgs: list[Config],
    variants: list[tuple[str, str]] | dict[Config, list[tuple[str, str]]] | None = None,
    checkpoint: Plan | None = None,
) -> list[dict] | None:
    """Returns, on rank 0, one entry per config:
    ``{"cfg": cfg, "reference": Trained, "runs": [(style, variant, Trained), …]}``; None elsewhere.
    ``variants``: the (style, variant)s to run (a dict: per config), default every one the pattern has.
    ``checkpoint``: saves and resumes (shared.checkpoint.Plan; torch_impl/checkpoint.py)."""
    module = importlib.import_module(f"torch_impl.{pattern}")
    out = []
    for cfg in cfgs:
        cfg.check(pattern, "torch")  # what --precision mixed (and its dtype) is built for in torch
        problem = make_problem(cfg)
        if ctx.rank == 0:
            ctx.progress(("start", f"{pattern} {cfg.model}: single-device reference"))
        ref = _reference(cfg, ctx.device) if ctx.rank == 0 else None
        runs = []
        # a pattern may offer some variants for one model only: its variants(cfg), else VARIANTS
        chosen = variants.get(cfg) if isinstance(variants, dict) else variants
        every = getattr(module, "variants", lambda c: module.VARIANTS)(cfg)
        for style, variant in every if chosen is None else chosen:  # [] (--styles): none of them
            ctx.progress(("start", f"{pattern} {cfg.model} {style}/{variant}"))
            trained = ckpt.run(module, pattern, cfg, problem, style, variant, ctx, checkpoint) if checkpoint \
                else module.train(cfg, problem, style, variant, ctx)
            ctx.progress(("done", 1))
            runs.append((style, variant, trained))
        entry = {"cfg": cfg, "reference": ref, "runs": runs}
        casts = getattr(module, "MIXED_CASTS", {}) if cfg.precision == "mixed" else {}
        if ctx.rank == 0 and any(v in casts for _, v, _ in runs):  # variants whose reference casts otherwise
            entry["references"] = {v: _reference(cfg, ctx.device, casts[v]) for _, v, _ in runs if v in casts}
        out.append(entry)
    return out if ctx.rank == 0 else None


def run_collectives(ctx: RankContext) -> list[dict]:
    """Every collective checked on this rank (all ranks return their own list)."""
    from torch_impl import collectives

    return [{**check, "where": ctx.where} for check in collectives.check_all(ctx)]  # platform, backend, devices


def run_jobs(ctx: RankContext, jobs: list[tuple], checkpoint: Plan | None = None, bare_steps: int = 0
             ) -> dict[str, object]:
    """Several patterns in one launch (compare.py): jobs of (pattern, cfgs[, {cfg: (style, variant)s}]);
    returns {pattern: run_pattern's or run_collectives' answer}. Collectives answer on every rank,
    patterns on rank 0. ``bare_steps`` (compare.py bench --overhead): each run also times that many bare
    steps (measuring_bare)."""
    with measuring_bare(bare_steps):
        return _run_jobs(ctx, jobs, checkpoint)


def _run_jobs(ctx: RankContext, jobs: list[tuple], checkpoint: Plan | None = None) -> dict[str, object]:
    out: dict[str, object] = {}
    if checkpoint is not None:
        preempt.install()  # SIGTERM / SIGINT: finish the step, save, stop (train_loop)
    for pattern, cfgs, *chosen in jobs:
        if pattern == "collectives":
            ctx.progress(("start", "collectives"))
            out[pattern] = run_collectives(ctx)
            ctx.progress(("done", len(out[pattern])))
        else:
            out[pattern] = run_pattern(ctx, pattern, cfgs, chosen[0] if chosen else None, checkpoint=checkpoint)
    return out
