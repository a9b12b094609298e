"""ZeRO-2 / ZeRO-3 (FSDP) in JAX for any model (MLP, transformer): jax.shard_map with explicit
collectives, jax.jit with shardings, and sharding in types ("typed"). ZeRO: Rajbhandari et al.
2020, arXiv:1910.02054; FSDP: Zhao et al. 2023, arXiv:2304.11277.

The steps are written once, for any Flax NNX model and loss:
``jax_impl.parallel.fsdp.parallelize(model, loss, tx, mesh, "zero2" | "zero3", style, units=…)``;
``train`` below puts the project's MLP and transformer through it. A model must offer: nnx.Param
state only, a loss that is a mean over the rows, and (shard_map/zero3) parameters read only by
calling the module that holds them (a parent reading a child's weight is refused; make it the unit).

Batch as in DP: device r trains on rows r·B/N:(r+1)·B/N, P('dp'). What is sharded comes from ONE
rule for every model (parallel.tree.rule; ``rules`` here for the project's names): every parameter with >= 2 dims (W_l;
wte, wpe, W_qkv, W_o, W_up, W_down, W_head) puts dim 0 on 'dp' (its row block r on device r:
P('dp', None)); vectors (RMSNorm gains) stay replicated, P(). torch_impl/fsdp.py shards the same
parameters along torch's dim 0 (nn.Linear stores Wᵀ: W's columns there) — the same bytes.

shard_map/zero3  params, grads, optax state sharded by the rule (vectors replicated).
    Each unit (default: every module holding a Param — MLP: each layer; transformer: wte, wpe,
    each Linear and norm, head) all-gathers its row blocks (tiled) right before its call, inside a
    jax.checkpoint with policy checkpoint_dots: matmul outputs are saved, gathered weights are
    not, so the backward gathers again — only where a weight is needed (not the embeddings, whose
    gradient is a scatter-add over the ids; not the MLP's layer 0, whose input is the data).
    The transpose of all_gather is psum_scatter: autodiff emits each unit's reduce-scatter. The
    vectors' gradients go through ONE psum of all of them flattened (torch: one all-reduce).
    payload S per step per device: shared.theory.fsdp_comm(cfg, "zero3") (MLP 3Φb − D²b).
shard_map/zero2  replicated params; unit gradients psum_scatter-ed to their row blocks, vectors one
    flat psum; optax on the rows (+ vectors); all_gather of the updated rows: fsdp_comm "zero2".
jit/zero3        NNX params created by build_model(rules=rules(cfg)), batch P('dp'), nnx.Optimizer
    (moments inherit the sharding); XLA picks the collectives (docs/fsdp.md says what it chose).
jit/zero2        replicated params; moments and gradients constrained to the rules' row blocks.
typed/zero3      sharding in types (JAX's Explicit axes, jax_impl/parallel/typed.py): the row-split params
    typed P('dp', None), the batch P('dp'). The forward STATES each gather, reshard(w, P()), at the
    start of the loss; autodiff transposes it, so each gradient comes back typed P('dp', None) like
    its param. XLA:CPU: one all-gather per row-split param (no re-gather in backward: XLA keeps the
    gathered weights), ONE all-reduce of every gradient and the loss, no reduce-scatter (the slice
    to the rows is local); tests/typed_expect.py has the table. jit/zero3 issues one all-gather
    fewer and a second all-reduce (tests/test_fsdp.py).
typed/zero2      params P(); the program states reshard(g, rows), reshard(w, rows) and reshard(w_new,
    P()) per row-split param: the same collectives as typed/zero3 on CPU. Trained.extra["stated"]
    lists every stated change with its types (jax.typeof), read at trace time.
The shard_map steps differentiate each device's SHARE of the loss (local mean / N) and return the
local mean per device (the loop averages them, outside the step): the ledger holds ZeRO traffic
only. The jit steps' loss is the global mean, so XLA adds it to its gradient reduction.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_impl.devices import make_mesh
from jax_impl.harness import train_loop, trainer_setup
from jax_impl.model import build_model, inputs, jax_dtype, make_optimizer, model_loss, targets, tree_bytes
from jax_impl.parallel.fsdp import cpu_options, parallelize  # noqa: F401  (cpu_options: cp, mesh cite it)
from jax_impl.transformer import Rules
from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import fsdp_comm_bytes

VARIANTS = (("shard_map", "zero3"), ("shard_map", "zero2"), ("jit", "zero3"), ("jit", "zero2"), ("typed", "zero3"),
            ("typed", "zero2"))


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
    cfg.check("fsdp")
    y = targets(cfg, problem)  # None | (B, T)
    raw = tuple(a for a in (inputs(cfg, problem), y) if a is not None)
    trainer = parallelize(build_model(cfg, problem), model_loss, make_optimizer(cfg), mesh, variant, style)
    batch = trainer.shard_batch(*raw)  # rows split over 'dp' on the trainer's mesh (typed: Explicit axes)
    setup = trainer_setup(trainer, batch)
    setup.comm_theory = fsdp_comm_bytes(cfg, variant)
    setup.state_bytes = lambda state: state_bytes(cfg, problem, variant, *state)
    setup.extra = {"shard": "dim 0 of each ≥2-D parameter (rows of W)"}
    if style == "typed":  # the layout changes the program states, read from the types at trace time
        setup.extra["stated"] = trainer.stated.entries
    return train_loop(cfg, setup)
