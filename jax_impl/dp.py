"""Data parallelism (DP) in JAX: every device holds the whole model, trains on its slice of the
global batch, and the gradients are averaged across the ``dp`` mesh axis before the update.

Sharded: the batch, P('dp'): device r sees rows r·B/N … (r+1)·B/N, the MLP's (B/dp, D) inputs
or the transformer's (B/dp, T) tokens and targets. Weights are replicated, P(); the AdamW state
too, except in ZeRO-1, which splits it over 'dp'. One rules function (``rules``: parameter name
and shape -> mesh axes) says so for any model; the shard_map bodies run on the {name: array}
dict (jax_impl.model.loss_fn), the jit steps on the NNX model built with the same rules.

    shard_map/dp     jax.shard_map, explicit collectives: local grads, then lax.pmean.
    jit/dp           the same step as one jax.jit program over NamedSharding inputs (batch
                     P('dp'), Flax NNX params P() via nnx.with_partitioning): XLA's SPMD
                     partitioner (GSPMD, Xu et al. 2021) inserts the all-reduce itself.
    shard_map/zero1  ZeRO stage 1 (Rajbhandari et al. 2020): psum_scatter the flat gradient,
                     optax on this device's 1/N slice, all_gather the updated parameters.
    jit/zero1        AdamW moments split on dim 0, P('dp', None, …) where N divides it, params P():
                     XLA picks the collectives (the ledger shows which).

Communication per step and device (payload S as nccl-tests counts it, shared.theory; Φ of either
model, the embedding gradients dense (V, D) / (T, D) scatter-adds, sent whole):
    dp       bwd: all-reduce dW over dp                     Φ·b   = dp_comm_bytes
    zero1    reduce-scatter dW + all-gather W over dp       2·Φ·b = zero1_comm_bytes
The shard_map steps return each device's local loss (out_specs P('dp')); the reported loss is
their mean, taken on the host, so the ledger holds gradient (and parameter) traffic only. The
jit steps compute the global mean loss inside the program (one scalar all-reduce more).
"""

from __future__ import annotations

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
from jax_impl.harness import Setup, leaves_fixture, train_loop
from jax_impl.model import (
    build_model,
    inputs,
    jax_dtype,
    loss_fn,
    make_optimizer,
    module_fixture,
    output_loss,
    spec,
    targets,
    to_numpy,
)
from jax_impl.transformer import Rules
from shared.config import Config
from shared.problem import Problem, param_names
from shared.results import Trained
from shared.theory import dp_comm_bytes, zero1_comm_bytes

VARIANTS = (("shard_map", "dp"), ("jit", "dp"), ("shard_map", "zero1"), ("jit", "zero1"))


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "dp", device)


def rules(cfg: Config, variant: str, moments: bool = False) -> Rules:
    """dp's sharding rules, for any model: (name, shape) -> mesh axis per dim. Parameters and
    gradients are replicated, and so are the AdamW moments, except in ZeRO-1 (``moments``): there
    dim 0 goes on 'dp' when N divides it (GSPMD needs even shards; shard_map/zero1 pads a flat
    vector instead), else the moment stays replicated."""
    n = cfg.world_size

    def rule(name: str, shape: tuple[int, ...]) -> tuple:
        if moments and variant == "zero1" and len(shape) and shape[0] % n == 0:
            return ("dp",) + (None,) * (len(shape) - 1)
        return (None,) * len(shape)
    return rule


def flatten(ws, n: int) -> jax.Array:
    """All arrays as one vector, zero-padded to a multiple of n (torch: _flatten_dense_tensors)."""
    flat = jnp.concatenate([w.reshape(-1) for w in ws])  # (Φ,)
    return jnp.pad(flat, (0, -flat.size % n))  # (Φ_pad,)


def unflatten(flat, like) -> list:
    """Inverse of ``flatten``: slices of ``flat`` shaped like the arrays in ``like``."""
    sizes = np.cumsum([0] + [int(np.prod(w.shape)) for w in like])
    return [flat[a:b].reshape(w.shape) for a, b, w in zip(sizes[:-1], sizes[1:], like)]


