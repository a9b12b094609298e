"""Checkpoints of the JAX runs with Orbax: save any pattern's training state, resume it bit for bit,
load it under another layout — or from torch's DCP files — through shared/checkpoint.py.

What is saved: the canonical ``shared.checkpoint.State`` — every parameter and both AdamW moments
(optax ``ScaleByAdamState.mu`` / ``nu``) as WHOLE arrays under their fixture names and orientation
(shared.problem.param_names / param_shapes), the step count (optax ``count``) in the manifest. The
pattern's own ``Setup.params_fixture`` turns its local layout (row blocks, TP shards with padding and
head permutations, pipeline slots, ZeRO-1's flat vector) into fixture arrays; the moments go through
the same function, since they are laid out like the parameters. Orbax writes
``{"params": {name: a}, "adam_m": {…}, "adam_v": {…}}`` (a flat dict per group: names keep their
dots) into ``step_K/orbax``, each array sharded on dim 0 over the run's devices where it divides
(each device writes its own chunk) else replicated (one copy written); zarr v2, no OCDBT, so
shared.orbax_files reads it with tensorstore alone.

How it reshards on load: the canonical state is layout-free, so loading under any layout is the
pattern's own placement of fixture arrays. The parameters go in as ``problem.params``; each moment
goes through a PROBE of the same pattern (its ``train`` with the moment as its "parameters", stopped
by harness.train_loop before compiling with ``Probed``) which hands back the moment in the pattern's
local layout; ``restore`` puts those into optax's state (``count`` = step) with the shardings the
compiled step takes (``compiled.input_shardings``: the program is the one compiled from step 0, so a
resumed run on the same layout is bitwise the uninterrupted one). The saver's sharding (Orbax's
chunks) and the loader's are independent: dp → fsdp, tp, pp, cp, mesh, one device. Moments laid
out unlike the parameters need ``Setup.moments`` (ZeRO-1 shard_map's flat vector has it); without it
a run is refused before training. Several JAX processes: process 0 writes the folders, barriers
around Orbax's (collective) save.

Cross-framework mapping: the names are torch's ``named_parameters()``; every matrix in fixture
orientation ``x @ W`` (torch's nn.Linear weight is Wᵀ; the torch side transposes); ``adam_m`` = optax
mu = torch ``exp_avg``, ``adam_v`` = nu = ``exp_avg_sq``, step = optax count = torch ``state["step"]``.
Both apply AdamW with torch's semantics (jax_impl.model.make_optimizer), so a DCP checkpoint continues
here, and an Orbax one in torch (shared.checkpoint.read_state reads either with NumPy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shared import preempt
from shared.checkpoint import (
    CheckpointError,
    Plan,
    RunLock,
    abandon,
    aside,
    commit,
    fault,
    manifest,
    read_state,
    save_error,
    step_name,
    verify,
)
from shared.problem import param_names


class Probed(Exception):  # noqa: N818  (a control-flow signal, not an error)
    """Raised by harness.train_loop under a probe session: ``params`` = the pattern's state[0]."""

    def __init__(self, params):
        super().__init__("probe")
        self.params = params


@dataclasses.dataclass
class Session:
    """One run's checkpoint context, read by harness.train_loop (``current()``)."""

    plan: Plan | None = None
    run_dir: str = ""
    layout: dict = dataclasses.field(default_factory=dict)  # pattern, style, variant, world_size, mesh
    probe: bool = False
    start: int = 0
    mu: Any = None  # the probed moments (pattern layout), or None: from step 0
    nu: Any = None
    saved: list = dataclasses.field(default_factory=list)  # {"step", "path", "bytes", "save_s"}
    devices: tuple = ()

    @property
    def what(self) -> str:
        return f"jax {self.layout.get('pattern')} {self.layout.get('style')}/{self.layout.get('variant')}"


_CURRENT: list[Session] = []


@contextlib.contextmanager
def session(**fields):
    """``with session(plan=…, run_dir=…, …) as s``: train_loop sees ``s`` (precedent: transformer.recomputing)."""
    s = Session(**fields)
    _CURRENT.append(s)
    try:
        yield s
    finally:
        _CURRENT.pop()


def current() -> Session | None:
    return _CURRENT[-1] if _CURRENT else None


# --- optax's AdamW state -------------------------------------------------------------------------

