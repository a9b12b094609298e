"""Pipeline parallelism in JAX: the circular (SPMD) pipeline, trained by autodiff of the schedule.

Sharded: the L layers, stacked per stage as (S, L/S, D, D) and split over the ``pp`` mesh axis, so
device s holds layers s·L/S … (s+1)·L/S − 1 (and their grads and AdamW state: Φ/S each). The
batch (B, D) is cut into M micro-batches (M, B/M, D), replicated (only stage 0 reads them).

Schedule ("circular": the shift wraps round; GSPMD's shifting-buffer pipeline): M + S − 1
iterations; in iteration t every stage s runs its layers on micro-batch t − s at once, then
every activation moves one stage on (s → s+1, the last wraps round to 0, where it is ignored).
Stage s is idle ("bubble": micro-batch t − s outside 0 … M−1) in S − 1 of the iterations: it
still computes — SPMD runs the same program everywhere — on zeros, and the output is masked to
zero, so bubble work never reaches the loss and contributes exactly nothing to the gradients.
Backward is jax.grad of the whole unrolled schedule: it is the same pipeline run in reverse,
each shift transposed into a shift s+1 → s (GPipe order: all forwards, then all backwards).

Communication per step, per device (shared.theory.pp_circular_permute_count / _bytes):
  fwd: a collective-permute of (B/M, D) after each iteration but the last: M + S − 2
  bwd: its transpose, one per forward shift:                                M + S − 2
  shard_map: 2·(M + S − 2)·(B/M)·D·b in all, plus an all-reduce of the scalar loss (b bytes).
  jit: XLA transposes jnp.roll (slice + concatenate → pad + split) into TWO permutes per shift
  (pairs s+1 → s, and the wrap 0 → S−1): 3·(M + S − 2) ledger entries, the same bytes per device
  on the wire, since each device sends in only one of the two.
torch's explicit pipeline sends ((s<S−1) + (s>0))·M messages on stage s: only real micro-batches
over real edges. The circular SPMD program shifts on every device in every iteration, bubbles
and the wrap-around edge S−1 → 0 included: 2·(S−2) more messages per device than torch's middle
stages send, and every device (not only middle ones) sends that many.

Styles:
  shard_map  the loop body sees one stage: w (1, L/S, D, D), shift = lax.ppermute over ``pp``.
  jit        the loop sees all stages as arrays with a leading (S,) axis sharded over ``pp``;
             jax.vmap runs the stages, the shift is jnp.roll(·, 1, axis=0) under a sharding
             constraint, and XLA's SPMD partitioner turns the roll into collective-permutes.

Papers: Huang et al. 2019 (GPipe); the SPMD formulation: Xu et al. 2021 (GSPMD, arXiv:2105.04663).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo
from jax_impl.model import gelu, jax_dtype, make_optimizer, to_numpy, tree_bytes
from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import pp_bubble_fraction, pp_circular_permute_bytes, pp_circular_permute_count

VARIANTS = (("shard_map", "circular"), ("jit", "circular"))


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "pp", device)


def stage_forward(w: jax.Array, x: jax.Array) -> jax.Array:
    """One stage: its L/S layers. w (L/S, D, D), x (B/M, D)."""
    for l in range(w.shape[0]):
        x = gelu(x @ w[l])  # (B/M, D)
    return x


def working(t: int, stages: int, microbatches: int) -> np.ndarray:
    """(S,) bool: which stages hold a real micro-batch (t − s in 0 … M−1) in iteration t."""
    mb = t - np.arange(stages)
    return (mb >= 0) & (mb < microbatches)


def shard_map_loss(w: jax.Array, xs: jax.Array, mesh) -> jax.Array:
    """Full-batch loss of the circular pipeline; w (S, L/S, D, D) sharded over pp, xs (M, B/M, D)."""
    S, M = w.shape[0], xs.shape[0]
    shift = [(i, (i + 1) % S) for i in range(S)]  # stage s → s+1, last → 0 (ignored there)

    def body(w, xs):
        assert w.shape[0] == 1 and xs.shape[0] == M, (w.shape, xs.shape)  # (1, L/S, D, D), (M, B/M, D)
        s = lax.axis_index("pp")
        state = jnp.zeros(xs.shape[1:], xs.dtype)  # (B/M, D): this stage's input
        outs = []
        for t in range(M + S - 1):  # Python loop: the ledger sees every collective-permute
            x = jnp.where(s == 0, xs[min(t, M - 1)], state)  # stage 0 feeds micro-batch t
            y = stage_forward(w[0], x)  # (B/M, D)
            y = jnp.where((t - s >= 0) & (t - s < M), y, 0)  # bubble: zero value, zero grad
            if t >= S - 1:
                outs.append(y)  # micro-batch t − S + 1, meaningful on the last stage
            if t < M + S - 2:
                state = lax.ppermute(y, "pp", shift)  # (B/M, D) from stage s − 1
        loss = jnp.mean(jnp.stack(outs) ** 2)  # mean of M equal micro-batch means = full-batch mean
        return lax.psum(jnp.where(s == S - 1, loss, 0), "pp")  # the last stage's loss, everywhere

    # Differentiated OUTSIDE shard_map (jax.grad of this function): the gradient of the
    # replicated scalar loss flows back through psum / ppermute transposes, no manual scaling.
    return jax.shard_map(body, mesh=mesh, in_specs=(P("pp"), P()), out_specs=P(), check_vma=True)(w, xs)


def jit_loss(w: jax.Array, xs: jax.Array, mesh) -> jax.Array:
    """The same schedule written on whole arrays; the (S,) stage axis is sharded over pp."""
    S, M = w.shape[0], xs.shape[0]
    by_stage = NamedSharding(mesh, P("pp"))
    state = jnp.zeros((S,) + xs.shape[1:], xs.dtype)  # (S, B/M, D): row s = stage s's input
    last = np.arange(S)[:, None, None] == S - 1  # (S, 1, 1): the last stage's row
    sq = jnp.zeros_like(state)  # (S, B/M, D): sum over finished micro-batches of y², last row only
    for t in range(M + S - 1):
        state = lax.with_sharding_constraint(state.at[0].set(xs[min(t, M - 1)]), by_stage)  # (S, B/M, D)
        y = jax.vmap(stage_forward)(w, state)  # (S, B/M, D): every stage at once, each on its device
        y = jnp.where(working(t, S, M)[:, None, None], y, 0)  # bubbles: zero value, zero grad
        if t >= S - 1:  # micro-batch t − S + 1 leaves the last stage
            sq = sq + jnp.where(last, y**2, 0)  # kept (S, …)-sharded: y[S − 1] would gather it
        if t < M + S - 2:
            state = lax.with_sharding_constraint(jnp.roll(y, 1, axis=0), by_stage)  # s → s+1
    return jnp.sum(sq) / (xs.shape[0] * xs.shape[1] * xs.shape[2])  # / (B·D): the full-batch mean


def make_step(style: str, mesh, tx):
    loss_of = shard_map_loss if style == "shard_map" else jit_loss

    @jax.jit
    def step(w, opt_state, xs):
        loss, grads = jax.value_and_grad(loss_of)(w, xs, mesh)  # grads (S, L/S, D, D), sharded
        updates, opt_state = tx.update(grads, opt_state, w)
        return jax.tree.map(lambda a, u: a + u, w, updates), opt_state, loss, grads

    return step


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    cfg.check("pp")
    S, M, per = cfg.world_size, cfg.microbatches, cfg.layers // cfg.world_size
    assert mesh.shape["pp"] == S, (mesh.shape, S)
    dtype = jax_dtype(cfg)
    stacked = np.stack(problem.weights).reshape(S, per, cfg.dim, cfg.dim)  # (S, L/S, D, D)
    w = jax.device_put(jnp.asarray(stacked, dtype), NamedSharding(mesh, P("pp")))
    xs = jax.device_put(jnp.asarray(problem.inputs.reshape(M, cfg.batch // M, cfg.dim), dtype),
                        NamedSharding(mesh, P()))  # (M, B/M, D), replicated
    tx = make_optimizer(cfg)
    opt_state = jax.jit(tx.init)(w)  # moments inherit w's sharding: (S, L/S, D, D) over pp
    step = make_step(style, mesh, tx)
    compiled = step.lower(w, opt_state, xs).compile()  # compile outside the timed loop
    comm = comm_from_hlo(compiled.as_text())  # = comm_of(step, …), without compiling twice
    losses, step_times, grads0 = [], [], None
    for k in range(cfg.steps):
        t0 = time.perf_counter()
        w, opt_state, loss, grads = compiled(w, opt_state, xs)
        losses.append(float(loss))  # float() waits for the devices
        step_times.append(time.perf_counter() - t0)
        if k == 0:
            grads0 = list(to_numpy(grads).reshape(cfg.layers, cfg.dim, cfg.dim))
    return Trained(
        losses=losses,
        grads0=grads0,
        params=list(to_numpy(w).reshape(cfg.layers, cfg.dim, cfg.dim)),
        step_times=step_times,
        comm=comm,
        comm_theory=pp_circular_permute_bytes(cfg, style) + cfg.bytes_per_element,  # + the loss all-reduce
        state_bytes={"params": tree_bytes(w, per_device=True), "grads": tree_bytes(grads, per_device=True),
                     "optimizer": tree_bytes(opt_state, per_device=True)},
        extra={"bubble_theory": pp_bubble_fraction(S, M), "iterations": M + S - 1,
               "permute_count_theory": pp_circular_permute_count(cfg, style)},
    )
