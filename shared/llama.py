"""One Llama for both frameworks: its shape, its weights and its data as NumPy (no torch, no JAX).

The torch side builds transformers' ``LlamaForCausalLM`` from ``hf_config(shape)`` and loads ``weights``;
the JAX side builds the Flax NNX Llama (jax_impl/parallel/llama.py) with the same parameter names and loads
the same arrays (torch's ``nn.Linear`` stores (out, in); an NNX kernel is (in, out): transpose). So both
frameworks train the same model from the same numbers, and their losses can be compared to ~1e-15.

Names and shapes are transformers' (Llama: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head):

    model.embed_tokens.weight                      (V, D)
    model.layers.{i}.input_layernorm.weight        (D,)
    model.layers.{i}.self_attn.q_proj.weight       (H·hd, D)     hd = D / H
    model.layers.{i}.self_attn.k_proj.weight       (KV·hd, D)
    model.layers.{i}.self_attn.v_proj.weight       (KV·hd, D)
    model.layers.{i}.self_attn.o_proj.weight       (D, H·hd)
    model.layers.{i}.post_attention_layernorm.weight (D,)
    model.layers.{i}.mlp.gate_proj.weight          (F, D)
    model.layers.{i}.mlp.up_proj.weight            (F, D)
    model.layers.{i}.mlp.down_proj.weight          (D, F)
    model.norm.weight                              (D,)
    lm_head.weight                                 (V, D)

The data: ``batch(shape, rows, seed)`` gives tokens (B, T) and targets (B, T), the targets being the
next token of one sequence of T + 1 (so a sequence split, context parallelism, needs no shift across
ranks). The loss both sides use: the mean cross-entropy of the logits (B, T, V) against the targets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class LlamaShape:
    vocab: int = 64
    dim: int = 32
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    seq: int = 16
    eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"LlamaShape.{name} must be positive, got {value}")
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"LlamaShape: dim={self.dim} must divide by heads={self.heads}, and heads by "
                             f"kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def hf_config(shape: LlamaShape) -> dict:
    """The keyword arguments of transformers' ``LlamaConfig`` for this shape (no dropout, no biases)."""
    return dict(vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.ffn,
                num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                max_position_embeddings=max(shape.seq, 64), rms_norm_eps=shape.eps, rope_theta=shape.rope_theta,
                tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_dropout=0.0)


def param_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in transformers' orientation."""
    D, F, V, hd = shape.dim, shape.ffn, shape.vocab, shape.head_dim
    H, KV = shape.heads * hd, shape.kv_heads * hd
    out = {"model.embed_tokens.weight": (V, D)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (D,),
                p + "self_attn.q_proj.weight": (H, D), p + "self_attn.k_proj.weight": (KV, D),
                p + "self_attn.v_proj.weight": (KV, D), p + "self_attn.o_proj.weight": (D, H),
                p + "post_attention_layernorm.weight": (D,),
                p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F)}
    return out | {"model.norm.weight": (D,), "lm_head.weight": (V, D)}


def weights(shape: LlamaShape, seed: int = 0, dtype=np.float64) -> dict[str, np.ndarray]:
    """Random weights (matrices N(0, 0.02²); norm gains 1 + N(0, 0.1²), so that their gradients matter)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, dims in param_shapes(shape).items():
        w = 1.0 + 0.1 * rng.standard_normal(dims) if len(dims) == 1 else 0.02 * rng.standard_normal(dims)
        out[name] = w.astype(dtype)
    return out


def batch(shape: LlamaShape, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """tokens (rows, T) and targets (rows, T): one random sequence of T + 1 tokens per row, shifted by one."""
    seq = np.random.default_rng(10_000 + seed).integers(0, shape.vocab, size=(rows, shape.seq + 1))
    return seq[:, :-1].astype(np.int64), seq[:, 1:].astype(np.int64)