def _adam_states(tree) -> list[optax.ScaleByAdamState]:
    found = []
    jax.tree.map(found.append, tree, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    return [x for x in found if isinstance(x, optax.ScaleByAdamState)]


def adam_state(opt_state, what: str) -> optax.ScaleByAdamState:
    found = _adam_states(opt_state)
    if len(found) != 1:
        raise CheckpointError(f"{what}: {len(found)} optax ScaleByAdamState in its optimizer state (expected one)")
    return found[0]


def _like(a, b) -> bool:
    """Same tree structure and same shapes leaf for leaf (the shardings may differ: device_put moves)."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.shape == y.shape for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _unlike(what: str) -> CheckpointError:
    return CheckpointError(f"{what}: its AdamW moments are laid out unlike its parameters: "
                           "checkpoints not supported for it yet")


def check_layout(setup, what: str) -> None:
    """The moments are parameter-shaped (or the Setup says how: ``moments`` = (to_local, to_params))."""
    mu = adam_state(setup.state[1], what).mu
    probe = setup.moments[1](mu) if setup.moments else mu
    if not _like(probe, setup.state[0]):
        raise _unlike(what)


def restore(setup, start: int, mu, nu, what: str = "jax", shardings=None) -> tuple:
    """setup.state with optax's mu / nu replaced by the probed moments (the pattern's layout) and
    count = start, placed as ``shardings`` (the compiled step's input shardings of its state: what the
    uninterrupted run's step K received; default: where the state's own arrays are)."""
    opt = setup.state[1]
    old = adam_state(opt, what)
    where = adam_state(shardings[1], what) if shardings is not None else jax.tree.map(lambda a: a.sharding, old)
    to_local = setup.moments[0] if setup.moments else (lambda t: t)

    def place(probe, have, at):
        probe = to_local(probe)
        if not _like(probe, have):
            raise _unlike(what)
        return jax.tree.map(lambda p, h, w: jax.device_put(jnp.asarray(p, h.dtype), w), probe, have, at)

    count = jax.device_put(np.asarray(start, old.count.dtype), where.count)
    new = optax.ScaleByAdamState(count=count, mu=place(mu, old.mu, where.mu), nu=place(nu, old.nu, where.nu))
    opt = jax.tree.map(lambda x: new if isinstance(x, optax.ScaleByAdamState) else x, opt,
                       is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    return (setup.state[0], opt, *setup.state[2:])


# --- save ----------------------------------------------------------------------------------------

def _writer():
    import logging

    import orbax.checkpoint as ocp

    # Orbax warns on every save without OCDBT that it has no OCDBT subfolders to merge: expected here
    logging.getLogger("absl").setLevel(logging.ERROR)

    # zarr v2, one folder per array, no OCDBT: the simplest layout on disk (shared.orbax_files reads it)
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)), ocp.args.PyTreeSave


def orbax_restore(folder: str, devices) -> dict:
    """Orbax's own restore of ``folder`` (a checkpoint's ``orbax/``) onto ``devices``, each array
    split on dim 0 where it divides: Orbax reads every device's box from whichever chunks cover it,
    so the saver's sharding and this one are independent. {group: {name: jax.Array}}."""
    import orbax.checkpoint as ocp

    checkpointer, _ = _writer()
    mesh = Mesh(np.asarray(devices), ("d",))
    meta = checkpointer.metadata(folder).item_metadata.tree
    spec = lambda m: P("d") if len(m.shape) and m.shape[0] % mesh.devices.size == 0 else P()
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=NamedSharding(mesh, spec(m))), meta)
    return checkpointer.restore(folder, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))


def _placed(a: np.ndarray, mesh: Mesh) -> jax.Array:
    n = mesh.devices.size
    spec = P("d") if a.ndim and a.shape[0] % n == 0 else P()  # row blocks, one per device, where they divide
    # every process holds the whole array: each device takes its block (its own process's devices only)
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda index: a[index])


