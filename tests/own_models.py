"""Models the project does not own, for the torch own-model tests (test_own_model_torch.py,
test_tp_plan.py): float64, small, each with what real models bring.

``BiasedMLP``: biases, LayerNorm, a frozen matrix and a frozen gain, a buffer, 7 and 5 rows (padding at
N = 2). ``TPMLP``: LayerNorm, a biased colwise/rowwise pair. ``TinyLlama``: separate q, k, v, o; SwiGLU
gate, up, down; RMSNorm; an untied head; V = 25, not divisible by 2; padding_idx on rank 1's half
(``LLAMA_PLAN`` splits it Megatron's way). ``TiedReader``: a parent reading a child's weight
(F.linear(h, self.emb.weight)), the tying idiom FSDP must refuse. ``UserMoE``: a top-k mixture of experts
whose ``StackedExperts`` hold (E, …) weights (expert parallelism's seam). And the rank code both launches
(test_own_model_torch.py, test_llama_torch.py) train with: ``train``, ``full``, ``max_err``, ``ce``.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

DT = torch.float64
V, D, HEADS, B, T = 25, 8, 2, 2, 6
STEPS, LR, WD = 3, 1e-2, 0.1


class BiasedMLP(nn.Module):
    """Biases, a LayerNorm, a frozen Linear and a frozen gain, a buffer; 7 and 5 output rows."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 7, dtype=DT)
        self.norm = nn.LayerNorm(7, dtype=DT)
        self.down = nn.Linear(7, 5, dtype=DT)
        self.fixed = nn.Linear(5, 5, bias=False, dtype=DT).requires_grad_(False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=DT), requires_grad=False)
        self.register_buffer("shift", torch.linspace(-1, 1, 5, dtype=DT))

    def forward(self, x):
        return self.fixed(self.down(F.gelu(self.norm(self.up(x))))) * self.gain + self.shift


class TPMLP(nn.Module):
    """A LayerNorm (replicated; SP: 'sequence'), then a biased colwise / rowwise pair."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6, dtype=DT)
        self.up = nn.Linear(6, 8, dtype=DT)
        self.down = nn.Linear(8, 6, dtype=DT)

    def forward(self, x):  # (B, T, 6)
        return self.down(F.gelu(self.up(self.norm(x))))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.head_dim = HEADS, D // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False, dtype=DT) for _ in range(4))

    def forward(self, h):  # (B, T, D); under TP q, k, v hold H/tp heads: the -1 below
        b, t, _ = h.shape
        q, k, v = (m(h).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, dh)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(D, 2 * D, bias=False, dtype=DT), nn.Linear(D, 2 * D, bias=False, dtype=DT)
        self.down = nn.Linear(2 * D, D, bias=False, dtype=DT)

    def forward(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(D, eps=1e-6, dtype=DT), nn.RMSNorm(D, eps=1e-6, dtype=DT)
        self.attn, self.mlp = Attention(), SwiGLU()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLlama(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=20, dtype=DT)  # row 20: rank 1's, local 7
        self.layers = nn.ModuleList(LlamaBlock() for _ in range(layers))
        self.normf = nn.RMSNorm(D, eps=1e-6, dtype=DT)
        self.head = nn.Linear(D, V, bias=False, dtype=DT)  # untied

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(self.normf(h))  # (B, T, V); under TP (B, T, ⌈V/tp⌉), padding −inf


LLAMA_PLAN = {
    "emb": "vocab_embed",
    "layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
    "layers.*.attn.o": "rowwise",
    "layers.*.mlp.gate": "colwise", "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise",
    "head": "colwise_vocab",
}


class TiedReader(nn.Module):
    """The tying idiom FSDP cannot gather for: the parent reads the embedding's weight itself."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, D, dtype=DT)
        self.norm = nn.RMSNorm(D, dtype=DT)

    def forward(self, tokens):
        return F.linear(self.norm(self.emb(tokens)), self.emb.weight)  # (B, T, 11)


class StackedExperts(nn.Module):
    """E experts' weights stacked (E, …), called torchtitan's way: rows grouped by expert and an (E,) int
    tensor of rows per expert; it loops over its own dim 0 (so E/N experts take E/N counts)."""

    def __init__(self, experts: int = 4, dim: int = 6, hidden: int = 5):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden, dtype=DT) * 0.4)
        self.b1 = nn.Parameter(torch.randn(experts, hidden, dtype=DT) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim, dtype=DT) * 0.4)

    def forward(self, x, counts):  # (Σ counts, D), (E,) -> (Σ counts, D)
        return torch.cat([F.silu(rows @ w1 + b1) @ w2
                          for rows, w1, b1, w2 in zip(x.split(counts.tolist()), self.w1, self.b1, self.w2)])


