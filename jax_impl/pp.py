"""Pipeline parallelism in JAX, the runner: the circular (SPMD) pipeline, trained by autodiff of the
schedule, and 1F1B / ZB-H1 / interleaved by hand (jax_impl/parallel/pp_schedules.py).

Sharded: the blocks, stacked (S, L/S, …) over the ``pp`` axis (device s: blocks s·L/S … (s+1)·L/S − 1,
their grads and AdamW state). The embeddings and the head are stacked (S, …) too, one slot per
device, real on stage 0 / S−1 and zero elsewhere: every device holds them
(shared.theory.pp_spmd_param_count). M micro-batches, replicated.

Schedule ("circular", GSPMD's shifting buffer): M + S − 1 iterations; in iteration t stage s runs
micro-batch t − s, then every activation moves one stage on (the last wraps round, ignored).
Bubble iterations compute on zeros and are masked out: they reach neither the loss nor the
gradients. Backward is jax.grad of the unrolled schedule (GPipe order), every shift transposed.

Collectives per step and device: collective-permutes of one micro-batch's activation ((B/M, D) or
(B/M, T, D)): M + S − 2 forward, M + S − 2 backward (shard_map), plus an all-reduce of the scalar
loss (shared.theory.pp_circular_permute_count / _bytes). jit writes the shift as jnp.roll under a
sharding constraint; XLA turns it into permutes (the ledger counts them).
  shard_map  lax.ppermute over ``pp``; variants 1f1b, zb (ZB-H1), interleaved: torch's orders,
             per-micro-batch jax.vjp on a tick clock
  jit        the stages vmapped over a leading (S,) axis sharded over ``pp``
Mixed precision (--precision mixed): float32 stacked weights and optax state, each stage's cast to bf16
inside the loss (1F1B / ZB / interleaved: the schedule differentiates the bf16 copies and sums every
micro-batch's gradient in float32); the messages travel in bf16, the loss in float32.
Papers: GPipe, Huang et al. 2019 (arXiv:1811.06965); GSPMD, Xu et al. 2021 (arXiv:2105.04663);
ZB-H1, Qi et al. 2024 (arXiv:2401.10241).
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl import recipe, transformer
from jax_impl.devices import make_mesh, wire_config
from jax_impl.harness import Setup, train_loop
from jax_impl.model import gelu, inputs, jax_dtype, make_optimizer, output_loss, targets, to_compute, to_loss, to_numpy
from jax_impl.parallel import pp_schedules
from jax_impl.parallel.scaling import keep, nonfinite, scale_cotangent
from shared.config import Config
from shared.problem import Problem, param_names
from shared.results import Trained
from shared.schedule import closed_form_bubble, simulate
from shared.theory import (
    pp_bubble_fraction,
    pp_circular_permute_bytes,
    pp_circular_permute_count,
    pp_spmd_param_count,
    pp_state_bytes,
    pp_ticks_permute_bytes,
    pp_ticks_permute_count,
)

VARIANTS = (("shard_map", "circular"), ("jit", "circular"), ("shard_map", "1f1b"), ("shard_map", "zb"),
            ("shard_map", "interleaved"))
BY_HAND = ("1f1b", "zb", "interleaved")  # jax_impl/parallel/pp_schedules.py
# Sharding in types ("typed", JAX's Explicit axes; jax_impl/parallel/typed.py) cannot say the pipeline's shift:
# jit's schedule with reshard(·, P('pp')) for the constraints fails at jnp.roll over the (S,) stage
# axis (jax 0.10.2). The shift that can be typed, reshard(a, P()) -> roll -> reshard(·, P('pp')), is
# an all-gather of every stage's activation per tick (S× the message: 24 KiB instead of 6 KiB on the
# MLP at S = M = 4), not a point-to-point pipeline: refused rather than passed off as one.
TYPED_REFUSAL = ("the stage-to-stage shift cannot be written in types: jnp.roll over the pp-split stage axis "
                 "is refused at trace time (ShardingTypeError: slicing on sharded dims where out dim (1) is not "
                 "divisible by mesh axes (4) with spec (pp) is not implemented. Got input type=f64[4@pp,4,16] and "
                 "output shape=(1, 4, 16)); use shard_map (ppermute) or jit")
BLOCK = re.compile(r"^(?:layers|blocks)\.(\d+)\.(.+)$")  # "blocks.3.attn.qkv.weight" -> 3, "attn.qkv.weight"


def variants(cfg: Config) -> list[tuple[str, str]]:
    """Every variant; interleaved only where M % S == 0, as torch_impl/pp.py's (Megatron's order); less those
    shared.recipe.refusal leaves out (float16: the schedules by hand)."""
    from shared.recipe import refusal

    return [sv for sv in VARIANTS if (sv[1] != "interleaved" or cfg.microbatches % cfg.world_size == 0)
            and refusal("jax", "pp", *sv, cfg) is None]


def mesh_for(cfg: Config, device: str = "auto"):
    return make_mesh(cfg.world_size, "pp", device)


def rules(name: str, shape: tuple[int, ...]) -> tuple:
    """The pipeline's sharding rule, for both models: every stacked array (``split``) puts its
    leading stage axis on ``pp`` and keeps the rest whole."""
    return ("pp",) + (None,) * (len(shape) - 1)


# --- the stage split: fixture {name: array} <-> stacked tree ------------------------------------


def split(params: dict[str, np.ndarray], stages: int) -> dict[str, dict[str, np.ndarray]]:
    """{"first": {name: (S, …)}, "blocks": {suffix: (S, L/S, …)}, "last": {name: (S, …)}}: block l's
    parameters stacked by suffix; parameters before the blocks (embeddings) in a slot that is real
    on stage 0, those after them (final norm, head) in one real on stage S−1; zeros elsewhere."""
    first, blocks, last = {}, {}, {}
    for name, w in params.items():
        if m := BLOCK.match(name):
            blocks.setdefault(m[2], []).append(w)
            continue
        slots = np.zeros((stages,) + w.shape)
        slots[stages - 1 if blocks else 0] = w
        (last if blocks else first)[name] = slots
    blocks = {k: np.stack(v).reshape((stages, len(v) // stages) + v[0].shape) for k, v in blocks.items()}
    return {"first": first, "blocks": blocks, "last": last}


def unsplit(tree, names: list[str]) -> list[np.ndarray]:
    """The inverse of ``split`` (real slots only): float64 fixture arrays in ``names`` order."""
    out = []
    for name in names:
        if m := BLOCK.match(name):
            a = to_numpy(tree["blocks"][m[2]])  # (S, L/S, …)
            out.append(a.reshape((-1,) + a.shape[2:])[int(m[1])])
        else:
            out.append(to_numpy(tree["first"][name][0] if name in tree["first"] else tree["last"][name][-1]))
    return out


def interleaved_name(name: str, layers: int, stages: int, virtual: int) -> str:
    """The interleaved layout (v chunks per device, chunk c of device s = virtual stage c·S + s, of
    n = L/(S·v) layers each): block l's fixture name renumbered to its place in ``split``'s stack,
    row s = [chunk 0's n layers, chunk 1's, …]. Other names, and v = 1, unchanged."""
    if not (m := BLOCK.match(name)) or virtual == 1:
        return name
    n = layers // (stages * virtual)
    (c, s), q = divmod(int(m[1]) // n, stages), int(m[1]) % n  # chunk, device; layer in the chunk
    return f"{name.split('.')[0]}.{s * (layers // stages) + c * n + q}.{m[2]}"


def chunked(params: dict[str, np.ndarray], stages: int, virtual: int) -> dict[str, np.ndarray]:
    """The fixture under ``interleaved_name``s, blocks in their new order (``split`` stacks them in
    dict order): embeddings first, head last, as before."""
    layers = len({BLOCK.match(k)[1] for k in params if BLOCK.match(k)})
    renamed = {interleaved_name(k, layers, stages, virtual): w for k, w in params.items()}
    keys, at = list(renamed), lambda k: int(BLOCK.match(k)[1]) if BLOCK.match(k) else None
    start = next(i for i, k in enumerate(keys) if at(k) is not None)  # the first block's parameter
    blocks = sorted((k for k in keys if at(k) is not None), key=at)  # stable: a layer's suffix order kept
    return {k: renamed[k] for k in keys[:start] + blocks + [k for k in keys[start:] if at(k) is None]}


# --- one stage's pieces, on local slices (one device's, or one row under vmap) -------------------


def stage_blocks(blocks: dict, x: jax.Array, head_dim: int) -> jax.Array:
    """This stage's L/S blocks; blocks {suffix: (L/S, …)}, x (B/M, D) MLP, (B/M, T, D) transformer."""
    for l in range(len(next(iter(blocks.values())))):  # (L/S, …) arrays, or lists of L/S (1f1b)
        if "linear.weight" in blocks:  # the MLP
            x = gelu(x @ blocks["linear.weight"][l])  # (B/M, D)
        else:
            x = transformer.block({f"blocks.{l}.{k}": w[l] for k, w in blocks.items()}, l, x, head_dim)  # (B/M, T, D)
    return x


