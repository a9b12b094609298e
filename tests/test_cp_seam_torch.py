"""Context parallelism for torch models the project does not own (issue 24, torch), through the
attention seam: ``cp.attention`` (or transformers' registry, ``attn_implementation=
"parallel_twins_cp"``) and global positions (torch_impl/cp.py). ONE launch at world size 2.

``Decoder`` (defined here, float64): learned position embedding read at the positions given, 2
pre-norm blocks of q/k/v/o attention (4 heads, no biases: see jax's test) through the seam + a biased
GELU MLP, LayerNorm, an untied head. ``LlamaForCausalLM`` (transformers, random init, float64, 2 layers,
4 query heads over 2 K|V heads, rope fed the global position_ids; the hub is never touched).
Every variant against single-process training from the same weights, 3 AdamW steps.
Tolerance 1e-12 (float64): the ring merges per-block softmaxes with log-sum-exp rescaling and the
gradient all-reduce adds per-rank partial sums, ~1e-16 relative per op; three orders of margin.
(Llama's RMSNorm rounds through float32 per token; both runs round the same values, and a 1e-16
difference crosses a float32 rounding boundary with probability ~1e-9 per element.)
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_impl.launch import launch
from torch_impl.parallel import cp
from torch_impl.parallel.llama import cp_attention, cp_logits

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOL = 1e-12  # float64: see the module docstring
DT = torch.float64
V, D, H, T, B, L, STEPS, N = 11, 8, 4, 8, 2, 2, 3, 2


class Block(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.attend, self.norm1, self.norm2 = attend, nn.LayerNorm(D, dtype=DT), nn.LayerNorm(D, dtype=DT)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False, dtype=DT) for _ in range(4))
        self.up, self.down = nn.Linear(D, 2 * D, dtype=DT), nn.Linear(2 * D, D, dtype=DT)

    def forward(self, x):  # (B, T or T/N, D)
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (m(h).view(b, t, H, D // H).transpose(1, 2) for m in (self.q, self.k, self.v))  # (B, H, t, dh)
        x = x + self.o(self.attend(q, k, v).transpose(1, 2).reshape(b, t, D))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, attend=cp.attention):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D, dtype=DT), nn.Embedding(T, D, dtype=DT)
        self.blocks = nn.ModuleList(Block(attend) for _ in range(L))
        self.norm, self.head = nn.LayerNorm(D, dtype=DT), nn.Linear(D, V, dtype=DT)

    def forward(self, tokens, positions):
        x = self.tok(tokens) + self.pos(positions)  # (B, T or T/N, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def own_attention():  # the same decoder calling torch's SDPA: it never calls the seam
    return Decoder(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))


def llama(attn=cp.NAME):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T, use_cache=False,
                      tie_word_embeddings=False)
    if attn == cp.NAME:
        cp_attention(cfg)  # the seam, registered in transformers' attention registry
    else:
        cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).to(DT)


def ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


LOSSES = {"decoder": lambda m, x, y, pos: ce(m(x, pos), y),
          "llama": lambda m, x, y, pos: ce(cp_logits(m, x, pos), y)}
MODELS = {"decoder": Decoder, "llama": llama}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def made(build):
    torch.manual_seed(0)
    return build()


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def reference(name):
    model, (x, y) = made(MODELS[name]), data()
    opt, losses = adamw(model.parameters()), []
    for _ in range(STEPS):
        opt.zero_grad()
        value = LOSSES[name](model, x, y, torch.arange(T))
        value.backward()
        opt.step()
        losses.append(value.item())
    return losses, dict(model.named_parameters())


def refusal(fn) -> str:
    try:
        fn()
    except cp.SeamError as e:
        return str(e)
    return "not refused"


def rank_checks(ctx):
    out, names = {}, ["decoder"] + (["llama"] if _have_transformers() else [])
    for name in names:
        ref_losses, ref_params = reference(name)
        for variant in cp.VARIANTS:
            model = made(MODELS[name])
            trainer = cp.context_parallel(model, LOSSES[name], adamw, ctx.group, variant)
            losses = [trainer.train_step(*data()) for _ in range(STEPS - 1)]
            with ctx.ledger.recording():
                losses.append(trainer.train_step(*data()))
            out[name, variant] = {
                "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "param_err": max(float((p - ref_params[k]).detach().abs().max()) for k, p in model.named_parameters()),
                "ledger": ctx.ledger.summary(), "theory": trainer.comm_theory(), "calls": len(trainer.calls)}
    if "llama" in names:
        m, (x, _) = made(llama), data()
        with torch.no_grad():
            out["llama_vs_sdpa"] = float((m(x).logits - made(lambda: llama("sdpa"))(x).logits).abs().max())
        out["no_position_ids"] = refusal(lambda: cp.context_parallel(
            made(llama), lambda m, x, y, pos: ce(m(input_ids=x).logits, y), adamw, ctx.group).train_step(*data()))
        pad = lambda x: torch.ones_like(x).index_fill(1, torch.tensor([0]), 0)  # each rank's first token
        padded = lambda m, x, y, pos: ce(m(input_ids=x, position_ids=pos[None], attention_mask=pad(x)).logits, y)
        out["padding"] = refusal(lambda: cp.context_parallel(made(llama), padded, adamw, ctx.group).train_step(
            *data()))
    three = torch.zeros(B, 3, T // N, 2, dtype=DT)  # 3 heads over cp = 2
    out["ulysses_heads"] = refusal(lambda: cp.context_parallel(
        Decoder(), lambda *_: cp.attention(three, three, three).sum(), adamw, ctx.group, "ulysses"
    ).train_step(*data()))
    out["dropout"] = refusal(lambda: cp.context_parallel(
        nn.Sequential(Decoder(), nn.Dropout(0.1)), LOSSES["decoder"], adamw, ctx.group))
    out["never_called"] = refusal(lambda: cp.context_parallel(
        own_attention(), LOSSES["decoder"], adamw, ctx.group).train_step(*data()))
    out["not_divisible"] = refusal(lambda: cp.context_parallel(
        Decoder(), LOSSES["decoder"], adamw, ctx.group, "ring_zigzag").shard_batch(torch.zeros(B, 6)))
    return out


def _have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def result():
    every = launch(rank_checks, N)
    return every[0] | {"no_position_ids": [r.get("no_position_ids") for r in every]}


CASES = [(m, v) for m in MODELS for v in cp.VARIANTS]


@pytest.mark.parametrize("name,variant", CASES)
def test_every_variant_trains_a_foreign_model_like_one_process(result, name, variant, measured):
    if name == "llama":
        pytest.importorskip("transformers")
    r = result[name, variant]
    measured(f"{name}/{variant}: loss {r['loss_err']:.1e}, params {r['param_err']:.1e}")
    assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r


@pytest.mark.parametrize("name,variant", CASES)
def test_ledger_equals_the_theory_from_the_seam_calls(result, name, variant):
    """L seam calls: ring L·(3N−2) sends (and receives) of 2a, ulysses 8L all-to-alls of a,
    a = B·H·T/N·dh·b (Llama: K|V repeated to the 4 query heads first); and (Φ + 2)·b all-reduced."""
    if name == "llama":
        pytest.importorskip("transformers")
    r = result[name, variant]
    a = B * (T // N) * D * 8
    assert r["calls"] == L
    if variant == "ulysses":
        assert r["theory"]["all_to_all"] == (8 * L, 8 * L * a)
    else:
        assert r["theory"]["send"] == ((3 * N - 2) * L, (3 * N - 2) * L * 2 * a)
    assert r["ledger"] == {op: {"count": c, "bytes": b} for op, (c, b) in r["theory"].items()}, r


def test_the_registered_seam_equals_transformers_sdpa(result):
    pytest.importorskip("transformers")
    assert result["llama_vs_sdpa"] <= TOL, result["llama_vs_sdpa"]


def test_refuses_a_model_that_never_calls_the_seam(result):
    assert "never called cp.attention" in result["never_called"], result["never_called"]


def test_refuses_a_sequence_not_divisible(result):
    assert "not divisible by 4" in result["not_divisible"], result["not_divisible"]


def test_refuses_local_position_ids(result):
    pytest.importorskip("transformers")
    """Rank 0's local arange IS its global positions: it learns of the refusal from the all-reduce."""
    rank0, rank1 = result["no_position_ids"]
    assert "another rank's seam call was refused" in rank0, rank0
    assert "position_ids are not the ranks' global positions" in rank1, rank1


