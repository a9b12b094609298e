"""N-D parallelism in JAX: dp/fsdp × pp × cp × tp on ONE multi-axis mesh (the transformer).

The mesh is ``jax.make_mesh`` over the layout's sizes and names in device order (``mesh_for``:
"dp=2,tp=2,pp=2" -> axes ("dp", "tp", "pp"), innermost last); every 1-D pattern keeps its axis name,
so each collective names the axis it runs on.

shard_map goes through the library's composition, the same call a user makes for
any NNX model: ``compose(Transformer, layout, loss, AdamW, plan=transformer.PLAN,
split=transformer.SPLIT)`` (jax_impl/parallel/compose.py has the per-axis contract and
``comm_theory()``; transformer.py the plan and split beside the model). This runner only builds the
model, loss and tx from Config / Problem and maps compose's params / gradients back to fixture order.
What that means for the transformer, against the 1-D patterns' hand-written forwards (and torch's
mesh rows, which split the vocabulary):

    data (dp | fsdp)  tokens/targets P(data, cp): rows per data index
    cp                the same arrays' columns; attention = parallel.cp's ring through the Block's seam
                      (transformer.seam_attention), wpe at the global positions
    tp                Megatron over the blocks (qkv by whole heads: colwise_heads, o / down rowwise, up
                      colwise); the embeddings, final norm and head stay REPLICATED over tp (compose
                      splits the blocks' Linear modules only; torch's mesh splits the vocabulary)
    pp                GPipe over the stacked blocks, M micro-batches of the local rows; wte/wpe and
                      normf/head replicated over pp (real on the first / last stage)
    fsdp              ZeRO-3 over "fsdp" alone (not fsdp·cp): dim 0 of every ≥2-D array split after tp,
                      gathered ONCE per step before the stages, one reduce-scatter per array in backward

Per step and device the collectives are ``Composed.comm_theory()`` (tests/test_mesh.py asserts the
ledger equals it per axis); memory: the params as the layout places them (``Composed.param_bytes``),
as much again for the gradients, twice for AdamW's moments.

jit and typed keep the runner's own programs. jit runs ``jit_loss`` below — every stage at once under
vmap, tp's vocab-parallel jit_ops with the stream pinned, pp.jit_circular — placed by ``rules(cfg)``
(tp.FIXTURE_PLAN's; fsdp over the fsdp(+cp) group): compose refuses pp under jit, and without pp its jit
(the plain forward under NamedShardings, no layout pinned) leaves the fused qkv split contiguously over
tp, so XLA moves k|v between the tp devices: measured at compare.py's defaults, dp=2,tp=2, 40× 2.2 MiB
on tp against this program's 20× 1.1 MiB, and no formula to check it against (``through_compose`` is
the one switch). typed runs jax_impl/mesh_typed.py (compose refuses typed). Their collectives:
shared.theory.mesh_comm_jax; memory: mesh_state_bytes_jax.
Papers: Megatron-LM PTD-P, Narayanan et al. 2021 (arXiv:2104.04473); GSPMD, Xu et al. 2021
(arXiv:2105.04663); torchtitan, Liang et al. 2024 (arXiv:2410.06511).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl import pp, recipe, tp, transformer
from jax_impl.devices import make_mesh
from jax_impl.harness import Setup, train_loop
from jax_impl.model import (
    build_model,
    compute_dtype,
    inputs,
    jax_dtype,
    make_optimizer,
    output_loss,
    targets,
    to_numpy,
)
from jax_impl.parallel.compose import Composed, compose
from jax_impl.parallel.typed import InMesh, Stated, explicit_mesh
from shared.config import Config
from shared.problem import Problem, param_names, param_shapes
from shared.results import Trained
from shared.theory import mesh_comm_jax, mesh_micro, mesh_state_bytes_jax


def variants(cfg: Config, full: bool = False) -> tuple[tuple[str, str], ...]:
    """shard_map and jit on every layout; typed (sharding in types) where mesh_typed.refusal is None; a
    style the recipe cannot run exactly (shared.recipe.refusal: compose's stacked blocks under a per-layer
    --freeze) left out (``full``: kept, for the notes that say so)."""
    from jax_impl.mesh_typed import refusal
    from shared.recipe import refusal as recipe_refusal

    styles = ("shard_map", "jit") + (("typed",) if refusal(cfg) is None else ())
    return tuple((style, cfg.mesh_name) for style in styles
                 if full or recipe_refusal("jax", "mesh", style, cfg.mesh_name, cfg) is None)


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(tuple(n for _, n in cfg.mesh), tuple(a for a, _ in cfg.mesh), device)


def names(cfg: Config) -> tuple[str, ...]:
    return tuple(a for a, _ in cfg.mesh)


def grad_axes(cfg: Config) -> tuple[str, ...]:
    """The data axis and cp, in mesh order: the loss is averaged (gradients summed) over them."""
    return tuple(a for a in names(cfg) if a in ("dp", "fsdp", "cp"))


def fsdp_axes(cfg: Config) -> tuple[str, ...]:
    """The group fsdp shards over: fsdp and cp (empty without fsdp; HSDP: dp replicates, not in it)."""
    return tuple(a for a in grad_axes(cfg) if a != "dp") if cfg.data_axis == "fsdp" else ()


def _one(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def rules(cfg: Config):
    """(fixture name, shape in the TP layout) -> mesh axes per dim of ONE (unstacked) parameter:
    tp.FIXTURE_PLAN's (parallel.tp.plan_rules) when the layout has tp, and under fsdp dim 0 of every
    ≥2-D array further split over the fsdp(+cp) group (after tp: tp-major, so the gather over fsdp
    yields the tp shard)."""
    tp_rule = tp.tp_rules(cfg, "megatron") if "tp" in names(cfg) else (lambda name, shape: P())
    shard = fsdp_axes(cfg)

    def rule(name: str, shape: tuple[int, ...]) -> tuple:
        axes = list(tp_rule(name, shape)) + [None] * (len(shape) - len(tp_rule(name, shape)))
        if shard and len(shape) >= 2:
            axes[0] = _one(((axes[0],) if axes[0] else ()) + shard)
        return tuple(axes)
    return rule


def stacked_specs(cfg: Config, tree: dict) -> dict:
    """PartitionSpecs of pp.split's tree: the stage axis on "pp" (when the layout has it), the block
    index whole, then ``rules`` on the parameter's own dims."""
    rule, stage = rules(cfg), ("pp" if "pp" in names(cfg) else None)
    out = {}
    for group, arrays in tree.items():
        lead = (stage,) if group != "blocks" else (stage, None)
        out[group] = {k: P(*lead, *rule(k if group != "blocks" else f"blocks.0.{k}", a.shape[len(lead):]))
                      for k, a in arrays.items()}
    return out


