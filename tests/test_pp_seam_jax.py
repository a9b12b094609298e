"""Pipeline parallelism for a Flax NNX model the project does not own (issue 24, JAX), through the
stage-split seam: module paths per stage, GPipe or 1F1B over "pp" (jax_impl/parallel/pp.py).

``Chain`` (defined here, float64): an embedding, two different blocks (a biased GELU MLP with
LayerNorm; a gated tanh block with a bare matrix Param), a final LayerNorm and an untied head — the
two stages share no code. 3 AdamW steps at S = 2, M = 4 micro-batches, under both schedules, against
single-device training from the same weights. Tolerance 1e-12 (float64): the loss is a mean of
per-micro-batch means (equal sizes: the full-batch mean re-associated; 1F1B sums the micro-batches'
gradients in another order), ~1e-16 relative per op; three orders of margin.
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
from jax_impl.parallel.pp import pipeline
from jax_impl.parallel.tree import WrapError

TOL = 1e-12  # float64: see the module docstring
V, D, T, B, M, S = 11, 8, 4, 8, 4, 2
STAGES = [["embed", "mlp"], ["gated", "norm", "head"]]


class MLPBlock(nnx.Module):
    def __init__(self, rngs):
        f64 = dict(param_dtype=jnp.float64, rngs=rngs)
        self.norm, self.up = nnx.LayerNorm(D, **f64), nnx.Linear(D, 2 * D, **f64)
        self.down = nnx.Linear(2 * D, D, **f64)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x)), approximate=False))


class Gated(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D), jnp.float64) * 0.3)
        self.gate = nnx.Linear(D, D, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w[...]) * jax.nn.sigmoid(self.gate(x))


class Chain(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        f64 = dict(param_dtype=jnp.float64, rngs=rngs)
        self.embed, self.mlp, self.gated = nnx.Embed(V, D, **f64), MLPBlock(rngs), Gated(rngs)
        self.norm, self.head = nnx.LayerNorm(D, **f64), nnx.Linear(D, V, **f64)

    def __call__(self, tokens):
        return self.head(self.norm(self.gated(self.mlp(self.embed(tokens)))))


class Skips(Chain):
    """Its forward is not the chain: a residual around the blocks, outside every module."""

    def __call__(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.gated(self.mlp(h))))


class Tied(Chain):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.head.kernel = self.mlp.up.kernel  # (D, 2D) read as the head: tied across the stages


class Widening(Chain):
    """A middle module changes the width: at S = 3 its two boundaries carry different messages."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self.wide = nnx.Linear(D, 2 * D, param_dtype=jnp.float64, rngs=rngs)
        self.head = nnx.Linear(2 * D, V, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.wide(self.norm(self.gated(self.mlp(self.embed(tokens))))))


