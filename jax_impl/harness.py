"""Driver mirroring torch_impl.harness: train every (style, variant) of one pattern for a list
of configs. One process, all devices — or, under multi-controller JAX (jax_impl/launch.py), every
process runs this same driver over the global devices, its own single-device reference included,
and results come back through ``model.to_numpy`` (process_allgather where shards live elsewhere).

Pattern modules (``jax_impl/dp.py`` …) provide
``VARIANTS: tuple[(style, variant), …]`` and
``train(cfg, problem, style, variant, mesh) -> Trained``; ``mesh_for(cfg, device)`` builds the
mesh the pattern trains on (its axis names are the pattern's: "dp", "tp", "pp"). A pattern's
``train`` builds a ``Setup`` and hands it to ``train_loop``, the one training loop every pattern
and model goes through (compile once, the HLO ledger, timing, losses, step-0 gradients, final
parameters, state bytes), as torch_impl.harness.train_loop does on the torch side.

Checkpoints (``run_pattern(..., checkpoint=Plan)``, jax_impl/checkpoint.py): each run goes through
``checkpoint.run``, and ``train_loop`` reads its session — a probe stops before compiling (the
pattern's layout of a moment), a resumed run starts at step K with optax's state restored, and a
save follows every step the plan names. Without a plan there is no session: nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl import checkpoint as checkpoints  # (run_pattern's argument is named checkpoint)
from jax_impl import reference, transformer
from jax_impl.devices import devices
from jax_impl.devices import where as devices_where
from jax_impl.ledger import comm_by_axis, comm_from_hlo
from jax_impl.model import compiler_options, to_numpy, tree_bytes
from jax_impl.parallel.tree import fetch
from jax_impl.recipe import scale_extra
from shared import preempt
from shared.checkpoint import Plan
from shared.config import Config
from shared.problem import make_problem
from shared.results import Trained, floor_extra, mixed_extra, needs_floor


@dataclass
class Setup:
    """One pattern's jitted step and how to read its results.

    step: ``jax.jit``-wrapped ``step(*state, *batch) -> (*state, loss, grads)``; ``loss`` is the
        global loss (a scalar) or one local loss per device (a vector: the loop takes its mean).
    state: the arrays the step carries (e.g. ``(params, opt_state)``); donated or not, as the step says.
    batch: the step's other inputs (e.g. ``(x,)`` or ``(tokens, targets)``), already placed.
    grads_fixture: the step's ``grads`` output -> float64 fixture arrays in param_names order.
    params_fixture: the final ``state`` -> float64 fixture arrays in param_names order.
    state_bytes: per-device bytes {params, grads, optimizer} from the final ``state``; default:
        params = grads = tree_bytes(state[0], per_device), optimizer = tree_bytes(state[1], per_device).
    """

    step: Any
    state: tuple
    batch: tuple
    grads_fixture: Callable[[Any], list[np.ndarray]]
    params_fixture: Callable[[tuple], list[np.ndarray]]
    comm_theory: int | None = None
    state_bytes: Callable[[tuple], dict[str, int]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    compiler_options: dict[str, str] | None = None  # XLA options for this step (e.g. jax_impl.fsdp.cpu_options)
    mesh: Any = None  # an N-D mesh: the ledger is also split per mesh axis (extra["comm_by_axis"])
    # Names of extra step outputs after ``grads`` (e.g. ep's ("expert_load",)): the step returns
    # (*state, loss, grads, *outputs) and extra[name] = that output of every step, stacked (NumPy).
    per_step: tuple[str, ...] = ()
    # Checkpoints (jax_impl/checkpoint.py), where the AdamW moments are NOT laid out like ``state[0]``:
    # (to_local(params-like tree) -> the moments' layout, to_params(moments) -> a params-like tree).
    moments: tuple[Callable, Callable] | None = None


def leaves_fixture(tree, names=None) -> list[np.ndarray]:
    """Every array of a parameter pytree as float64 NumPy, in fixture order: a list as it is; a
    {name: array} dict in the order of ``names`` (shared.problem.param_names) — a jitted step hands
    dicts back with sorted keys (``layers.10`` before ``layers.2``), so its order is not the fixture's."""
    if not isinstance(tree, dict):
        return [to_numpy(a) for a in jax.tree.leaves(tree)]
    return [to_numpy(tree[k]) for k in (names or tree)]


