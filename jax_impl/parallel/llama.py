"""A Flax NNX Llama with transformers' parameter names and shapes, and its plans: the JAX twin of
transformers' ``LlamaForCausalLM`` (the model torch_impl/parallel/llama.py plans), beside the tp plan,
the stage split and the cp seam that jax_impl/parallel/compose.py takes.

Module paths are transformers' (model.embed_tokens, model.layers.{i}.self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm, model.norm, lm_head); an
nnx.Linear kernel is (in, out), torch's weight (out, in): ``from_numpy`` transposes. The arithmetic is
transformers' (modeling_llama.py): RMSNorm ``w · (x · rsqrt(mean(x²) + eps))``; RoPE with
``inv_freq = 1 / θ^(arange(0, hd, 2) / hd)``, ``cos/sin(cat(freqs, freqs))`` and rotate_half
``cat(−x2, x1)``; grouped-query attention by repeating every K|V head H/KV times (repeat_kv); causal
softmax(q·kᵀ / √hd) in the inputs' dtype (parallel.cp.causal, not jax.nn.dot_product_attention whose
logits are float32); SwiGLU ``down(silu(gate(x)) · up(x))``; an untied head.

transformers computes RMSNorm and the RoPE angles in float32 even in a float64 model (``.to(float32)``;
RoPE's ``.float()``): unpatched, its logits differ from this model's by ~1e-7 relative (float32's
rounding). This model stays in float64 throughout; tests/test_compose_jax.py patches transformers'
two float32 casts to float64 and gets ~1e-15. The torch composition example must do the same to
agree with JAX to 1e-12 (float32 arithmetic of two libraries does not agree to the last bit).

Head counts are read from the weights (``q_proj`` columns / ``head_dim``), so a tp shard of
q/k/v (whole heads) runs as the same module with H/tp and KV/tp heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jax_impl.parallel import cp
from jax_impl.parallel.compose_axes import Split
from jax_impl.parallel.tree import submodules
from shared.llama import LlamaShape

# Megatron over the blocks (whole heads: tp must divide heads and kv_heads); embedding, norms and the
# head stay replicated over tp (compose splits only the blocks' Linear modules).
PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise"}


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return self.weight[...] * (x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps))


def rope(positions, head_dim: int, theta: float, dtype):
    """cos, sin (T, hd) at the given global positions (transformers' default RoPE, in ``dtype``)."""
    inv_freq = 1.0 / (jnp.asarray(theta, dtype) ** (jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim))
    freqs = positions.astype(dtype)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate(x, cos, sin):  # x (B, T, H, hd); cos, sin (T, hd)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nnx.Module):
    def __init__(self, s: LlamaShape, dtype, rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, param_dtype=dtype, rngs=rngs)
        self.head_dim = s.head_dim
        self.q_proj, self.k_proj = lin(s.dim, s.heads * s.head_dim), lin(s.dim, s.kv_heads * s.head_dim)
        self.v_proj, self.o_proj = lin(s.dim, s.kv_heads * s.head_dim), lin(s.heads * s.head_dim, s.dim)

    def __call__(self, x, cos, sin):
        B, T, hd = x.shape[0], x.shape[1], self.head_dim
        q, k, v = (p(x).reshape(B, T, -1, hd) for p in (self.q_proj, self.k_proj, self.v_proj))  # heads from weights
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)  # repeat_kv
        return self.o_proj(cp.attention(q, k, v).reshape(B, T, -1))  # the cp seam


