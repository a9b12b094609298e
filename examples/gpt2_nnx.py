"""A GPT-2-style Flax NNX model as people write it, and what ``compose`` needs beside it (its tp plan and
stage split): biases on every Linear, LayerNorm with bias, learned positions, a fused biased q|k|v, and
the head tied to the embedding (``wte.attend``). examples/compose_jax.py ``--family gpt2`` trains it.

    model = GPT2(GPT2Shape(vocab=97), rngs=nnx.Rngs(0))
    trainer = compose(model, {"fsdp": 2, "tp": 2}, cross_entropy, tx, plan=PLAN, split=SPLIT, units=UNITS)

What compose asks of such a model (docs/compose.md):
- ``colwise_heads`` (the fused [q|k|v] kernel, its bias alike): the attention module's ``head_dim``
  attribute, so each tp device holds whole heads of q, k and v; head counts come from the weights.
- rowwise projections with a bias (c_proj, mlp_proj): split by input rows; the bias is added ONCE,
  after the psum (torch's RowwiseParallel).
- the tied head: ``split.head`` receives the first stage's modules too (``mods["wte"]``), so the head
  reads the embedding table itself; under pp the table's gradient sums its two uses over the stages.
- attention through the cp seam (``parallel.cp.attention``) and ``positions`` handed to the embedding
  (learned ``wpe`` read at the global positions under cp).
- an odd vocabulary: fsdp shards dim 0 of every ≥ 2-D Param of the ZeRO units; V = 97 does not divide,
  so ``UNITS`` keeps the embeddings out (the blocks only).

``GPT2(..., attention="flax")`` builds each block's attention from Flax's own ``nnx.MultiHeadAttention``
(``attn.query`` / ``key`` / ``value``: nnx.LinearGeneral (D) -> (H, dh), ``attn.out``: (H, dh) -> D, biases
on all four) in place of c_attn / c_proj; ``FLAX_MHA_PLAN`` is ``compose_axes.flax_mha_plan("h.*.attn")``
plus the MLP's (``--family gpt2-mha``). It is built with ``keep_rngs=False`` (compose trains Params only)
and ``attention_fn=cp.attention``: Flax's default (jax.nn.dot_product_attention) takes the logits in
float32, ~1e-7 from float64 (the seam's is causal, in the inputs' dtype, and runs cp).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jax_impl.parallel import cp
from jax_impl.parallel.compose_axes import Split, flax_mha_plan


@dataclass(frozen=True)
class GPT2Shape:
    vocab: int = 97
    dim: int = 32
    layers: int = 4
    heads: int = 4
    seq: int = 16


def _normal(std):
    return nnx.initializers.normal(std)


class Block(nnx.Module):
    def __init__(self, s: GPT2Shape, dtype, rngs: nnx.Rngs, attention: str = "fused"):
        lin = lambda i, o: nnx.Linear(i, o, param_dtype=dtype, kernel_init=_normal(0.02),  # noqa: E731
                                      bias_init=_normal(0.02), rngs=rngs)
        norm = lambda: nnx.LayerNorm(s.dim, param_dtype=dtype, scale_init=lambda k, sh, d: 1 + 0.1 * jax.random.normal(  # noqa: E731
            k, sh, d), bias_init=_normal(0.1), rngs=rngs)
        self.head_dim = s.dim // s.heads  # colwise_heads reads it: q, k, v split by whole heads
        if attention == "flax":  # Flax's own attention: query/key/value/out nnx.LinearGeneral (FLAX_MHA_PLAN)
            self.ln_1, self.attn = norm(), nnx.MultiHeadAttention(
                s.heads, s.dim, decode=False, keep_rngs=False, attention_fn=cp.attention, dtype=dtype,
                param_dtype=dtype, kernel_init=_normal(0.02), bias_init=_normal(0.02), rngs=rngs)
        else:
            self.ln_1, self.c_attn, self.c_proj = norm(), lin(s.dim, 3 * s.dim), lin(s.dim, s.dim)
        self.ln_2, self.c_fc, self.mlp_proj = norm(), lin(s.dim, 4 * s.dim), lin(4 * s.dim, s.dim)

    def __call__(self, x):  # (B, T, D)
        if hasattr(self, "attn"):
            x = x + self.attn(self.ln_1(x))  # its attention_fn: the cp seam
        else:
            B, T, hd = x.shape[0], x.shape[1], self.head_dim
            q, k, v = (a.reshape(B, T, -1, hd) for a in jnp.split(self.c_attn(self.ln_1(x)), 3, axis=-1))
            x = x + self.c_proj(cp.attention(q, k, v).reshape(B, T, -1))  # the cp seam: causal softmax(q·kᵀ/√hd)·v
        return x + self.mlp_proj(jax.nn.gelu(self.c_fc(self.ln_2(x)), approximate=True))  # GPT-2's tanh GELU


class GPT2(nnx.Module):
    """logits (B, T, V) = GPT2(tokens (B, T), positions (T,) or None = arange(T)); the head is wte's table."""

    def __init__(self, shape: GPT2Shape | None = None, dtype=jnp.float64, rngs: nnx.Rngs | None = None,
                 attention: str = "fused"):
        s, rngs = shape or GPT2Shape(), rngs or nnx.Rngs(0)
        self.wte = nnx.Embed(s.vocab, s.dim, param_dtype=dtype, embedding_init=_normal(0.02), rngs=rngs)
        self.wpe = nnx.Embed(s.seq, s.dim, param_dtype=dtype, embedding_init=_normal(0.02), rngs=rngs)
        self.h = nnx.List([Block(s, dtype, rngs, attention) for _ in range(s.layers)])
        self.ln_f = nnx.LayerNorm(s.dim, param_dtype=dtype, bias_init=_normal(0.1), rngs=rngs)

    def __call__(self, tokens, positions=None):
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        h = self.wte(tokens) + self.wpe(positions)  # (B, T, D)
        for block in self.h:
            h = block(h)
        return self.wte.attend(self.ln_f(h))  # tied: (B, T, D) · (V, D)ᵀ


PLAN = {"h.*.c_attn": "colwise_heads", "h.*.c_proj": "rowwise", "h.*.c_fc": "colwise", "h.*.mlp_proj": "rowwise"}
FLAX_MHA_PLAN = flax_mha_plan("h.*.attn") | {"h.*.c_fc": "colwise", "h.*.mlp_proj": "rowwise"}  # attention="flax"
SPLIT = Split(first=("wte", "wpe"), blocks="h", last=("ln_f",),
              embed=lambda root, mods, tokens, positions: mods["wte"](tokens) + mods["wpe"](positions),
              block=lambda root, layer, h, positions: layer(h),
              head=lambda root, mods, h: mods["wte"].attend(mods["ln_f"](h)))  # mods: first's too (the tie)
UNITS = ["h.*"]  # fsdp shards the blocks; V = 97 rows of wte do not divide by fsdp