def embed(first: dict, xs: jax.Array) -> jax.Array:
    """Stage 0's inputs for all M micro-batches at once: the embeddings (M, B/M, T, D) of (M, B/M, T)
    tokens, or the MLP's (M, B/M, D) inputs as they are."""
    if not first:
        return xs
    return transformer.embed(first, xs.reshape(-1, xs.shape[-1])).reshape(xs.shape + (-1,))  # (M, B/M, T, D)


def head(last: dict, ys: jax.Array) -> jax.Array:
    """The last stage's outputs for all M micro-batches at once: logits (M, B/M, T, V) after the
    final norm, or the MLP's outputs (M, B/M, D) as they are."""
    return transformer.head(last, ys) if last else ys


def working(t: int, stages: int, microbatches: int) -> np.ndarray:
    """(S,) bool: which stages hold a real micro-batch (t − s in 0 … M−1) in iteration t."""
    mb = t - np.arange(stages)
    return (mb >= 0) & (mb < microbatches)


# --- the schedule, twice -----------------------------------------------------------------------


def circular(stage, inp: jax.Array, stages: int) -> jax.Array:
    """The circular schedule, inside a shard_map over "pp": ``stage(x)`` runs this device's blocks on
    one micro-batch; inp (M, …) stage 0's inputs (real on stage 0 only). Returns (M, …) the micro-
    batches leaving this stage in order (real on the last stage). jax_impl.mesh runs its tp / cp-aware
    stages through it too."""
    S, M = stages, inp.shape[0]
    shift = [(i, (i + 1) % S) for i in range(S)]  # stage s → s+1, last → 0 (ignored there)
    s = lax.axis_index("pp")
    state, outs = None, []  # state: this stage's input from s − 1, (B/M, D) / (B/M, T, D)
    for t in range(M + S - 1):  # Python loop: the ledger sees every collective-permute
        x = inp[min(t, M - 1)]  # stage 0 feeds micro-batch t
        x = x if state is None else jnp.where(s == 0, x, state)  # t = 0: only stage 0 works yet
        y = stage(x)
        assert y.shape == x.shape == inp.shape[1:], (y.shape, x.shape)  # (B/M, D) / (B/M, T, D)
        y = jnp.where((t - s >= 0) & (t - s < M), y, 0)  # bubble: zero value, zero grad
        if t >= S - 1:
            outs.append(y)  # micro-batch t − S + 1, meaningful on the last stage
        if t < M + S - 2:
            state = lax.ppermute(y, "pp", shift)  # from stage s − 1
    return jnp.stack(outs)