# --- shard_map: the collectives are written out ------------------------------------------------

def local_grads(cfg: Config, params: dict, x, y=None):
    """This device's loss and gradient on its B/dp rows. With check_vma the replicated
    params are *invariant* over 'dp'; differentiating w.r.t. them would transpose the implicit
    invariant->varying cast into a psum, handing back gradients already summed over devices.
    We cast them to *varying* first, so grad is the LOCAL gradient (as torch's backward), and
    the averaging is an explicit collective below. (The other correct form is grad of
    pmean(local_loss) w.r.t. the invariant params: autodiff then inserts that psum itself.)"""
    local = lax.pcast(params, "dp", to="varying")
    return jax.value_and_grad(loss_fn)(local, x, y, cfg)  # (), {name: like the param}


def allreduce_gradients(grads):
    return lax.pmean(grads, "dp")  # all-reduce, Φ·b: every device gets the mean


def shard_map_dp_step(cfg: Config, tx, params, opt_state, x, y=None):
    assert x.shape[0] == cfg.batch // cfg.world_size, x.shape  # (B/dp, D) | tokens (B/dp, T)
    loss, grads = local_grads(cfg, params, x, y)
    grads = allreduce_gradients(grads)  # {name: full gradient}, invariant over dp
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss[None], grads


def shard_map_zero1_step(cfg: Config, tx, params, opt_state, x, y=None):
    n, names = cfg.world_size, param_names(cfg)  # the flat layout follows the fixture's order
    assert x.shape[0] == cfg.batch // n, x.shape  # (B/dp, D) | tokens (B/dp, T)
    loss, grads = local_grads(cfg, params, x, y)
    g = lax.psum_scatter(flatten([grads[k] for k in names], n), "dp", tiled=True) / n  # (Φ_pad/N,) mean
    shard = g.shape[0]
    w = lax.dynamic_slice_in_dim(flatten([params[k] for k in names], n),
                                 lax.axis_index("dp") * shard, shard)  # (Φ_pad/N,) my slice
    assert all(a.shape == (shard,) for a in jax.tree.leaves(opt_state) if a.ndim)  # my moments only
    updates, opt_state = tx.update(g, opt_state, w)
    w = optax.apply_updates(w, updates)  # (Φ_pad/N,)
    flat = lax.all_gather(w, "dp", tiled=True, to="invarying")  # (Φ_pad,) same on every device
    return dict(zip(names, unflatten(flat, [params[k] for k in names]))), opt_state, loss[None], g


def shard_map_setup(cfg: Config, problem: Problem, mesh, variant: str, batch: tuple) -> Setup:
    """Params as the {name: array} dict, placed by the rules (replicated); AdamW over the dict
    (dp) or over one flat vector split in N contiguous slices (zero1)."""
    tx, n, names, rule = make_optimizer(cfg), cfg.world_size, param_names(cfg), rules(cfg, variant)
    param_specs = {k: spec(rule, k, w.shape) for k, w in problem.params.items()}  # P(None, …) each
    params = {k: jax.device_put(jnp.asarray(w, jax_dtype(cfg)), NamedSharding(mesh, param_specs[k]))
              for k, w in problem.params.items()}
    if variant == "dp":
        body, opt_state, opt_spec, grad_spec = shard_map_dp_step, tx.init(params), P(), param_specs
    else:
        body, opt_state = shard_map_zero1_step, tx.init(flatten([params[k] for k in names], n))
        opt_spec, grad_spec = P("dp"), P("dp")  # (Φ_pad,) as N × (Φ_pad/N,)
    opt_specs = jax.tree.map(lambda a: opt_spec if a.ndim else P(), opt_state)
    opt_state = jax.device_put(opt_state, jax.tree.map(partial(NamedSharding, mesh), opt_specs))
    step = jax.shard_map(partial(body, cfg, tx), mesh=mesh, check_vma=True,
                         in_specs=(param_specs, opt_specs, *[P("dp")] * len(batch)),
                         out_specs=(param_specs, opt_specs, P("dp"), grad_spec))
    by_name = partial(leaves_fixture, names=names)  # jit hands dicts back key-sorted

    def grads_fixture(g):  # zero1: the flat mean gradient, gathered by device_get
        return by_name(g) if variant == "dp" else unflatten(to_numpy(g), problem.params.values())
    return Setup(step=jax.jit(step, donate_argnums=(0, 1)), state=(params, opt_state), batch=batch,
                 grads_fixture=grads_fixture, params_fixture=lambda state: by_name(state[0]))


