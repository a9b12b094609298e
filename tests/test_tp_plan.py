"""``tp.check_plan`` on models the project does not own: what it accepts (any vocabulary, a tied
embedding and head) and what it refuses — one PlanError naming what, where (module path) and the fix,
before anything changes (no process group, no launch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from own_models import LLAMA_PLAN, TinyLlama, made

from shared.config import Config
from torch_impl.model import empty_model
from torch_impl.parallel import tp


def test_check_plan_accepts_the_llama_plan_at_any_vocabulary():
    styles = tp.check_plan(made(TinyLlama), LLAMA_PLAN, 2)
    assert styles["emb.weight"] == "vocab_embed" and styles["head.weight"] == "colwise_vocab"
    assert len(styles) == 2 + 7 * 2  # embedding, head, 7 projections per block; norms replicated


def test_check_plan_shares_a_tied_embedding_and_head():
    """Tied wte/head split alike (rows, padded to ⌈V/tp⌉): one shard serves both."""
    model = made(TinyLlama)
    model.head.weight = model.emb.weight
    styles = tp.check_plan(model, LLAMA_PLAN, 2)
    assert styles["emb.weight"] == "vocab_embed" and styles["head.weight"] == "colwise_vocab"


class ThreeHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = 4
        self.q = nn.Linear(12, 12, bias=False)


class ScaledLinear(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.scale = nn.Parameter(torch.ones(4))


def _tied():
    model = made(TinyLlama)
    model.head.weight = model.emb.weight
    return model


def test_apply_dtensor_plan_refuses_a_tie_split_unlike_before_anything_changes():
    """parallelize_module would split the embedding's copy and leave the head's whole: refused first
    (no mesh needed), the tie intact."""
    model = _tied()
    with pytest.raises(tp.PlanError, match=r"\(DTensor\): one Parameter \(tied\) is used as 'emb\.weight' "
                                                r"\(vocab_embed\), 'head\.weight' \(replicated\)"):
        tp.apply_dtensor_plan(model, {"emb": "vocab_embed"}, mesh=None)
    assert model.head.weight is model.emb.weight and not model.emb._forward_hooks


def _transformer_heads_2():
    return empty_model(Config(world_size=4, model="transformer", layers=1, dim=16, heads=2, vocab=32), "meta")


REFUSALS = {  # id: (model, plan, world size, sequence parallel, the message's what / where)
    "key_matches_no_module": (lambda: made(TinyLlama), {"layers.*.attn.qq": "colwise"}, 2, False,
                              r"key 'layers\.\*\.attn\.qq' \(colwise\) matches no module .*layers\.0\.attn\.q"),
    "unknown_style": (lambda: made(TinyLlama), {"head": "colwise_vocabulary"}, 2, False,
                      r"key 'head' has unknown style 'colwise_vocabulary'"),
    "colwise_on_a_norm": (lambda: made(TinyLlama), {"layers.*.norm1": "colwise"}, 2, False,
                          r"'colwise' at 'layers\.0\.norm1' \(RMSNorm\): this style splits an nn\.Linear"),
    "vocab_embed_on_a_linear": (lambda: made(TinyLlama), {"head": "vocab_embed"}, 2, False,
                                r"'vocab_embed' at 'head' \(Linear\): this style splits an nn\.Embedding"),
    "colwise_out_features": (lambda: nn.Sequential(nn.Linear(6, 7)), {"0": "colwise"}, 2, False,
                             r"'colwise' at '0' \(Linear\): out_features=7 is not divisible by tp=2"),
    "rowwise_in_features": (lambda: nn.Sequential(nn.Linear(7, 4)), {"0": "rowwise"}, 2, False,
                            r"'rowwise' at '0' \(Linear\): in_features=7 is not divisible by tp=2"),
    "part_of_a_head": (ThreeHeads, {"q": "colwise"}, 2, False,
                       r"'colwise' at 'q' \(Linear\): it would split 3 heads of head_dim=4 over tp=2"),
    "colwise_heads": (_transformer_heads_2, {"blocks.*.attn.qkv": "colwise_heads"}, 4, False,
                      r"'colwise_heads' at 'blocks\.0\.attn\.qkv' \(Linear\): .*whole heads per rank"),
    "two_styles_for_one_module": (lambda: made(TinyLlama), {"layers.*.attn.q": "colwise", "layers.0.attn.*": "rowwise"},
                                  2, False, r"module 'layers\.0\.attn\.q' \(Linear\) is matched by"),
    "tied_split_unlike": (_tied, {"emb": "vocab_embed"}, 2, False,
                          r"one Parameter \(tied\) is used as 'emb\.weight' \(vocab_embed\), "
                          r"'head\.weight' \(replicated\)"),
    "sequence_without_sp": (lambda: made(TinyLlama), {"layers.*.norm1": "sequence"}, 2, False,
                            r"'sequence' at 'layers\.0\.norm1' \(RMSNorm\): .*only under sequence parallelism"),
    "sp_leaves_a_gain_unplanned": (lambda: made(TinyLlama), LLAMA_PLAN, 2, True,
                                   r"'layers\.0\.norm1\.weight' is in no plan entry"),
    "embedding_max_norm": (lambda: nn.Sequential(nn.Embedding(5, 2, max_norm=1.0)), {"0": "vocab_embed"}, 2, False,
                           r"'vocab_embed' at '0' \(Embedding\): max_norm"),
    "unknown_parameter": (lambda: nn.Sequential(ScaledLinear()), {"0": "colwise"}, 2, False,
                          r"'colwise' at '0' \(ScaledLinear\): it has a parameter 'scale'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_check_plan_refuses(case):
    """ONE PlanError naming what, where (module path) and how to fix, before any change."""
    build, plan, n, sp, what = REFUSALS[case]
    model = build()
    before = {k: (tuple(p.shape), p.device.type) for k, p in model.named_parameters()}
    with pytest.raises(tp.PlanError, match=what) as err:
        tp.check_plan(model, plan, n, sequence_parallel=sp)
    assert "Fix: " in str(err.value), err.value
    assert {k: (tuple(p.shape), p.device.type) for k, p in model.named_parameters()} == before
