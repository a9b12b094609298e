"""Data parallelism (DP) in JAX: every device holds the whole model, trains on its slice of the
global batch, and the gradients are averaged across the ``dp`` mesh axis before the update.

Sharded: the batch, P('dp'): device r sees rows r·B/N … (r+1)·B/N, the MLP's (B/dp, D) inputs
or the transformer's (B/dp, T) tokens and targets. Weights are replicated, P(); the AdamW state
too, except in ZeRO-1, which splits it over 'dp'. The steps are written once, for any Flax NNX
model and loss: ``jax_impl.parallel.fsdp.parallelize(model, loss, tx, mesh, "dp" | "zero1",
style)``; ``train`` below puts the project's MLP and transformer through it.

A model must offer: a call on a batch whose rows split over 'dp', nnx.Param state only, a loss
that is a mean over the rows.

shard_map with check_vma: the replicated params are *invariant* over 'dp'; differentiating w.r.t.
them would transpose the implicit invariant->varying cast into a psum, handing back gradients
already summed over devices. The step casts them to *varying* first (lax.pcast), so grad is the
LOCAL gradient (as torch's backward) and the averaging is the explicit collective.

    shard_map/dp     jax.shard_map, explicit collectives: local grads, then lax.pmean.
    jit/dp           the same step as one jax.jit program over NamedSharding inputs (batch
                     P('dp'), Flax NNX params P() via nnx.with_partitioning): XLA's SPMD
                     partitioner (GSPMD, Xu et al. 2021) inserts the all-reduce itself.
    shard_map/zero1  ZeRO stage 1 (Rajbhandari et al. 2020): psum_scatter the flat gradient,
                     optax on this device's 1/N slice, all_gather the updated parameters.
    jit/zero1        AdamW moments split on dim 0, P('dp', None, …) where N divides it, params P():
                     XLA picks the collectives (the ledger shows which).
    typed/dp         sharding in types (JAX's Explicit axes, jax_impl/parallel/typed.py): params typed P(),
                     batch P('dp'); nothing is stated — the gradient of a P() weight from a
                     dp-split batch is typed P(), XLA:CPU issues ONE all-reduce (Φ·b + the loss).
    typed/zero1      the moments typed P('dp', …); the program states reshard(g, rows),
                     reshard(w, rows) (slices: no communication) and reshard(w_new, P()) per array;
                     XLA:CPU: one all-reduce of every gradient (not a reduce-scatter) and one
                     all-gather per array, Φ·b each (tests/typed_expect.py; the stated changes in
                     Trained.extra["stated"]).

Communication per step and device (payload S as nccl-tests counts it, shared.theory; Φ of either
model, the embedding gradients dense (V, D) / (T, D) scatter-adds, sent whole):
    dp       bwd: all-reduce dW over dp                     Φ·b   = dp_comm_bytes
    zero1    reduce-scatter dW + all-gather W over dp       2·Φ·b = zero1_comm_bytes
The shard_map steps return each device's local loss (out_specs P('dp')); the reported loss is
their mean, taken on the host, so the ledger holds gradient (and parameter) traffic only. The
jit steps compute the global mean loss inside the program (one scalar all-reduce more).
"""

from __future__ import annotations

from jax_impl.devices import make_mesh
from jax_impl.harness import train_loop, trainer_setup
from jax_impl.model import build_model, inputs, make_optimizer, model_loss, targets
from jax_impl.parallel.fsdp import parallelize
from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import dp_comm_bytes, zero1_comm_bytes

VARIANTS = (("shard_map", "dp"), ("jit", "dp"), ("typed", "dp"), ("shard_map", "zero1"), ("jit", "zero1"),
            ("typed", "zero1"))


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "dp", device)


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    """The project's model through the public API (parallel.fsdp.parallelize), run by the one loop."""
    cfg.check("dp")
    if (style, variant) not in VARIANTS:
        raise ValueError(f"dp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    if mesh.shape["dp"] != cfg.world_size:
        raise ValueError(f"mesh has dp={mesh.shape['dp']} devices, cfg.world_size={cfg.world_size}")
    y = targets(cfg, problem)  # None | (B, T)
    raw = tuple(a for a in (inputs(cfg, problem), y) if a is not None)
    trainer = parallelize(build_model(cfg, problem), model_loss, make_optimizer(cfg), mesh, variant, style)
    batch = trainer.shard_batch(*raw)  # rows split over 'dp' on the trainer's mesh (typed: Explicit axes)
    setup = trainer_setup(trainer, batch)
    setup.comm_theory = zero1_comm_bytes(cfg) if variant == "zero1" else dp_comm_bytes(cfg)
    setup.extra = {"local_batch": cfg.batch // cfg.world_size}
    if style == "typed":  # the layout changes the program states, read from the types at trace time
        setup.extra["stated"] = trainer.stated.entries
    return train_loop(cfg, setup)
