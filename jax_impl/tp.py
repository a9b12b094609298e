"""Tensor parallelism (TP): every weight is split over the mesh axis "tp"; every device sees the full batch.

From Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, §3) and the CS336 lecture-8 code (forward
only, random shards); here device r's shard is a SLICE of the fixture weight W_l and we train
(forward, backward, AdamW on the sharded arrays). S = B·D·b below.

- shard_map/allgather (the CS336 scheme): every layer column-parallel, W_l is P(None, "tp"), a
  (D, D/tp) shard per device. fwd: y = gelu(x @ W_l,r) (B, D/tp) -- GELU is elementwise, so it
  runs on the shard BEFORE the gather -- then all_gather -> (B, D). bwd: autodiff transposes
  all_gather into psum_scatter (each device's dL/dx is partial: it only used its own columns). The
  last gather is ``to="invarying"``: the loss is computed from the same full output on every device,
  so the transpose is a local slice, no collective.
  Per step per device: L all-gathers + (L-1) reduce-scatters, S each.
- shard_map/megatron: column-parallel P(None, "tp") then row-parallel P("tp", None) pairs, GELU local
  in between; Megatron's f is ``pcast(x, to="varying")`` (identity fwd, its transpose is psum) and
  g is ``psum`` (all-reduce fwd, its transpose is identity). Odd L: last layer column + all-gather.
  Per step per device: floor(L/2) all-reduces fwd + ceil(L/2)-1 bwd + (L mod 2) all-gathers, S each.
- jit/allgather, jit/megatron: the Flax NNX MLP with per-layer ``nnx.with_partitioning`` kernel axes
  (None, "tp") / ("tp", None) and ``with_sharding_constraint`` on the activations; XLA (GSPMD) inserts
  the collectives, which the HLO ledger reports.

Loss: every device holds the full output, so the loss needs no collective.
Memory per device: params, grads, AdamW moments all 1/tp: Φ·b/tp, Φ·b/tp, 2·Φ·b/tp.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo
from jax_impl.model import MLP, gelu, inputs, jax_dtype, make_optimizer, params_of, to_numpy, tree_bytes
from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import tp_comm_bytes

VARIANTS = (("shard_map", "allgather"), ("shard_map", "megatron"), ("jit", "allgather"), ("jit", "megatron"))
KERNEL_AXES = {"col": (None, "tp"), "row": ("tp", None)}  # W_l's columns / rows split over "tp"


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "tp", device)


def layer_kinds(layers: int, variant: str) -> list[str]:
    """Per layer: "col" (device holds W_l[:, shard], (D, D/tp)) or "row" (W_l[shard, :], (D/tp, D))."""
    if variant == "allgather":
        return ["col"] * layers
    return ["col", "row"] * (layers // 2) + ["col"] * (layers % 2)  # odd L: last col + all-gather


# --- the collectives: JAX's transpose rules give the backward that torch writes by hand ----------


def gather_columns(y: jax.Array, grad_is_partial: bool) -> jax.Array:
    """all-gather (B, D/tp) -> (B, D). "varying" transposes to psum_scatter (reduce-scatter);
    "invarying" (the output is the same on every device) transposes to a local slice."""
    return lax.all_gather(y, "tp", axis=1, tiled=True, to="varying" if grad_is_partial else "invarying")


def copy_to_tp(x: jax.Array) -> jax.Array:
    """Megatron's f: identity fwd; replicated -> per-device-varying, whose transpose is psum."""
    return lax.pcast(x, "tp", to="varying")


def reduce_from_tp(z: jax.Array) -> jax.Array:
    """Megatron's g: psum fwd (sum the row-parallel partial products); its transpose is identity."""
    return lax.psum(z, "tp")


# --- the two shard_map bodies (per-device code: local shapes asserted) ---------------------------


