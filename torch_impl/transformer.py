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

Mixture of experts (``experts=E``, ``topk=k``): every block's ``mlp`` is an ``MoE`` (children
``router`` = nn.Linear(D, E) and ``experts`` = ``GroupedExperts``, stacked ``w_up`` (E, D, 4D) and
``w_down`` (E, 4D, D) applied as ``x @ w_up[e]``: torchtitan's layout). Two seams for expert
parallelism: ``MoE.dispatch`` (rows sorted by expert, per-expert counts -> the experts' outputs,
same rows; default: the local experts) and ``MoE.global_counts`` (this device's (E,) counts -> the
global ones for the balancing loss; default: the same). After forward an MoE holds ``aux`` (its
balancing loss) and ``load`` ((B, E) int64 assignments per sequence).

Activation recomputation (``recompute``, shared.config.RECOMPUTE; Korthikanti et al. 2022,
arXiv:2205.05198): "full" runs each ``Block.forward`` under ``torch.utils.checkpoint`` (non-reentrant:
only the block's input is saved, the block runs again in backward), "selective" only the attention
core (whatever ``Attention.core`` is: SDPA, a ring, Ulysses), so q|k|v and the core's output stay
saved and the core's own tensors are recomputed. Both are attributes (``Block.recompute``,
``Attention.recompute``), so every pattern that builds this model gets them; shared.theory's
"activation recomputation" section counts what each policy saves.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shared.problem import MOE_BALANCE_COEF, RMS_EPS

# The tensor-parallel plans of this model (module path -> style: torch_impl/parallel/tp.py).
TRANSFORMER_PLAN = {
    "wte": "vocab_embed",
    "blocks.*.attn.qkv": "colwise_heads",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "head": "colwise_vocab",
}
# Sequence parallelism: the same splits, and the modules between the
# matmuls run on this rank's T/tp tokens. Their weights stay replicated with partial gradients.
SP_PLAN = TRANSFORMER_PLAN | {
    "wpe": "positions",  # rows of this rank's positions: (T/tp, D)
    "blocks.*.norm1": "sequence",  # on (B, T/tp, D)
    "blocks.*.norm2": "sequence",
    "normf": "sequence",
}


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, dh), scale 1/√dh


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype=None, device=None, recompute: str = "none"):
        super().__init__()
        self.head_dim, self.recompute = dim // heads, recompute
        self.core = causal_sdpa  # (q, k, v) -> y, all (B, H, T, dh); context parallelism swaps it
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, dtype=dtype, device=device)  # q | k | v columns
        self.o = nn.Linear(dim, dim, bias=False, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(h)  # (B, T, 3·H·dh); sequence parallel: h is (B, T/tp, D), gathered by qkv's hook
        b, t, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)  # 3 × (B, T, H·dh): the q|k|v column blocks
        q, k, v = (a.reshape(b, t, -1, self.head_dim).transpose(1, 2) for a in (q, k, v))  # (B, H, T, dh)
        if self.recompute == "selective":  # keep q, k, v (one qkv storage); backward runs the core again
            y = checkpoint(self.core, q, k, v, use_reentrant=False)  # (B, H, T, dh)
        else:
            y = self.core(q, k, v)  # (B, H, T, dh)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))  # heads concatenated in order: (B, T, D)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, dtype=None, device=None):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(4 * dim, dim, bias=False, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h), approximate="none"))  # (B, T, D)