class MLP(nnx.Module):
    def __init__(self, s: LlamaShape, dtype, rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, param_dtype=dtype, rngs=rngs)
        self.gate_proj, self.up_proj, self.down_proj = lin(s.dim, s.ffn), lin(s.dim, s.ffn), lin(s.ffn, s.dim)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, s: LlamaShape, dtype, rngs):
        self.input_layernorm = RMSNorm(s.dim, s.eps, dtype)
        self.self_attn = Attention(s, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(s.dim, s.eps, dtype)
        self.mlp = MLP(s, dtype, rngs)

    def __call__(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    def __init__(self, s: LlamaShape, dtype, rngs):
        self.embed_tokens = nnx.Embed(s.vocab, s.dim, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(s, dtype, rngs) for _ in range(s.layers)])
        self.norm = RMSNorm(s.dim, s.eps, dtype)


class Llama(nnx.Module):
    """logits (B, T, V) = Llama(tokens (B, T), positions (T,) or None = arange(T))."""

    def __init__(self, shape: LlamaShape | None = None, dtype=jnp.float64, rngs: nnx.Rngs | None = None):
        rngs, shape = rngs or nnx.Rngs(0), shape or LlamaShape()
        self.shape = shape
        self.model = LlamaModel(shape, dtype, rngs)
        self.lm_head = nnx.Linear(shape.dim, shape.vocab, use_bias=False, param_dtype=dtype, rngs=rngs)

    def rope(self, positions, dtype):
        return rope(positions, self.shape.head_dim, self.shape.rope_theta, dtype)

    def __call__(self, tokens, positions=None):
        h = self.model.embed_tokens(tokens)
        cos, sin = self.rope(_positions(tokens, positions), h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.model.norm(h))


def _positions(tokens, positions):
    return jnp.arange(tokens.shape[1]) if positions is None else positions


# The stage split: embed on the first stage, model.layers evenly over pp, norm + head on the last;
# Llama(x) == head(block(…block(embed(x))…)) (compose checks it at wrap time). ``mods``: {path: module}.
SPLIT = Split(first=("model.embed_tokens",), blocks="model.layers", last=("model.norm", "lm_head"),
              embed=lambda root, mods, tokens, positions: mods["model.embed_tokens"](tokens),
              block=lambda root, layer, h, positions: layer(h, *root.rope(positions, h.dtype)),
              head=lambda root, mods, h: mods["lm_head"](mods["model.norm"](h)))
CP_SEAM = "ring"  # Attention calls parallel.cp.attention: the ring over "cp" inside a composed step


def from_numpy(weights: dict[str, np.ndarray], shape: LlamaShape | None = None) -> Llama:
    """The NNX Llama holding transformers-named NumPy weights (shared/llama.py's ``weights``): a Linear's
    (out, in) weight becomes its (in, out) kernel; the embedding table and norm gains as they are."""
    dtype, shape = next(iter(weights.values())).dtype, shape or LlamaShape()
    model = Llama(shape, jnp.dtype(dtype))
    mods = dict(_modules(model))
    for name, w in weights.items():
        path = name.removesuffix(".weight")
        m = mods.get(path)
        if m is None:
            raise KeyError(f"from_numpy: no module {path!r} in the NNX Llama for weight {name!r}")
        if isinstance(m, nnx.Linear):
            target, value = m.kernel, np.asarray(w).T
        else:
            target, value = (m.embedding if isinstance(m, nnx.Embed) else m.weight), np.asarray(w)
        if target.shape != value.shape:
            raise ValueError(f"from_numpy: {name} has shape {w.shape}, the model expects {target.shape} (transposed)")
        target[...] = jnp.asarray(value)
    return model


def to_numpy(model: Llama) -> dict[str, np.ndarray]:
    """transformers-named NumPy weights of the model (the inverse of ``from_numpy``)."""
    out = {}
    for path, m in _modules(model):
        if isinstance(m, nnx.Linear):
            out[path + ".weight"] = np.asarray(m.kernel[...]).T
        elif isinstance(m, nnx.Embed):
            out[path + ".weight"] = np.asarray(m.embedding[...])
        elif isinstance(m, RMSNorm):
            out[path + ".weight"] = np.asarray(m.weight[...])
    return out


def _modules(model):
    return submodules(model)[0].items()
