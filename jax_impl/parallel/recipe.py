"""A real training recipe under the wrappers of jax_impl/parallel/: the optimizer probe that refuses,
before anything compiles, an optax transformation a layout cannot apply exactly, and global-norm
clipping with the TRUE norm (torch's formula) for every layout: the twin of
torch_impl/parallel/recipe.py (``clip_``, ``global_norm``); docs/recipe.md has both frameworks.

Why a probe. Under some layouts each device's optimizer does not see the user's tree:

    zero1 / shard_map   ONE flat 1-D piece (1/N) of the concatenated, padded parameters
    zero2, zero3 / sm   the user's {path: array} dict, row-split leaves as row blocks (dim 0 / N)
    pp pipeline         ONE packed (S, Φ_max) array, every stage's Params flattened into a row
    tp apply_plan       the whole dict, split leaves padded (vocabularies) or column-reordered
    dp, jit, typed, cp  the whole {path: array} dict (nothing to probe)

A transform that reads the whole tree (``clip_by_global_norm``: each device would clip by ITS
piece's norm), the tree's structure (``mask=``, ``multi_transform`` labels: one flat vector has no
paths) or one tensor's statistics (trust ratios) then computes something else, silently. ``check`` runs
the user's ``tx`` on the host, in one process, on deterministic random gradients of the real shapes —
two steps scaled 1e4 (any clipping threshold below that triggers), one 1e-4, each leaf and row by
another factor in [0.1, 10] so that the norms of a layout's pieces vary between steps — once on the
whole tree and once as the layout's devices see it (their states cut as the wrapper places them), and
compares the updates leaf by leaf; for an accumulating ``tx`` (optax.MultiSteps, which updates every
K-th call, its first update 0 under a warmup from 0) that pattern runs 4 times. A difference beyond
round-off (``rtol``) raises ONE ``WrapError``: the layout, the first leaf that differs, the likely
transform, the fix. Elementwise optimizers (sgd, adam, adamw with schedules) give identical updates and
pass. Cost: three eager optax steps on the host, O(Φ): 1-20 ms once JAX's per-op cache holds the
shapes; the first probe of a process compiles those ops (~0.2-1 s). Above ``BOUND`` elements every leaf
is probed cut to at most 6·N along each dim (whether N divides it kept), so a large model costs what a
small one does; a mask reading a size (``shape[0] == vocab``) is then probed on the cut sizes.

Clipping. ``clip=max_norm`` on the wrappers computes the norm of the WHOLE model's gradient —
shard_map: the squares of each device's row blocks / flat piece psum'ed over the axis (zero2/zero3:
one more element of the vectors' psum), replicated leaves counted once — and scales the gradient
by ``min(1, max_norm / (norm + 1e-6))``, torch's ``clip_grad_norm_``. ``clip_by_global_norm`` below
is the same as an optax transformation, for the single-device reference and the whole-tree layouts.
optax's own ``clip_by_global_norm`` has no 1e-6 and scales only when norm > max_norm: ~1e-6 relative
from torch's; it passes the probe where the layout hands optax the whole tree, and is refused where
it would see a piece.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_impl.parallel.tree import WrapError, rule

BOUND = 1 << 20  # elements: above, the probe cuts every leaf (module docstring)
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


# --- clipping with the true norm --------------------------------------------------------------------


def sumsq(tree) -> jax.Array:
    """Σ of the squares of every leaf (the local part of the global norm²)."""
    wide = lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32))  # bf16 squares summed in float32
    return sum((jnp.sum(jnp.square(wide(a))) for a in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))


def scale_by_norm(grads, norm_sq, max_norm: float):
    """``grads`` times torch's clip coefficient min(1, max_norm / (‖g‖ + 1e-6)) for the given ‖g‖²."""
    norm = jnp.sqrt(norm_sq)
    coef = jnp.minimum(1.0, max_norm / (norm + EPS))
    return jax.tree.map(lambda g: (g * coef).astype(g.dtype), grads)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """torch's ``clip_grad_norm_`` as an optax transformation (the reference for ``clip=``)."""
    def update(updates, state, params=None):
        return scale_by_norm(updates, sumsq(updates), max_norm), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def cast(flat: dict, dtype) -> dict:
    """compute_dtype: the floating arrays of ``flat`` cast to ``dtype`` inside the step (None: as they
    are); the gradient flows back through the cast to the master weights in their own dtype."""
    if dtype is None:
        return flat
    return {k: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a for k, a in flat.items()}


ARRAY_ATTRS = frozenset({"astype", "dtype", "shape", "ndim", "size", "reshape", "sum", "at", "T", "real"})


def as_array(path: str, name: str) -> str:
    """The refusal of tp's / zero3's stand-in modules read as an array (``.astype`` ...): the loss maps
    over the model's state (nnx.split -> astype -> nnx.merge), where a split module is no array."""
    return (f"the loss read {name!r} of {path!r} as if it were an array: it maps over the model's state "
            "(nnx.split -> astype -> nnx.merge, a tree map), where this module is split over the devices and "
            "stands in as one object. Fix: for bf16 compute pass compute_dtype=jnp.bfloat16 to the wrapper "
            "(it casts the Params inside the step; master weights stay), or build the model with Flax's dtype=")