# --- jit: shardings only ------------------------------------------------------------------------------


def jit_loss(cfg: Config, mesh):
    """loss(params, tokens, y, pos) -> (1,) the global mean CE, on global arrays: the stages run at
    once under vmap (spmd_axis_name "pp": a constraint inside gets the stage axis), tp's jit_ops
    placements written for the mesh (the stream (…, rows, T, D) stays P(…, data, cp, None) instead of
    P(); every constraint names the batch dims from the END, so the (M, …) arrays outside a stage keep
    M whole), pp.jit_circular's shifts pinned to P(pp, …, data, cp, None)."""
    S, (M, m, _), d = cfg.axis("pp"), mesh_micro(cfg), cfg.data_size
    data = _one(tuple(a for a in grad_axes(cfg) if a != "cp"))
    seq, tpx = ("cp" if "cp" in names(cfg) else None), ("tp" if "tp" in names(cfg) else None)
    stage_axis = "pp" if "pp" in names(cfg) else None
    at = lambda *spec: lambda a: lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))
    stream = lambda a: at(*[None] * (a.ndim - 3), data, seq, None)(a)  # (…, rows, T, D): leading dims whole
    vocab = lambda a: at(*[None] * (a.ndim - 3), data, seq, tpx)(a)  # (…, rows, T, V/tp)
    # in a stage: (rows, T, 3, D/tp) qkv, (rows, T, D/tp) attention output and MLP hidden
    ops = SimpleNamespace(f=stream, g=stream, split=lambda a: at(data, seq, *[None] * (a.ndim - 3), tpx)(a))
    head_ops = SimpleNamespace(f=stream, split=vocab)  # on (M, rows, T, …)

    def hot(ids, n, dtype):  # (…, rows, T) ids -> one-hot (…, rows, T, n), n split over tp (jax.nn.one_hot
        # without its (…, 1) reshape: no size-1 dim for the partitioner to put an axis on)
        shape = ids.shape + (n,)
        ids = lax.broadcast_in_dim(ids, shape, tuple(range(ids.ndim)))
        return vocab((ids == lax.broadcasted_iota(ids.dtype, shape, ids.ndim - 1)).astype(dtype))

    def embed(wte, tok):  # the vocab-parallel lookup as a matmul: one-hot (…, V/tp) @ (V/tp, D), summed over tp
        return stream(jnp.einsum("...v,vd->...d", hot(tok, wte.shape[0], wte.dtype), wte))

    def cross_entropy(logits, y):  # mean CE of vocab-split logits (…, V/tp): max, Σexp, target logit over tp
        picked = jnp.sum(hot(y, logits.shape[-1], logits.dtype) * logits, axis=-1)  # (…, rows, T)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    pin = lambda a: at(stage_axis, *[None] * (a.ndim - 4), data, seq, None)(a)  # (S, [M,] rows, T, D)
    vmap = partial(jax.vmap, spmd_axis_name=stage_axis)
    is_last = np.arange(S) == S - 1

    def stage(blocks, x):  # one stage's L/S blocks on (d·m, T, D)
        for l in range(blocks["attn.qkv.weight"].shape[0]):
            x = tp.block_forward(lambda n, l=l: blocks[f"{n}.weight"][l], x, cfg.head_dim, ops)
        return x

    low = compute_dtype(cfg)  # mixed precision: every Param cast inside the step (master weights float32)

    def loss(params, tokens, y, pos):
        params = jax.tree.map(lambda a: a.astype(low), params) if cfg.precision == "mixed" else params
        # micro-batch k = rows chunk k of every data rank's B/d rows: (B, T) -> (M, d·m, T)
        micro = lambda a: at(None, data, seq)(a.reshape(d, M, m, cfg.seq).swapaxes(0, 1).reshape(M, d * m, cfg.seq))
        xs, ys = micro(tokens), micro(y)
        first = lambda f: embed(f["wte.weight"], xs) + f["wpe.weight"][pos]  # (M, d·m, T, D) per stage slot
        inp = pin(vmap(first)(params["first"]))  # (S, M, d·m, T, D)
        run = lambda x: vmap(stage)(params["blocks"], x)  # (S, d·m, T, D): every stage at once
        outs = pp.jit_circular(run, inp, pin) if S > 1 else \
            jnp.stack([run(inp[:, k]) for k in range(M)], axis=1)  # (S, M, d·m, T, D); S = 1: --accumulate's M
        head = lambda last, o: cross_entropy(tp.head_logits(last, o, head_ops).astype(jax_dtype(cfg)), ys)
        losses = vmap(head)(params["last"], outs)  # (S,)
        return jnp.sum(jnp.where(is_last, losses, 0))[None]  # the last stage's
    return loss


