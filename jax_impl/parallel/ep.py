"""Expert parallelism's generic pieces, shared by the ep runner (jax_impl/ep.py: capacity all-to-all
in shard_map, GShard einsums under jit) and its typed twin (jax_impl/ep_typed.py): the mesh axis and
``slots``, which turns each token's top-k expert choice into (expert, position-in-expert) pairs,
the indices both dispatches scatter tokens by. And ``dispatch``, the twin of torch_impl/parallel/ep.py's
``expert_parallel``: the token exchange for YOUR mixture-of-experts layer, inside a shard_map over "ep".

    out = dispatch(expert_fn, w_local, h, top)   # (n, k, D): each assignment's expert output
    y = jnp.einsum("nk,nkd->nd", gates, out)     # your combine

Sharded: device r holds experts [r·E/N, (r+1)·E/N) of every stacked (E, …) weight (in_specs P("ep")) and
n tokens of the batch (P("ep")); the router and the rest are the caller's (replicated: P()). Static
shapes, so capacity C = n (nothing dropped: a token picks an expert at most once): each device scatters
its k·n assignments into an (E, C, D) buffer, ONE all_to_all sends each expert's rows to its owner, the
local experts run (``expert_fn`` vmapped over E/N), ONE all_to_all brings them back; autodiff
transposes each. Per call: 4 all-to-alls (2 forward, 2 backward) of E·C·D·b per device, whatever the
routing (E/k× the routed rows: the padding, shared.theory.ep_padding). ``global_counts``: the psum of
the (E,) counts, for a balancing loss equal to one device's.

ONE code path for one device and for the mesh (a layer written once): where ``axis`` is bound (a
shard_map over it) the tokens move; where it is not (one device, plain jit, jit with shardings: XLA's
own placement) ``dispatch`` runs the same buffer with N = 1 — no collective, every expert here — and
``global_counts`` returns the local counts. Inside compose's shard_map (jax_impl/parallel/compose_ep.py)
``_active`` names the axis the experts are split on (None: not split, e.g. ep absent) and the axes the
counts sum over (every data axis: dp, fsdp, ep; × cp without ep), so the same layer's balancing loss
equals one device's on the whole batch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_impl.parallel.tree import WrapError

AXIS = "ep"
# compose's shard_map body: (the experts' axis or None, the axes the counts sum over, record); None outside
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ep_seam", default=None)


@contextlib.contextmanager
def _active(axis: str | None, count_axes: tuple[str, ...], record: Callable | None = None):
    """compose's body: ``record(kind, *bytes)`` sees each call ("dispatch", in bytes, out bytes of the
    (E, C, ·) buffers; "counts", the counts' bytes), for its comm_theory."""
    token = _ACTIVE.set((axis, tuple(count_axes), record or (lambda *a: None)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """Is compose's shard_map body (its ep seam) tracing now? (a layer with its own one-device path asks)"""
    return _ACTIVE.get() is not None


def _bound(axis: str) -> bool:
    """Is ``axis`` a mapped axis here (inside a shard_map over it)?"""
    try:
        lax.axis_size(axis)
    except NameError:  # jax: "unbound axis name"
        return False
    return True


def _axis(axis: str) -> str | None:
    """The axis the tokens move over here: compose's (while active), else ``axis`` where bound, else None."""
    active = _ACTIVE.get()
    if active is not None:
        return active[0]
    return axis if _bound(axis) else None


def slots(top: jax.Array, experts_total: int) -> tuple[jax.Array, jax.Array]:
    """top (..., S, k) -> (expert, position) of every assignment, (..., S·k) each: assignment
    a = token·k + slot; position = how many earlier assignments (same group) chose that expert."""
    expert = top.reshape(top.shape[:-2] + (-1,))  # (…, S·k)
    hits = jax.nn.one_hot(expert, experts_total, dtype=jnp.int32)  # (…, S·k, E)
    return expert, jnp.sum((jnp.cumsum(hits, axis=-2) - 1) * hits, axis=-1)  # (…, S·k)


def dispatch(expert_fn: Callable, weights, h: jax.Array, top: jax.Array, axis: str = AXIS) -> jax.Array:
    """Inside a shard_map over ``axis``: this device's tokens h (n, D) and their top-k experts ``top``
    (n, k) ints in [0, E) (distinct per token, as lax.top_k gives) -> (n, k, D') each assignment's
    expert output, equal to ``expert_fn(weights[e], h[i:i+1])`` on one device. ``weights``: a pytree of
    this device's stacked (E/N, …) expert weights; ``expert_fn(w, rows (R, D)) -> (R, D')`` one expert
    (w its slice, no expert dim); rows that carry no token are zeros and their outputs dropped. Where
    ``axis`` is not bound (one device, jit): N = 1, the same buffer, no all_to_all (module docstring)."""
    leaves = jax.tree.leaves(weights)
    lead = {a.shape[0] if a.ndim else None for a in leaves}
    if not leaves or len(lead) != 1 or None in lead:
        raise WrapError(f"ep.dispatch: the expert weights must be stacked (E/N, …) on dim 0 (this device's "
                        f"experts), leading dims {sorted(map(str, lead))}; keep the router outside ``weights``")
    if h.ndim != 2 or top.ndim != 2 or top.shape[0] != h.shape[0]:
        raise WrapError(f"ep.dispatch: h must be (n, D) and top (n, k), got {h.shape} and {top.shape}: flatten "
                        "(B, T) to n rows first")
    axis = _axis(axis)
    (n, d), k, local = h.shape, top.shape[1], lead.pop()
    world = lax.axis_size(axis) if axis is not None else 1
    e, c = local * world, n  # capacity: every local token may pick the same expert, at most once
    expert, pos = slots(top[None], e)  # (1, n·k) each
    expert, pos = expert[0], pos[0]
    buf = jnp.zeros((e, c, d), h.dtype).at[expert, pos].set(h[jnp.arange(n * k) // k])  # (E, C, D)
    if axis is None:  # one device (or jit's global arrays): every expert here
        return jax.vmap(expert_fn)(weights, buf)[expert, pos].reshape(n, k, -1)
    buf = lax.all_to_all(buf.reshape(world, local, c, d), axis, 0, 0, tiled=True)  # (N src, E/N, C, D)
    rows = buf.transpose(1, 0, 2, 3).reshape(local, world * c, d)  # (E/N, N·C, D): each local expert's rows
    y = jax.vmap(expert_fn)(weights, rows)  # (E/N, N·C, D')
    y = y.reshape(local, world, c, -1).transpose(1, 0, 2, 3)  # (N dst, E/N, C, D')
    y = lax.all_to_all(y, axis, 0, 0, tiled=True).reshape(e, c, -1)  # (E, C, D'): my assignments' outputs
    if _ACTIVE.get() is not None:
        _ACTIVE.get()[2]("dispatch", buf.size * buf.dtype.itemsize, y.size * y.dtype.itemsize)
    return y[expert, pos].reshape(n, k, -1)


def global_counts(top: jax.Array, experts_total: int, axis: str = AXIS) -> jax.Array:
    """(E,) assignments per expert over every device's tokens (one psum), for the balancing loss: over
    compose's data axes while its shard_map runs, over ``axis`` where bound, else this device's (one
    device, jit: the whole batch already)."""
    return total_counts(jnp.sum(jax.nn.one_hot(top.reshape(-1), experts_total, dtype=jnp.int32), axis=0), axis)


def total_counts(counts: jax.Array, axis: str = AXIS) -> jax.Array:
    """This device's (E,) counts -> every data device's (``global_counts``'s rule; the seam a layer that
    counts its own way calls)."""
    active = _ACTIVE.get()
    axes = active[1] if active is not None else (axis,) if _bound(axis) else ()
    if axes and active is not None:
        active[2]("counts", counts.size * counts.dtype.itemsize)
    return lax.psum(counts, axes) if axes else counts