def forward_allgather(shards: list[jax.Array], x: jax.Array) -> jax.Array:
    b, d = x.shape
    n = lax.axis_size("tp")
    for l, w in enumerate(shards):
        assert w.shape == (d, d // n), w.shape
        y = gelu(x @ w)  # (B, D/tp): GELU before the gather
        x = gather_columns(y, l < len(shards) - 1)  # (B, D)
    return x


def forward_megatron(shards: list[jax.Array], x: jax.Array) -> jax.Array:
    b, d = x.shape
    n = lax.axis_size("tp")
    for wa, wb in zip(shards[0::2], shards[1::2], strict=False):  # (col, row) pairs; odd L: last one left
        assert wa.shape == (d, d // n) and wb.shape == (d // n, d), (wa.shape, wb.shape)
        h = gelu(copy_to_tp(x) @ wa)  # f; (B, D/tp)
        x = gelu(reduce_from_tp(h @ wb))  # g; (B, D)
    if len(shards) % 2:  # odd L: a lone column-parallel layer, gathered for the loss
        w = shards[-1]
        assert w.shape == (d, d // n), w.shape
        x = gather_columns(gelu(copy_to_tp(x) @ w), False)  # (B, D)
    return x


def shard_map_loss(mesh, variant: str, kinds: list[str]):
    """loss(params, x) with the forward inside shard_map. We differentiate OUTSIDE it: JAX then
    transposes the whole shard_map (all_gather -> psum_scatter, pcast -> psum, psum -> identity),
    the grads come out sharded like the params, and the form stays right if a replicated parameter
    is ever added (a grad taken inside is already summed over devices for a replicated input)."""
    forward = forward_allgather if variant == "allgather" else forward_megatron
    local_loss = lambda shards, x: jnp.mean(forward(shards, x) ** 2)  # full output: no collective
    specs = [P(*KERNEL_AXES[k]) for k in kinds]
    return jax.shard_map(local_loss, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=True)


# --- jit: Flax NNX with per-layer kernel axes, XLA inserts the collectives -----------------------


def build_tp_model(cfg: Config, problem: Problem, mesh, kinds: list[str]) -> MLP:
    """jax_impl.model.build_model takes ONE kernel_axes for every layer; Megatron needs a list.
    Built inside nnx.jit under the mesh, so each device only ever holds its shard."""

    def make():
        model = MLP(problem.params, jax_dtype(cfg))
        for layer, kind in zip(model.layers, kinds, strict=True):
            layer.kernel = nnx.Param(layer.kernel[...], out_sharding=KERNEL_AXES[kind])
        return model

    with jax.set_mesh(mesh):
        return nnx.jit(make)()


def jit_loss(graphdef, mesh, variant: str, kinds: list[str]):
    """Activations: replicated P() after every gathered / row-parallel layer; P(None, "tp") after a
    column-parallel layer that feeds a row-parallel one (Megatron keeps it sharded: no gather)."""
    specs = [P() if variant == "allgather" or k == "row" or l == len(kinds) - 1 else P(None, "tp")
             for l, k in enumerate(kinds)]

    def loss(params, x):
        model = nnx.merge(graphdef, params)
        for layer, spec in zip(model.layers, specs, strict=True):
            x = lax.with_sharding_constraint(gelu(layer(x)), NamedSharding(mesh, spec))  # (B, D)
        return jnp.mean(x**2)

    return loss


# --- training ------------------------------------------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    if (style, variant) not in VARIANTS:
        raise ValueError(f"tp: unknown variant {style}/{variant}")
    cfg.check("tp")
    kinds = layer_kinds(cfg.layers, variant)
    x = jax.device_put(inputs(cfg, problem), NamedSharding(mesh, P()))  # (B, D) on every device
    if style == "shard_map":
        params = [jax.device_put(jnp.asarray(w, jax_dtype(cfg)), NamedSharding(mesh, P(*KERNEL_AXES[k])))
                  for w, k in zip(problem.weights, kinds, strict=True)]  # L × (D, D), sharded
        loss_of, kernels = shard_map_loss(mesh, variant, kinds), list
    else:
        graphdef, params = nnx.split(build_tp_model(cfg, problem, mesh, kinds))
        loss_of = jit_loss(graphdef, mesh, variant, kinds)
        kernels = lambda tree: params_of(nnx.merge(graphdef, tree))
    tx = make_optimizer(cfg)
    opt_state = tx.init(params)  # zeros_like keeps each param's sharding

    @jax.jit
    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(loss_of)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    compiled = step.lower(params, opt_state, x).compile()  # compile before timing
    comm = comm_from_hlo(compiled.as_text())  # what comm_of(step, ...) reads, without a recompile

    losses, step_times, grads0, grads = [], [], None, None
    for k in range(cfg.steps):
        t0 = time.perf_counter()
        params, opt_state, loss, grads = compiled(params, opt_state, x)
        losses.append(float(loss))  # float() waits for the device
        step_times.append(time.perf_counter() - t0)
        if k == 0:
            grads0 = [to_numpy(g) for g in kernels(grads)]  # device_get gathers the shards
    return Trained(
        losses=losses,
        grads0=grads0,
        params=[to_numpy(w) for w in kernels(params)],
        step_times=step_times,
        comm=comm,
        comm_theory=tp_comm_bytes(cfg, variant),
        state_bytes={"params": tree_bytes(params, per_device=True),
                     "grads": tree_bytes(grads, per_device=True),
                     "optimizer": tree_bytes(opt_state, per_device=True)},
        extra={"layer_kinds": kinds},
    )
