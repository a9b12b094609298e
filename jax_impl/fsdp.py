"""ZeRO-2 / ZeRO-3 (FSDP) in JAX: jax.shard_map with explicit collectives, and jax.jit with shardings.
ZeRO: Rajbhandari et al. 2020, arXiv:1910.02054; FSDP: Zhao et al. 2023, arXiv:2304.11277.

Batch as in DP: device r trains on rows r·B/N:(r+1)·B/N, P('dp'). Weight shards are row blocks of
the fixture weight, W_l[r·D/N:(r+1)·D/N, :] = P('dp', None), (D/N, D): the slice torch_impl/fsdp.py
holds (there all_gather_single concatenates along dim 0, so rows need no copies).

shard_map/zero3  params, grads and optax state all (D/N, D) per device.
    fwd: all_gather(tiled=True) of W_l right before layer l. Each layer is a jax.checkpoint whose
         policy saves only x @ W_l, so W_l is not kept: the backward gathers it again.
    bwd: the transpose of all_gather is psum_scatter: autodiff itself emits the reduce-scatter of
         dW_l. Layer 0's input is x (no gradient), so W_0 is not needed and not re-gathered.
    payload S per step per device: 2L−1 all-gathers + L reduce-scatters of D²·b = 3·Φ·b − D²·b
    (the textbook 3·Φ·b counts W_0's useless re-gather); each moves S·(N−1)/N on the wire.
shard_map/zero2  full replicated params; dW_l psum_scatter-ed to (D/N, D); optax on the row shard;
    all_gather of the updated shards: 2·Φ·b.
jit/zero3        NNX kernels annotated ('dp', None), batch P('dp'), nnx.Optimizer (moments inherit
    the sharding); XLA picks the collectives. On CPU it gathers each W_l once, keeps it for the
    backward and all-reduces the full dW (then keeps its rows): Φ·b + Φ·b, no reduce-scatter.
jit/zero2        replicated kernels; moments and gradients constrained to P('dp', None).
The shard_map steps return each device's share of the loss, summed outside the step (bookkeeping,
as torch_impl/dp.py does): the ledger holds ZeRO traffic only. The jit steps' loss is the global
mean, so XLA adds it to its gradient all-reduce.
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo
from jax_impl.model import build_model, gelu, inputs, jax_dtype, make_optimizer, to_numpy, tree_bytes
from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import zero2_comm_bytes, zero3_comm_bytes, zero3_skip_first_comm_bytes

VARIANTS = (("shard_map", "zero3"), ("shard_map", "zero2"), ("jit", "zero3"), ("jit", "zero2"))
ROWS = P("dp", None)  # W_l's row block r on device r: (D/N, D)


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "dp", device)


# --- shard_map: the collectives written out ----------------------------------------------------
# check_vma=True: JAX types every value as invariant (the same on every device) or varying over
# 'dp'. Both steps differentiate this device's SHARE of the global loss, local mean / N (varying),
# with respect to varying values — zero3: the shards; zero2: a pcast copy of the replicated params.
# So each device gets only its own contribution, and one psum_scatter (zero3: autodiff's transpose
# of all_gather; zero2: written out) sums the N contributions into this device's rows of the mean
# gradient. Differentiating w.r.t. the invariant params instead would make JAX psum the gradient
# for us (an all-reduce: not ZeRO), and pmean-ing that again is N× too large.


def local_share(layer, params, x: jax.Array) -> jax.Array:
    """() this device's share of the global mean loss; the N shares sum to it (no collective)."""
    for w in params:
        x = layer(w, x)  # (B/N, D)
    return jnp.mean(x**2) / lax.axis_size("dp")


