"""The recipe of compare.py's own runs in JAX (shared/recipe.py says what each flag means), the twin of
torch_impl/recipe.py: the optax transformation, the loss and the clipping that the single-device
reference and every runner share, so that they apply it the same way.

    paths = fixture_paths(model)        {NNX path ("blocks.0.qkv.kernel"): fixture name ("blocks.0.attn.qkv.weight")}
    tx = optimizer(cfg, paths)          AdamW; the lr schedule (the same float64 table as torch's LambdaLR);
                                        the decay mask (>= 2 dims, never a frozen leaf)
    loss = loss_fn(cfg, paths)          the project's loss, frozen Params behind stop_gradient (their gradient
                                        is zero, as torch's requires_grad=False leaves none), K micro-batches
    trainer = parallelize(..., clip=cfg.clip)   the TRUE global norm in every layout (jax_impl.parallel.recipe)

Accumulation: the loss is Σ_k loss(part k) / K over K equal parts of each device's rows (under jit and
typed the global batch is cut as (devices, K, rows) so no row moves between devices); its gradient is
the sum of the K parts', reduced ONCE per step (one pmean / reduce-scatter of the summed gradient:
the ledger shows one reduction, not K). The parts are traced in sequence into one program.
Frozen leaves: a zero gradient and no decay, so AdamW leaves them bitwise unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_impl.model import model_loss, named_params, output_loss, to_compute, to_loss
from jax_impl.parallel.tree import flat_state, key_of
from shared.config import Config
from shared.recipe import LOSS_SCALE, is_frozen, lr_factors


def fixture_paths(model) -> dict[str, str]:
    """{NNX state path: fixture name} of the project's model (matched by array identity)."""
    by_id = {id(a): k for k, a in flat_state(model)[2].items()}
    return {by_id[id(a)]: name for name, a in named_params(model).items()}


def frozen_paths(cfg: Config, paths: dict[str, str]) -> set[str]:
    return {p for p, name in paths.items() if is_frozen(name, cfg.freeze)}


def learning_rate(cfg: Config):
    """cfg.lr, or the schedule: lr · lr_factors[count] (the table torch's LambdaLR reads)."""
    if cfg.schedule == "constant":
        return cfg.lr
    table = jnp.asarray([cfg.lr * f for f in lr_factors(cfg.schedule, cfg.steps)])
    return lambda count: table[jnp.minimum(count, cfg.steps - 1)]


def optimizer(cfg: Config, paths: dict[str, str]) -> optax.GradientTransformation:
    """AdamW with torch semantics (jax_impl.model.make_optimizer), the schedule and the decay mask."""
    frozen = frozen_paths(cfg, paths)
    mask = None
    if cfg.decay_mask or frozen:
        def mask(tree):  # a {path: array} dict (the wrappers) or an nnx.State (the reference): paths either way
            return jax.tree_util.tree_map_with_path(
                lambda p, a: (a.ndim >= 2 or not cfg.decay_mask) and key_of(p) not in frozen, tree)
    return optax.adamw(learning_rate(cfg), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                       mask=mask)


