"""What the JAX own-model tests share (test_own_model_jax, test_tp_plan_jax, test_cp_seam_jax,
test_pp_seam_jax): the AdamW they all train with, a model's Params by path, and the single-device
reference — plain NNX on one device, the same optimizer and loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_impl.parallel.tree import key_of

STEPS = 3


def adamw():
    return optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def flat(model) -> dict[str, np.ndarray]:
    """{"blocks.0.up.kernel": array} for every Param of ``model``."""
    return {key_of(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}


def train_single(model, loss, *batch) -> tuple[list[float], dict[str, np.ndarray]]:
    """STEPS of AdamW on ``loss(model, *batch)``, one device: (losses, final Params by path)."""
    gdef, params = nnx.split(model)
    tx = adamw()
    opt, losses = tx.init(params), []
    for _ in range(STEPS):
        value, grads = jax.value_and_grad(lambda p: loss(nnx.merge(gdef, p), *batch))(params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return losses, flat(nnx.merge(gdef, params))


class Stacked(nnx.Module):
    """Layers stacked by ``nnx.vmap`` and run by ``nnx.scan`` (Flax's scan-over-layers idiom): ``layers``
    is ONE nnx.Linear (d -> d) holding a (L, d, d) kernel and an (L, d) bias, passed into the scan."""

    def __init__(self, rngs, d: int = 8, layers: int = 2, out: int = 4):
        f64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}
        self.embed = nnx.Linear(d, d, rngs=rngs, **f64)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return nnx.Linear(d, d, rngs=rngs, **f64)

        self.layers = make(rngs)
        self.head = nnx.Linear(d, out, rngs=rngs, **f64)

    def __call__(self, x):  # (B, d) -> (B, out)
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(layer, h):
            return jnp.tanh(layer(h))

        return self.head(body(self.layers, self.embed(x)))