# Remat policy: keep only x @ W_l for the backward (plus the inputs x and the shard, always kept).
# NOT "save everything except the name of the gathered W": the unnamed all_gather output itself
# would then count as saveable and W_l would be kept, silently turning ZeRO-3 back into 2 gathers.
@partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names("pre_activation"))
def zero3_layer(w_shard: jax.Array, x: jax.Array) -> jax.Array:
    w = lax.all_gather(w_shard, "dp", axis=0, tiled=True)  # (D, D) == W_l, this layer only
    return gelu(checkpoint_name(x @ w, "pre_activation"))  # (B/N, D); bwd gathers W_l again


def zero3_step(state, x, *, optimizer):
    shards, opt_state = state
    n = lax.axis_size("dp")
    assert all(w.shape == (w.shape[1] // n, w.shape[1]) for w in shards), [w.shape for w in shards]
    # bwd: all_gather's transpose is psum_scatter -> (D/N, D) rows of the mean dW_l. Layer 0's input
    # is x (no gradient wanted), so autodiff never needs W_0 again: 2L−1 gathers, not 2L.
    share, grads = jax.value_and_grad(partial(local_share, zero3_layer))(shards, x)
    updates, opt_state = optimizer.update(grads, opt_state, shards)  # AdamW on (D/N, D) shards
    return (optax.apply_updates(shards, updates), opt_state), share[None], grads


def zero2_step(state, x, *, optimizer):
    params, opt_state = state
    n, r = lax.axis_size("dp"), lax.axis_index("dp")
    rows = params[0].shape[0] // n
    assert all(w.shape == (rows * n, rows * n) for w in params), [w.shape for w in params]  # (D, D)
    mine = lax.pcast(params, "dp", to="varying")  # this device's copy: its own gradient, no psum
    share, grads = jax.value_and_grad(partial(local_share, lambda w, h: gelu(h @ w)))(mine, x)
    grads = [lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True) for g in grads]  # (D/N, D)
    shards = [lax.dynamic_slice_in_dim(w, r * rows, rows) for w in params]  # (D/N, D) my rows
    updates, opt_state = optimizer.update(grads, opt_state, shards)
    shards = optax.apply_updates(shards, updates)
    params = [lax.all_gather(s, "dp", axis=0, tiled=True, to="invarying") for s in shards]  # (D, D)
    return (params, opt_state), share[None], grads


def shard_map_setup(cfg: Config, problem: Problem, variant: str, mesh):
    optimizer = make_optimizer(cfg)
    p_spec = ROWS if variant == "zero3" else P()
    params = [jax.device_put(jnp.asarray(w, jax_dtype(cfg)), NamedSharding(mesh, p_spec))
              for w in problem.weights]  # L × (D, D) global arrays; zero3: (D/N, D) per device
    opt_state = optimizer.init([jax.device_put(w, NamedSharding(mesh, ROWS)) for w in params])
    o_spec = jax.tree.map(lambda a: ROWS if a.ndim == 2 else P(), opt_state)  # mu, nu rows; count P()
    body = partial(zero3_step if variant == "zero3" else zero2_step, optimizer=optimizer)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=((p_spec, o_spec), P("dp")),
                                 out_specs=((p_spec, o_spec), P("dp"), ROWS), check_vma=True))
    return step, (params, opt_state), lambda state: state


# --- jit: shardings only, XLA (GSPMD) inserts the collectives -------------------------------------


def jit_setup(cfg: Config, problem: Problem, variant: str, mesh):
    rows = NamedSharding(mesh, ROWS)
    model = build_model(cfg, problem, mesh, ("dp", None) if variant == "zero3" else (None, None))
    with jax.set_mesh(mesh):  # the moments inherit the kernels' sharding annotation
        opt = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    if variant == "zero2":  # ZeRO-2: AdamW moments sharded even though the kernels are not
        moments = jax.tree.map(lambda a: jax.device_put(a, rows) if a.ndim == 2 else a,
                               nnx.state(opt, nnx.OptState))
        nnx.update(opt, moments)
    graphdef, state = nnx.split((model, opt))
    shardings = jax.tree.map(lambda a: a.sharding, state)  # keep every array where it started

    def step(state, x):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        if variant == "zero2":  # each device keeps only its rows of the mean gradient
            grads = jax.tree.map(lambda g: lax.with_sharding_constraint(g, rows), grads)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss, [g.kernel[...] for g in grads["layers"].values()]  # (D, D)

    def unpack(state):  # -> (kernels, optimizer state)
        model, opt = nnx.merge(graphdef, state)
        return [layer.kernel[...] for layer in model.layers], nnx.state(opt, nnx.OptState)

    jitted = jax.jit(step, out_shardings=(shardings, None, [rows] * cfg.layers))
    return jitted, state, unpack


