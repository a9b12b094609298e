"""Your own Flax NNX model under every JAX pattern that takes one: dp, ZeRO-1/2/3, a tensor-parallel
plan (each in shard_map and jit), a pipeline from a stage split, and context parallelism through the
attention seam.

    python examples/own_model_jax.py

Runs on 2 simulated CPU devices, trains 3 AdamW steps of each from the same weights and checks every
one against plain single-device training (float64: ~1e-16; the script fails above 1e-12). The glue:

    trainer = parallelize(model, loss, tx, mesh, "zero3", "shard_map")        # dp zero1 zero2 zero3
    trainer = apply_plan(model, PLAN, loss, tx, tp_mesh, "shard_map")         # tp
    trainer = pipeline(model, [["embed", "block"], ["head"]], ce, tx, pp_mesh)   # pp
    trainer = context_parallel(decoder, cp_loss, tx, cp_mesh, "ring")         # cp
    for _ in range(steps):
        trainer.train_step(x, y)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from shared.env import simulate_host_devices  # noqa: E402

simulate_host_devices(2)  # before JAX starts: 2 CPU devices (a GPU machine uses its own)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 parity

from jax_impl.parallel.cp import attention, context_parallel  # noqa: E402
from jax_impl.parallel.fsdp import parallelize  # noqa: E402
from jax_impl.parallel.pp import pipeline  # noqa: E402
from jax_impl.parallel.tp import apply_plan, cross_entropy  # noqa: E402

VOCAB, DIM, SEQ, BATCH, STEPS = 16, 8, 8, 4, 3
F64 = dict(param_dtype=jnp.float64)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs, **F64)
        self.up, self.down = nnx.Linear(DIM, 4 * DIM, rngs=rngs, **F64), nnx.Linear(4 * DIM, DIM, rngs=rngs, **F64)

    def __call__(self, h):  # (B, T, D): pre-norm MLP with biases, residual inside
        return h + self.down(jax.nn.gelu(self.up(self.norm(h)), approximate=False))


class TinyLM(nnx.Module):
    """A user's model whose forward is a chain of submodules (so it also pipelines)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed, self.block = nnx.Embed(VOCAB, DIM, rngs=rngs, **F64), Block(rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs, **F64)

    def __call__(self, tokens):
        return self.head(self.block(self.embed(tokens)))  # (B, T, V)


class TinyDecoder(nnx.Module):
    """The cp seam: attention through jax_impl.parallel.cp.attention (causal), positions as an input."""

    def __init__(self, rngs: nnx.Rngs):
        self.tok, self.pos = nnx.Embed(VOCAB, DIM, rngs=rngs, **F64), nnx.Embed(SEQ, DIM, rngs=rngs, **F64)
        self.attn = nnx.MultiHeadAttention(2, DIM, attention_fn=attention, decode=False, use_bias=False,
                                           rngs=rngs, **F64)
        self.block, self.head = Block(rngs), nnx.Linear(DIM, VOCAB, rngs=rngs, **F64)

    def __call__(self, tokens, positions):
        h = self.tok(tokens) + self.pos(positions)
        return self.head(self.block(h + self.attn(h)))


def loss(model, tokens, targets):  # a mean over the batch rows: each device takes its B/N rows
    return cross_entropy(model(tokens), targets)  # optax's mean CE; vocab-parallel under a TP plan


def cp_loss(model, tokens, targets, positions):  # a mean over the tokens this device holds
    return cross_entropy(model(tokens, positions), targets)


PLAN = {"embed": "vocab_embed", "block.up": "colwise", "block.down": "rowwise", "head": "colwise_vocab"}


def adamw():
    return optax.adamw(1e-2, weight_decay=0.01)  # optax's default decay is 1e-4, torch's 0.01: pass it


def params_of(model) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def single_device(model, loss_of, *batch) -> list[np.ndarray]:
    graphdef, params = nnx.split(model)
    tx = adamw()
    opt_state = tx.init(params)

    @jax.jit  # one program per step, as the wrappers' (eager, every op would be a program of its own)
    def step(params, opt_state):
        grads = jax.grad(lambda p: loss_of(nnx.merge(graphdef, p), *batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(STEPS):
        params, opt_state = step(params, opt_state)
    return params_of(nnx.merge(graphdef, params))


def main() -> int:
    mesh = {axis: jax.make_mesh((2,), (axis,), devices=jax.devices()[:2]) for axis in ("dp", "tp", "pp", "cp")}
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32) for _ in range(2))
    want = single_device(TinyLM(nnx.Rngs(0)), loss, x, y)
    want_cp = single_device(TinyDecoder(nnx.Rngs(0)), cp_loss, x, y, jnp.arange(SEQ))
    runs = [(f"{v} {s}", f"parallelize(model, loss, tx, mesh, {v!r}, {s!r})",
             lambda v=v, s=s: parallelize(TinyLM(nnx.Rngs(0)), loss, adamw(), mesh["dp"], v, s), want)
            for v in ("dp", "zero1", "zero2", "zero3") for s in ("shard_map", "jit")]
    runs += [(f"tp {s}", f"apply_plan(model, PLAN, loss, tx, mesh, {s!r})",
              lambda s=s: apply_plan(TinyLM(nnx.Rngs(0)), PLAN, loss, adamw(), mesh["tp"], s), want)
             for s in ("shard_map", "jit")]
    runs.append(("pp gpipe", 'pipeline(model, [["embed", "block"], ["head"]], ce, tx, mesh)',
                 lambda: pipeline(TinyLM(nnx.Rngs(0)), [["embed", "block"], ["head"]], cross_entropy, adamw(),
                                  mesh["pp"], microbatches=2), want))
    runs += [(f"cp {v}", f"context_parallel(decoder, cp_loss, tx, mesh, {v!r})",
              lambda v=v: context_parallel(TinyDecoder(nnx.Rngs(0)), cp_loss, adamw(), mesh["cp"], v),
              want_cp) for v in ("ring", "ring_zigzag", "ulysses", "seq_sharded")]
    print(f"{'pattern':<16} {'loss step 3':>12} {'max |Δparam|':>13}  glue")
    worst = 0.0
    for name, glue, make, expected in runs:
        trainer = make()
        for _ in range(STEPS):
            last = trainer.train_step(x, y)
        err = max(float(np.max(np.abs(a - b))) for a, b in zip(params_of(trainer.module()), expected))
        worst = max(worst, err)
        print(f"{name:<16} {last:>12.6f} {err:>13.1e}  {glue}")
    ok = worst <= 1e-12  # float64: the same sums split over devices, ~1e-16 per op
    print(f"{'ok' if ok else 'FAILED'}: worst parameter difference {worst:.1e} (limit 1e-12)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
