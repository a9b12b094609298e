"""Tensor parallelism (TP) in JAX, the runner: every weight matrix split over the mesh axis "tp";
every device sees the full batch.

A TP layout is a RULES function, ``tp_rules(cfg, variant)(name, shape) -> PartitionSpec``; the
transformer's is its module-path plan (FIXTURE_PLAN through parallel.tp.plan_rules, torch's
vocabulary): wte P("tp", None) (vocab-parallel), attn.qkv held as (D, 3, D) and split
P(None, None, "tp") (whole heads), attn.o P("tp", None), mlp.up P(None, "tp"), mlp.down P("tp", None),
head P(None, "tp") (logits never gathered); norms and wpe replicated.

shard_map: Megatron's f = pcast(x, to="varying") (identity fwd, psum bwd) before each column-parallel
matmul, g = psum (identity bwd) after each row-parallel one and the embedding; the vocab-parallel
loss: a pmax of (B, T) and one psum of (2, B, T), backward local. shard_map/megatron trains the NNX
Transformer through jax_impl.parallel.tp.apply_plan (``train_plan``).
jit: the same forward with f / g as sharding constraints; XLA (GSPMD) picks the collectives.
typed (jax_impl/tp_typed.py): the rules on Explicit axes; row layers state P(unreduced={'tp'}) then
reshard: Megatron's g in types.
Bytes per step per device: (4L+2)·B·T·D·b + 3·B·T·b (shared.theory.tp_transformer_comm); MLP
allgather / megatron: shared.theory.tp_comm_bytes.
Sequence parallelism (megatron_sp; transformer only): the stream is (B, T/tp, D); f -> all_gather
(bwd psum_scatter), g -> psum_scatter (bwd all_gather): (4L+2) of each of B·T·D·b, the loss's, and
((2L+1)·D + T·D)·b for the replicated gains and wpe (shared.theory.tp_sp_comm).
What jit and typed issued: the ledger, docs/tp.md.
Mixed precision (--precision mixed): float32 weights and optax state, cast to bf16 inside the loss
(model.to_compute), the logits to the loss in float32; activations (f, g) travel in bf16, the loss's
reductions and megatron_sp's replicated-weight gradients in float32; attention computed in float32.
The recipe (--clip, --accumulate, --schedule, --decay-mask, --freeze; jax_impl/recipe.py): the step clips
the global gradient tree (XLA all-reduces one scalar per split leaf), K parts of the whole batch's rows,
frozen entries behind stop_gradient (shard_map/megatron with --freeze: the dict step, not the plan).
Papers: Megatron-LM, Shoeybi et al. 2019 (arXiv:1909.08053 §3); sequence parallelism, Korthikanti
et al. 2022 (arXiv:2205.05198 §4.2.2).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl import recipe, transformer
from jax_impl.devices import make_mesh, wire_config
from jax_impl.harness import Setup, leaves_fixture, train_loop, trainer_setup
from jax_impl.model import (
    build_model,
    gelu,
    inputs,
    jax_dtype,
    output_loss,
    targets,
    to_compute,
    to_loss,
)
from jax_impl.parallel.recipe import scale_by_norm, sumsq
from jax_impl.parallel.scaling import keep, nonfinite
from jax_impl.parallel.tp import plan_rules
from jax_impl.parallel.tree import fetch
from jax_impl.parallel.typed import InMesh, Stated, explicit_mesh
from jax_impl.tp_typed import layer_kinds
from jax_impl.transformer import rms_norm
from shared.config import Config
from shared.problem import Problem
from shared.recipe import refusal
from shared.results import Trained
from shared.theory import tp_comm_bytes

PLAN_STYLES = ("shard_map",)  # the transformer's megatron styles that train through parallel.tp.apply_plan
VARIANTS = (("shard_map", "allgather"), ("shard_map", "megatron"), ("jit", "allgather"), ("jit", "megatron"),
            ("typed", "allgather"), ("typed", "megatron"), ("shard_map", "megatron_sp"), ("jit", "megatron_sp"),
            ("typed", "megatron_sp"))
KERNEL_AXES = {"col": (None, "tp"), "row": ("tp", None)}  # MLP: W_l's columns / rows split over "tp"
# The transformer's Megatron plan over the fixture's parameter names (torch's module paths, as
# torch_impl.transformer.TRANSFORMER_PLAN): parallel.tp.plan_rules makes it the PartitionSpecs of the
# {name: array} model (W_qkv held (D, 3, D): colwise_heads splits its last dim, whole heads).
FIXTURE_PLAN = {"wte": "vocab_embed", "blocks.*.attn.qkv": "colwise_heads", "blocks.*.attn.o": "rowwise",
                "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise", "head": "colwise_vocab"}


# The same plan over the project's NNX model (jax_impl.transformer.Transformer), for
# jax_impl.parallel.tp.apply_plan: shard_map/megatron trains through it (``train_plan``).
TRANSFORMER_PLAN = {"wte": "vocab_embed", "blocks.*.qkv": "colwise_heads", "blocks.*.o": "rowwise",
                    "blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise_vocab"}


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    """allgather is MLP-only; megatron_sp (sequence parallel) transformer-only; less those that cannot
    apply cfg's recipe exactly (shared.recipe.refusal: none under tp today)."""
    drop = "megatron_sp" if cfg.model == "mlp" else "allgather"
    return tuple(v for v in VARIANTS if v[1] != drop and refusal("jax", "tp", *v, cfg) is None)


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "tp", device)


