"""Expert parallelism's generic pieces, shared by the ep runner (jax_impl/ep.py: capacity all-to-all
in shard_map, GShard einsums under jit) and its typed twin (jax_impl/ep_typed.py): the mesh axis and
``slots``, which turns each token's top-k expert choice into (expert, position-in-expert) pairs,
the indices both dispatches scatter tokens by.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AXIS = "ep"


def slots(top: jax.Array, experts_total: int) -> tuple[jax.Array, jax.Array]:
    """top (..., S, k) -> (expert, position) of every assignment, (..., S·k) each: assignment
    a = token·k + slot; position = how many earlier assignments (same group) chose that expert."""
    expert = top.reshape(top.shape[:-2] + (-1,))  # (…, S·k)
    hits = jax.nn.one_hot(expert, experts_total, dtype=jnp.int32)  # (…, S·k, E)
    return expert, jnp.sum((jnp.cumsum(hits, axis=-2) - 1) * hits, axis=-1)  # (…, S·k)