def cpu_options(mesh, style: str, variant: str) -> dict | None:
    """XLA:CPU settings (GPU / TPU need neither). 1) Its default scheduler starts every all-gather
    at the top of the step (they depend on parameters only), so all gathered weights are alive at
    once; the memory-optimized one frees each after use (ZeRO-3 temp: (2L−1)·D²·b -> ~2·D²·b).
    2) It drops jax.checkpoint's optimization barriers (pass cse_barrier_expander) BEFORE its last
    CSE pass, which would then merge every backward re-gather into its forward gather, keeping
    W_l alive from forward to backward; GPU / TPU drop them only after scheduling."""
    if mesh.devices.flat[0].platform != "cpu":
        return None
    options = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    if (style, variant) == ("shard_map", "zero3"):
        options["xla_disable_hlo_passes"] = "cse"
    return options


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    if (style, variant) not in VARIANTS:
        raise ValueError(f"fsdp: unknown jax variant {style}/{variant}; choose from {VARIANTS}")
    cfg.check("fsdp")
    x = jax.device_put(inputs(cfg, problem), NamedSharding(mesh, P("dp")))  # (B, D), (B/N, D) each
    setup = shard_map_setup if style == "shard_map" else jit_setup
    step, state, unpack = setup(cfg, problem, variant, mesh)
    with jax.set_mesh(mesh):  # compile once, outside the timed loop
        compiled = step.lower(state, x).compile(compiler_options=cpu_options(mesh, style, variant))

    losses, step_times, grads0 = [], [], None
    for k in range(cfg.steps):
        t0 = time.perf_counter()
        state, loss, grads = compiled(state, x)
        loss.block_until_ready()
        step_times.append(time.perf_counter() - t0)
        losses.append(float(jnp.sum(loss)))  # shard_map: sum of the N shares, outside the step
        if k == 0:
            grads0 = [to_numpy(g) for g in grads]  # gathered (D, D) W_l gradients

    params, opt_state = unpack(state)
    textbook = zero2_comm_bytes(cfg) if variant == "zero2" else zero3_comm_bytes(cfg)
    comm = comm_from_hlo(compiled.as_text())
    extra = {"shard": "rows of W_l", "textbook_comm_bytes": textbook}
    if style == "jit":  # say in words what XLA chose
        gathers = comm.get("all_gather", {}).get("count", 0)
        extra["xla_chose"] = (f"{gathers} weight all-gathers for {cfg.layers} layers; dW by "
                              + ("reduce-scatter" if "reduce_scatter" in comm else "all-reduce + slice"))
    mem = compiled.memory_analysis()
    if mem is not None:  # per device: what the compiled step allocates besides its arguments
        extra.update(temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes),
                     output_bytes=int(mem.output_size_in_bytes))
    return Trained(
        losses=losses,
        grads0=grads0,
        params=[to_numpy(w) for w in params],
        step_times=step_times,
        comm=comm,
        comm_theory=zero3_skip_first_comm_bytes(cfg) if (style, variant) == ("shard_map", "zero3") else textbook,
        state_bytes={"params": tree_bytes(params, per_device=True),
                     "grads": tree_bytes(grads, per_device=True),
                     "optimizer": tree_bytes(opt_state, per_device=True)},
        extra=extra,
    )
