"""The shared GPT-style decoder (shared/problem.py has the recipe) as a plain ``nn.Module``.

Built from the ecosystem's pieces so the builtins (DDP, FSDP2, DTensor's ``parallelize_module``,
pipelining) see what they see in torchtitan: ``nn.Embedding`` for tokens and positions,
``nn.RMSNorm``, bias-free ``nn.Linear`` (weight == Wᵀ of the fixture's W), and
``F.scaled_dot_product_attention(is_causal=True)``. Module paths, which a TP plan names::

    wte, wpe, blocks.{l}.norm1, blocks.{l}.attn.qkv, blocks.{l}.attn.o,
    blocks.{l}.norm2, blocks.{l}.mlp.up, blocks.{l}.mlp.down, normf, head

``Attention`` reads its head count from its own weight (``qkv.out_features // 3 // head_dim``),
so the same module runs on a tensor-parallel rank that holds H/tp heads of (D, 3D/tp).
``forward`` returns logits (B, T, V); ``shared``'s loss is ``torch_impl.model.loss_fn``.

Two seams for the patterns that split the sequence (context parallelism): ``Attention.core``
(default: causal SDPA) takes q, k, v (B, H, T, dh) and returns (B, H, T, dh), so a ring or an
all-to-all can replace it; ``forward(tokens, positions)`` takes the global positions of a
sequence shard (default ``arange(T)``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.problem import RMS_EPS


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, dh), scale 1/√dh


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype=None, device=None):
        super().__init__()
        self.head_dim = dim // heads
        self.core = causal_sdpa  # (q, k, v) -> y, all (B, H, T, dh); context parallelism swaps it
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, dtype=dtype, device=device)  # q | k | v columns
        self.o = nn.Linear(dim, dim, bias=False, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(h)  # (B, T, 3·H·dh); sequence parallel: h is (B, T/tp, D), gathered by qkv's hook
        b, t, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)  # 3 × (B, T, H·dh): the q|k|v column blocks
        q, k, v = (a.reshape(b, t, -1, self.head_dim).transpose(1, 2) for a in (q, k, v))  # (B, H, T, dh)
        y = self.core(q, k, v)  # (B, H, T, dh)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))  # heads concatenated in order: (B, T, D)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, dtype=None, device=None):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(4 * dim, dim, bias=False, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h), approximate="none"))  # (B, T, D)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dtype=None, device=None):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=RMS_EPS, dtype=dtype, device=device)
        self.attn = Attention(dim, heads, dtype, device)
        self.norm2 = nn.RMSNorm(dim, eps=RMS_EPS, dtype=dtype, device=device)
        self.mlp = MLPBlock(dim, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))  # (B, T, D)


class Transformer(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int, seq: int, dtype=None, device=None):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim, dtype=dtype, device=device)
        self.wpe = nn.Embedding(seq, dim, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(Block(dim, heads, dtype, device) for _ in range(layers))
        self.normf = nn.RMSNorm(dim, eps=RMS_EPS, dtype=dtype, device=device)
        self.head = nn.Linear(dim, vocab, bias=False, dtype=dtype, device=device)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        return self.wte(tokens) + self.wpe(positions)  # (B, T, D)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens, positions)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.normf(x))  # (B, T, V) logits