# --- jit: shardings on the arrays, XLA inserts the collectives ---------------------------------

def jit_setup(cfg: Config, problem: Problem, mesh, variant: str, batch: tuple) -> Setup:
    """MaxText style: an NNX model whose parameters are placed by the rules (replicated),
    nnx.Optimizer; the step is a pure function of (model state, optimizer state, batch) under jax.jit."""
    model = build_model(cfg, problem, mesh, rules=rules(cfg, variant))
    with jax.set_mesh(mesh):  # the AdamW moments inherit the parameters' sharding metadata...
        opt = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    moment_rule = rules(cfg, variant, moments=True)
    for path, v in nnx.iter_graph(opt):  # ...which ZeRO-1 changes: moments split over dp by rows
        if isinstance(v, nnx.OptVariable) and v.ndim:
            v.set_metadata(out_sharding=moment_rule(".".join(map(str, path)), v.shape))
    model_def, params = nnx.split(model)
    opt_def, opt_state = nnx.split(opt)
    param_shardings = nnx.get_named_sharding(params, mesh)  # P(None, …) each
    opt_shardings = nnx.get_named_sharding(opt_state, mesh)  # scalars P()
    opt_state = jax.device_put(opt_state, opt_shardings)
    # Gradients laid out as the moments they feed (zero1: row-split where the rules split).
    grad_shardings = jax.tree.map(lambda a: NamedSharding(mesh, spec(moment_rule, "", a.shape)), params)

    def step(params, opt_state, x, y=None):
        model, opt = nnx.merge(model_def, params), nnx.merge(opt_def, opt_state)
        loss, grads = nnx.value_and_grad(lambda m: output_loss(m(x), y))(model)  # global mean
        opt.update(model, grads)
        # Pin the intended layouts; without them XLA may keep the updated params sharded.
        return (lax.with_sharding_constraint(nnx.state(model), param_shardings),
                lax.with_sharding_constraint(nnx.state(opt), opt_shardings),
                loss, lax.with_sharding_constraint(grads, grad_shardings))

    fixture = partial(module_fixture, model_def)
    return Setup(step=jax.jit(step, donate_argnums=(0, 1)), state=(params, opt_state), batch=batch,
                 grads_fixture=fixture, params_fixture=lambda state: fixture(state[0]))


# --- the dp Setup, for any model: the one loop (jax_impl.harness) runs it ----------------------

def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    cfg.check("dp")
    if (style, variant) not in VARIANTS:
        raise ValueError(f"dp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    if mesh.shape["dp"] != cfg.world_size:
        raise ValueError(f"mesh has dp={mesh.shape['dp']} devices, cfg.world_size={cfg.world_size}")
    rows = NamedSharding(mesh, P("dp"))  # dim 0 split: N × (B/dp, …)
    y = targets(cfg, problem)  # None | (B, T)
    batch = tuple(jax.device_put(a, rows) for a in (inputs(cfg, problem), y) if a is not None)
    setup = (shard_map_setup if style == "shard_map" else jit_setup)(cfg, problem, mesh, variant, batch)
    setup.comm_theory = zero1_comm_bytes(cfg) if variant == "zero1" else dp_comm_bytes(cfg)
    setup.extra = {"local_batch": cfg.batch // cfg.world_size}
    return train_loop(cfg, setup)