def tp_rules(cfg: Config, variant: str):
    """(name, shape in the TP layout) -> PartitionSpec, for either model."""
    if cfg.model == "mlp":
        kinds = layer_kinds(cfg.layers, variant)
        return lambda name, shape: P(*KERNEL_AXES[kinds[int(name.split(".")[1])]])

    return plan_rules(FIXTURE_PLAN)


def to_layout(params: dict) -> dict:
    """Fixture dict -> TP layout: W_qkv (D, 3D) as (D, 3, D), so its last dim splits by heads."""
    return {k: (w.reshape(w.shape[0], 3, -1) if k.endswith("attn.qkv.weight") else w) for k, w in params.items()}


def from_layout(params: dict) -> dict:
    return {k: (w.reshape(w.shape[0], -1) if k.endswith("attn.qkv.weight") else w) for k, w in params.items()}


# --- Megatron's f and g, the all-gather: JAX's transpose rules give the backward -------------------


def copy_to_tp(x: jax.Array) -> jax.Array:
    """f: identity fwd; replicated -> per-device-varying, whose transpose is psum."""
    return lax.pcast(x, "tp", to="varying")


def reduce_from_tp(z: jax.Array) -> jax.Array:
    """g: psum fwd (sum the row-parallel partial products); its transpose is identity."""
    return lax.psum(z, "tp")


def gather_columns(y: jax.Array, grad_is_partial: bool) -> jax.Array:
    """all-gather (B, D/tp) -> (B, D). "varying" transposes to psum_scatter; "invarying" (the output
    is the same on every device) to a local slice."""
    return lax.all_gather(y, "tp", axis=1, tiled=True, to="varying" if grad_is_partial else "invarying")


def vocab_embed(wte: jax.Array, tokens: jax.Array, reduce=reduce_from_tp) -> jax.Array:
    """wte rows [r·V/tp, (r+1)·V/tp) on device r: look up my tokens, zero for the rest, psum (g)
    (sequence parallel: ``reduce=scatter_sequence``, ḡ: (B, T/tp, D))."""
    rows = wte.shape[0]  # V/tp
    local = tokens - lax.axis_index("tp") * rows  # (B, T)
    mine = (local >= 0) & (local < rows)
    return reduce(jnp.where(mine[..., None], wte[jnp.where(mine, local, 0)], 0))  # (B, T, D) partial


# --- sequence parallelism's g / ḡ (Korthikanti et al. 2022, §4.2.2) ---------------------------------


def gather_sequence(x: jax.Array) -> jax.Array:
    """g (before a column-parallel matmul): all-gather (B, T/tp, …) -> (B, T, …); its transpose is
    psum_scatter (each device's dL/dx is partial: sum, keep my tokens)."""
    return lax.all_gather(x, "tp", axis=1, tiled=True)


def scatter_sequence(z: jax.Array) -> jax.Array:
    """ḡ (after a row-parallel matmul, the embedding): psum_scatter (B, T, …) partial -> (B, T/tp, …);
    its transpose is all_gather."""
    return lax.psum_scatter(z, "tp", scatter_dimension=1, tiled=True)


