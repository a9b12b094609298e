"""Data parallelism (DP) in JAX: every device holds the whole model, trains on its slice of the
global batch, and the gradients are averaged across the ``dp`` mesh axis before the update.

Sharded: the batch, P('dp'): device r sees rows r·B/N … (r+1)·B/N, a (B/dp, D) slice. Weights
are replicated, P(); the AdamW state too, except in ZeRO-1, which splits it over 'dp'.

    shard_map/dp     jax.shard_map, explicit collectives: local grads, then lax.pmean.
    jit/dp           the same step as one jax.jit program over NamedSharding inputs (batch
                     P('dp'), Flax NNX params P() via nnx.with_partitioning): XLA's SPMD
                     partitioner (GSPMD, Xu et al. 2021) inserts the all-reduce itself.
    shard_map/zero1  ZeRO stage 1 (Rajbhandari et al. 2020): psum_scatter the flat gradient,
                     optax on this device's 1/N slice, all_gather the updated parameters.
    jit/zero1        AdamW moments NamedSharding P('dp', None), params P(): XLA picks the
                     collectives (the ledger shows which).

Communication per step and device (payload S as nccl-tests counts it, shared.theory):
    dp       bwd: all-reduce dW over dp                     Φ·b   = dp_comm_bytes
    zero1    reduce-scatter dW + all-gather W over dp       2·Φ·b = zero1_comm_bytes
The shard_map steps return each device's local loss (out_specs P('dp')); the reported loss is
their mean, taken on the host, so the ledger holds gradient (and parameter) traffic only. The
jit steps compute the global mean loss inside the program (one scalar all-reduce more).
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo
from jax_impl.model import build_model, inputs, jax_dtype, loss_fn, make_optimizer, to_numpy, tree_bytes
from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import dp_comm_bytes, zero1_comm_bytes

VARIANTS = (("shard_map", "dp"), ("jit", "dp"), ("shard_map", "zero1"), ("jit", "zero1"))


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "dp", device)


def flatten(ws, n: int) -> jax.Array:
    """All arrays as one vector, zero-padded to a multiple of n (torch: _flatten_dense_tensors)."""
    flat = jnp.concatenate([w.reshape(-1) for w in ws])  # (Φ,)
    return jnp.pad(flat, (0, -flat.size % n))  # (Φ_pad,)


def unflatten(flat, like) -> list:
    """Inverse of ``flatten``: slices of ``flat`` shaped like the arrays in ``like``."""
    sizes = np.cumsum([0] + [int(np.prod(w.shape)) for w in like])
    return [flat[a:b].reshape(w.shape) for a, b, w in zip(sizes[:-1], sizes[1:], like)]


# --- shard_map: the collectives are written out ------------------------------------------------

def local_grads(params, x):
    """This device's loss and gradient on its (B/dp, D) rows. With check_vma the replicated
    params are *invariant* over 'dp'; differentiating w.r.t. them would transpose the implicit
    invariant->varying cast into a psum, handing back gradients already summed over devices.
    We cast them to *varying* first, so grad is the LOCAL gradient (as torch's backward), and
    the averaging is an explicit collective below. (The other correct form is grad of
    pmean(local_loss) w.r.t. the invariant params: autodiff then inserts that psum itself.)"""
    local = lax.pcast(params, "dp", to="varying")
    return jax.value_and_grad(loss_fn)(local, x)  # (), L × (D, D)


def allreduce_gradients(grads):
    return lax.pmean(grads, "dp")  # all-reduce, Φ·b: every device gets the mean


def shard_map_dp_step(cfg: Config, tx, params, opt_state, x):
    assert x.shape == (cfg.batch // cfg.world_size, cfg.dim), x.shape  # (B/dp, D)
    loss, grads = local_grads(params, x)
    grads = allreduce_gradients(grads)  # L × (D, D), invariant over dp
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss[None], grads


def shard_map_zero1_step(cfg: Config, tx, params, opt_state, x):
    n = cfg.world_size
    assert x.shape == (cfg.batch // n, cfg.dim), x.shape  # (B/dp, D)
    loss, grads = local_grads(params, x)
    g = lax.psum_scatter(flatten(grads, n), "dp", tiled=True) / n  # (Φ_pad/N,) my slice, mean
    shard = g.shape[0]
    w = lax.dynamic_slice_in_dim(flatten(params, n), lax.axis_index("dp") * shard, shard)  # (Φ_pad/N,)
    assert all(a.shape == (shard,) for a in jax.tree.leaves(opt_state) if a.ndim)  # my moments only
    updates, opt_state = tx.update(g, opt_state, w)
    w = optax.apply_updates(w, updates)  # (Φ_pad/N,)
    flat = lax.all_gather(w, "dp", tiled=True, to="invarying")  # (Φ_pad,) same on every device
    return unflatten(flat, params), opt_state, loss[None], g


def shard_map_setup(cfg: Config, problem: Problem, mesh, variant: str):
    """(state, jitted step): step(*state, x) -> (*state, local losses (N,), grads)."""
    tx, n = make_optimizer(cfg), cfg.world_size
    params = [jax.device_put(jnp.asarray(w, jax_dtype(cfg)), NamedSharding(mesh, P()))
              for w in problem.weights]  # L × (D, D) replicated
    if variant == "dp":
        body, opt_state = shard_map_dp_step, tx.init(params)
        opt_spec, grad_spec = P(), P()
    else:  # AdamW state of one flat vector, split in N contiguous slices
        body, opt_state = shard_map_zero1_step, tx.init(flatten(params, n))
        opt_spec, grad_spec = P("dp"), P("dp")
    opt_specs = jax.tree.map(lambda a: opt_spec if a.ndim else P(), opt_state)
    opt_state = jax.device_put(opt_state, jax.tree.map(partial(NamedSharding, mesh), opt_specs))
    step = jax.shard_map(partial(body, cfg, tx), mesh=mesh, check_vma=True,
                         in_specs=(P(), opt_specs, P("dp")),
                         out_specs=(P(), opt_specs, P("dp"), grad_spec))
    return (params, opt_state), jax.jit(step, donate_argnums=(0, 1))


# --- jit: shardings on the arrays, XLA inserts the collectives ---------------------------------

def jit_setup(cfg: Config, problem: Problem, mesh, variant: str):
    """MaxText style: an NNX model whose kernels are annotated replicated, nnx.Optimizer; the
    step is a pure function of (model state, optimizer state, x) under jax.jit."""
    model = build_model(cfg, problem, mesh, kernel_axes=(None, None))  # kernels P(None, None)
    with jax.set_mesh(mesh):  # the AdamW moments inherit the kernels' sharding metadata...
        opt = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    grad_spec = P()
    # ...which ZeRO-1 changes: every (D, D) moment split over dp by rows. GSPMD needs even
    # shards, so when D % N != 0 the moments stay replicated (shard_map/zero1 pads instead).
    if variant == "zero1" and cfg.dim % cfg.world_size == 0:
        grad_spec = P("dp", None)
        for _, v in nnx.iter_graph(opt):
            if isinstance(v, nnx.OptVariable) and v.ndim == 2:
                v.set_metadata(out_sharding=("dp", None))
    model_def, params = nnx.split(model)
    opt_def, opt_state = nnx.split(opt)
    param_shardings = nnx.get_named_sharding(params, mesh)  # P(None, None) each
    opt_shardings = nnx.get_named_sharding(opt_state, mesh)  # scalars P()
    opt_state = jax.device_put(opt_state, opt_shardings)
    grad_shardings = jax.tree.map(lambda _: NamedSharding(mesh, grad_spec), params)

    def step(params, opt_state, x):
        model, opt = nnx.merge(model_def, params), nnx.merge(opt_def, opt_state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)  # global mean
        opt.update(model, grads)
        # Pin the intended layouts; without them XLA may keep the updated params sharded.
        return (lax.with_sharding_constraint(nnx.state(model), param_shardings),
                lax.with_sharding_constraint(nnx.state(opt), opt_shardings),
                loss, lax.with_sharding_constraint(grads, grad_shardings))

    return (params, opt_state), jax.jit(step, donate_argnums=(0, 1))


# --- training loop shared by every variant ------------------------------------------------------

def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    cfg.check("dp")
    if (style, variant) not in VARIANTS:
        raise ValueError(f"dp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    if mesh.shape["dp"] != cfg.world_size:
        raise ValueError(f"mesh has dp={mesh.shape['dp']} devices, cfg.world_size={cfg.world_size}")
    x = jax.device_put(inputs(cfg, problem), NamedSharding(mesh, P("dp")))  # (B, D) as N × (B/dp, D)
    setup = shard_map_setup if style == "shard_map" else jit_setup
    state, step = setup(cfg, problem, mesh, variant)
    compiled = step.lower(*state, x).compile()  # compile outside the timed loop
    comm = comm_from_hlo(compiled.as_text())  # = comm_of(step, *state, x), without compiling twice

    losses, step_times, grads0 = [], [], None
    for k in range(cfg.steps):
        t0 = time.perf_counter()
        *state, loss, grads = compiled(*state, x)
        jax.block_until_ready((state, loss))
        step_times.append(time.perf_counter() - t0)
        losses.append(float(np.mean(to_numpy(loss))))  # shard_map: mean of N local losses
        if k == 0:
            grads0 = [to_numpy(g) for g in jax.tree.leaves(grads)]  # layer order
    params, opt_state = state
    final = [to_numpy(w) for w in jax.tree.leaves(params)]
    if variant == "zero1" and style == "shard_map":  # the flat gradient, gathered by device_get
        grads0 = unflatten(grads0[0], final)
    return Trained(
        losses=losses,
        grads0=grads0,
        params=final,
        step_times=step_times,
        comm=comm,
        comm_theory=zero1_comm_bytes(cfg) if variant == "zero1" else dp_comm_bytes(cfg),
        state_bytes={
            "params": tree_bytes(params, per_device=True),
            "grads": tree_bytes(params, per_device=True),  # full local gradients inside the step
            "optimizer": tree_bytes(opt_state, per_device=True),
        },
        extra={"local_batch": cfg.batch // cfg.world_size},
    )