def ce(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()




def data():
    rng = np.random.default_rng(0)
    return rng.integers(0, V, (B, T)).astype(np.int32), rng.integers(0, V, (B, T)).astype(np.int32)




PERMUTES = {"gpipe": 2 * (M + S - 2), "1f1b": M + 2}  # 1F1B at S = 2: 2·(M+S−1) ticks, M − 2 of them shared


def _compiled(trainer, x, y):
    return trainer.step.lower(*trainer.state, *trainer.shard_batch(x, y)).compile()


def test_gpipe_and_1f1b_train_a_foreign_chain_like_one_device(measured):
    """Both schedules against one single-device run (and so against each other: the same sums in
    another order); each compiled program's collectives equal comm_theory()."""
    model, (x, y) = Chain(nnx.Rngs(0)), data()
    ref_losses, ref = train_single(model, lambda m, x, y: ce(m(x), y), x, y)
    runs, temp = {}, {}
    for schedule in ("gpipe", "1f1b"):
        trainer = pipeline(Chain(nnx.Rngs(0)), STAGES, ce, adamw(), make_mesh(S, "pp"), microbatches=M,
                           schedule=schedule)
        losses = [trainer.train_step(x, y) for _ in range(STEPS)]
        got = runs[schedule] = flat(trainer.module())
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        param_err = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
        compiled = _compiled(trainer, x, y)
        temp[schedule] = compiled.memory_analysis().temp_size_in_bytes  # XLA's scratch: the activations live there
        measured(f"{schedule} S={S} M={M}: loss {loss_err:.1e}, params {param_err:.1e}; XLA temp {temp[schedule]} B")
        assert loss_err <= TOL and param_err <= TOL, (schedule, loss_err, param_err)

        ledger = comm_from_hlo(compiled.as_text())
        theory = trainer.comm_theory()
        k = PERMUTES[schedule]
        assert theory["collective_permute"] == (k, k * (B // M) * T * D * 8), theory
        assert ledger["collective_permute"] == dict(zip(("count", "bytes"), theory["collective_permute"])), ledger
        assert ledger["all_reduce"] == dict(zip(("count", "bytes"), theory["all_reduce"])), ledger
        if schedule == "1f1b":  # at most S micro-batches' activations per stage (GPipe: all M)
            assert trainer.stash["stash_slots"] == min(S, M) < M, trainer.stash
    diff = max(float(np.max(np.abs(runs["gpipe"][k] - runs["1f1b"][k]))) for k in ref)
    assert diff <= TOL, diff
    assert temp["1f1b"] < temp["gpipe"], temp  # 2 stashed micro-batches of one stage vs all 4 (measured: 0.6×)


@pytest.mark.slow
def test_1f1b_activation_memory_stays_flat_in_microbatches(measured):
    """XLA's temp bytes per device (compiled.memory_analysis(), where the activations live), micro-batches
    of 2 rows of 64 tokens (the activations, not the weights, dominate): GPipe's grow with M (jax.grad
    keeps every micro-batch's residuals), 1F1B's stay (min(S, M) stash slots) and are the smaller.
    Compiled only."""
    rng, temp = np.random.default_rng(0), {}
    for m in (4, 8):
        x, y = rng.integers(0, V, (2, 2 * m, 64)).astype(np.int32)  # B = 2·M rows, T = 64
        for schedule in ("gpipe", "1f1b"):
            trainer = pipeline(Chain(nnx.Rngs(0)), STAGES, ce, adamw(), make_mesh(S, "pp"), microbatches=m,
                               schedule=schedule)
            temp[schedule, m] = _compiled(trainer, x, y).memory_analysis().temp_size_in_bytes
    measured(f"XLA temp bytes, S={S}, 2x64-token micro-batches: "
             + ", ".join(f"{s} M={m}: {b}" for (s, m), b in sorted(temp.items())))
    assert temp["gpipe", 8] > 1.5 * temp["gpipe", 4], temp  # GPipe: ~ linear in M
    assert temp["1f1b", 8] < 1.1 * temp["1f1b", 4], temp  # 1F1B: flat in M (the same two stash slots)
    assert temp["1f1b", 4] < temp["gpipe", 4] and temp["1f1b", 8] < temp["gpipe", 8], temp

REFUSALS = {
    "not the chain": (lambda: (Skips(nnx.Rngs(0)), STAGES), "does not give model"),
    "unknown path": (lambda: (Chain(nnx.Rngs(0)), [["embed", "mlp"], ["gated", "norm", "lm_head"]]),
                     "'lm_head' is not a submodule path"),
    "param in no stage": (lambda: (Chain(nnx.Rngs(0)), [["embed", "mlp"], ["gated", "head"]]),
                          "Param 'norm.bias' is in no stage"),
    "tied across stages": (lambda: (Tied(nnx.Rngs(0)), STAGES), "different stages \\(tied\\)"),
    "stage count": (lambda: (Chain(nnx.Rngs(0)), [STAGES[0] + STAGES[1]]), "1 stages for a mesh with pp=2"),
    "unknown schedule": (lambda: (Chain(nnx.Rngs(0)), STAGES), "unknown schedule 'zb'"),
    "another boundary": (lambda: (Chain(nnx.Rngs(0)), [["embed"], ["mlp", "gated", "norm", "head"]]), None),
}


def test_stage_boundaries_must_carry_one_message_shape():
    stages = [["embed", "mlp"], ["gated", "norm", "wide"], ["head"]]
    with pytest.raises(WrapError, match="boundaries carry different activations"):
        pipeline(Widening(nnx.Rngs(0)), stages, ce, adamw(), make_mesh(3, "pp"), microbatches=M).shard_batch(*data())


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_before_training(case):
    build, message = REFUSALS[case]
    model, stages = build()
    if message is None:  # a valid split at another boundary: accepted
        assert pipeline(model, stages, ce, adamw(), make_mesh(S, "pp"), microbatches=M).shard_batch(*data())
        return
    schedule = "zb" if case == "unknown schedule" else "gpipe"
    with pytest.raises(WrapError, match=message):
        pipeline(model, stages, ce, adamw(), make_mesh(S, "pp"), microbatches=M, schedule=schedule).shard_batch(
            *data())