def _sync(name: str) -> None:
    if jax.process_count() > 1:  # several JAX processes (jax_impl/launch.py): one writes the folders
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save(cfg, setup, state: tuple, done: int, s: Session) -> str:
    """Write the canonical state after ``done`` steps with Orbax, commit it atomically; returns its path."""
    t0 = time.perf_counter()
    adam = adam_state(state[1], s.what)
    to_params = setup.moments[1] if setup.moments else (lambda t: t)
    canon = {"params": setup.params_fixture(state)}
    for group, moment in (("adam_m", adam.mu), ("adam_v", adam.nu)):
        moment = to_params(moment)
        if not _like(moment, state[0]):
            raise _unlike(s.what)
        canon[group] = setup.params_fixture((moment, *state[1:]))
    # float64 runs save float64; float32 / bfloat16 ones float32 (lossless for both; NumPy reads it)
    dtype = np.float64 if cfg.dtype == "float64" else np.float32
    mesh = Mesh(np.asarray(s.devices or jax.devices()[:1]), ("d",))
    names = param_names(cfg)
    tree = {g: {n: _placed(np.asarray(a, dtype), mesh) for n, a in zip(names, arrays, strict=True)}
            for g, arrays in canon.items()}
    lead = jax.process_index() == 0
    tmp = aside(s.run_dir, done) if lead else os.path.join(s.run_dir, ".tmp-" + step_name(done))
    _sync(f"aside {tmp}")
    checkpointer, args = _writer()
    try:
        checkpointer.save(os.path.join(tmp, "orbax"), args=args(tree))  # synchronous: written when it returns
    except Exception as exc:  # noqa: BLE001 — full disk, read-only folder (OSError, or tensorstore's): one line
        if lead:
            abandon(tmp)
        raise save_error(s.run_dir, done, exc) from None
    fault("save", done, jax.process_index())
    final = commit(tmp, manifest(cfg, done, "jax", "orbax", s.layout), keep=s.plan.keep) if lead else \
        os.path.join(s.run_dir, step_name(done))
    _sync(f"commit {final}")
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(final) for f in fs)
    s.saved.append({"step": done, "path": final, "bytes": size, "save_s": time.perf_counter() - t0})
    return final


# --- one run -------------------------------------------------------------------------------------

def _ordered(arrays: dict, cfg) -> dict:
    return {n: arrays[n] for n in param_names(cfg)}  # the patterns read problem.params in fixture order


def _probe(module, cfg, problem, moment: dict, style, variant, mesh, fields: dict):
    with session(probe=True, **fields):
        try:
            module.train(cfg, dataclasses.replace(problem, params=_ordered(moment, cfg)), style, variant, mesh)
        except Probed as p:
            return p.params
    raise CheckpointError(f"jax {fields['layout']['pattern']} {style}/{variant}: its train does not go through "
                          "harness.train_loop: checkpoints not supported for it yet")


@contextlib.contextmanager
def writer_lock(plan: Plan, run_dir: str):
    """Process 0 (the one that creates each save's folder and commits it) holds ``run_dir``'s lock
    (shared.checkpoint_io.RunLock) for the whole run when it writes there; with several JAX
    processes its refusal reaches every process (one line, before training)."""
    if not plan.writes:
        yield
        return
    lock, refusal = RunLock(run_dir), None
    if jax.process_index() == 0:
        try:
            lock.__enter__()
        except CheckpointError as exc:
            refusal = str(exc)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if int(multihost_utils.broadcast_one_to_all(np.int32(refusal is not None))) and refusal is None:
            refusal = f"{run_dir}: another run is writing this checkpoint folder (process 0 could not lock it)"
    if refusal:
        raise CheckpointError(refusal)
    try:
        yield
    finally:
        lock.__exit__()


def preempted(s: Session, step: int) -> preempt.Preempted:
    """What the training loop raises once ``step`` is saved on a signal (shared/preempt.py)."""
    return preempt.Preempted(step, os.path.join(s.run_dir, step_name(step)))


def stop_requested() -> bool:
    """Whether SIGTERM or SIGINT came (with several processes: to any of them; every one answers the same)."""
    if jax.process_count() == 1:
        return preempt.requested()
    from jax.experimental import multihost_utils

    return bool(np.max(multihost_utils.process_allgather(np.int32(preempt.requested()))))


def run(module, pattern: str, cfg, problem, style: str, variant: str, mesh, plan: Plan):
    """One (style, variant) run of ``module`` under ``plan``: from ``plan.source`` (verified, checked,
    resharded by probes) or from step 0; saving when ``plan.due``. Returns its Trained. Process 0
    holds the run folder's lock throughout (``writer_lock``). A signal that came before it began
    stops it before its first step: nothing saved."""
    if plan.writes and stop_requested():
        raise preempt.Preempted(None)
    run_dir = plan.run_dir("jax", pattern, style, variant, cfg)
    with writer_lock(plan, run_dir):
        return _run(module, pattern, cfg, problem, style, variant, mesh, plan, run_dir)