def shard_map_loss(params: dict, xs: jax.Array, ys: jax.Array | None, mesh, head_dim: int, cast=None,
                   out=None) -> jax.Array:
    """Full-batch loss of the circular pipeline; params from ``split`` sharded over pp, xs (M, B/M, …)
    micro-batched inputs, ys (M, B/M, T) targets or None. Mixed precision: ``cast(tree)`` the stage's
    parameters and inputs to the compute dtype, ``out(a)`` the outputs to the loss's (model.to_compute,
    model.to_loss; None: as they are)."""
    cast, out = cast or (lambda a: a), out or (lambda a: a)
    S = mesh.shape["pp"]

    def body(params, xs, ys):
        local = cast(jax.tree.map(lambda a: a[0], params))  # this stage's slice: blocks (L/S, …), slots (…)
        assert all(a.shape[0] == 1 for a in jax.tree.leaves(params)), "one stage per device"
        inp = embed(local["first"], cast(xs))  # (M, B/M, D) / (M, B/M, T, D): real on stage 0 only
        outs = circular(lambda x: stage_blocks(local["blocks"], x, head_dim), inp, S)
        loss = output_loss(out(head(local["last"], outs)), ys)  # mean over M equal micro-batches
        return lax.psum(jnp.where(lax.axis_index("pp") == S - 1, loss, 0), "pp")  # the last stage's, everywhere

    # Differentiated OUTSIDE shard_map (jax.grad of this function): the gradient of the
    # replicated scalar loss flows back through psum / ppermute transposes, no manual scaling.
    specs = jax.tree.map(lambda a: P(*rules("", a.shape)), params)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P(), check_vma=True)(params, xs, ys)