class GroupedExperts(nn.Module):
    """Experts ``first … first+num−1`` of an MoE layer, stacked: ``w_up`` (num, D, 4D), ``w_down``
    (num, 4D, D), expert e applied as gelu(x @ w_up[e]) @ w_down[e] (fixture orientation)."""

    def __init__(self, num: int, dim: int, first: int = 0, dtype=None, device=None):
        super().__init__()
        self.first, self.num = first, num
        self.w_up = nn.Parameter(torch.empty(num, dim, 4 * dim, dtype=dtype, device=device))
        self.w_down = nn.Parameter(torch.empty(num, 4 * dim, dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (Σ counts, D): rows grouped by local expert, counts[i] of them for expert first+i."""
        assert len(counts) == self.num and x.shape[0] == sum(counts), (x.shape, counts)
        return torch.cat([F.gelu(rows @ up, approximate="none") @ down
                          for rows, up, down in zip(x.split(counts), self.w_up, self.w_down)])  # (Σ counts, D)

    def shard(self, first: int, num: int) -> GroupedExperts:
        """A copy holding experts first … first+num−1 only (expert parallelism)."""
        part = GroupedExperts(num, self.w_up.shape[1], first, self.w_up.dtype, self.w_up.device)
        with torch.no_grad():
            part.w_up.copy_(self.w_up[first - self.first:first - self.first + num])
            part.w_down.copy_(self.w_down[first - self.first:first - self.first + num])
        for mine, whole in ((part.w_up, self.w_up), (part.w_down, self.w_down)):
            mine.requires_grad_(whole.requires_grad)  # --freeze on the experts: they stay frozen
        return part


class MoE(nn.Module):
    """Top-k routed mixture of experts (shared/problem.py): probs = softmax(h @ W_r); the k most
    probable experts (ties to the lower index: a stable descending sort); gates renormalised;
    out = Σ gate · expert(h). Dropless. ``aux`` = 0.01·E·Σ_e f_e·P_e (f from the global counts)."""

    def __init__(self, dim: int, experts: int, topk: int, dtype=None, device=None):
        super().__init__()
        self.num_experts, self.topk = experts, topk
        self.router = nn.Linear(dim, experts, bias=False, dtype=dtype, device=device)  # weight = W_rᵀ
        self.experts = GroupedExperts(experts, dim, 0, dtype, device)
        # the seams (None: this device's experts, its own counts); expert parallelism sets both:
        # dispatch (rows sorted by expert, counts list) -> expert outputs, global_counts (E,) -> (E,)
        self.dispatch, self.global_counts = None, None
        self.aux: torch.Tensor | None = None
        self.load: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        e, k = self.num_experts, self.topk
        x = h.reshape(b * t, d)  # (n, D)
        probs = F.softmax(self.router(x), dim=-1)  # (n, E)
        top_p, top_i = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: lower index first
        top_p, top_i = top_p[:, :k], top_i[:, :k]  # (n, k)
        gates = top_p / top_p.sum(-1, keepdim=True)  # (n, k), renormalised (gradient flows)
        load = F.one_hot(top_i, e).reshape(b, t * k, e).sum(1)  # (B, E) int64 assignments per sequence
        counts = load.sum(0)  # (E,)
        total = self.global_counts(counts) if self.global_counts else counts  # (E,) over every device's tokens
        f = total.to(probs.dtype) / total.sum()  # share of the k·B·T assignments: a constant
        self.aux = MOE_BALANCE_COEF * e * (f * probs.mean(0)).sum()
        self.load = load.detach()
        flat = top_i.reshape(-1)  # (n·k,) assignment j = token j // k
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order within
        y = (self.dispatch or self.experts)(x[order // k], counts.tolist())  # (n·k, D) expert outputs, sorted
        out = torch.empty_like(y).index_copy(0, order, y).reshape(b * t, k, d)  # (n, k, D) unsorted
        return (gates.unsqueeze(-1) * out).sum(1).reshape(b, t, d)  # (B, T, D)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dtype=None, device=None, experts: int = 0, topk: int = 1,
                 recompute: str = "none"):
        super().__init__()
        self.recompute = recompute
        self.norm1 = nn.RMSNorm(dim, eps=RMS_EPS, dtype=dtype, device=device)
        self.attn = Attention(dim, heads, dtype, device, recompute)
        self.norm2 = nn.RMSNorm(dim, eps=RMS_EPS, dtype=dtype, device=device)
        self.mlp = MoE(dim, experts, topk, dtype, device) if experts else MLPBlock(dim, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":  # saves x (B, T, D) only; backward runs _forward again
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))  # (B, T, D)


class Transformer(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int, seq: int, dtype=None, device=None,
                 experts: int = 0, topk: int = 1, recompute: str = "none"):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim, dtype=dtype, device=device)
        self.wpe = nn.Embedding(seq, dim, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(Block(dim, heads, dtype, device, experts, topk, recompute)
                                    for _ in range(layers))
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
