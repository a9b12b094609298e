"""ZeRO-2 / ZeRO-3 (FSDP) in JAX for any model (MLP, transformer): jax.shard_map with explicit
collectives, and jax.jit with shardings. ZeRO: Rajbhandari et al. 2020, arXiv:1910.02054;
FSDP: Zhao et al. 2023, arXiv:2304.11277.

Batch as in DP: device r trains on rows r·B/N:(r+1)·B/N, P('dp'). What is sharded comes from ONE
rules function for both models, ``rules(cfg)(name, shape)``: every parameter with >= 2 dims (W_l;
wte, wpe, W_qkv, W_o, W_up, W_down, W_head) puts dim 0 on 'dp' (its row block r on device r:
P('dp', None)); vectors (RMSNorm gains) stay replicated, P(). torch_impl/fsdp.py shards the same
parameters along torch's dim 0 (nn.Linear stores Wᵀ: W's columns there) — the same bytes.

shard_map/zero3  params, grads, optax state sharded by the rules (vectors replicated).
    The model is a chain of pieces (MLP: one per layer; transformer: embedding, each block, final
    norm + head); each piece all-gathers its units (tiled) right before it runs and is a
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
The shard_map steps differentiate each device's SHARE of the loss (local mean / N) and return the
local mean per device (the loop averages them, outside the step): the ledger holds ZeRO traffic
only. The jit steps' loss is the global mean, so XLA adds it to its gradient reduction.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl import transformer
from jax_impl.devices import make_mesh
from jax_impl.harness import Setup, leaves_fixture, train_loop
from jax_impl.model import (
    build_model,
    gelu,
    inputs,
    jax_dtype,
    loss_fn,
    make_optimizer,
    module_fixture,
    output_loss,
    spec,
    targets,
    tree_bytes,
)
from jax_impl.transformer import Rules
from shared.config import Config
from shared.problem import Problem, param_names
from shared.results import Trained
from shared.theory import fsdp_comm_bytes

VARIANTS = (("shard_map", "zero3"), ("shard_map", "zero2"), ("jit", "zero3"), ("jit", "zero2"))


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "dp", device)


def rules(cfg: Config) -> Rules:
    """ZeRO's sharding, for any model: dim 0 of every >= 2-D parameter on 'dp' (when N divides it:
    GSPMD and shard_map need even blocks; Config.check('fsdp') makes it so), vectors replicated."""
    n = cfg.world_size

    def rule(name: str, shape: tuple[int, ...]) -> tuple:
        if len(shape) >= 2 and shape[0] % n == 0:
            return ("dp",) + (None,) * (len(shape) - 1)
        return (None,) * len(shape)
    return rule


def is_sharded(rule: Rules, name: str, shape) -> bool:
    return rule(name, tuple(shape))[:1] == ("dp",)


def pieces(cfg: Config) -> list[tuple[list[str], callable]]:
    """The model as a chain h -> h, each piece with the parameters it uses (gathered together)."""
    if cfg.model == "mlp":
        return [([k], lambda p, h, k=k: gelu(h @ p[k])) for k in param_names(cfg)]  # (B/N, D)
    blk = lambda l: [f"blocks.{l}.{m}.weight" for m in ("norm1", "attn.qkv", "attn.o", "norm2", "mlp.up", "mlp.down")]
    return ([(["wte.weight", "wpe.weight"], transformer.embed)]  # tokens (B/N, T) -> (B/N, T, D)
            + [(blk(l), partial(lambda p, h, l: transformer.block(p, l, h, cfg.head_dim), l=l))
               for l in range(cfg.layers)]
            + [(["normf.weight", "head.weight"], transformer.head)])  # -> (B/N, T, V)


def average_vectors(grads: dict, names: list[str]) -> dict:
    """The replicated vectors' gradients (each device's share), summed by ONE flat psum."""
    if not names:
        return grads
    flat = lax.psum(jnp.concatenate([grads[k].reshape(-1) for k in names]), "dp")  # ((2L+1)·D,)
    parts = jnp.split(flat, [sum(grads[k].size for k in names[:i + 1]) for i in range(len(names) - 1)])
    return grads | {k: g.reshape(grads[k].shape) for k, g in zip(names, parts)}


# --- shard_map: the collectives written out ----------------------------------------------------
# check_vma=True: every value is typed invariant (same on every device) or varying over 'dp'. We
# differentiate this device's SHARE (local mean / N) w.r.t. varying values only — the row shards,
# and pcast copies of the replicated arrays — so each device gets its own contribution and one
# psum_scatter (or the vectors' psum) sums the N of them into the mean gradient.


def zero3_step(cfg: Config, tx, vectors: list[str], params, opt_state, x, y=None):
    n = lax.axis_size("dp")

    def gathered_piece(fn, sub, h):  # all-gather this piece's units, then run it
        full = {k: lax.all_gather(w, "dp", axis=0, tiled=True) if k not in vectors else w for k, w in sub.items()}
        return fn(full, h)

    def share(mine):
        h = x  # (B/N, D) | tokens (B/N, T)
        for names, fn in pieces(cfg):
            remat = jax.checkpoint(partial(gathered_piece, fn), policy=jax.checkpoint_policies.checkpoint_dots)
            h = remat({k: mine[k] for k in names}, h)
        loss = output_loss(h, y)  # this device's mean
        return loss / n, loss

    mine = {k: lax.pcast(w, "dp", to="varying") if k in vectors else w for k, w in params.items()}
    (_, loss), grads = jax.value_and_grad(share, has_aux=True)(mine)  # units: (rows/N, …) of the mean
    grads = average_vectors(grads, vectors)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss[None], grads


def zero2_step(cfg: Config, tx, vectors: list[str], params, opt_state, x, y=None):
    n, r = lax.axis_size("dp"), lax.axis_index("dp")
    mine = lax.pcast(params, "dp", to="varying")  # this device's copy: its own gradient, no psum
    (_, loss), grads = jax.value_and_grad(lambda p: ((l := loss_fn(p, x, y, cfg)) / n, l), has_aux=True)(mine)
    grads = {k: g if k in vectors else lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True)
             for k, g in grads.items()}  # units: (rows/N, …) of the mean
    grads = average_vectors(grads, vectors)
    rows = {k: params[k].shape[0] // n for k in params}
    shards = {k: w if k in vectors else lax.dynamic_slice_in_dim(w, r * rows[k], rows[k]) for k, w in params.items()}
    updates, opt_state = tx.update(grads, opt_state, shards)
    shards = optax.apply_updates(shards, updates)
    params = {k: s if k in vectors else lax.all_gather(s, "dp", axis=0, tiled=True, to="invarying")
              for k, s in shards.items()}
    return params, opt_state, loss[None], grads


def shard_map_setup(cfg: Config, problem: Problem, mesh, variant: str, batch: tuple) -> Setup:
    tx, rule = make_optimizer(cfg), rules(cfg)
    shapes = {k: w.shape for k, w in problem.params.items()}
    zero = {k: spec(rule, k, s) for k, s in shapes.items()}  # rows on 'dp' / P() for vectors
    p_spec = zero if variant == "zero3" else {k: P() for k in shapes}
    params = {k: jax.device_put(jnp.asarray(w, jax_dtype(cfg)), NamedSharding(mesh, p_spec[k]))
              for k, w in problem.params.items()}
    opt_state = tx.init({k: jax.device_put(w, NamedSharding(mesh, zero[k])) for k, w in params.items()})
    o_spec = jax.tree.map(lambda a: spec(rule, "", a.shape), opt_state)  # m, v like the rows; count P()
    vectors = [k for k, s in shapes.items() if not is_sharded(rule, k, s)]  # by GLOBAL shape: replicated
    body = partial(zero3_step if variant == "zero3" else zero2_step, cfg, tx, vectors)
    b_spec = tuple(P("dp") for _ in batch)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(p_spec, o_spec, *b_spec),
                                 out_specs=(p_spec, o_spec, P("dp"), zero), check_vma=True))
    fixture = partial(leaves_fixture, names=param_names(cfg))
    return Setup(step=step, state=(params, opt_state), batch=batch, grads_fixture=fixture,
                 params_fixture=lambda state: fixture(state[0]))


# --- jit: shardings only, XLA (GSPMD) inserts the collectives -------------------------------------


def jit_setup(cfg: Config, problem: Problem, mesh, variant: str, batch: tuple) -> Setup:
    rule = rules(cfg)
    replicated = lambda name, shape: (None,) * len(shape)
    model = build_model(cfg, problem, mesh, rules=rule if variant == "zero3" else replicated)
    with jax.set_mesh(mesh):  # the AdamW moments inherit the parameters' sharding metadata...
        opt = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    for path, v in nnx.iter_graph(opt):  # ...which ZeRO-2 overrides: moments in row blocks
        if isinstance(v, nnx.OptVariable) and v.ndim:
            v.set_metadata(out_sharding=rule(".".join(map(str, path)), v.shape))
    model_def, params = nnx.split(model)
    opt_def, opt_state = nnx.split(opt)
    param_shardings = nnx.get_named_sharding(params, mesh)
    opt_shardings = nnx.get_named_sharding(opt_state, mesh)
    opt_state = jax.device_put(opt_state, opt_shardings)
    grad_shardings = jax.tree.map(lambda a: NamedSharding(mesh, spec(rule, "", a.shape)), params)

    def step(params, opt_state, x, y=None):
        model, opt = nnx.merge(model_def, params), nnx.merge(opt_def, opt_state)
        loss, grads = nnx.value_and_grad(lambda m: output_loss(m(x), y))(model)  # global mean
        if variant == "zero2":  # each device keeps only its rows of the mean gradient
            grads = lax.with_sharding_constraint(grads, grad_shardings)
        opt.update(model, grads)
        return nnx.state(model), nnx.state(opt), loss, grads  # laid out by out_shardings

    fixture = partial(module_fixture, model_def)
    step = jax.jit(step, out_shardings=(param_shardings, opt_shardings, None, grad_shardings), donate_argnums=(0, 1))
    return Setup(step=step, state=(params, opt_state), batch=batch,
                 grads_fixture=fixture, params_fixture=lambda state: fixture(state[0]))


def cpu_options(mesh, style: str, variant: str) -> dict | None:
    """XLA:CPU settings (GPU / TPU need neither). 1) Its default scheduler starts every all-gather
    at the top of the step (they depend on parameters only), so all gathered weights are alive at
    once; the memory-optimized one frees each after use. 2) It drops jax.checkpoint's optimization
    barriers (pass cse_barrier_expander) BEFORE its last CSE pass, which would then merge every
    backward re-gather into its forward gather, keeping W alive from forward to backward; GPU /
    TPU drop them only after scheduling."""
    if mesh.devices.flat[0].platform != "cpu":
        return None
    options = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    if (style, variant) == ("shard_map", "zero3"):
        options["xla_disable_hlo_passes"] = "cse"
    return options


def state_bytes(cfg: Config, problem: Problem, variant: str, params, opt_state) -> dict[str, int]:
    """Per device: params and AdamW moments as placed; gradients as the rules shard them."""
    rule, b = rules(cfg), jnp.dtype(jax_dtype(cfg)).itemsize
    grads = sum(w.size // (cfg.world_size if is_sharded(rule, k, w.shape) else 1) for k, w in problem.params.items())
    return {"params": tree_bytes(params, per_device=True), "grads": grads * b,
            "optimizer": tree_bytes(opt_state, per_device=True)}


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    if (style, variant) not in VARIANTS:
        raise ValueError(f"fsdp: unknown jax variant {style}/{variant}; choose from {VARIANTS}")
    cfg.check("fsdp")
    rows = NamedSharding(mesh, P("dp"))  # dim 0 split: N × (B/N, …)
    y = targets(cfg, problem)  # None | (B, T)
    batch = tuple(jax.device_put(a, rows) for a in (inputs(cfg, problem), y) if a is not None)
    setup = (shard_map_setup if style == "shard_map" else jit_setup)(cfg, problem, mesh, variant, batch)
    setup.comm_theory = fsdp_comm_bytes(cfg, variant)
    setup.compiler_options = cpu_options(mesh, style, variant)
    setup.state_bytes = lambda state: state_bytes(cfg, problem, variant, *state)
    setup.extra = {"shard": "dim 0 of each ≥2-D parameter (rows of W)"}
    return train_loop(cfg, setup)