def shard_map_scheduled(params: dict, xs: jax.Array, ys: jax.Array | None, mesh, head_dim: int,
                        schedule: str = "1f1b", virtual: int = 1, info=None, cast=None, out=None):
    """(loss, grads) of a schedule by hand (jax_impl/parallel/pp_schedules.py: 1f1b, zb, interleaved): the gradient
    is computed inside the schedule, micro-batch by micro-batch (no jax.grad over it); params, xs, ys
    as above (interleaved: blocks laid out by ``chunked``, device s's v chunks in its row); ``info``
    gets the stash sizes (pp_schedules.run). Mixed precision (``cast``, ``out`` as shard_map_loss): the
    schedule runs on the stage's bf16 copies and sums each micro-batch's gradient into float32."""
    S, M = mesh.shape["pp"], xs.shape[0]
    cast, out = cast or (lambda a: a), out or (lambda a: a)

    def body(params, xs, ys):
        s = lax.axis_index("pp")

        def stage_fn(local, x, mb, c):  # mb through chunk c: + embedding on virtual stage 0, + head, loss on the last
            if c == 0:
                x = jnp.where(s == 0, embed(local["first"], cast(xs[mb][None]))[0], x)  # (B/M, D) / (B/M, T, D)
            y = stage_blocks(local["blocks"], x, head_dim)
            if c < virtual - 1:
                return y, lax.pcast(out(jnp.zeros((), y.dtype)), "pp", to="varying")  # no loss off the last chunk
            loss = output_loss(out(head(local["last"], y)), None if ys is None else ys[mb]) / M  # share of the mean
            return y, jnp.where(s == S - 1, loss, 0)

        master = jax.tree.map(lambda a: a[0], params)  # this stage's slice: blocks (L/S, …), slots (…)
        local = cast(master)  # mixed: the bf16 copies the schedule differentiates (their grads summed in float32)
        # blocks as lists of per-layer weights: a weight the vjp keeps is then the input itself, not
        # a slice of the stack, and pp_schedules leaves it out of the per-micro-batch stash; chunk c takes
        # layers c·n … (c+1)·n − 1 of the row (n = L/(S·v)), chunk 0 the embedding, chunk v−1 the head
        n = len(next(iter(local["blocks"].values()))) // virtual
        chunks = [{"first": local["first"] if c == 0 else {}, "last": local["last"] if c == virtual - 1 else {},
                   "blocks": {k: list(w[c * n:(c + 1) * n]) for k, w in local["blocks"].items()}}
                  for c in range(virtual)]
        message = jax.eval_shape(lambda: embed(local["first"], cast(xs[:1]))[0])  # (B/M, D) / (B/M, T, D)
        grad_dtype = jax.tree.leaves(master)[0].dtype
        loss, grads = pp_schedules.run(stage_fn, chunks, message, S, M, schedule, virtual, info, grad_dtype)
        grads = {"first": grads[0]["first"], "last": grads[-1]["last"],
                 "blocks": {k: jnp.stack([w for g in grads for w in g["blocks"][k]])  # (L/S, …)
                            for k in local["blocks"]}}
        return lax.psum(loss, "pp"), jax.tree.map(lambda g: g[None], grads)  # the last stage's loss, everywhere

    specs = jax.tree.map(lambda a: P(*rules("", a.shape)), params)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs),
                         check_vma=True)(params, xs, ys)