def local_positions(wpe: jax.Array, t: int) -> jax.Array:
    """wpe's rows for this device's T/tp tokens (the invariant table sliced at a varying offset:
    the transpose psums wpe's gradient over "tp")."""
    n = lax.axis_size("tp")
    return lax.dynamic_slice_in_dim(wpe, lax.axis_index("tp") * (t // n), t // n)  # (T/tp, D)


def vocab_parallel_ce(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy from vocab-split logits (B, T, V/tp): pmax of the row max (B, T), then one
    psum of (2, B, T): the target logit (on one device, zero elsewhere) and Σexp. The backward is
    local. (Separate psums: XLA defers the target's, which no gradient needs, into a backward one.)"""
    rows = logits.shape[-1]
    m = lax.pmax(lax.stop_gradient(logits.max(axis=-1)), "tp")  # (B, T); cancels in the loss
    shifted = logits - m[..., None]
    local = y - lax.axis_index("tp") * rows
    mine = (local >= 0) & (local < rows)
    picked = jnp.take_along_axis(shifted, jnp.where(mine, local, 0)[..., None], axis=-1)[..., 0]
    sums = jnp.stack([jnp.where(mine, picked, 0), jnp.exp(shifted).sum(axis=-1)])  # (2, B, T)
    picked, sumexp = lax.psum(sums, "tp")  # one all-reduce for both sums
    return jnp.mean(jnp.log(sumexp) - picked)


def attend(qkv: jax.Array, head_dim: int) -> jax.Array:
    """Causal attention from qkv (B, T, 3, h·dh) -> (B, T, h·dh): transformer.attention's math with
    q|k|v on their own axis, so under jit the heads axis stays split (no (3, D) merge)."""
    b, t = qkv.shape[:2]
    dt, qkv = qkv.dtype, transformer.wide(qkv)  # 16-bit: the core in float32 (transformer.wide)
    q, k, v = (qkv[:, :, i].reshape(b, t, -1, head_dim) for i in range(3))  # (B, T, h, dh)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(head_dim, q.dtype))  # (B, h, T, T)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1).astype(dt)  # (B, T, h·dh)


# --- the forwards: one transformer for both styles, the ops say what f / g are ------------------------


def transformer_forward(p: dict, tokens: jax.Array, y: jax.Array, head_dim: int, ops, out=lambda a: a) -> jax.Array:
    """The loss over the TP layout. shard_map: local shapes, ops = explicit collectives; jit:
    global shapes, ops = sharding constraints. ``out``: the logits as the loss takes them (mixed
    precision: float32, model.to_loss)."""
    t = tokens.shape[1]
    x = ops.embed(p["wte.weight"], tokens) + ops.positions(p["wpe.weight"], t)  # (B, T, D); SP: (B, T/tp, D)
    layers = sum(1 for k in p if k.endswith("attn.qkv.weight"))
    for l in range(layers):
        x = block_forward(lambda n, l=l: p[f"blocks.{l}.{n}.weight"], x, head_dim, ops)
    return ops.loss(out(head_logits(p, x, ops)), y)


def block_forward(w, x: jax.Array, head_dim: int, ops, attn=attend) -> jax.Array:
    """One Megatron block, ``w(name)`` its weights in the TP layout; ``attn(qkv (B, T, 3, h·dh),
    head_dim)`` (jax_impl.mesh passes cp's ring here)."""
    core = transformer.remat_core(attn)  # cfg.recompute (jax_impl.transformer.recomputing)

    def run(x):
        qkv = jnp.einsum("btd,dcf->btcf", ops.f(rms_norm(x, w("norm1"))), w("attn.qkv"))  # (B, T, 3, D/tp)
        x = x + ops.g(ops.split(core(ops.split(qkv), head_dim)) @ w("attn.o"))  # (B, T, D)
        return x + ops.g(gelu(ops.split(ops.f(rms_norm(x, w("norm2"))) @ w("mlp.up"))) @ w("mlp.down"))

    return transformer.remat_block(run)(x)


def head_logits(p: dict, x: jax.Array, ops) -> jax.Array:
    """Final norm + column-parallel head: (…, D) -> logits (…, V/tp), never gathered."""
    return ops.split(ops.f(rms_norm(x, p["normf.weight"])) @ p["head.weight"])  # (…, V/tp)


SHARD_MAP_OPS = SimpleNamespace(f=copy_to_tp, g=reduce_from_tp, split=lambda a: a, embed=vocab_embed,
                                positions=lambda wpe, t: wpe[:t], loss=vocab_parallel_ce)
# sequence parallel: the residual stream, norms and embedding output are (B, T/tp, D) on each device
SHARD_MAP_SP_OPS = SimpleNamespace(f=gather_sequence, g=scatter_sequence, split=lambda a: a,
                                   embed=lambda wte, tok: vocab_embed(wte, tok, scatter_sequence),
                                   positions=local_positions, loss=vocab_parallel_ce)


def jit_ops(mesh, sequence_parallel: bool = False):
    """The same places as constraints: f's input and g's output replicated, split activations on
    their last dim; XLA derives the collectives. Sequence parallel: g's output, the embedding
    output and wpe's rows sharded along the sequence, (B, T/tp, D)."""
    at = lambda *spec: lambda a: lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))
    last = lambda a: at(*([None] * (a.ndim - 1)), "tp")(a)
    stream = at(None, "tp", None) if sequence_parallel else at()  # the residual stream
    rows = at("tp", None) if sequence_parallel else at()
    return SimpleNamespace(f=at(), g=stream, split=last, embed=lambda wte, tok: stream(wte[tok]),
                           positions=lambda wpe, t: rows(wpe[:t]), loss=output_loss)


def mlp_forward_allgather(shards: list[jax.Array], x: jax.Array) -> jax.Array:
    b, d = x.shape
    n = lax.axis_size("tp")
    for l, w in enumerate(shards):
        assert w.shape == (d, d // n), w.shape
        x = gather_columns(gelu(x @ w), l < len(shards) - 1)  # (B, D/tp): GELU before the gather -> (B, D)
    return x


def mlp_forward_megatron(shards: list[jax.Array], x: jax.Array) -> jax.Array:
    b, d = x.shape
    n = lax.axis_size("tp")
    for wa, wb in zip(shards[0::2], shards[1::2], strict=False):  # (col, row) pairs; odd L: last one left
        assert wa.shape == (d, d // n) and wb.shape == (d // n, d), (wa.shape, wb.shape)
        h = gelu(copy_to_tp(x) @ wa)  # f; (B, D/tp)
        x = gelu(reduce_from_tp(h @ wb))  # g; (B, D)
    if len(shards) % 2:  # odd L: a lone column-parallel layer, gathered for the loss
        assert shards[-1].shape == (d, d // n), shards[-1].shape
        x = gather_columns(gelu(copy_to_tp(x) @ shards[-1]), False)  # (B, D)
    return x


def mlp_jit_loss(mesh, kinds: list[str], variant: str, cast=lambda a: a, out=lambda a: a):
    """Activations: P() after every gathered / row-parallel layer, P(None, "tp") after a column
    layer that feeds a row layer (Megatron keeps it split: no gather). ``cast``, ``out``: loss_for's."""
    specs = [P() if variant == "allgather" or k == "row" or l == len(kinds) - 1 else P(None, "tp")
             for l, k in enumerate(kinds)]

    def loss(p, x):
        p, x = cast(p), cast(x)
        for w, spec in zip((p[f"layers.{l}.linear.weight"] for l in range(len(kinds))), specs, strict=True):
            x = lax.with_sharding_constraint(gelu(x @ w), NamedSharding(mesh, spec))  # (B, D)
        return output_loss(out(x))

    return loss


# --- training ------------------------------------------------------------------------------------


def loss_for(cfg: Config, style: str, variant: str, mesh, specs: dict):
    """loss(params, *batch). shard_map: differentiated OUTSIDE it, so JAX transposes the whole
    shard_map (all_gather -> psum_scatter, pcast -> psum, psum -> identity) and the replicated
    parameters' gradients stay invariant (taken inside, they would be summed over devices).
    Mixed precision: the parameters (and the MLP's input) cast to bf16 inside the loss, the output
    handed to the loss in float32 (model.to_compute / to_loss); megatron_sp's replicated gains and
    wpe are made device-varying BEFORE the cast, so their gradients' psum runs in float32."""
    cast, out = partial(to_compute, cfg), partial(to_loss, cfg)
    if cfg.model == "mlp":
        if style == "jit":
            return mlp_jit_loss(mesh, layer_kinds(cfg.layers, variant), variant, cast, out)
        forward = mlp_forward_allgather if variant == "allgather" else mlp_forward_megatron
        local = lambda p, x: output_loss(out(forward([p[k] for k in specs], x)))  # full output: no collective
        return jax.shard_map(lambda p, x: local(cast(p), cast(x)), mesh=mesh, in_specs=(specs, P()), out_specs=P(),
                             check_vma=True)
    sp = variant == "megatron_sp"
    if style == "jit":
        return lambda p, tok, y: transformer_forward(cast(p), tok, y, cfg.head_dim, jit_ops(mesh, sp), out)
    ops = SHARD_MAP_SP_OPS if sp else SHARD_MAP_OPS
    vary = (lambda p: {k: lax.pcast(a, "tp", to="varying") if specs[k] == P() else a for k, a in p.items()}) \
        if sp and cfg.precision == "mixed" else (lambda p: p)  # SP: every replicated weight meets split tokens
    local = lambda p, tok, y: transformer_forward(cast(vary(p)), tok, y, cfg.head_dim, ops, out)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P(), check_vma=True)


def flag_bytes(cfg: Config, specs: dict) -> int:
    """float16's skip flag on the wire: the gradients are global arrays, each split leaf's non-finite test
    all-reduced by XLA as one pred (1 byte per split leaf, in the step's combined all-reduce; measured,
    every style); no collective of ours (parallel/scaling.py). 0 without loss scaling."""
    if cfg.dtype != "float16":
        return 0
    return sum(any(d is not None for d in tuple(s)) for s in specs.values())


def comm_theory(cfg: Config, style: str, variant: str, mesh, specs: dict) -> int | None:
    """shared.theory's bytes per step per device + float16's flags + the recipe's (measured on the tiny
    transformer, 2 devices, float64). --clip: the step sums the squares of the global gradient tree, XLA
    all-reduces one scalar per split leaf (the replicated ones are whole on every device). --accumulate
    K: the activations' f / g / loss reductions move B/K of the rows each, the same bytes; megatron_sp's
    replicated gains and wpe enter each micro-batch's shard_map (typed: each part's program) apart, so
    their partial gradients are all-reduced K times, not once. --freeze: None (a frozen stretch drops
    reductions XLA sees no use for)."""
    if cfg.freeze:
        return None
    b = cfg.bytes_per_element
    clip = 0 if cfg.clip is None else b * sum(any(d is not None for d in tuple(s)) for s in specs.values())
    sp = (cfg.accumulate - 1) * ((2 * cfg.layers + 1) * cfg.dim + cfg.seq * cfg.dim) * b \
        if variant == "megatron_sp" and style != "jit" else 0  # jit/megatron_sp: XLA's own, not the theory's
    return tp_comm_bytes(wire_config(cfg, mesh), variant) + flag_bytes(cfg, specs) + clip + sp


def train_plan(cfg: Config, problem: Problem, style: str, mesh) -> Trained:
    """The transformer's Megatron TP through the model-generic API: the NNX model, TRANSFORMER_PLAN,
    parallel.tp.apply_plan (the same shards, f / g and vocab-parallel loss as transformer_forward)."""
    from jax_impl.parallel.tp import apply_plan, cross_entropy

    model = build_model(cfg, problem)
    paths = recipe.fixture_paths(model)  # the recipe: the decay mask by ndim, the schedule, K parts, the true norm
    loss = recipe.loss_fn(cfg, paths, devices=1, base=lambda model, tokens, y: cross_entropy(model(tokens), y))
    trainer = apply_plan(model, TRANSFORMER_PLAN, loss, recipe.optimizer(cfg, paths), mesh, style, clip=cfg.clip,
                         loss_scale=recipe.loss_scale(cfg) or False)  # float16: the model casts itself (dtype=)
    setup = trainer_setup(trainer, trainer.replicate(inputs(cfg, problem), targets(cfg, problem)))
    setup.comm_theory = comm_theory(cfg, style, "megatron", mesh, trainer.specs)
    setup.extra = {"rules": {k: str(s) for k, s in trainer.specs.items()}, "plan": TRANSFORMER_PLAN}
    return train_loop(cfg, setup)


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    from jax_impl import tp_typed

    if (style, variant) not in variants(cfg):
        raise ValueError(f"tp: unknown variant {style}/{variant} for the {cfg.model}; choose from {variants(cfg)}")
    cfg.check("tp", "jax")
    if cfg.model == "transformer" and variant == "megatron" and style in PLAN_STYLES and not cfg.moe \
            and not cfg.freeze:  # --freeze: the dict step below (stop_gradient meets the plan's stand-in modules)
        return train_plan(cfg, problem, style, mesh)
    typed = style == "typed"  # sharding in types: an Explicit-axes copy of the mesh (jax_impl/tp_typed.py)
    if typed:
        mesh = explicit_mesh(mesh)
        stated = Stated(mesh)
    rules = tp_rules(cfg, variant)
    layout = to_layout(problem.params)  # name -> array, param_names order
    specs = {k: rules(k, w.shape) for k, w in layout.items()}
    params = {k: jax.device_put(jnp.asarray(w, jax_dtype(cfg)), NamedSharding(mesh, specs[k]))
              for k, w in layout.items()}
    batch = tuple(jax.device_put(a, NamedSharding(mesh, P()))  # the full batch on every device
                  for a in (inputs(cfg, problem), targets(cfg, problem)) if a is not None)
    loss_of = tp_typed.loss_for(cfg, variant, stated) if typed else loss_for(cfg, style, variant, mesh, specs)
    loss_of = recipe.whole_batch_loss(cfg, loss_of)  # frozen entries stopped, K parts of the rows
    tx = recipe.optimizer(cfg, {k: k for k in layout})  # the decay mask by ndim (W_qkv (D, 3, D): >= 2), schedule

    state = (params, tx.init(params))
    placed = jax.tree.map(lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else None, state)
    scaler = recipe.loss_scale(cfg)  # float16: dynamic loss scaling (jax_impl/parallel/scaling.py)
    if scaler:
        state += (jax.device_put(scaler.init(), NamedSharding(mesh, P())),)

    def step(params, opt_state, *rest):
        sc, batch = (rest[0], rest[1:]) if scaler else (None, rest)
        mult = 1.0 if sc is None else sc["scale"]
        (_, loss), grads = jax.value_and_grad(lambda p, *b: ((l := loss_of(p, *b)) * mult, l),
                                              has_aux=True)(params, *batch)
        grads = grads if sc is None else scaler.unscale(grads, sc)
        # --clip: the global tree's norm (split leaves' squares summed by XLA over tp), torch's formula
        clipped = grads if cfg.clip is None else scale_by_norm(grads, sumsq(grads), cfg.clip)
        updates, new_opt = tx.update(clipped, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt)
        if sc is not None:  # global arrays (split ones sharded): the check over the tree is global under jit
            bad = nonfinite(grads)
            new, sc = keep(bad, new, (params, opt_state)), scaler.update(sc, bad)
        if style == "jit":  # the state leaves as it came (megatron_sp: XLA would keep wpe row-split)
            new = jax.tree.map(lambda a, s: a if s is None else lax.with_sharding_constraint(a, s), new, placed,
                               is_leaf=lambda x: x is None)
        return (*new, loss, grads) if sc is None else (*new, sc, loss, grads, bad > 0, sc["scale"])

    # jax sorts dict keys (layers.10 < layers.2): back to param_names order; device_get gathers
    read = fetch if typed else (lambda a: a)  # typed: (D, 3, D@tp) -> (D, 3D) is refused in types; on the host
    fixture = lambda tree: leaves_fixture(from_layout({k: read(tree[k]) for k in layout}))
    extra = {"rules": {k: str(s) for k, s in specs.items()}} | ({"stated": stated.entries} if typed else {})
    return train_loop(cfg, Setup(
        step=InMesh(jax.jit(stated.traced(step)), mesh) if typed else jax.jit(step), state=state, batch=batch,
        per_step=("skipped", "loss_scale") if scaler else (), grads_fixture=fixture,
        params_fixture=lambda state: fixture(state[0]),
        comm_theory=comm_theory(cfg, style, variant, mesh, specs), extra=extra))