def compose_tx(cfg: Config, frozen: set[str], blocks: str) -> optax.GradientTransformation:
    """The recipe's AdamW (jax_impl.recipe: the schedule) with its decay mask written for either tree optax
    may see: compose's {"rest": {path: a}, "blocks": {path in a block: (S, L/S, …)}} (the blocks' leaves 2
    dims more) or the model's {path: a} (compose's probe compares the two); frozen paths never decay."""
    from jax_impl import recipe

    if not (cfg.decay_mask or frozen):
        return optax.adamw(recipe.learning_rate(cfg), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay)
    decays = lambda path, ndim: (ndim >= 2 or not cfg.decay_mask) and path not in frozen  # noqa: E731

    def mask(tree):
        if set(tree) == {"rest", "blocks"}:
            return {"rest": {k: decays(k, a.ndim) for k, a in tree["rest"].items()},
                    "blocks": {k: decays(f"{blocks}.0.{k}", a.ndim - 2) for k, a in tree["blocks"].items()}}
        return {k: decays(k, a.ndim) for k, a in tree.items()}

    return optax.adamw(recipe.learning_rate(cfg), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, mask=mask)


def composed(cfg: Config, problem: Problem, style: str, mesh) -> Composed:
    """The transformer of ``problem`` composed on ``mesh`` (jax_impl/parallel/compose.py): its plan and
    split (transformer.PLAN, SPLIT), the mean CE, AdamW with torch's semantics, cfg's micro-batches (times
    --accumulate), and the recipe: --clip (clip=), --freeze (freeze=, the fixture names' NNX paths), the
    schedule and the decay mask (compose_tx)."""
    from jax_impl import recipe

    model = build_model(cfg, problem)
    frozen = recipe.frozen_paths(cfg, recipe.fixture_paths(model)) if cfg.freeze else set()
    tx = compose_tx(cfg, frozen, transformer.SPLIT.blocks) if cfg.recipe_active else make_optimizer(cfg)
    moe = {"plan": transformer.MOE_PLAN, "split": transformer.MOE_SPLIT, "experts": transformer.MOE_EXPERTS,
           "aux": transformer.MOE_AUX} if cfg.moe else {"plan": transformer.PLAN, "split": transformer.SPLIT}
    return compose(model, dict(cfg.mesh), output_loss, tx, style=style, microbatches=cfg.pipeline_microbatches,
                   devices=list(mesh.devices.flat), clip=cfg.clip, freeze=sorted(frozen), **moe)