def jit_circular(stage, inp: jax.Array, pin) -> jax.Array:
    """The same schedule on whole arrays: inp (S, M, …) stage 0's inputs in row 0; ``stage(x)`` runs
    every stage at once on x (S, …) (vmapped); ``pin(a)`` constrains an (S, …) or (S, M, …) array to
    its stage rows on pp (jax_impl.mesh also keeps the batch, sequence and tp dims sharded there).
    Returns (S, M, …): the micro-batches leaving each stage (real in row S−1)."""
    S, M = inp.shape[:2]
    rows = lambda mask, a: mask.reshape((S,) + (1,) * (a.ndim - 1))  # (S,) mask against (S, …)
    is_first = np.arange(S) == 0
    state, outs = None, []
    for t in range(M + S - 1):
        x = inp[:, min(t, M - 1)]  # (S, B/M, …): the micro-batch stage 0 reads
        x = x if state is None else jnp.where(rows(is_first, x), x, state)
        x = pin(x)  # (S, B/M, …): row s = stage s's input
        y = stage(x)  # every stage at once
        y = jnp.where(rows(working(t, S, M), y), y, 0)  # bubbles: zero value, zero grad
        if t >= S - 1:  # micro-batch t − S + 1 leaves the last stage
            outs.append(y)
        if t < M + S - 2:
            state = pin(jnp.roll(y, 1, axis=0))  # s → s+1
    return pin(jnp.stack(outs, axis=1))  # (S, M, B/M, …)


def jit_loss(params: dict, xs: jax.Array, ys: jax.Array | None, mesh, head_dim: int, cast=None,
             out=None) -> jax.Array:
    """The same schedule written on whole arrays; the (S,) stage axis is sharded over pp (``cast``,
    ``out``: as shard_map_loss)."""
    S = mesh.shape["pp"]
    cast, out = cast or (lambda a: a), out or (lambda a: a)
    params, xs = cast(params), cast(xs)
    by_stage = NamedSharding(mesh, P("pp"))
    is_last = np.arange(S) == S - 1
    inp = jax.vmap(embed, in_axes=(0, None))(params["first"], xs) if params["first"] else \
        jnp.broadcast_to(xs, (S,) + xs.shape)  # (S, M, B/M, …): stage 0's inputs, real in row 0 only
    stage = lambda x: jax.vmap(stage_blocks, in_axes=(0, 0, None))(params["blocks"], x, head_dim)
    outs = jit_circular(stage, inp, lambda a: lax.with_sharding_constraint(a, by_stage))  # (S, M, B/M, …)
    losses = jax.vmap(lambda last, o: output_loss(out(head(last, o)), ys))(params["last"], outs)  # (S,)
    return jnp.sum(jnp.where(is_last, losses, 0))  # the last stage's: kept (S,)-sharded, [S − 1] would gather


def make_step(cfg: Config, style: str, mesh, tx, variant: str = "circular", info: dict | None = None,
              zero=lambda grads: grads):
    """The jitted step. float16 (``recipe.loss_scale``): the state carries the scale; the logits' cotangent
    is multiplied by it (scaling.scale_cotangent: the schedules seed their backward by hand), the gradients
    divided by it; they come back as global arrays (stages over pp): the finite check over them is XLA's."""
    scaler = recipe.loss_scale(cfg)

    def grad_of(scale):
        out = partial(to_loss, cfg) if scale is None else lambda a: scale_cotangent(to_loss(cfg, a), scale)
        mixed = {"cast": partial(to_compute, cfg), "out": out}  # identities unless --precision mixed
        loss_of = partial(shard_map_loss if style == "shard_map" else jit_loss, **mixed)
        return jax.value_and_grad(loss_of) if variant == "circular" else \
            lambda *args: shard_map_scheduled(*args, variant, cfg.virtual_stages if variant == "interleaved" else 1,
                                              info, **mixed)

    def step(params, opt_state, *rest):
        sc, (xs, ys) = (rest[0], rest[1:]) if scaler else (None, rest)
        loss, grads = grad_of(None if sc is None else sc["scale"])(params, xs, ys, mesh, cfg.head_dim)  # like params
        grads = zero(grads if sc is None else scaler.unscale(grads, sc))  # --freeze: frozen gradients zero
        updates, new_opt = tx.update(grads, opt_state, params)
        new = (jax.tree.map(lambda a, u: a + u, params, updates), new_opt)
        if sc is None:
            return *new, loss, grads
        bad = nonfinite(grads)
        new, sc = keep(bad, new, (params, opt_state)), scaler.update(sc, bad)
        return *new, sc, loss, grads, bad > 0, sc["scale"]

    return jax.jit(step)


