"""N-D parallelism in JAX: dp/fsdp × pp × cp × tp on ONE multi-axis mesh (the transformer).

The mesh is ``jax.make_mesh`` over the layout's sizes and names in device order (``mesh_for``:
"dp=2,tp=2,pp=2" -> axes ("dp", "tp", "pp"), innermost last); every 1-D pattern keeps its axis name,
so each collective names the axis it runs on. ``rules(cfg)`` is the one layout table of both styles.

    data (dp | fsdp)  tokens/targets P(data, cp): rows per data index
    cp                the same arrays' columns; attention = jax_impl.cp's ring on the tp-local heads
    tp                Megatron (jax_impl.tp: f = pcast, g = psum, vocab-parallel embedding and loss)
    pp                jax_impl.pp's circular pipeline over "pp"; M micro-batches of the local rows
    fsdp              ZeRO-3 over the fsdp(+cp) group: dim 0 of every ≥2-D local array split;
                      gathered once per step before the pipeline, again in backward where needed,
                      one reduce-scatter per array (the gather's transpose)

shard_map  one body over the whole mesh; the replicated weights' gradients are summed over data and
           cp together by ONE invariant -> varying cast per array (one "dp+cp" group).
jit        the same arrays under NamedShardings; XLA (Shardy + the SPMD partitioner) picks the
           collectives (mesh_comm_jax(cfg, "jit"), read back from the HLO).

Per step and device (shared.theory.mesh_comm_jax; A = one micro-batch's (m, T/c, D) stream,
I = M+S−1 iterations): tp (4·L/S·I + 2M)·A + 3·M·m·T/c·b all-reduces; cp L/S·I·(3c−2) permutes
of K|V; pp 2·(M+S−2) permutes of A; the gradient group Φ_dev·b (dp) or ZeRO-3's gathers and
reduce-scatters (fsdp). Memory per device: mesh_state_bytes_jax.
Papers: Megatron-LM PTD-P, Narayanan et al. 2021 (arXiv:2104.04473); GSPMD, Xu et al. 2021
(arXiv:2105.04663).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl import cp, pp, tp
from jax_impl.devices import make_mesh
from jax_impl.harness import Setup, train_loop
from jax_impl.model import inputs, jax_dtype, make_optimizer, output_loss, targets
from jax_impl.parallel.typed import InMesh, Stated, explicit_mesh
from shared.config import Config
from shared.problem import Problem, param_names, param_shapes
from shared.results import Trained
from shared.theory import mesh_comm_jax, mesh_micro, mesh_state_bytes_jax

GATHERED = "fsdp_gathered"  # jax.checkpoint name of fsdp's gathered weights: re-gathered in backward
# no tp axis: Megatron's f / g are identities, the embedding a lookup, the loss the plain mean CE
PLAIN_OPS = SimpleNamespace(f=lambda a: a, g=lambda a: a, split=lambda a: a, embed=lambda wte, tok: wte[tok],
                            loss=output_loss)


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    """shard_map and jit on every layout; typed (sharding in types) where mesh_typed.refusal is None."""
    from jax_impl.mesh_typed import refusal

    styles = ("shard_map", "jit") + (("typed",) if refusal(cfg) is None else ())
    return tuple((style, cfg.mesh_name) for style in styles)


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(tuple(n for _, n in cfg.mesh), tuple(a for a, _ in cfg.mesh), device)


def names(cfg: Config) -> tuple[str, ...]:
    return tuple(a for a, _ in cfg.mesh)


def grad_axes(cfg: Config) -> tuple[str, ...]:
    """The data axis and cp, in mesh order: the loss is averaged (gradients summed) over them."""
    return tuple(a for a in names(cfg) if a in ("dp", "fsdp", "cp"))


def fsdp_axes(cfg: Config) -> tuple[str, ...]:
    """The group fsdp shards over: fsdp and cp (empty without fsdp)."""
    return grad_axes(cfg) if cfg.data_axis == "fsdp" else ()


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


# --- the forward on one device's slices --------------------------------------------------------------


def attention(cfg: Config):
    """attn(qkv (B, T/c, 3, h·dh), head_dim) -> (B, T/c, h·dh): tp's causal attention, or cp's ring."""
    if cfg.axis("cp") == 1 or "cp" not in names(cfg):
        return tp.attend
    ring = cp.ring_attention("ring", cfg.axis("cp"))
    return lambda qkv, head_dim: ring(qkv.reshape(qkv.shape[:2] + (-1,)), head_dim)  # [q | k | v] heads


def local_loss(cfg: Config, local: dict, tokens: jax.Array, y: jax.Array, pos: jax.Array) -> jax.Array:
    """This device's mean CE over its (B/d, T/c) tokens; ``local``: this stage's weights, tp-local and
    whole (fsdp gathered). tokens, y (B/d, T/c); pos (T/c,) their global positions."""
    S, (M, m, tc) = cfg.axis("pp"), mesh_micro(cfg)
    assert tokens.shape == y.shape == (M * m, tc), (tokens.shape, (M * m, tc))
    ops, attn = tp.SHARD_MAP_OPS if "tp" in names(cfg) else PLAIN_OPS, attention(cfg)
    xs, ys = tokens.reshape(M, m, tc), y.reshape(M, m, tc)  # micro-batch k = rows chunk k
    first, blocks, last = local["first"], local["blocks"], local["last"]
    x = ops.embed(first["wte.weight"], xs) + first["wpe.weight"][pos]  # (M, m, T/c, D): real on stage 0

    def stage(x):  # this stage's L/S blocks on one micro-batch (m, T/c, D)
        for l in range(len(blocks["attn.qkv.weight"])):
            x = tp.block_forward(lambda n, l=l: blocks[f"{n}.weight"][l], x, cfg.head_dim, ops, attn)
        return x

    outs = pp.circular(stage, x, S) if S > 1 else stage(x[0])[None]  # (M, m, T/c, D)
    loss = ops.loss(tp.head_logits(last, outs, ops), ys)  # mean over M equal micro-batches
    if S > 1:  # the last stage's loss, on every stage
        loss = lax.psum(jnp.where(lax.axis_index("pp") == S - 1, loss, 0), "pp")
    return loss


def prepare(cfg: Config, local: dict) -> dict:
    """This stage's weights, ready for ``local_loss``; blocks as per-layer lists. Replicated arrays
    are cast to varying over the data and cp axes ONCE here, so that the transpose sums their
    gradients over both in one psum per array (an implicit cast at every use would psum once per
    use: per pipeline iteration, and wpe's over cp and dp apart). fsdp: every ≥2-D array is all-
    gathered over the fsdp(+cp) group along its rows instead (transpose: psum_scatter), per block
    and weight, tagged so that jax.checkpoint recomputes (re-gathers) it in backward (``regather``)."""
    shard, vary = fsdp_axes(cfg), grad_axes(cfg)

    def one(a):
        if shard and a.ndim >= 2:
            return checkpoint_name(lax.all_gather(a, shard, axis=0, tiled=True), GATHERED)
        return lax.pcast(a, vary, to="varying") if vary else a

    out = {g: {k: one(a) for k, a in local[g].items()} for g in ("first", "last")}
    out["blocks"] = {k: [one(w) for w in a] for k, a in local["blocks"].items()}  # L/S × (…): one gather each
    return out


def regather(prim, *_, **params) -> bool:
    """jax.checkpoint policy: save everything but fsdp's gathered weights (and their names), so the
    backward re-gathers each weight it needs (the gathered value feeds the ops directly: a slice in
    between would be saved in its place)."""
    return not (prim.name == "all_gather" or (prim.name == "name" and params.get("name") == GATHERED))


def shard_map_loss(cfg: Config, mesh, specs: dict):
    """loss(params, tokens, y, pos) -> (d·c,) local mean CEs, one per (data, cp) coordinate."""
    loss_axes = grad_axes(cfg)
    data = _one(tuple(a for a in loss_axes if a != "cp"))
    seq = "cp" if "cp" in names(cfg) else None

    def body(params, tokens, y, pos):
        local = jax.tree.map(lambda a: a[0], params)  # this stage's slice: blocks (L/S, …), slots (…)
        run = lambda w, *b: local_loss(cfg, prepare(cfg, w), *b)
        if fsdp_axes(cfg):  # backward recomputes the gathers only: activations saved as usual
            run = jax.checkpoint(run, policy=regather)
        return run(local, tokens, y, pos)[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(data, seq), P(data, seq), P(seq)),
                         out_specs=P(_one(loss_axes)), check_vma=True)


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

    def loss(params, tokens, y, pos):
        # micro-batch k = rows chunk k of every data rank's B/d rows: (B, T) -> (M, d·m, T)
        micro = lambda a: at(None, data, seq)(a.reshape(d, M, m, cfg.seq).swapaxes(0, 1).reshape(M, d * m, cfg.seq))
        xs, ys = micro(tokens), micro(y)
        first = lambda f: embed(f["wte.weight"], xs) + f["wpe.weight"][pos]  # (M, d·m, T, D) per stage slot
        inp = pin(vmap(first)(params["first"]))  # (S, M, d·m, T, D)
        run = lambda x: vmap(stage)(params["blocks"], x)  # (S, d·m, T, D): every stage at once
        outs = pp.jit_circular(run, inp, pin) if S > 1 else run(inp[:, 0])[:, None]  # (S, M, d·m, T, D)
        head = lambda last, o: cross_entropy(tp.head_logits(last, o, head_ops), ys)
        losses = vmap(head)(params["last"], outs)  # (S,)
        return jnp.sum(jnp.where(is_last, losses, 0))[None]  # the last stage's
    return loss


def cpu_options(cfg: Config, mesh) -> dict | None:
    """XLA:CPU drops optimization barriers before its last CSE pass, which would merge fsdp's backward
    re-gathers into the forward ones and cp's backward K|V rotation into the forward one (see
    jax_impl.fsdp.cpu_options, jax_impl.cp.cpu_options): those layouts compile without CSE on CPU."""
    if mesh.devices.flat[0].platform != "cpu" or not (fsdp_axes(cfg) or cfg.axis("cp") > 1):
        return None
    return {"xla_disable_hlo_passes": "cse"}


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    from jax_impl import mesh_typed

    if style == "typed" and mesh_typed.refusal(cfg):
        raise ValueError(mesh_typed.refusal(cfg))
    if (style, variant) not in variants(cfg):
        raise ValueError(f"mesh: unknown style/variant {style}/{variant}; choose from {variants(cfg)}")
    typed = style == "typed"  # an Explicit-axes copy of the mesh (jax_impl/mesh_typed.py)
    if typed:
        mesh = explicit_mesh(mesh)
        stated = Stated(mesh)
    cfg.check("mesh", "jax")
    assert dict(mesh.shape) == dict(cfg.mesh), (mesh.shape, cfg.mesh)
    order, shapes = param_names(cfg), param_shapes(cfg)
    tree = pp.split(tp.to_layout(problem.params), cfg.axis("pp"))  # blocks (S, L/S, …), slots (S, …)
    specs = stacked_specs(cfg, tree)
    dtype = jax_dtype(cfg)
    params = jax.tree.map(lambda a, s: jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, s)), tree, specs)
    data, seq = _one(tuple(a for a in grad_axes(cfg) if a != "cp")), "cp" if "cp" in names(cfg) else None
    rows = NamedSharding(mesh, P(data, seq))
    batch = (jax.device_put(inputs(cfg, problem), rows), jax.device_put(targets(cfg, problem), rows),
             jax.device_put(jnp.arange(cfg.seq, dtype=jnp.int32), NamedSharding(mesh, P(seq))))
    tx = make_optimizer(cfg)
    to_loss = shard_map_loss(cfg, mesh, specs) if style == "shard_map" else mesh_typed.loss_for(cfg, stated) \
        if typed else jit_loss(cfg, mesh)
    # (differentiated, reported): the mean of the local losses is differentiated and never computed
    loss_of = lambda p, *b: (lambda v: (jnp.mean(v), v))(to_loss(p, *b))

    state = (params, tx.init(params))
    placed = jax.tree.map(lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else None, state)

    def step(params, opt_state, *batch):
        (_, loss), grads = jax.value_and_grad(loss_of, has_aux=True)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), opt_state)
        if style == "jit":  # the state leaves as it came (XLA might keep another layout)
            new = jax.tree.map(lambda a, s: a if s is None else lax.with_sharding_constraint(a, s), new, placed,
                               is_leaf=lambda x: x is None)
        return *new, loss, grads

    def fixture(tree):  # stacked, TP layout -> fixture arrays in param_names order (device_get gathers)
        return [a.reshape(shapes[k]) for k, a in zip(order, pp.unsplit(tree, order), strict=True)]

    theory = None if typed else mesh_comm_jax(cfg, style)  # jit with cp or fsdp: None, XLA's choice (docstring there)
    jitted = jax.jit(stated.traced(step) if typed else step, donate_argnums=(0, 1))
    return train_loop(cfg, Setup(
        step=InMesh(jitted, mesh) if typed else jitted, state=state, batch=batch,
        grads_fixture=fixture, params_fixture=lambda state: fixture(state[0]),
        comm_theory=None if theory is None else sum(b for ops in theory.values() for _, b in ops.values()),
        extra={"comm_by_axis_theory": theory,
               "state_bytes_theory": mesh_state_bytes_jax(cfg, style),
               "rules": {g: {k: str(s) for k, s in v.items()} for g, v in specs.items()}}
        | ({"stated": stated.entries} if typed else {}),
        compiler_options=cpu_options(cfg, mesh) if style == "shard_map" else None, mesh=mesh))
