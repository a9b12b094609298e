"""Your own Flax NNX model under every JAX data-parallel / ZeRO pattern, in both styles.

    python examples/own_model_jax.py

Runs on 2 simulated CPU devices (or your GPUs), trains 3 AdamW steps of each pattern from the same
weights and checks every one against plain single-device training (float64: parity ~1e-16; the
script fails above 1e-12). The glue is one call:

    trainer = parallelize(model, loss, optax.adamw(...), mesh, "zero3", "shard_map")
    for _ in range(steps):
        trainer.train_step(x, y)
    trained = trainer.module()
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

from jax_impl.fsdp_wrapper import parallelize  # noqa: E402

VOCAB, DIM, SEQ, BATCH, STEPS = 16, 8, 6, 4, 3


class TinyLM(nnx.Module):
    """A user's model: embedding, a pre-norm MLP block with biases, LayerNorm, a tied-free head."""

    def __init__(self, rngs: nnx.Rngs):
        f64 = dict(param_dtype=jnp.float64, rngs=rngs)
        self.embed = nnx.Embed(VOCAB, DIM, **f64)
        self.norm = nnx.LayerNorm(DIM, **f64)
        self.up, self.down = nnx.Linear(DIM, 4 * DIM, **f64), nnx.Linear(4 * DIM, DIM, **f64)
        self.head = nnx.Linear(DIM, VOCAB, **f64)

    def __call__(self, tokens):
        h = self.embed(tokens)  # (B, T, D)
        h = h + self.down(jax.nn.gelu(self.up(self.norm(h)), approximate=False))
        return self.head(h)  # (B, T, V)


def loss(model, tokens, targets):  # a mean over the batch rows: each device takes its B/N rows
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()


def adamw():
    return optax.adamw(1e-2, weight_decay=0.01)  # optax's default decay is 1e-4, torch's 0.01: pass it


def params_of(model) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


def single_device(x, y):
    model = TinyLM(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = adamw()
    opt_state = tx.init(params)
    for _ in range(STEPS):
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p), x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params_of(nnx.merge(graphdef, params))


def main() -> int:
    mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32) for _ in range(2))
    want = single_device(x, y)
    print(f"{'pattern':<8} {'style':<10} {'loss step 3':>12} {'max |Δparam|':>13}  glue")
    worst = 0.0
    for variant in ("dp", "zero1", "zero2", "zero3"):
        for style in ("shard_map", "jit"):
            trainer = parallelize(TinyLM(nnx.Rngs(0)), loss, adamw(), mesh, variant, style)  # the glue
            for _ in range(STEPS):
                last = trainer.train_step(x, y)
            err = max(float(np.max(np.abs(a - b))) for a, b in zip(params_of(trainer.module()), want))
            worst = max(worst, err)
            print(f"{variant:<8} {style:<10} {last:>12.6f} {err:>13.1e}  parallelize(model, loss, tx, mesh, "
                  f"{variant!r}, {style!r})")
    ok = worst <= 1e-12  # float64: the same sums split over devices, ~1e-16 per op
    print(f"{'ok' if ok else 'FAILED'}: worst parameter difference {worst:.1e} (limit 1e-12)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