def composed_setup(cfg: Config, problem: Problem, style: str, mesh) -> Setup:
    """The harness's Setup from compose's program (its step with the gradients), compose's params /
    gradients mapped back to fixture names and order, its per-axis theory and the layout's state bytes."""
    c = composed(cfg, problem, style, mesh)
    step, state, batch = c.program(np.asarray(inputs(cfg, problem)), np.asarray(targets(cfg, problem)), grads=True)
    order = param_names(cfg)

    def fixture(tree):  # compose's {"rest", "blocks"} tree -> fixture arrays in param_names order
        named = {transformer.param_name(path): a for path, a in c.to_paths(tree).items()}
        return [to_numpy(named[k]) for k in order]

    theory, p = c.comm_theory(), c.param_bytes()  # per axis from the model wrapped; per device from the specs
    return Setup(step=step, state=state, batch=batch, grads_fixture=fixture,
                 params_fixture=lambda state: fixture(state[0]),
                 comm_theory=None if theory is None else sum(b for ops in theory.values() for _, b in ops.values()),
                 extra={"comm_by_axis_theory": theory,
                        "state_bytes_theory": {"params": p, "grads": p, "optimizer": 2 * p},  # AdamW: mu, nu
                        "rules": {g: {k: str(sp) for k, sp in v.items()} for g, v in c.specs.items()}},
                 compiler_options=c.compiler_options, mesh=c.mesh)