def _run(module, pattern, cfg, problem, style, variant, mesh, plan, run_dir):
    layout = {"pattern": pattern, "style": style, "variant": variant, "world_size": cfg.world_size,
              "mesh": {k: int(v) for k, v in dict(mesh.shape).items()}}
    fields = {"plan": plan, "run_dir": run_dir, "layout": layout, "devices": tuple(mesh.devices.flat)}
    path, start, mu, nu, load_s = plan.source(run_dir, cfg.steps), 0, None, None, None
    if path:
        t0 = time.perf_counter()
        info = verify(path, cfg)
        state = read_state(path, info)
        state.check(cfg, where=path)
        if state.step >= cfg.steps:
            raise CheckpointError(f"{path}: saved after step {state.step}, this run has --steps {cfg.steps}")
        mu = _probe(module, cfg, problem, state.adam_m, style, variant, mesh, fields)
        nu = _probe(module, cfg, problem, state.adam_v, style, variant, mesh, fields)
        problem, start = dataclasses.replace(problem, params=_ordered(state.params, cfg)), state.step
        load_s = time.perf_counter() - t0  # read, checked, both probes: the moments placed (params: in train)
    with session(start=start, mu=mu, nu=nu, **fields) as s:
        trained = module.train(cfg, problem, style, variant, mesh)
    trained.extra["checkpoints"] = s.saved
    if path:
        trained.extra |= {"load_s": load_s, "loaded_from": path}
    return trained


# --- a model's weights (a compose trainer's state), for the other framework's twin -------------------

def save_weights(run_dir: str, step: int, params: dict, layout: dict | None = None, devices=None) -> str:
    """Write ``params`` ({NNX Param path: array}: ``Composed.params()``, or ``nnx_params(model)``) as a
    weights checkpoint ``run_dir/step_N`` with Orbax (shared/checkpoint_weights.py: ``kernel`` /
    ``embedding`` / ``scale`` stored as ``weight``, matrices x @ W as NNX holds them), commit it; returns
    its path. float64 stays float64, every other dtype is stored as float32 (lossless)."""
    from shared.checkpoint_weights import from_nnx, weights_manifest

    arrays = from_nnx(params)
    mesh = Mesh(np.asarray(devices or jax.devices()[:1]), ("d",))
    cast = lambda a: np.asarray(a, np.float64 if a.dtype == np.float64 else np.float32)  # noqa: E731
    tree = {"params": {n: _placed(cast(a), mesh) for n, a in arrays.items()}}
    lead = jax.process_index() == 0
    tmp = aside(run_dir, step) if lead else os.path.join(run_dir, ".tmp-" + step_name(step))
    _sync(f"aside {tmp}")
    checkpointer, args = _writer()
    try:
        checkpointer.save(os.path.join(tmp, "orbax"), args=args(tree))
    except Exception as exc:  # noqa: BLE001 — full disk, read-only folder: one line
        if lead:
            abandon(tmp)
        raise save_error(run_dir, step, exc) from None
    shapes = {n: a.shape for n, a in arrays.items()}
    final = commit(tmp, weights_manifest(step, "jax", "orbax", shapes, layout)) if lead else \
        os.path.join(run_dir, step_name(step))
    _sync(f"commit {final}")
    return final


def nnx_params(model) -> dict[str, np.ndarray]:
    """{NNX Param path: array} of an NNX model (a tied Param once, under its first path)."""
    from flax import nnx

    from jax_impl.parallel.tree import key_of

    return {key_of(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}


def load_weights(path: str, model):
    """Copy a weights checkpoint (either framework's: shared.checkpoint_weights.read_weights) into the NNX
    ``model``'s Params, every one by its canonical name, in place; returns ``model``. A name or shape
    that does not map: CheckpointError, one line, before anything changes."""
    from flax import nnx

    from jax_impl.parallel.tree import key_of
    from shared.checkpoint_weights import canonical_nnx, check_names, from_nnx, read_weights

    arrays = read_weights(path)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    want = {n: a.shape for n, a in from_nnx({key_of(p): a for p, a in leaves}).items()}
    check_names(arrays, want, path)
    new = [jnp.asarray(arrays[canonical_nnx(key_of(p))], a.dtype) for p, a in leaves]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))
    return model
