"""ZeRO-2 / ZeRO-3 (FSDP) in JAX, the runner: jax.shard_map with explicit collectives, jax.jit with
shardings, and sharding in types ("typed"), for the MLP and the transformer.

The steps are written once for any Flax NNX model: ``jax_impl.parallel.fsdp.parallelize(model, loss,
tx, mesh, "zero2" | "zero3", style, units=…)``; ``train`` puts the project's models through it.
Sharded: the batch as in DP, P('dp'); every parameter with >= 2 dims puts dim 0 on 'dp'
(P('dp', None): parallel.tree.rule); vectors (norm gains) stay replicated, P().

shard_map/zero3  params, grads, optax state sharded. Each unit all-gathers its row blocks right
    before its call, inside jax.checkpoint (matmul outputs saved, gathered weights not), so backward
    gathers again where a weight is needed; all_gather's transpose is the unit's psum_scatter; the
    vectors' gradients go through ONE flat psum. Bytes: shared.theory.fsdp_comm(cfg, "zero3")
    (MLP 3Φb − D²b).
shard_map/zero2  replicated params; gradients psum_scatter-ed to row blocks, vectors one psum;
    optax on the rows; all_gather of the updated rows: fsdp_comm(cfg, "zero2").
jit/zero2, zero3 the same layouts as shardings; XLA (GSPMD) picks the collectives.
typed/zero2, zero3  the layouts as types (jax_impl/parallel/typed.py); each gather or slice is a
    stated reshard (Trained.extra["stated"]); XLA picks what each becomes.
Mixed precision (--precision mixed): float32 shards, cast to bf16 inside the loss (zero3 gathers float32).
What jit and typed issued is read from the HLO into the ledger; docs/fsdp.md and
docs/sharding_modes.md compare it with the hand-written steps.
The shard_map steps differentiate each device's share of the loss (local mean / N); the jit steps
the global mean, so XLA folds the loss into its gradient reduction.
Papers: ZeRO, Rajbhandari et al. 2020 (arXiv:1910.02054); FSDP, Zhao et al. 2023 (arXiv:2304.11277).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_impl import recipe
from jax_impl.devices import make_mesh
from jax_impl.harness import train_loop, trainer_setup
from jax_impl.model import inputs, jax_dtype, targets, tree_bytes
from jax_impl.parallel.fsdp import cpu_options  # noqa: F401  (cpu_options: cp, mesh cite it)
from jax_impl.transformer import Rules
from shared.config import Config
from shared.problem import Problem
from shared.recipe import refusal
from shared.results import Trained
from shared.theory import fsdp_comm_bytes

VARIANTS = (("shard_map", "zero3"), ("shard_map", "zero2"), ("jit", "zero3"), ("jit", "zero2"), ("typed", "zero3"),
            ("typed", "zero2"))


def variants(cfg: Config) -> tuple:
    """VARIANTS, less those that cannot apply cfg's recipe exactly (shared.recipe.refusal says why)."""
    return tuple(v for v in VARIANTS if refusal("jax", "fsdp", *v, cfg) is None)


def comm_theory(cfg: Config, style: str, variant: str) -> int | None:
    """shared.theory's bytes with the recipe: + the norm's scalar (it rides in the vectors' psum under
    shard_map). --accumulate K: shard_map zero3 gathers per micro-batch and reduce-scatters each gather's
    gradient (K× both: the transpose of every all-gather); zero2 reduces the summed gradient once; jit and
    typed: XLA reduces each micro-batch's gradient (measured K×; not modelled: None). --freeze: None."""
    if cfg.freeze or (cfg.accumulate > 1 and style != "shard_map"):
        return None
    k = cfg.accumulate if variant == "zero3" else 1
    return (fsdp_comm_bytes(cfg, variant, gathers=k, reduces=k) + recipe.clip_bytes(cfg, variant, style)
            + recipe.scale_bytes(cfg, variant, style))


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "dp", device)


def rules(cfg: Config) -> Rules:
    """ZeRO's sharding by the project's parameter names: dim 0 of every >= 2-D parameter on 'dp'
    (when N divides it: GSPMD and shard_map need even blocks; Config.check('fsdp') makes it so),
    vectors replicated — parallel.tree.rule, which needs no names."""
    n = cfg.world_size

    def rule(name: str, shape: tuple[int, ...]) -> tuple:
        if len(shape) >= 2 and shape[0] % n == 0:
            return ("dp",) + (None,) * (len(shape) - 1)
        return (None,) * len(shape)
    return rule


def is_sharded(rule: Rules, name: str, shape) -> bool:
    return rule(name, tuple(shape))[:1] == ("dp",)


def state_bytes(cfg: Config, problem: Problem, variant: str, params, opt_state) -> dict[str, int]:
    """Per device: params and AdamW moments as placed; gradients as the rules shard them."""
    rule, b = rules(cfg), jnp.dtype(jax_dtype(cfg)).itemsize
    grads = sum(w.size // (cfg.world_size if is_sharded(rule, k, w.shape) else 1) for k, w in problem.params.items())
    return {"params": tree_bytes(params, per_device=True), "grads": grads * b,
            "optimizer": tree_bytes(opt_state, per_device=True)}


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    """The project's model through the public API (parallel.fsdp.parallelize), run by the one loop."""
    if (style, variant) not in VARIANTS:
        raise ValueError(f"fsdp: unknown jax variant {style}/{variant}; choose from {VARIANTS}")
    cfg.check("fsdp", "jax")
    y = targets(cfg, problem)  # None | (B, T)
    raw = tuple(a for a in (inputs(cfg, problem), y) if a is not None)
    trainer = recipe.parallelized(cfg, problem, mesh, variant, style)  # + --clip, --accumulate, masks, schedule
    batch = trainer.shard_batch(*raw)  # rows split over 'dp' on the trainer's mesh (typed: Explicit axes)
    setup = trainer_setup(trainer, batch)
    setup.comm_theory = comm_theory(cfg, style, variant)
    setup.state_bytes = lambda state: state_bytes(cfg, problem, variant, *state[:2])  # (float16: + the scaler)
    setup.extra = {"shard": "dim 0 of each ≥2-D parameter (rows of W)"}
    if style == "typed":  # the layout changes the program states, read from the types at trace time
        setup.extra["stated"] = trainer.stated.entries
    return train_loop(cfg, setup)
