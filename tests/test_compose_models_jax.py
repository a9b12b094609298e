"""jax_impl/parallel/compose.py on the models people write (issue 48), through examples/compose_jax.py:
examples/gpt2_nnx.py's GPT-2 (biases on every Linear, LayerNorm with bias, learned positions, a fused
biased q|k|v, the head tied to the embedding, an odd vocabulary V = 97) and HSDP (dp × fsdp: replicate ×
shard). Each run against the same model trained on one device, and (shard_map) its theory per axis
against the compiled step's ledger.

Default tier: a small GPT-2 (D 16, 2 layers, 2 heads, T 8) under dp × fsdp × tp (HSDP with tp: the
rowwise biases added once after the psum, the fused qkv split by whole heads, the tied head), and the
refusals that compile nothing (slow: the small GPT-2 under tp × pp, the tied head on the last stage);
the GPT-2 with Flax's own nnx.MultiHeadAttention (compose_axes.flax_mha_plan) under fsdp × tp (slow: jit).
Slow: the default GPT-2 under fsdp × tp, fsdp × tp × pp (jit: compose's vmapped GPipe) and dp × tp × cp
in both styles, and the Llama under HSDP with tp in both styles.

Tolerance: 1e-12 relative on losses and parameters (the example's ``exact``): float64 throughout, the
shards only reorder sums (measured ~3e-15 on the parameters, 2e-16 on the losses).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import jax
import pytest
from flax import nnx

jax.config.update("jax_enable_x64", True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # gpt2_nnx: the user's model beside the example


def example():
    path = os.path.join(ROOT, "examples", "compose_jax.py")
    spec = importlib.util.spec_from_file_location("compose_jax_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def small():
    import gpt2_nnx

    return gpt2_nnx.GPT2Shape(vocab=97, dim=16, layers=2, heads=2, seq=8)


def assert_exact_and_theory(out, measured):
    measured(f"{out['family']} {out['layout']} {out['style']}: loss rel {out['max_rel_loss_diff']:.1e}, "
             f"params {out['max_abs_param_diff']:.1e}")
    assert out["exact"], out  # 1e-12 relative (the module docstring)
    assert out["losses"][-1] < out["losses"][0], out["losses"]  # it trains
    comm = out["comm"]
    if out["style"] == "jit":
        assert comm["theory"] is None
        return
    ledger, theory = ({a: {op: tuple(v) for op, v in ops.items()} for a, ops in c.items()}
                      for c in (comm["ledger"], comm["theory"]))
    assert ledger == theory, (out["layout"], ledger, theory)


@pytest.mark.parametrize("layout", [{"dp": 2, "fsdp": 2, "tp": 2},
                                    pytest.param({"tp": 2, "pp": 2}, marks=pytest.mark.slow)])  # budget: slow
def test_gpt2_style_model(layout, measured):
    """HSDP × tp (biases, fused qkv, tied head) and tp × pp (the tied head on the last stage: its table's
    gradient summed over the stages, in the theory too): exact."""
    ex = example()
    assert_exact_and_theory(ex.run(layout, family="gpt2", gpt2_shape=small()), measured)


def test_refusals_that_compile_nothing():
    """An odd vocabulary under fsdp without units: one line saying tp does not split it and naming units=;
    a rowwise bias on a Linear subclass with its own __call__; pp under jit."""
    import gpt2_nnx

    from jax_impl.parallel.compose import ComposeError, compose

    ex = example()
    make = lambda layout, model=None, **kw: compose(model or gpt2_nnx.GPT2(small(), rngs=nnx.Rngs(0)),  # noqa: E731
                                                    layout, ex.cross_entropy, ex.adamw(), plan=gpt2_nnx.PLAN,
                                                    split=gpt2_nnx.SPLIT, **kw)
    with pytest.raises(ComposeError, match=r"wte.embedding dim 0 = 97 \(tp does not split it\) does not divide by "
                                           r"fsdp=2; leave its module out of the ZeRO units \(units="):
        make({"fsdp": 2})

    class Scaled(nnx.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    odd = gpt2_nnx.GPT2(small(), rngs=nnx.Rngs(0))
    odd.h[0].c_proj = Scaled(16, 16, param_dtype=odd.h[0].c_proj.kernel.dtype, rngs=nnx.Rngs(1))
    with pytest.raises(ComposeError, match="has a bias and its own __call__"):
        make({"tp": 2}, odd, units=gpt2_nnx.UNITS)


class _Layer(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + jax.numpy.tanh(self.lin(x))


class _Stack(nnx.Module):
    """4 layers made by nnx.vmap and run by nnx.scan: their Params carry a leading (4,) layer axis."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _Layer(rngs)
        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x)
        return body(x, self.layers)


class _Scanned(nnx.Module):
    def __init__(self):
        r = nnx.Rngs(0)
        self.embed, self.blocks, self.head = nnx.Embed(16, 8, rngs=r), _Stack(r), nnx.Linear(8, 16, rngs=r)

    def __call__(self, x, positions=None):
        return self.head(self.blocks(self.embed(x)))


