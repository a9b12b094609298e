"""Expert parallelism in types ("typed": JAX's Explicit axes, jax_impl/parallel/typed.py): ep.py's GShard
einsums with the two token moves stated by the program.

Typed: the batch (B@ep, T), the stacked experts w_up / w_down (E@ep, …), everything else P().
Per MoE layer the groups G = N (one per device) hold their tokens (G@ep, S, D); the dispatch einsum
"gsec,gsd->egcd" keeps G split (E, G@ep, C, D); ``reshard(x, P('ep'))`` moves every (expert, group)
block to the expert's owner (E@ep, G, C, D) — XLA: an all-to-all; the experts run on their rows;
``reshard(y, P(None, 'ep'))`` brings the outputs back to their groups (the second all-to-all), and
the combine einsum contracts E and C locally. The embedding lookup states its output (B@ep, T, D).
Routing: lax.top_k — XLA all-gathers its operand, the (B·T, E) probs, once per layer (jit avoids
that with ep.sorted_top_k, a stable sort; in types the sort is refused under autodiff: its JVP
adds an unsharded index operand, "Arguments to sort must have equal shardings", jax 0.10.2). Both moves are recorded
(Trained.extra["stated"]).

No torch twin: torch has no sharding-in-types style; the nearest is torch_impl/ep.py's functional all-to-
all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_impl import recipe
from jax_impl.parallel.ep import AXIS, slots
from jax_impl.parallel.typed import Stated
from jax_impl.transformer import experts, head, moe_block, wide
from shared.theory import ep_capacity


def dispatch_in_types(cfg, stated: Stated, l: int):
    """transformer.moe's ``dispatch`` seam for layer l, GShard's einsums in types."""
    g, c = cfg.world_size, ep_capacity(cfg)

    def dispatch(h, top, gates, w_up, w_down):  # h (B·T@ep, D); top, gates (B·T@ep, k); w_* (E@ep, …)
        (bt, d), k, e = h.shape, top.shape[1], w_up.shape[0]
        # (G@ep, S, …): the split axis stated (with G = 1, one device, JAX would put @ep on S instead)
        h, top, gates = (jnp.reshape(a, (g, c, a.shape[1]), out_sharding=P(AXIS)) for a in (h, top, gates))
        expert, pos = slots(top, e)  # (G@ep, S·k) each
        mask = (jax.nn.one_hot(expert, e, dtype=h.dtype)[..., None]
                * jax.nn.one_hot(pos, c, dtype=h.dtype)[..., None, :]).reshape(g, c, k, e, c)  # (G, S, k, E, C)
        combine_w = jnp.einsum("gskec,gsk->gsec", mask, gates)  # (G@ep, S, E, C)
        x = jnp.einsum("gsec,gsd->egcd", jnp.sum(mask, axis=2), h)  # (E, G@ep, C, D)
        x = stated.reshard(x, P(AXIS), f"blocks.{l} tokens to their experts (E, G, C, D)")  # (E@ep, G, C, D)
        y = experts(w_up, w_down, x.reshape(e, g * c, d)).reshape(e, g, c, d)  # (E@ep, G, C, D)
        y = stated.reshard(y, P(None, AXIS), f"blocks.{l} expert outputs to their groups")  # (E, G@ep, C, D)
        out = jnp.einsum("gsec,egcd->gsd", wide(combine_w), wide(y)).astype(y.dtype)  # 16-bit: ep.gshard_dispatch's
        return out.reshape(bt, d)  # (B·T@ep, D)
    return dispatch


def loss_for(cfg, stated: Stated):
    """loss(params, tokens (K, B/K, T), y) -> (global loss, load (L, K, B/K, E)): transformer.apply_moe in types,
    per micro-batch (jax_impl.recipe.micro_losses: --accumulate K, mixed precision's casts)."""
    part = recipe.micro(cfg)

    def forward(params, tokens):
        t = tokens.shape[1]
        x = (params["wte.weight"].at[tokens].get(out_sharding=P(AXIS, None, None))
             + params["wpe.weight"][jnp.arange(t)])  # (B@ep, T, D)
        aux, loads = 0.0, []
        for l in range(cfg.layers):
            dispatch = dispatch_in_types(part, stated, l)
            x, a, load = moe_block(params, l, x, cfg.head_dim, cfg.topk, dispatch, select=lax.top_k)
            aux, loads = aux + a, loads + [load]
        return head(params, x), aux, jnp.stack(loads)
    return lambda params, tokens, y: recipe.micro_losses(cfg, forward, params, tokens, y)