def test_refuses_a_padding_mask(result):
    pytest.importorskip("transformers")
    assert "a padding attention_mask would be ignored" in result["padding"], result["padding"]


def test_refuses_ulysses_over_heads_not_divisible(result):
    assert "ulysses splits heads: 3 heads over cp=2" in result["ulysses_heads"], result["ulysses_heads"]


def test_refuses_active_dropout(result):
    assert "has active dropout" in result["dropout"], result["dropout"]


def test_refuses_a_mask_dropout_or_scale_at_the_seam():
    q = torch.zeros(B, H, T, D // H, dtype=DT)
    with pytest.raises(cp.SeamError, match="takes no attn_mask"):
        cp.attention(q, q, q, attn_mask=torch.ones(T, T, dtype=torch.bool))
    with pytest.raises(cp.SeamError, match="takes no attn_mask"):
        cp.attention(q, q, q, is_causal=False)
    with pytest.raises(cp.SeamError, match="dropout_p=0"):
        cp.attention(q, q, q, dropout_p=0.1)
    with pytest.raises(cp.SeamError, match="scales by dh"):
        cp.attention(q, q, q, scale=1.0)
    with pytest.raises(cp.SeamError, match="takes no attention_mask"):
        cp.hf_attention(None, q, q, q, torch.ones(B, 1, T, T))
    with pytest.raises(cp.SeamError, match="sliding_window=4 is not supported"):
        cp.hf_attention(None, q, q, q, None, sliding_window=4)
    with pytest.raises(cp.SeamError, match="takes no attn_mask"):
        cp.hf_attention(None, q, q, q, None, is_causal=False)


def test_refuses_an_unknown_variant():
    with pytest.raises(cp.SeamError, match="unknown variant"):
        cp.context_parallel(Decoder(), LOSSES["decoder"], adamw, None, "striped")
