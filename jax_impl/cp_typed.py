"""Context parallelism in types ("typed": JAX's Explicit axes, jax_impl/parallel/typed.py): cp.py's
seq_sharded layout with every layout change stated by the program.

Typed: tokens, targets (B, T@cp) and their positions (T@cp); every weight P(). The lookups state
their output (``.at[ids].get(out_sharding=…)``: (B, T@cp, D)); the residual stream stays (B, T@cp, D)
by the type rules; attention states the one thing it needs: ``reshard(k, P())`` and ``reshard(v,
P())`` — every query sees every key (XLA: an all-gather of K and of V per layer; the transpose in
backward sums the whole-sequence dK, dV partials). The causal mask is resharded to the queries'
rows (a slice). ulysses: q, k, v resharded from the tokens to the heads and the output back,
four stated all-to-alls per layer (``ulysses``). The loss is the global mean over the split tokens
(typed P(): XLA's all-reduce), and the P() weights' gradients from the split tokens come back P()
(XLA's all-reduce). ring / ring_zigzag have no typed form: a K|V hop is a point-to-point shift
along the split sequence, what pp.TYPED_REFUSAL quotes JAX refusing (jnp.roll over a split axis).

No torch twin: torch has no sharding-in-types style; the nearest is torch_impl/cp.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_impl.model import output_loss, to_compute, to_loss
from jax_impl.parallel.typed import Stated
from jax_impl.transformer import block, head, wide

AXIS = "cp"


def attention(stated: Stated, l: int):
    """transformer.attention with K and V resharded to the whole sequence (stated)."""
    def attn(qkv: jax.Array, head_dim: int) -> jax.Array:
        b, t, _ = qkv.shape
        dt, qkv = qkv.dtype, wide(qkv)  # 16-bit: the core in float32 (transformer.wide)
        q, k, v = (a.reshape(b, t, -1, head_dim) for a in jnp.split(qkv, 3, axis=-1))  # (B, T@cp, h, dh)
        k, v = (stated.reshard(a, P(), f"blocks.{l}.attn {name}") for a, name in ((k, "K"), (v, "V")))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(head_dim, q.dtype))  # (B, h, T@cp, T)
        causal = stated.reshard(jnp.tril(jnp.ones((t, t), dtype=bool)), P(AXIS, None), "causal mask rows")
        probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1).astype(dt)  # (B, T@cp, h·dh)
    return attn


def ulysses(stated: Stated, l: int):
    """DeepSpeed-Ulysses in types: q, k, v (B, T@cp, h, dh) resharded to (B, T, h@cp, dh) — each
    device gets every token of H/N heads (XLA: an all-to-all each) — causal attention there, the
    output resharded back to the tokens (B, T@cp, h, dh)."""
    heads = P(None, None, AXIS, None)

    def attn(qkv: jax.Array, head_dim: int) -> jax.Array:
        b, t, _ = qkv.shape
        dt, qkv = qkv.dtype, wide(qkv)  # 16-bit: the core in float32 (transformer.wide)
        q, k, v = (stated.reshard(a.reshape(b, t, -1, head_dim), heads, f"blocks.{l}.attn {name}")
                   for a, name in zip(jnp.split(qkv, 3, axis=-1), "QKV", strict=True))  # (B, T, h@cp, dh)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(head_dim, q.dtype))  # (B, h@cp, T, T)
        probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), logits, -jnp.inf), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).astype(dt)  # (B, T, h@cp, dh)
        return stated.reshard(out, P(None, AXIS, None, None), f"blocks.{l}.attn output").reshape(b, t, -1)
    return attn


def loss_for(cfg, stated: Stated, variant: str = "seq_sharded"):
    """loss(params, tokens, y, pos) -> (1,) the global mean (cp.train takes its mean). Mixed precision:
    the weights cast to bf16 inside the loss, the logits to the loss in float32 (model.to_compute / to_loss)."""
    core = ulysses if variant == "ulysses" else attention

    def loss(params, tokens, y, pos):
        params = to_compute(cfg, params)
        x = (params["wte.weight"].at[tokens].get(out_sharding=P(None, AXIS, None))
             + params["wpe.weight"].at[pos].get(out_sharding=P(AXIS, None)))  # (B, T@cp, D)
        for l in range(cfg.layers):
            x = block(params, l, x, cfg.head_dim, attn=core(stated, l))
        return output_loss(to_loss(cfg, head(params, x)), y)[None]
    return loss