def trainer_setup(trainer, batch: tuple) -> Setup:
    """A ``jax_impl.parallel.fsdp.Trainer`` (any model) as the loop's Setup; the fixtures read the
    project model's parameters by name (model.named_params) from the trainer's full arrays."""
    from jax_impl.model import named_params

    fixture = lambda flat: [to_numpy(a) for a in named_params(trainer.module(flat)).values()]
    moments = None
    if getattr(trainer, "variant", None) == "zero1" and trainer.style == "shard_map":  # one flat (Φ_pad,) vector
        moments = (trainer._flatten, lambda flat: trainer._unflatten(jnp.asarray(fetch(flat))))
    return Setup(step=trainer.step, state=trainer.state, batch=batch,
                 grads_fixture=lambda g: fixture(trainer.full_grads(g)),
                 params_fixture=lambda state: fixture(state[0]), compiler_options=trainer.compiler_options,
                 moments=moments, per_step=getattr(trainer, "per_step", ()))


def _preempted() -> bool:
    """Whether SIGTERM came (shared/preempt.py); with several processes, whether it came to any
    (a process_allgather of the flag, so all stop after the same step)."""
    if jax.process_count() == 1:
        return preempt.requested()
    from jax.experimental import multihost_utils

    return bool(np.max(multihost_utils.process_allgather(np.int32(preempt.requested()))))


def train_loop(cfg: Config, setup: Setup) -> Trained:
    s, start = checkpoints.current(), 0  # no session (no --checkpoint-dir): nothing below changes
    if s is not None and s.probe:  # the pattern's layout of a moment (jax_impl/checkpoint.py), nothing run
        raise checkpoints.Probed(setup.state[0])
    if s is not None and (s.mu is not None or s.plan.every or s.plan.save_at):
        checkpoints.check_layout(setup, s.what)  # refused before training, not at the first save
    t_compile = time.perf_counter()
    compiled = _compile(setup.step.lower(*setup.state, *setup.batch),  # outside the timed loop
                        compiler_options(cfg, setup.compiler_options))  # mixed: no excess precision (model.py)
    compile_s = time.perf_counter() - t_compile  # trace + lower + XLA compile (or its cache) of the whole step
    if s is not None and s.mu is not None:  # resumed: the same program as from step 0, its state placed as
        placed = compiled.input_shardings[0][:len(setup.state)]  # that program takes it (as at step K)
        setup.state, start = checkpoints.restore(setup, s.start, s.mu, s.nu, s.what, placed), s.start
    comm = comm_from_hlo(compiled.as_text())  # the collectives XLA put in the step
    state, losses, step_times, grads0 = tuple(setup.state), [], [], None if start == 0 else []
    recorded = {name: [] for name in setup.per_step}
    host = []  # the host's share of each step: ~1 when the device waited on the dispatch
    for k in range(start, cfg.steps):
        state, loss, grads, seconds, share = _step(compiled, state, setup, recorded)
        step_times.append(seconds)
        host.append(share)
        losses.append(loss)  # read back after the loop: no device-to-host copy between timed steps
        if k == 0:
            grads0 = setup.grads_fixture(grads)
        if s is not None:
            checkpoints.fault("step", k + 1, jax.process_index())
            if s.plan.due(k + 1):
                checkpoints.save(cfg, setup, tuple(state), k + 1, s)
            if (s.plan.every or s.plan.save_at) and _preempted():  # SIGTERM: stop after this step, saved
                if not s.plan.due(k + 1):
                    checkpoints.save(cfg, setup, tuple(state), k + 1, s)
                raise checkpoints.preempted(s, k + 1)  # one line: the step, the folder saved
    state = tuple(state)
    losses = [float(np.mean(to_numpy(loss))) for loss in losses]  # each a vector: the mean of N local losses
    params = setup.params_fixture(state)  # before any bare step (bench --overhead) moves them
    timed = [k != start for k in range(start, cfg.steps)]  # the first: the program's first run (allocations)
    if _BARE.get():  # compare.py bench --overhead: the harness's timed step against the bare one, in turns
        harness, bare, harness_cpu, bare_cpu, state = _paired_steps(compiled, state, setup)  # donated: replaced
        setup.extra = {**setup.extra, "harness_step_times": harness, "bare_step_times": bare,
                       "harness_step_cpu": harness_cpu, "bare_step_cpu": bare_cpu}
    if len(host) > 1:
        setup.extra = {**setup.extra, "host_fraction": float(np.median(host[1:]))}
    state_bytes = setup.state_bytes(state) if setup.state_bytes else {
        "params": tree_bytes(state[0], per_device=True), "grads": tree_bytes(state[0], per_device=True),
        "optimizer": tree_bytes(state[1], per_device=True)}
    if "skipped" in recorded:  # float16's loss scaling (parallel/scaling.py): the steps it skipped, the final scale
        setup.extra = {**setup.extra, **scale_extra(recorded.pop("skipped"), recorded.pop("loss_scale"))}
    extra = dict(setup.extra) | {name: np.stack([fetch(v) for v in values]) for name, values in recorded.items()}
    if setup.mesh is not None:  # {axis label: {op: count, bytes}} (jax_impl.ledger.comm_by_axis)
        extra["comm_by_axis"] = comm_by_axis(compiled.as_text(), setup.mesh)
    memory = compiled.memory_analysis()  # per device; None where the backend does not say
    if memory is not None:
        extra["temp_bytes"] = memory.temp_size_in_bytes  # XLA's scratch: the activations live in it
    placed = sorted({d for leaf in jax.tree.leaves(state) for d in leaf.sharding.device_set}, key=lambda d: d.id)
    return Trained(losses=losses, grads0=grads0, params=params, step_times=step_times,
                   comm=comm, comm_theory=setup.comm_theory, state_bytes=state_bytes, extra=extra,
                   where=devices_where(placed), start_step=start, timed=timed, compile_s=compile_s)


