"""The shared GPT-style decoder (shared/problem.py has the recipe) in JAX, twice:

- ``Transformer`` (``nnx.Module``) from Flax NNX's own pieces: ``nnx.Embed`` for tokens and
  positions, ``nnx.RMSNorm``, bias-free ``nnx.Linear`` (``kernel == W``, applied as ``x @ W``),
  causal attention written out (see ``attention``). Every parameter is created through
  ``rules(name, shape)`` → logical mesh axes (``nnx.with_partitioning``, MaxText style), so the
  jit styles get their shardings from one rules function (jax_impl/model.py).
- ``apply(params, tokens)``: the same math over a plain ``{name: array}`` dict keyed like
  ``shared.problem.transformer_param_names`` — the form the shard_map bodies use. Head counts are
  read from the arrays (``W_qkv.shape[1] // 3 // head_dim``), so a tensor-parallel device holding
  (D, 3D/tp) of whole heads runs the same code.
``named_params(model)`` maps the module back to that dict. Loss: ``jax_impl.model.output_loss``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shared.problem import RMS_EPS

Rules = Callable[[str, tuple[int, ...]], tuple | None]  # param name, shape -> mesh axes per dim (None: replicated)


def gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)  # exact erf GELU, as torch's F.gelu


def fixture_init(params: dict[str, np.ndarray], name: str, rules: Rules | None):
    w = params[name]

    def init(key, shape, dtype):
        assert tuple(shape) == w.shape, (name, shape, w.shape)
        return jnp.asarray(w, dtype)

    axes = rules(name, w.shape) if rules is not None else None
    return nnx.with_partitioning(init, axes) if axes is not None else init


def attention(qkv: jax.Array, head_dim: int) -> jax.Array:
    """qkv (B, T, 3·h·dh) for h local heads -> causal attention output (B, T, h·dh), heads in order.

    Written out rather than ``jax.nn.dot_product_attention``: its XLA path computes the logits
    with ``preferred_element_type=float32``, which caps float64 runs at ~1e-7 (measured 2e-7 vs
    torch's SDPA); this is the same math in the run's dtype."""
    b, t, _ = qkv.shape
    q, k, v = (a.reshape(b, t, -1, head_dim) for a in jnp.split(qkv, 3, axis=-1))  # (B, T, h, dh)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(head_dim, q.dtype))  # (B, h, T, T)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # key k visible from query q iff k <= q
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1)  # (B, T, h·dh)


class Block(nnx.Module):
    def __init__(self, prefix: str, params, dim: int, heads: int, dtype, rules: Rules | None):
        lin = lambda n, i, o: nnx.Linear(i, o, use_bias=False, kernel_init=fixture_init(params, prefix + n, rules),
                                        dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
        norm = lambda n: nnx.RMSNorm(dim, epsilon=RMS_EPS, scale_init=fixture_init(params, prefix + n, rules),
                                     dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
        self.head_dim = dim // heads
        self.norm1, self.norm2 = norm("norm1.weight"), norm("norm2.weight")
        self.qkv, self.o = lin("attn.qkv.weight", dim, 3 * dim), lin("attn.o.weight", dim, dim)
        self.up, self.down = lin("mlp.up.weight", dim, 4 * dim), lin("mlp.down.weight", 4 * dim, dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.o(attention(self.qkv(self.norm1(x)), self.head_dim))
        return x + self.down(gelu(self.up(self.norm2(x))))  # (B, T, D)


class Transformer(nnx.Module):
    def __init__(self, params: dict[str, np.ndarray], heads: int, dtype, rules: Rules | None = None):
        vocab, dim = params["wte.weight"].shape
        seq = params["wpe.weight"].shape[0]
        layers = sum(1 for k in params if k.endswith("attn.qkv.weight"))
        emb = lambda n, rows: nnx.Embed(rows, dim, embedding_init=fixture_init(params, n, rules), dtype=dtype,
                                        param_dtype=dtype, rngs=nnx.Rngs(0))
        self.wte, self.wpe = emb("wte.weight", vocab), emb("wpe.weight", seq)
        self.blocks = nnx.List(Block(f"blocks.{l}.", params, dim, heads, dtype, rules) for l in range(layers))
        self.normf = nnx.RMSNorm(dim, epsilon=RMS_EPS, scale_init=fixture_init(params, "normf.weight", rules),
                                 dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(dim, vocab, use_bias=False, kernel_init=fixture_init(params, "head.weight", rules),
                               dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.normf(x))  # (B, T, V) logits


def named_params(model: Transformer) -> dict[str, jax.Array]:
    """{torch-style name: array} in shared.problem.transformer_param_names order."""
    out = {"wte.weight": model.wte.embedding[...], "wpe.weight": model.wpe.embedding[...]}
    for l, b in enumerate(model.blocks):
        p = f"blocks.{l}."
        out |= {p + "norm1.weight": b.norm1.scale[...], p + "attn.qkv.weight": b.qkv.kernel[...],
                p + "attn.o.weight": b.o.kernel[...], p + "norm2.weight": b.norm2.scale[...],
                p + "mlp.up.weight": b.up.kernel[...], p + "mlp.down.weight": b.down.kernel[...]}
    return out | {"normf.weight": model.normf.scale[...], "head.weight": model.head.kernel[...]}


# --- the same math over a {name: array} dict (shard_map bodies, pipeline stages) ---------------------


def rms_norm(x: jax.Array, g: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * g


def embed(params: dict, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    positions = jnp.arange(tokens.shape[1]) if positions is None else positions
    return params["wte.weight"][tokens] + params["wpe.weight"][positions]  # (B, T, D)


def block(params: dict, l: int, x: jax.Array, head_dim: int, attn=attention) -> jax.Array:
    """``attn(qkv, head_dim) -> (B, T, h·dh)`` is ``attention`` unless a pattern splits the sequence
    (context parallelism: a ring or an all-to-all around the same math)."""
    p = lambda n: params[f"blocks.{l}.{n}.weight"]
    x = x + attn(rms_norm(x, p("norm1")) @ p("attn.qkv"), head_dim) @ p("attn.o")
    return x + gelu(rms_norm(x, p("norm2")) @ p("mlp.up")) @ p("mlp.down")  # (B, T, D)


def head(params: dict, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["normf.weight"]) @ params["head.weight"]  # (B, T, V)


def apply(params: dict, tokens: jax.Array, head_dim: int, positions: jax.Array | None = None,
          attn=attention) -> jax.Array:
    """Logits (B, T, V) from the {name: array} dict; the blocks present are those in ``params``.
    ``positions``: the global positions of a sequence shard (default ``arange(T)``)."""
    x = embed(params, tokens, positions)
    layers = sorted({int(k.split(".")[1]) for k in params if k.startswith("blocks.")})
    for l in layers:
        x = block(params, l, x, head_dim, attn)
    return head(params, x)
