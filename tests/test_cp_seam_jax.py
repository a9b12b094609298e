"""Context parallelism for a Flax NNX model the project does not own (issue 24, JAX), through the
attention seam: ``nnx.MultiHeadAttention(attention_fn=cp_seam.attention)`` and global positions.

``Decoder`` (defined here, float64): learned position embedding read at the positions given,
2 pre-norm blocks of nnx.MultiHeadAttention (4 heads, no biases: see Block) + a biased GELU MLP, LayerNorm, an
untied head. Every variant against single-device training from the same weights, 3 AdamW steps.
Tolerance 1e-12 (float64): the ring merges per-block softmaxes with log-sum-exp rescaling and the
gradient all-reduce adds per-device partial sums, ~1e-16 relative per op; three orders of margin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from own_models_jax import STEPS, adamw, flat, train_single

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo
from jax_impl.parallel import cp as cp_seam
from jax_impl.parallel.tree import WrapError

TOL = 1e-12  # float64: see the module docstring
V, D, H, T, B, L, N = 11, 8, 4, 8, 2, 2, 2


class Block(nnx.Module):
    def __init__(self, rngs, attention_fn=cp_seam.attention):
        f64 = dict(param_dtype=jnp.float64, rngs=rngs)
        self.norm1, self.norm2 = nnx.LayerNorm(D, **f64), nnx.LayerNorm(D, **f64)
        # No q/k/v/o biases: the key bias's gradient is exactly 0 (softmax ignores a shift of every
        # logit), so its float noise (~1e-17) is what AdamW normalises — m/(√v+ε) turns it into
        # ~1e-11 steps whose value depends on the summation order (measured 4.8e-11 with them).
        self.attn = nnx.MultiHeadAttention(H, D, attention_fn=attention_fn, decode=False, use_bias=False, **f64)
        self.up, self.down = nnx.Linear(D, 2 * D, **f64), nnx.Linear(2 * D, D, **f64)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x)), approximate=False))


class Decoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, attention_fn=cp_seam.attention):
        f64 = dict(param_dtype=jnp.float64, rngs=rngs)
        self.tok, self.pos = nnx.Embed(V, D, **f64), nnx.Embed(T, D, **f64)
        self.blocks = nnx.List([Block(rngs, attention_fn) for _ in range(L)])
        self.norm, self.head = nnx.LayerNorm(D, **f64), nnx.Linear(D, V, **f64)

    def __call__(self, tokens, positions):
        x = self.tok(tokens) + self.pos(positions)  # (B, T or T/N, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss(model, tokens, targets, positions):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens, positions), targets).mean()




def data():
    rng = np.random.default_rng(0)
    return rng.integers(0, V, (B, T)).astype(np.int32), rng.integers(0, V, (B, T)).astype(np.int32)




_REF = {}


def reference():
    if not _REF:
        losses, params = train_single(Decoder(nnx.Rngs(0)), loss, *data(), jnp.arange(T))
        _REF.update(losses=losses, params=params)
    return _REF


@pytest.mark.parametrize("style,variant", [  # zigzag and seq_sharded: pytest -m slow
    v if v[1] in ("ring", "ulysses") else pytest.param(*v, marks=pytest.mark.slow) for v in cp_seam.VARIANTS])
def test_every_variant_trains_a_foreign_decoder_like_one_device(style, variant, measured):
    ref = reference()
    trainer = cp_seam.context_parallel(Decoder(nnx.Rngs(0)), loss, adamw(), make_mesh(N, "cp"), variant, style)
    losses = [trainer.train_step(*data()) for _ in range(STEPS)]
    params = flat(trainer.module())
    loss_err = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    param_err = max(float(np.max(np.abs(params[k] - ref["params"][k]))) for k in params)
    measured(f"{style}/{variant}: loss {loss_err:.1e}, params {param_err:.1e}")
    assert loss_err <= TOL and param_err <= TOL, (variant, loss_err, param_err)


@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_ledger_equals_the_theory_from_the_seam_calls(variant):
    """L seam calls: ring L·(3N−2) collective-permutes of 2a, ulysses 8L all-to-alls of a, a = B·T/N·D·b;
    and the gradients' all-reduce, Φ·b (XLA's combiner sets its count: bytes compared)."""
    trainer = cp_seam.context_parallel(Decoder(nnx.Rngs(0)), loss, adamw(), make_mesh(N, "cp"), variant)
    batch = trainer.shard_batch(*data())
    ledger = comm_from_hlo(trainer.step.lower(*trainer.state, *batch)
                           .compile(compiler_options={"xla_disable_hlo_passes": "cse"}).as_text())
    theory = trainer.comm_theory()
    a = B * (T // N) * D * 8
    attn_op = "collective_permute" if variant == "ring" else "all_to_all"
    assert theory[attn_op] == ((3 * N - 2) * L, (3 * N - 2) * L * 2 * a) if variant == "ring" else (8 * L, 8 * L * a)
    assert ledger[attn_op] == {"count": theory[attn_op][0], "bytes": theory[attn_op][1]}, ledger
    assert ledger["all_reduce"]["bytes"] == theory["all_reduce"][1], (ledger, theory)


class OwnAttention(Decoder):
    """The same decoder with flax's own attention: it never calls the seam."""

    def __init__(self, rngs):
        super().__init__(rngs, attention_fn=nnx.dot_product_attention)


def test_refusals():
    mesh = make_mesh(N, "cp")
    with pytest.raises(cp_seam.SeamError, match="never called parallel.cp.attention"):
        cp_seam.context_parallel(OwnAttention(nnx.Rngs(0)), loss, adamw(), mesh).train_step(*data())
    with pytest.raises(WrapError, match="not divisible by 4"):
        cp_seam.context_parallel(Decoder(nnx.Rngs(0)), loss, adamw(), mesh, "ring_zigzag").shard_batch(
            np.zeros((B, 6), np.int32))
    with pytest.raises(WrapError, match="no 'cp'"):
        cp_seam.context_parallel(Decoder(nnx.Rngs(0)), loss, adamw(), make_mesh(N, "dp"))
    with pytest.raises(WrapError, match="unknown style/variant"):
        cp_seam.context_parallel(Decoder(nnx.Rngs(0)), loss, adamw(), mesh, "striped")
    q = jnp.zeros((B, T, H, D // H))
    with pytest.raises(cp_seam.SeamError, match="no mask or bias"):
        cp_seam.attention(q, q, q, mask=jnp.ones((B, H, T, T), bool))
    with pytest.raises(cp_seam.SeamError, match="dropout_rate=0"):
        cp_seam.attention(q, q, q, dropout_rate=0.1, deterministic=False)