# Two runs at a time (parallel_twins/runs.py on a CPU): the threads take turns with ONE lock, held for
# everything that traces or runs on the devices, and let go of only while XLA compiles a step (no device
# work; the GIL is free): the one program in flight never shares the devices with another (two multi-device
# programs enqueued in different orders on the devices' queues could wait on each other's collectives).
_TURN: contextvars.ContextVar[threading.Lock | None] = contextvars.ContextVar("jax_turn", default=None)


@contextlib.contextmanager
def taking_turns(lock: threading.Lock):
    """This thread's runs share the devices with other threads' through ``lock`` (held here, except while
    ``_compile`` compiles)."""
    token = _TURN.set(lock)
    try:
        with lock:
            yield
    finally:
        _TURN.reset(token)


def _compile(lowered, options):
    """``lowered.compile``; taking turns, the lock is let go of for the compile (XLA's, or its cache's)."""
    lock = _TURN.get()
    if lock is None:
        return lowered.compile(compiler_options=options)
    lock.release()
    try:
        return lowered.compile(compiler_options=options)
    finally:
        lock.acquire()


# compare.py bench --overhead (parallel_twins/overhead.py), as torch_impl.harness's: after a run, this many
# more steps of the same compiled program in a bare loop. 0 (every other run): none.
_BARE: contextvars.ContextVar[int] = contextvars.ContextVar("bare_steps", default=0)


@contextlib.contextmanager
def measuring_bare(steps: int):
    """Within the block, every train_loop also times ``steps`` bare steps (extra["bare_step_times"])."""
    token = _BARE.set(steps)
    try:
        yield
    finally:
        _BARE.reset(token)


def _step(compiled, state, setup: Setup, recorded: dict | None):
    """One step as train_loop times it: the compiled call and the one sync that ends it (the new state and
    the loss ready). ``recorded``: {name: list} that keeps the step's per-step outputs (read back after the
    loop); None: they are dropped. Returns (state, loss, grads, seconds, the host's share of them)."""
    t0 = time.perf_counter()
    out = compiled(*state, *setup.batch)
    issued = time.perf_counter()
    *state, loss, grads = out[:len(out) - len(setup.per_step)]
    if recorded is not None:
        for name, value in zip(setup.per_step, out[len(out) - len(setup.per_step):]):
            recorded[name].append(value)
    jax.block_until_ready((state, loss))
    seconds = time.perf_counter() - t0
    return state, loss, grads, seconds, (issued - t0) / max(seconds, 1e-12)