def check_clip(clip, where: str, tx=None):
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise WrapError(f"{where}: clip={clip!r}; pass the maximum global norm, a number > 0 (or None)")
    if clip is not None and tx is not None and accumulates(tx):
        raise WrapError(f"{where}: clip={clip} with an optax.MultiSteps optimizer: clip= scales each call's (one "
                        "micro-batch's) gradient by its own norm before optax, where MultiSteps steps with the "
                        "accumulated mean, whose norm is another (silently another update). Fix: accumulate in the "
                        "loss (the mean over K parts of the batch) and keep clip=, or clip inside MultiSteps "
                        "(optax.MultiSteps(optax.chain(recipe.clip_by_global_norm(max_norm), tx), K)) under a "
                        "whole-tree layout (dp, jit, typed)")


def accumulates(tx) -> bool:
    """Does ``tx`` accumulate gradients over calls (optax.MultiSteps, at the top or inside a chain)?"""
    if isinstance(tx, optax.MultiSteps):
        return True
    try:
        state = tx.init({"probe": jnp.zeros((1,))})
    except Exception:  # noqa: BLE001 - a labels function reading the user's paths: not knowable here
        return False
    is_ms = lambda s: isinstance(s, optax.MultiStepsState)  # noqa: E731
    return any(is_ms(s) for s in jax.tree.leaves(state, is_leaf=is_ms))


# --- what each layout's devices hand optax ------------------------------------------------------------


class Layout:
    """How a wrapper's devices see the {path: array} tree: ``views`` (one tree per device),
    ``back`` (the device trees -> the full tree), ``init`` (the per-device optimizer states, cut
    as the wrapper places them, from ``tx_init``). ``what`` names it in the refusal."""

    what, n = "", 1

    def views(self, tree: dict) -> list:
        raise NotImplementedError

    def back(self, views: list) -> dict:
        raise NotImplementedError

    def init(self, tx_init, tree: dict) -> list:
        return [tx_init(v) for v in self.views(tree)]


class Flat(Layout):
    """zero1/shard_map: the concatenation of every leaf, zero-padded to a multiple of N, cut in N."""

    def __init__(self, n: int):
        self.n, self.what = n, (f"each device's optimizer sees ONE flat 1-D piece (1/{n}) of all "
                                "the parameters concatenated, not your tree")

    def views(self, tree):
        self.shapes = {k: a.shape for k, a in tree.items()}
        flat = np.concatenate([np.ravel(a) for a in tree.values()])
        return np.split(np.pad(flat, (0, -flat.size % self.n)), self.n)

    def back(self, views):
        flat, out, at = np.concatenate(views), {}, 0
        for k, s in self.shapes.items():
            out[k] = flat[at:at + int(np.prod(s))].reshape(s)
            at += int(np.prod(s))
        return out

    def init(self, tx_init, tree):
        state = tx_init(jnp.asarray(np.concatenate(self.views(tree))))
        return [jax.tree.map(lambda a, i=i: np.split(np.asarray(a), self.n)[i] if np.ndim(a) else a, state)
                for i in range(self.n)]


class Rows(Layout):
    """zero2 / zero3 shard_map: the dict with every leaf ``rule`` splits cut in N row blocks."""

    def __init__(self, n: int, variant: str):
        self.n, self.variant = n, variant
        self.what = (f"each device's optimizer sees your dict with every >= 2-D leaf whose dim 0 "
                     f"{n} divides cut to its 1/{n} row block")

    def _cut(self, a, i):
        return np.split(np.asarray(a), self.n)[i] if rule(np.shape(a), self.n, self.variant) else a

    def views(self, tree):
        self.cut = {k for k, a in tree.items() if rule(np.shape(a), self.n, self.variant)}
        return [{k: self._cut(a, i) for k, a in tree.items()} for i in range(self.n)]

    def back(self, views):
        return {k: np.concatenate([v[k] for v in views]) if k in self.cut else a for k, a in views[0].items()}

    def init(self, tx_init, tree):
        state = tx_init(tree)
        return [jax.tree.map(lambda a, i=i: self._cut(a, i), state) for i in range(self.n)]


class Whole(Layout):
    """One view of the whole tree through ``to`` / ``back_fn`` (tp: padding, reordering; pp: packing)."""

    def __init__(self, what: str, to: Callable, back: Callable, n: int = 1):
        self.what, self._to, self._back, self.n = what, to, back, n

    def views(self, tree):
        return [self._to(tree)]

    def back(self, views):
        return self._back(views[0])


# --- the probe ---------------------------------------------------------------------------------------------


def _bounded(params: dict, n: int) -> dict:
    """Every dim cut to at most 6·N (keeping whether N divides it) when the model exceeds BOUND."""
    if sum(int(np.prod(np.shape(a))) for a in params.values()) <= BOUND:
        return params
    cut = lambda d: d if d <= 6 * n else 6 * n + d % n
    return {k: np.asarray(a)[tuple(slice(cut(d)) for d in np.shape(a))] for k, a in params.items()}