def through_compose(cfg: Config, style: str) -> bool:
    """shard_map: the library's composition; jit and typed: this runner's programs (docstring: why); the MoE
    transformer (an ep axis): compose in both styles (its jit: the experts P("ep"), XLA's collectives)."""
    return style == "shard_map" or (cfg.moe and style == "jit")


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    from jax_impl import mesh_typed

    if style == "typed" and mesh_typed.refusal(cfg):
        raise ValueError(mesh_typed.refusal(cfg))
    if (style, variant) not in variants(cfg):
        raise ValueError(f"mesh: unknown style/variant {style}/{variant}; choose from {variants(cfg)}")
    cfg.check("mesh", "jax")
    assert dict(mesh.shape) == dict(cfg.mesh), (mesh.shape, cfg.mesh)
    if through_compose(cfg, style):
        return train_loop(cfg, composed_setup(cfg, problem, style, mesh))
    typed = style == "typed"  # an Explicit-axes copy of the mesh (jax_impl/mesh_typed.py)
    if typed:
        mesh = explicit_mesh(mesh)
        stated = Stated(mesh)
    order, shapes = param_names(cfg), param_shapes(cfg)
    tree = pp.split(tp.to_layout(problem.params), cfg.axis("pp"))  # blocks (S, L/S, …), slots (S, …)
    specs = stacked_specs(cfg, tree)
    dtype = jax_dtype(cfg)
    params = jax.tree.map(lambda a, s: jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, s)), tree, specs)
    data, seq = _one(tuple(a for a in grad_axes(cfg) if a != "cp")), "cp" if "cp" in names(cfg) else None
    rows = NamedSharding(mesh, P(data, seq))
    batch = (jax.device_put(inputs(cfg, problem), rows), jax.device_put(targets(cfg, problem), rows),
             jax.device_put(jnp.arange(cfg.seq, dtype=jnp.int32), NamedSharding(mesh, P(seq))))
    tx, zero = recipe.stacked(cfg, tree) if cfg.recipe_active else (make_optimizer(cfg), lambda g: g)
    to_loss = mesh_typed.loss_for(cfg, stated) if typed else jit_loss(cfg, mesh)
    # (differentiated, reported): the mean of the local losses is differentiated and never computed
    loss_of = lambda p, *b: (lambda v: (jnp.mean(v), v))(to_loss(p, *b))

    state = (params, tx.init(params))
    placed = jax.tree.map(lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else None, state)

    def step(params, opt_state, *batch):
        (_, loss), grads = jax.value_and_grad(loss_of, has_aux=True)(params, *batch)
        grads = zero(grads)  # --freeze: the frozen Params' gradients zero (stop_gradient's)
        updates, opt_state = tx.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), opt_state)
        if style == "jit":  # the state leaves as it came (XLA might keep another layout)
            new = jax.tree.map(lambda a, s: a if s is None else lax.with_sharding_constraint(a, s), new, placed,
                               is_leaf=lambda x: x is None)
        return *new, loss, grads

    def fixture(tree):  # stacked, TP layout -> fixture arrays in param_names order (device_get gathers)
        return [a.reshape(shapes[k]) for k, a in zip(order, pp.unsplit(tree, order), strict=True)]

    # --clip (XLA reduces the norm's squares per sharded leaf) and mixed precision: measured, no formula here
    theory = None if typed or cfg.clip is not None or cfg.precision == "mixed" else mesh_comm_jax(cfg, style)
    jitted = jax.jit(stated.traced(step) if typed else step, donate_argnums=(0, 1))
    return train_loop(cfg, Setup(
        step=InMesh(jitted, mesh) if typed else jitted, state=state, batch=batch,
        grads_fixture=fixture, params_fixture=lambda state: fixture(state[0]),
        comm_theory=None if theory is None else sum(b for ops in theory.values() for _, b in ops.values()),
        extra={"comm_by_axis_theory": theory,
               "state_bytes_theory": mesh_state_bytes_jax(cfg, style),
               "rules": {g: {k: str(s) for k, s in v.items()} for g, v in specs.items()}}
        | ({"stated": stated.entries} if typed else {}), mesh=mesh))