def part(a: jax.Array, k: int, parts: int, rows: int) -> jax.Array:
    """Micro-batch ``k`` of ``parts``: rows k·r … (k+1)·r of every device's block of ``a`` (r = rows)."""
    return a.reshape(a.shape[0] // (parts * rows), parts, rows, *a.shape[1:])[:, k].reshape(-1, *a.shape[1:])


def loss_fn(cfg: Config, paths: dict[str, str], devices: int | None = None, base=model_loss):
    """``loss(model, *batch)`` for parallelize: ``base`` (the project's model_loss) with the frozen Params'
    gradient stopped and cfg.accumulate micro-batches. ``devices``: the row blocks the batch is split in
    (default cfg.world_size; tp: 1, every device holds the whole batch)."""
    frozen, k = frozen_paths(cfg, paths), cfg.accumulate
    rows = cfg.batch // ((cfg.world_size if devices is None else devices) * k)  # one block's rows per micro-batch

    def loss(model, *batch):
        model = stopped(model, frozen)
        if k == 1:
            return base(model, *batch)
        total = 0.0
        for i in range(k):
            total = total + base(model, *(part(a, i, k, rows) for a in batch)) / k
        return total

    return loss


def stopped(model, frozen: set[str]):
    """``model`` with the Params at the ``frozen`` paths behind stop_gradient (their gradient zero)."""
    if not frozen:
        return model
    graphdef, state = nnx.split(model)
    state = jax.tree_util.tree_map_with_path(lambda p, a: jax.lax.stop_gradient(a) if key_of(p) in frozen else a,
                                             state)
    return nnx.merge(graphdef, state)


def moe_loss(cfg: Config, paths: dict[str, str], split: int = 1):
    """The MoE transformer's recipe loss on one device: ``loss(model, x, y) -> (loss, load (L, B, E))``, the
    mean CE + Σ_l aux_l of each of the cfg.accumulate micro-batches (B/K whole sequences in order, loss / K
    each: a micro-batch's balancing loss from ITS routing), frozen Params stopped. ``split`` > 1 (the mixed
    runs' floor): each micro-batch in ``split`` parts whose gradients add, f from the whole micro-batch's
    counts (a first pass, a constant) and P from the part, as ep's devices compute them."""
    frozen, k = frozen_paths(cfg, paths), cfg.accumulate

    def loss(model, x, y):
        model, total, loads = stopped(model, frozen), 0.0, []
        for xk, yk in zip(jnp.split(x, k), jnp.split(y, k)):
            totals = None if split == 1 else jax.lax.stop_gradient(jnp.sum(model(xk)[2], axis=1))  # (L, E)
            for xs, ys in zip(jnp.split(xk, split), jnp.split(yk, split)):
                logits, aux, load = model(xs, totals)
                total, loads = total + (output_loss(logits, ys) + aux) / (k * split), loads + [load]
        return total, jnp.concatenate(loads, axis=1)

    return loss


def micro(cfg: Config) -> Config:
    """ep: one micro-batch's config (--accumulate K: B/K whole sequences, split over ep as a whole batch is)."""
    return cfg if cfg.accumulate == 1 else cfg.replace(batch=cfg.batch // cfg.accumulate, accumulate=1)


def micro_losses(cfg: Config, forward, params, tokens, y):
    """ep (jax_impl/ep.py, ep_typed.py): Σ_k (mean CE + Σ_l aux_l)_k / K over the K micro-batches tokens[k],
    y[k] (each its own routing: f from its counts), and their loads stacked (L, K, B/K, E);
    ``forward(params, tokens) -> (logits, aux, load)``. Mixed precision: the params cast to the compute dtype
    (their gradients flow back to the float32 masters) and the logits to the loss in float32."""
    k, params, total, loads = cfg.accumulate, to_compute(cfg, params), 0.0, []
    for i in range(k):
        logits, aux, load = forward(params, tokens[i])
        part = output_loss(to_loss(cfg, logits), y[i]) + aux
        total, loads = total + (part / k if k > 1 else part), loads + [load]
    return total, jnp.stack(loads, axis=1)


def whole_batch_loss(cfg: Config, loss):
    """The recipe around a loss over a {fixture name: array} dict whose batch every device holds whole
    (tp): ``loss(params, *batch)`` -> a scalar. Frozen entries behind stop_gradient; --accumulate K: K
    equal parts of the rows (dim 0), loss / K each, summed in one program."""
    k = cfg.accumulate

    def out(params, *batch):
        params = {n: jax.lax.stop_gradient(a) if is_frozen(n, cfg.freeze) else a for n, a in params.items()}
        if k == 1:
            return loss(params, *batch)
        total = 0.0
        for parts in zip(*(jnp.split(a, k) for a in batch), strict=True):
            total = total + loss(params, *parts) / k
        return total

    return out


def dict_loss(cfg: Config, loss):
    """The recipe around a loss over a {fixture name: array} dict (cp): ``loss(params, tokens, y, pos)``
    -> (mean, reported). Frozen entries behind stop_gradient; --accumulate K: K groups of B/K whole
    sequences (dim 0, never split over the devices), the means and the reported values averaged."""
    k = cfg.accumulate

    def out(params, tokens, y, *rest):
        params = {n: jax.lax.stop_gradient(a) if is_frozen(n, cfg.freeze) else a for n, a in params.items()}
        if k == 1:
            return loss(params, tokens, y, *rest)
        mean = reported = 0.0
        for t, yy in zip(jnp.split(tokens, k), jnp.split(y, k)):
            m, r = loss(params, t, yy, *rest)
            mean, reported = mean + m / k, reported + r / k
        return mean, reported

    return out


def loss_scale(cfg: Config):
    """--dtype float16 (mixed): dynamic loss scaling with shared/recipe.py's LOSS_SCALE (torch GradScaler's
    numbers, so both frameworks skip the same steps); None otherwise."""
    from jax_impl.parallel.scaling import DynamicScale

    if cfg.dtype != "float16":
        return None
    return DynamicScale(LOSS_SCALE["init"], LOSS_SCALE["growth"], LOSS_SCALE["backoff"], LOSS_SCALE["interval"])


def parallelized(cfg: Config, problem, mesh, variant: str, style: str):
    """The project's model through ``parallelize`` with the recipe: its optimizer, loss, clip and (float16)
    loss scaling. The model computes in cfg.dtype itself (Flax's dtype=), so the scaling is asked for."""
    from jax_impl.model import build_model
    from jax_impl.parallel.fsdp import parallelize

    model = build_model(cfg, problem)
    paths = fixture_paths(model)
    return parallelize(model, loss_fn(cfg, paths), optimizer(cfg, paths), mesh, variant, style, clip=cfg.clip,
                       loss_scale=loss_scale(cfg) or False)


def scale_bytes(cfg: Config, variant: str, style: str) -> int:
    """float16's agreed skip flag per step per device: shard_map zero1/2/3 pmax one float32 (4 bytes);
    dp's summed gradient is whole on every device (no collective); jit / typed: XLA's, measured."""
    return 4 if cfg.dtype == "float16" and style == "shard_map" and variant != "dp" else 0


def scale_extra(skipped, scales) -> dict:
    """A loss-scaled run's record (compare.py checks it against the reference's): the indices of the
    steps it skipped and the scale it ended with (``skipped``, ``scales``: one entry per step)."""
    import numpy as np

    from jax_impl.parallel.tree import fetch

    return {"skipped_steps": [int(k) for k in np.flatnonzero(np.stack([np.asarray(fetch(b)) for b in skipped]))],
            "loss_scale": float(np.asarray(fetch(scales[-1])).reshape(-1)[0])}


def clip_bytes(cfg: Config, variant: str, style: str) -> int:
    """The norm's collectives per step per device. dp: none (every device holds the whole gradient).
    shard_map zero1/2/3: one scalar all-reduced (zero2/3 carry it as one more element of the vectors'
    psum). jit and typed: XLA all-reduces each sharded leaf's sum of squares on its own (measured): one
    scalar per leaf the layout splits (parallel.tree.rule)."""
    if cfg.clip is None or variant == "dp":
        return 0
    if style == "shard_map":
        return cfg.bytes_per_element
    from jax_impl.parallel.tree import rule
    from shared.problem import param_shapes

    return cfg.bytes_per_element * sum(rule(s, cfg.world_size, variant) for s in param_shapes(cfg).values())


def stacked(cfg: Config, tree: dict):
    """(tx, zero) of the recipe on pp.split's tree ({"first" | "last": {name: (S, …)}, "blocks": {suffix:
    (S, L/S, …)}}): AdamW with the schedule and its decay mask on the Params' own dims, --clip's global
    norm first (the stacked tree is the whole model: the slots' unused copies have zero gradients), and
    ``zero`` setting the --freeze Params' gradients to zero (stop_gradient's; a stacked suffix frozen in
    some layers and not all: refused)."""
    from jax_impl.parallel.recipe import clip_by_global_norm

    L = cfg.layers
    frozen = {g: {k for k in tree[g] if is_frozen(k, cfg.freeze)} for g in ("first", "last")}
    hits = {k: [is_frozen(f"blocks.{l}.{k}", cfg.freeze) for l in range(L)] for k in tree["blocks"]}
    partial_ = [k for k, h in hits.items() if any(h) and not all(h)]
    if partial_:
        raise ValueError(f"--freeze {','.join(cfg.freeze)} freezes some layers' blocks.*.{partial_[0]} "
                         "and not the others: the pipeline stacks the layers (S, L/S, …); freeze all or none")
    frozen["blocks"] = {k for k, h in hits.items() if all(h)}
    lead = {"first": 1, "last": 1, "blocks": 2}

    def mask(t):
        return {g: {k: (a.ndim - lead[g] >= 2 or not cfg.decay_mask) and k not in frozen[g] for k, a in arrays.items()}
                for g, arrays in t.items()}

    tx = optax.adamw(learning_rate(cfg), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, mask=mask if (cfg.decay_mask or any(frozen.values())) else None)
    if cfg.clip is not None:
        tx = optax.chain(clip_by_global_norm(cfg.clip), tx)
    zero = lambda grads: {g: {k: jnp.zeros_like(a) if k in frozen[g] else a for k, a in arrays.items()}  # noqa: E731
                          for g, arrays in grads.items()}
    return tx, zero