def train(cfg: Config, problem: Problem, style: str, variant: str, mesh) -> Trained:
    if style == "typed":
        raise ValueError(f"pp: the typed style (sharding in types) is refused: {TYPED_REFUSAL}")
    cfg.check("pp", "jax")
    recipe_cfg, cfg = cfg, cfg.pipelined()  # --accumulate K: the schedule runs K·M micro-batches (the same mean)
    by_hand = variant in BY_HAND
    S, M, v = cfg.world_size, cfg.microbatches, cfg.virtual_stages if variant == "interleaved" else 1
    names = [interleaved_name(n, cfg.layers, S, v) for n in param_names(cfg)]  # v = 1: the fixture's
    assert mesh.shape["pp"] == S, (mesh.shape, S)
    dtype = jax_dtype(cfg)
    place = lambda a: jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, P(*rules("", a.shape))))
    params = jax.tree.map(place, split(chunked(problem.params, S, v), S))  # blocks (S, L/S, …), slots (S, …) over pp
    micro = lambda a: None if a is None else jax.device_put(
        a.reshape((M, cfg.batch // M) + a.shape[1:]), NamedSharding(mesh, P()))  # (M, B/M, …), replicated
    xs, ys = micro(inputs(cfg, problem)), micro(targets(cfg, problem))
    tx, zero = recipe.stacked(recipe_cfg, params) if recipe_cfg.recipe_active else (make_optimizer(cfg), lambda g: g)
    opt_state = jax.jit(tx.init)(params)  # moments inherit the params' sharding: over pp
    extra = {"bubble_theory": pp_bubble_fraction(S, M), "iterations": M + S - 1,
             "permute_count_theory": pp_ticks_permute_count(cfg, variant, v) if by_hand else
             pp_circular_permute_count(cfg, style), "virtual_stages": v,
             "state_bytes_theory": pp_state_bytes(pp_spmd_param_count(cfg), cfg)}  # every device alike
    if by_hand:  # the static schedule it runs (order, ticks, most stashed per stage); the stash's bytes
        plan = pp_schedules.plan(S, M, variant, v)  # are added to ``extra`` when the step is traced (train_loop)
        extra |= {"order": plan.executed(), "iterations": len(plan.grid), "peak_in_flight": plan.peak_in_flight,
                  "bubble_ticks": float(np.mean(plan.kind == pp_schedules.IDLE)),  # unit F = B (= W) ticks
                  # the closed form (F = B = W); ZB-H1's needs M ≥ S, below it the simulator's
                  "bubble_theory": simulate("zb", S, M).bubble if variant == "zb" and M < S else
                  closed_form_bubble(variant, S, M, v)}
    wire = wire_config(cfg, mesh)  # mixed precision: bf16 messages (XLA:CPU sends them in float32)
    scaler = recipe.loss_scale(cfg)  # float16: the scale state rides as a third state entry
    state = (params, opt_state) + ((jax.device_put(scaler.init(), NamedSharding(mesh, P())),) if scaler else ())
    flags = len(jax.tree.leaves(params)) if scaler else 0  # XLA's 1-byte non-finite flag per (pp-split) leaf
    setup = Setup(
        step=make_step(cfg, style, mesh, tx, variant, extra, zero), state=state, batch=(xs, ys),
        grads_fixture=lambda grads: unsplit(grads, names), params_fixture=lambda state: unsplit(state[0], names),
        comm_theory=None if recipe_cfg.clip is not None else  # --clip: XLA reduces the norm's squares (measured)
        (pp_ticks_permute_bytes(wire, variant, v) if by_hand else pp_circular_permute_bytes(wire, style))
        + wire.bytes_per_element + flags,  # + the loss all-reduce (float32 under mixed precision)
        extra=extra, per_step=("skipped", "loss_scale") if scaler else (),
    )
    return train_loop(cfg, setup)
