"""Data parallelism (DP) and ZeRO-1 in JAX, the runner: every device holds the whole model, trains on
its slice of the batch, and the gradients are averaged over the ``dp`` mesh axis.

Sharded: the batch, P('dp') (device r: rows r·B/N … (r+1)·B/N). Weights are replicated, P(); the
AdamW state too, except in ZeRO-1, which splits it over 'dp'. The steps are written once for any
Flax NNX model (``jax_impl.parallel.fsdp.parallelize(model, loss, tx, mesh, "dp" | "zero1", style)``);
``train`` puts the project's MLP and transformer through them.

    shard_map/dp     local gradients (params pcast to varying first), then lax.pmean
    shard_map/zero1  psum_scatter of the flat gradient, optax on 1/N of it, all_gather of the update
    jit/dp, zero1    the same step under NamedShardings; XLA (GSPMD) inserts the collectives
    typed/dp, zero1  sharding in types (jax_impl/parallel/typed.py): the layouts are types, every
                     layout change a stated reshard; XLA picks what each becomes

Collectives: none in forward; backward all-reduces every gradient (zero1: reduce-scatter, then an
all-gather of the updated parameters). Bytes per step and device (payload S, nccl-tests size):
dp Φ·b (dp_comm_bytes), zero1 2·Φ·b (zero1_comm_bytes), shared/theory/dp.py. What XLA issued for the
jit and typed steps is read from the HLO into the ledger (docs/dp.md).
Mixed precision (--precision mixed): float32 parameters and optax state, the model's dtype=bfloat16
casts them inside the loss, so the gradients (and their reductions, 4 bytes per element) are float32.
The shard_map steps return each device's local loss, averaged on the host (outside the ledger);
the jit steps compute the global mean loss in the program (one scalar all-reduce more).
Papers: PyTorch DDP, Li et al. 2020 (arXiv:2006.15704); ZeRO, Rajbhandari et al. 2020
(arXiv:1910.02054); GSPMD, Xu et al. 2021 (arXiv:2105.04663).
"""

from __future__ import annotations

from jax_impl import recipe
from jax_impl.devices import make_mesh
from jax_impl.harness import train_loop, trainer_setup
from jax_impl.model import inputs, targets
from shared.config import Config
from shared.problem import Problem
from shared.recipe import refusal
from shared.results import Trained
from shared.theory import dp_comm_bytes, zero1_comm_bytes

VARIANTS = (("shard_map", "dp"), ("jit", "dp"), ("typed", "dp"), ("shard_map", "zero1"), ("jit", "zero1"),
            ("typed", "zero1"))


def variants(cfg: Config) -> tuple:
    """VARIANTS, less those that cannot apply cfg's recipe exactly (shared.recipe.refusal says why)."""
    return tuple(v for v in VARIANTS if refusal("jax", "dp", *v, cfg) is None)


def comm_theory(cfg: Config, style: str, variant: str) -> int | None:
    """shared.theory's bytes with the recipe: + the norm's scalar all-reduce (zero1: the slices are
    sharded; dp holds the whole gradient). --accumulate K: shard_map reduces the summed gradient once; jit
    and typed: XLA reduces each micro-batch's gradient (measured K×; not modelled: None). --freeze: None
    (XLA drops the frozen gradients' reductions)."""
    if cfg.freeze or (cfg.accumulate > 1 and style != "shard_map"):
        return None
    base = zero1_comm_bytes(cfg) if variant == "zero1" else dp_comm_bytes(cfg)
    return base + recipe.clip_bytes(cfg, variant, style) + recipe.scale_bytes(cfg, variant, style)


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "dp", device)


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    """The project's model through the public API (parallel.fsdp.parallelize), run by the one loop."""
    cfg.check("dp", "jax")
    if (style, variant) not in VARIANTS:
        raise ValueError(f"dp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    if mesh.shape["dp"] != cfg.world_size:
        raise ValueError(f"mesh has dp={mesh.shape['dp']} devices, cfg.world_size={cfg.world_size}")
    y = targets(cfg, problem)  # None | (B, T)
    raw = tuple(a for a in (inputs(cfg, problem), y) if a is not None)
    trainer = recipe.parallelized(cfg, problem, mesh, variant, style)  # + --clip, --accumulate, masks, schedule
    batch = trainer.shard_batch(*raw)  # rows split over 'dp' on the trainer's mesh (typed: Explicit axes)
    setup = trainer_setup(trainer, batch)
    setup.comm_theory = comm_theory(cfg, style, variant)
    setup.extra = {"local_batch": cfg.batch // cfg.world_size}
    if style == "typed":  # the layout changes the program states, read from the types at trace time
        setup.extra["stated"] = trainer.stated.entries
    return train_loop(cfg, setup)