def _grad(rng, shape, scale: float) -> np.ndarray:
    """Normal draws times ``scale``, times a factor 10^U(-1, 1) per leaf and per row (dim 0): the
    pieces a layout cuts get norms whose ratios change from step to step (AdamW normalizes a constant
    scale away; a piece's clipping then shows only through these ratios)."""
    rows = 10 ** rng.uniform(-1, 1, (shape[0],) + (1,) * (len(shape) - 1)) if shape else 1.0
    return rng.standard_normal(shape) * rows * 10 ** rng.uniform(-1, 1) * scale


def _cause(ref: np.ndarray, got: np.ndarray) -> str:
    zr, zg = ref == 0, got == 0
    if np.any(zr != zg):
        return ("a mask or labels chose differently on the layout's view (optax mask= / multi_transform labels / "
                "set_to_zero for frozen parts: computed from paths, shapes or ndim that the view does not have)")
    return ("the update is scaled otherwise: a statistic over the whole tree or one tensor (clip_by_global_norm "
            "over a piece, a trust ratio, per-tensor scaling)")


def check(tx: optax.GradientTransformation, params: dict, layout: Layout | None, where: str, fix: str,
          seed: int = 0, jit: bool = False) -> None:
    """Refuse ``tx`` (WrapError) if ``layout``'s devices would update ``params`` ({path: array})
    otherwise than ``tx`` on the whole dict; ``layout=None``: the wrapper hands optax the whole dict.
    ``jit``: init and update jitted (one compile per tree: for a layout whose view has shapes of its own)."""
    if layout is None:
        return
    # eager: each op compiles once per shape and process (~1 s the first time on a small model), then
    # the probe takes milliseconds; jit would compile the whole update again for every new tx, but
    # once per tree instead of once per op and shape (compose's stacked view: shapes no other run has).
    # An accumulating tx always jitted: MultiSteps builds new cond branches on every eager call, so each of
    # its 12 probe calls compiled them again (two wrappers on a 3-layer model: 8.4 s eager, 2.5 s jitted)
    accumulating = accumulates(tx)
    jit = jit or accumulating
    init, update = (jax.jit(tx.init), jax.jit(tx.update)) if jit else (tx.init, tx.update)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # own process (jax.distributed)
        ref_p = {k: np.asarray(a) for k, a in _bounded(params, layout.n).items()}
        ref_p = {k: a.astype(np.float64 if a.dtype == np.float64 else np.float32) for k, a in ref_p.items()}
        try:
            ref_state = init(ref_p)
        except Exception:  # noqa: BLE001 - the optimizer fails on the user's own tree: theirs to see at init
            return
        try:
            states = layout.init(init, ref_p)
        except Exception as e:  # noqa: BLE001
            raise WrapError(f"{where}: the optimizer cannot be applied to this layout: {layout.what}; optax raised "
                            f"{type(e).__name__}: {str(e)[:200]}. Fix: {fix}") from e
        rng, p = np.random.default_rng(seed), ref_p
        # an accumulating tx (optax.MultiSteps) updates every K-th call, and a warmup from 0 makes its first
        # update 0: 12 calls (K <= 4 gives >= 3 real updates; before, zero1 × MultiSteps + mask passed: 6e-3 off)
        for scale in (1e4, 1e4, 1e-4) * (4 if accumulating else 1):
            g = {k: _grad(rng, a.shape, scale).astype(a.dtype) for k, a in p.items()}
            u_ref, ref_state = update(g, ref_state, p)
            try:
                outs = [update(gv, s, pv) for gv, s, pv in zip(layout.views(g), states, layout.views(p),
                                                                     strict=True)]
            except Exception as e:  # noqa: BLE001
                raise WrapError(f"{where}: the optimizer cannot be applied to this layout: {layout.what}; optax "
                                f"raised {type(e).__name__}: {str(e)[:200]}. Fix: {fix}") from e
            states = [s for _, s in outs]
            u_got = layout.back([jax.tree.map(np.asarray, u) for u, _ in outs])
            for k in p:
                ref, got = np.asarray(u_ref[k], np.float64), np.asarray(u_got[k], np.float64)
                big = max(np.abs(ref).max(initial=0), np.abs(got).max(initial=0))
                rtol = min(1e4 * np.finfo(p[k].dtype).eps, 5e-2)  # round-off: sums in another order
                if big > 0 and np.abs(ref - got).max() > rtol * big:
                    raise WrapError(f"{where}: the optimizer would compute another update than on your whole tree, "
                                    f"silently: {layout.what}. First difference at {k!r} (relative "
                                    f"{np.abs(ref - got).max() / big:.2g}): {_cause(ref, got)}. Fix: {fix}")
            p = {k: p[k] + np.asarray(u_ref[k]) for k in p}  # in the model's order (zero1 concatenates in it)
