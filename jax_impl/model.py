"""The shared MLP in JAX: a Flax NNX module, and the same math as plain functions.

- ``MLP`` (``nnx.Module``): ``nnx.Linear`` layers without bias, ``kernel == W_l`` (applied as
  ``x @ W_l``), exact (erf) GELU. ``kernel_axes`` annotates every kernel with
  ``nnx.with_partitioning`` (MaxText style) for the ``jit`` styles, e.g. ``("dp", None)``.
- ``forward`` / ``loss_fn`` take the parameter pytree as a plain list ``[W_0, …, W_{L-1}]``,
  the form the shard_map styles use; ``params_of(model)`` extracts it from the module.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shared.config import Config
from shared.problem import Problem

JAX_DTYPES = {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.bfloat16}


def jax_dtype(cfg: Config):
    return JAX_DTYPES[cfg.dtype]


def gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)  # exact erf GELU, as torch's F.gelu


def forward(params: Sequence[jax.Array], x: jax.Array) -> jax.Array:
    for w in params:  # w: (D, D)
        x = gelu(x @ w)  # (B, D)
    return x


def loss_fn(params: Sequence[jax.Array], x: jax.Array) -> jax.Array:
    return jnp.mean(forward(params, x) ** 2)


def _fixture_init(w: np.ndarray, axes: tuple | None):
    def init(key, shape, dtype):
        assert shape == w.shape, (shape, w.shape)
        return jnp.asarray(w, dtype)

    return nnx.with_partitioning(init, axes) if axes is not None else init


class MLP(nnx.Module):
    def __init__(self, weights: Sequence[np.ndarray], dtype, kernel_axes: tuple | None = None):
        dim = weights[0].shape[0]
        self.layers = nnx.List(
            nnx.Linear(dim, dim, use_bias=False, kernel_init=_fixture_init(w, kernel_axes),
                       dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
            for w in weights
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = gelu(layer(x))  # (B, D)
        return x


def build_model(cfg: Config, problem: Problem, mesh=None, kernel_axes: tuple | None = None) -> MLP:
    """The MLP holding the fixture weights. With ``mesh`` and ``kernel_axes`` the kernels are
    created sharded: the module is built inside ``nnx.jit`` under the mesh, so each device only
    ever holds its shard."""
    if kernel_axes is None:
        return MLP(problem.weights, jax_dtype(cfg))
    with jax.set_mesh(mesh):
        return nnx.jit(lambda: MLP(problem.weights, jax_dtype(cfg), kernel_axes))()


def params_of(model: MLP) -> list[jax.Array]:
    return [layer.kernel[...] for layer in model.layers]


def inputs(cfg: Config, problem: Problem) -> jax.Array:
    return jnp.asarray(problem.inputs, jax_dtype(cfg))  # (B, D)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW with torch semantics. optax's weight_decay default (1e-4) differs from torch's
    (0.01), so every hyper-parameter is passed explicitly."""
    return optax.adamw(cfg.lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)


def to_numpy(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), dtype=np.float64)


def tree_bytes(tree, per_device: bool = False) -> int:
    """Bytes of every array in ``tree``; with ``per_device`` only one device's shard of each."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "dtype") or not getattr(leaf, "shape", ()):
            continue  # skip scalars (step counters), as torch_impl counts tensors only
        shape = leaf.shape
        if per_device and hasattr(leaf, "sharding"):
            shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape)) * jnp.dtype(leaf.dtype).itemsize
    return total