def _paired_steps(compiled, state: tuple, setup: Setup) -> tuple[list[float], list[float], list[float],
                                                                   list[float], tuple]:
    """compare.py bench --overhead, after the run (its results read; the state moves on): ``_BARE`` rounds of
    the harness's timed step (train_loop's: ``_step``, its outputs kept) and the bare one (the call and one
    block_until_ready, nothing else), in turns and alternating which goes first, so both see the machine
    in the same state (timed apart, a busy moment of 2 shared cores moved the ratio by up to 2x on 2 ms
    steps). Each also in this thread's CPU time, the harness's with the outputs it keeps: the host's own work
    (dispatch, bookkeeping), not XLA's threads nor the waits. Returns (harness step times, bare step times,
    harness CPU times, bare CPU times, the state after them)."""
    harness, bare, harness_cpu, bare_cpu = [], [], [], []
    kept, losses = {name: [] for name in setup.per_step}, []
    state = tuple(state)
    for i in range(_BARE.get()):
        for timed_by_harness in (i % 2 == 0, i % 2 == 1):
            cpu = time.thread_time()
            if timed_by_harness:
                state, loss, _, seconds, _ = _step(compiled, state, setup, kept)
                losses.append(loss)  # as the run keeps them
                harness.append(seconds)
                harness_cpu.append(time.thread_time() - cpu)
            else:
                t0 = time.perf_counter()
                out = compiled(*state, *setup.batch)
                jax.block_until_ready(out)
                bare.append(time.perf_counter() - t0)
                bare_cpu.append(time.thread_time() - cpu)
                state = out[:len(state)]
            state = tuple(state)
    return harness, bare, harness_cpu, bare_cpu, state


def _reference(cfg: Config, device: str):
    """The single-device run depends on none of the parallel layout (world size, micro-batches,
    buckets) nor on recomputation (a run with recompute is checked against the one without):
    compute it once per remaining configuration."""
    return _cached_reference(cfg.replace(world_size=1, microbatches=1, bucket_mb=25.0, recompute="none",
                                        virtual_stages=1), device)


@functools.lru_cache(maxsize=8)
def _cached_reference(cfg: Config, device: str):
    one = devices(1, device)[0]
    ref = reference.train(cfg, make_problem(cfg), one)
    if cfg.precision == "mixed":  # its floor (the batch split in two) and the float64 run (shared.results.mixed_extra)
        ref.extra.update(mixed_extra(ref, reference.train(cfg, make_problem(cfg), one, split=2),
                                     reference.train(cfg.replace(dtype="float64", precision="pure"),
                                                     make_problem(cfg), one)))
    elif needs_floor(cfg):  # a long pure run: its measured floor, the batch split in two (shared/tolerances.py)
        ref.extra.update(floor_extra(ref, reference.train(cfg, make_problem(cfg), one, split=2), cfg))
    return ref


def run_pattern(
    pattern: str, cfgs: list[Config], variants: list[tuple[str, str]] | None = None, device: str = "auto",
    progress=None, checkpoint: Plan | None = None,
) -> list[dict]:
    """One entry per config: ``{"cfg", "reference": Trained, "runs": [(style, variant, Trained)]}``.
    ``progress(event)`` hears ("start", what) before each run and ("done", 1) after it. ``checkpoint``
    (a shared.checkpoint.Plan): every run saves / resumes through jax_impl.checkpoint.run."""
    plan = checkpoint
    module = importlib.import_module(f"jax_impl.{pattern}")
    progress = progress or (lambda event: None)
    out = []
    for cfg in cfgs:
        cfg.check(pattern, "jax")
        problem = make_problem(cfg)
        progress(("start", f"{pattern} {cfg.model}: single-device reference"))
        ref = _reference(cfg, device)
        mesh = module.mesh_for(cfg, device)
        runs = []
        with transformer.recomputing(cfg.recompute):  # every block traced in the steps below (not the reference)
            every = getattr(module, "variants", lambda c: module.VARIANTS)(cfg)
            for style, variant in every if variants is None else variants:  # [] (--styles): none of them
                progress(("start", f"{pattern} {cfg.model} {style}/{variant}"))
                runs.append((style, variant, module.train(cfg, problem, style, variant, mesh) if plan is None else
                             checkpoints.run(module, pattern, cfg, problem, style, variant, mesh, plan)))
                progress(("done", 1))
        out.append({"cfg": cfg, "reference": ref, "runs": runs})
    return out