class UserMoE(nn.Module):
    """A user's top-k mixture-of-experts layer with a residual: LayerNorm, a router, gates renormalised
    over the top k, the assignments sorted by expert for ``experts``, un-sorted and gate-weighted."""

    def __init__(self, experts: int = 4, topk: int = 2, dim: int = 6):
        super().__init__()
        self.e, self.k = experts, topk
        self.norm = nn.LayerNorm(dim, dtype=DT)
        self.router = nn.Linear(dim, experts, bias=False, dtype=DT)
        self.experts = StackedExperts(experts, dim)
        # the balancing loss's seam (the project's MoE's): (E,) this device's counts -> every data rank's
        # (None: its own); compose's ep axis sets it. After forward ``aux`` is Switch's balancing loss.
        self.global_counts, self.aux = None, None

    def forward(self, x):  # (B, T, D)
        h = self.norm(x).reshape(-1, x.shape[-1])  # (n, D)
        probs = F.softmax(self.router(h), dim=-1)  # (n, E)
        top_p, top_i = probs.topk(self.k, dim=-1)  # (n, k)
        gates = top_p / top_p.sum(-1, keepdim=True)
        flat = top_i.reshape(-1)  # (n·k,): assignment j = token j // k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.e)  # (E,) int64
        total = self.global_counts(counts) if self.global_counts else counts
        self.aux = 0.01 * self.e * (total.to(probs.dtype) / total.sum() * probs.mean(0)).sum()
        y = self.experts(h[order // self.k], counts)  # (n·k, D), by expert
        out = torch.empty_like(y).index_copy(0, order, y).reshape(h.shape[0], self.k, -1)  # (n, k, D)
        return x + (gates.unsqueeze(-1) * out).sum(1).reshape(x.shape)


def made(fn, *args, seed=0, **kw):
    """``fn(*args, **kw)`` under ``torch.manual_seed(seed)``: a model's (or a batch's) same values anywhere."""
    torch.manual_seed(seed)
    return fn(*args, **kw)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def train(step, params, sync=None, ledger=None, grads0=None, around=nullcontext, opt=None, after_step=None):
    """STEPS of AdamW (or ``opt``, e.g. a Zero1Optimizer) over ``params``; ``step()`` -> loss (forward),
    run with its backward inside ``around()``; the ledger (if given) records the last step;
    ``grads0()`` is captured after the first backward; ``after_step()`` runs after each optimizer step
    (Zero2's all-gather of the updated rows)."""
    opt, losses, first = opt or adamw(params), [], None
    for k in range(STEPS):
        with ledger.recording() if ledger is not None and k == STEPS - 1 else nullcontext():
            opt.zero_grad(set_to_none=True)
            with around():
                loss = step()
                loss.backward()
            if sync is not None:
                sync()
            if k == 0 and grads0 is not None:
                first = grads0()
            opt.step()
            if after_step is not None:
                after_step()
        losses.append(loss.item())
    return losses, first


def full(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_err(a, b):
    if isinstance(a, dict):
        assert list(a) == list(b), (list(a), list(b))
        return max(max_err(a[k], b[k]) for k in a)
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) if isinstance(a, list) \
        else float((a - b).detach().abs().max())


def ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class MoEBlock(nn.Module):
    """A LayerNorm'd biased MLP (tp's colwise / rowwise pair), then a ``UserMoE`` (residual inside)."""

    def __init__(self, experts: int = 4, dim: int = 6):
        super().__init__()
        self.norm = nn.LayerNorm(dim, dtype=DT)
        self.up, self.down = nn.Linear(dim, 8, dtype=DT), nn.Linear(8, dim, dtype=DT)
        self.moe = UserMoE(experts, 2, dim)

    def forward(self, x):
        return self.moe(x + self.down(F.gelu(self.up(self.norm(x)))))


class MoENet(nn.Module):
    """compose's ep axis on a user's MoE model: embedding (V = 24), ``layers`` MoEBlocks, a head; the
    experts ``layers.*.moe.experts`` (E, …) stacked, ``MOE_NET_PLAN`` Megatron's split of the rest."""

    def __init__(self, layers: int = 2, experts: int = 4, vocab: int = 24, dim: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, dtype=DT)
        self.layers = nn.ModuleList(MoEBlock(experts, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False, dtype=DT)

    def forward(self, tokens):  # (B, T) -> (B, T, V)
        h = self.emb(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)

    def aux(self):
        """Σ over the layers of the last forward's balancing losses."""
        return sum(block.moe.aux for block in self.layers)


MOE_NET_PLAN = {"emb": "vocab_embed", "layers.*.up": "colwise", "layers.*.down": "rowwise", "head": "colwise_vocab"}
MOE_NET_EXPERTS = ["layers.*.moe.experts"]