def test_scan_stacked_layers_are_named_as_the_cause():
    """compose (its split's blocks) and the pp seam (a stage listing the vmapped module) name the stacked
    module and its (4, 8, 8) kernel, not the forward's chain."""
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from jax_impl.parallel import pp
    from jax_impl.parallel.compose import ComposeError, Split, compose
    from jax_impl.parallel.tree import WrapError

    split = Split(first=("embed",), blocks="blocks", last=("head",), embed=lambda r, m, t, p: m["embed"](t),
                  block=lambda r, layer, h, p: layer(h), head=lambda r, m, h: m["head"](h))
    with pytest.raises(ComposeError, match=r"'blocks.layers.lin' holds kernel \(4, 8, 8\).*stacked layers"):
        compose(_Scanned(), {"dp": 2}, lambda logits, y: logits.mean(), optax.sgd(0.1), split=split)
    mesh = Mesh(np.array(jax.devices()[:2]), ("pp",))
    trainer = pp.pipeline(_Scanned(), [["embed", "blocks.layers"], ["head"]], lambda m, x, y: m(x).mean(),
                          optax.sgd(0.1), mesh)
    x = np.zeros((8, 4), np.int32)
    with pytest.raises(WrapError, match=r"module 'blocks.layers' holds stacked layers .* list that module"):
        trainer.train_step(x, x)


@pytest.mark.slow  # 4-8 simulated devices, a compile each: ~20-40 s per layout on 2 cores
@pytest.mark.parametrize("layout,style", [
    ({"fsdp": 2, "tp": 2}, "shard_map"), ({"fsdp": 2, "tp": 2}, "jit"),
    ({"fsdp": 2, "tp": 2, "pp": 2}, "shard_map"), ({"fsdp": 2, "tp": 2, "pp": 2}, "jit"),  # jit: vmapped GPipe
    ({"dp": 2, "tp": 2, "cp": 2}, "shard_map"), ({"dp": 2, "tp": 2, "cp": 2}, "jit")])
def test_gpt2_style_model_in_every_issue_layout(layout, style, measured):
    assert_exact_and_theory(example().run(layout, style, family="gpt2"), measured)


@pytest.mark.slow
@pytest.mark.parametrize("style", ["shard_map", "jit"])
def test_llama_under_hsdp_with_tp(style, measured):
    """dp=2 × fsdp=2 × tp=2: the rows over (dp, fsdp), the weights split over fsdp only, replicated over dp."""
    assert_exact_and_theory(example().run({"dp": 2, "fsdp": 2, "tp": 2}, style), measured)


def mha_shape():
    import gpt2_nnx

    return gpt2_nnx.GPT2Shape(vocab=97, dim=16, layers=2, heads=4, seq=8)  # 4 heads: H/tp = 2 split over fsdp


@pytest.mark.parametrize("style", ["shard_map", pytest.param("jit", marks=pytest.mark.slow)])
def test_flax_multi_head_attention(style, measured):
    """Flax's own nnx.MultiHeadAttention (examples/gpt2_nnx.py attention="flax": query / key / value / out
    nnx.LinearGeneral with biases) under fsdp × tp with compose_axes.flax_mha_plan: q, k, v split over heads
    (kernels (D, H, dh) on H, biases (H, dh) with them), out by its (H, dh) rows, its bias once after the
    psum; exact against one device (its attention_fn the seam's float64 causal attention) and, shard_map,
    the theory per axis equals the compiled step's ledger."""
    out = example().run({"fsdp": 2, "tp": 2}, style, family="gpt2-mha", gpt2_shape=mha_shape())
    assert_exact_and_theory(out, measured)


def test_flax_mha_plan_refusals():
    """What compose cannot split of an nnx.LinearGeneral is refused in one line naming the module: a layout
    other than MultiHeadAttention's for the style, colwise_heads, heads tp does not divide."""
    import gpt2_nnx

    from jax_impl.parallel.compose import ComposeError, compose, flax_mha_plan

    assert flax_mha_plan("h.*.attn") == {"h.*.attn.query": "colwise", "h.*.attn.key": "colwise",
                                         "h.*.attn.value": "colwise", "h.*.attn.out": "rowwise"}
    ex = example()
    make = lambda layout, plan: compose(gpt2_nnx.GPT2(mha_shape(), rngs=nnx.Rngs(0), attention="flax"),  # noqa: E731
                                        layout, ex.cross_entropy, ex.adamw(), plan=plan, split=gpt2_nnx.SPLIT,
                                        units=gpt2_nnx.UNITS)
    cases = [({"tp": 2}, {"h.*.attn.query": "rowwise"}, r"rowwise nnx.LinearGeneral 'h.0.attn.query' \(kernel "
              r"\(16, 4, 4\), axis=\(-1,\)\): compose splits an output projection"),
             ({"tp": 2}, {"h.*.attn.out": "colwise"}, r"colwise nnx.LinearGeneral 'h.0.attn.out'"),
             ({"tp": 2}, {"h.*.attn.key": "colwise_heads"}, "its heads are a kernel dim already"),
             ({"tp": 8}, flax_mha_plan("h.*.attn"), r"colwise 'h.0.attn.query' has 4 heads, not divisible by tp=8")]
    for layout, plan, words in cases:
        with pytest.raises(ComposeError, match=words):
            make(layout, plan)
