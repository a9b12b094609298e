"""The models in JAX (Flax NNX modules, and the same math as plain functions), model-generic pieces.

- ``MLP`` (``nnx.Module``): ``nnx.Linear`` layers without bias, ``kernel == W_l`` (applied as
  ``x @ W_l``), exact (erf) GELU. ``Transformer``: jax_impl/transformer.py.
- ``build_model(cfg, problem, mesh, rules)`` builds either; ``rules(name, shape)`` gives each
  parameter's mesh axes (``nnx.with_partitioning``, MaxText style) for the ``jit`` styles.
- Parameters as a pytree: ``named_params(model)`` → ``{name: array}`` keyed like
  ``shared.problem.param_names`` (fixture orientation); ``loss_fn(params, x, y, cfg)`` computes
  either model's loss from such a dict (the MLP also takes a plain list ``[W_0, …]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_impl import transformer
from jax_impl.parallel.tree import fetch
from jax_impl.transformer import Rules, gelu
from shared.config import Config
from shared.problem import Problem

JAX_DTYPES = {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def jax_dtype(cfg: Config):
    """The parameters' (and gradients', optimizer state's) dtype: float32 under mixed precision."""
    return JAX_DTYPES[cfg.param_dtype]


def compute_dtype(cfg: Config):
    """What the model computes in: ``cfg.dtype`` (mixed precision: bfloat16, Flax's ``dtype=`` casts the
    float32 parameters inside every call, so the step's gradients and AdamW stay float32)."""
    return JAX_DTYPES[cfg.dtype]


# Mixed precision: XLA may keep a bf16 value in float32 between fused ops ("excess precision", on by
# default), so where a program rounds to bf16 depends on how XLA fused THAT program: the same math
# rounded differently per program (measured: pp 1F1B's step-0 gradients 2.7e-2 from the reference,
# 5x the split-batch floor). Off, every bf16 op rounds where the program says, and a sharded step
# whose rows are computed by the same ops IS the split-batch run (pp 1F1B, M = 2: bit for bit).
MIXED_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def compiler_options(cfg: Config, options: dict | None = None) -> dict | None:
    """The XLA options a step of ``cfg`` compiles with: ``options`` (a pattern's own), plus
    MIXED_COMPILER_OPTIONS under mixed precision (the reference's steps and every pattern's alike)."""
    if cfg.precision != "mixed":
        return options
    return {**(options or {}), **MIXED_COMPILER_OPTIONS}


def to_compute(cfg: Config, tree):
    """Mixed precision in a hand-written step (tp, pp, cp: the {name: array} forwards): every floating
    leaf of ``tree`` cast to the compute dtype inside the loss, as Flax's ``dtype=`` does in the modules,
    so the gradient flows back through the cast to the float32 master weights. Pure: ``tree`` as it is."""
    if cfg.precision != "mixed":
        return tree
    dtype = compute_dtype(cfg)
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def to_loss(cfg: Config, out: jax.Array) -> jax.Array:
    """The model's output as the loss takes it: mixed precision hands it over in the master dtype
    (float32), as the Flax models' ``logits_dtype`` / ``out_dtype`` do; pure: as it is."""
    return out.astype(jax_dtype(cfg)) if cfg.precision == "mixed" else out


def forward(params: Sequence[jax.Array] | dict, x: jax.Array) -> jax.Array:
    """The MLP over a list [W_0, …] or a {name: W} dict (layer order)."""
    for w in (params.values() if isinstance(params, dict) else params):  # w: (D, D)
        x = gelu(x @ w)  # (B, D)
    return x


def output_loss(out: jax.Array, y: jax.Array | None = None) -> jax.Array:
    """MLP (y None): mean(out²). Transformer: mean cross-entropy of logits (…, V) vs ids (…)."""
    if y is None:
        return jnp.mean(out**2)
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def model_loss(model: nnx.Module, x: jax.Array, y: jax.Array | None = None) -> jax.Array:
    """The project's loss on its NNX model, in the form ``parallel.fsdp.parallelize`` takes any model's:
    ``loss(model, *batch)``. The MoE transformer returns (logits, Σ_l aux_l, load): CE + aux."""
    out = model(x)
    if isinstance(out, tuple):
        return output_loss(out[0], y) + out[1]
    return output_loss(out, y)


def loss_fn(params, x: jax.Array, y: jax.Array | None = None, cfg: Config | None = None) -> jax.Array:
    """Either model's loss from its parameter pytree (the transformer needs ``cfg`` for dh)."""
    if y is None:
        return output_loss(forward(params, x))
    if cfg.moe:  # the MoE transformer: mean CE + Σ_l balancing loss (all experts on this device)
        logits, aux, _ = transformer.apply_moe(params, x, cfg.head_dim, cfg.topk)
        return output_loss(logits, y) + aux
    return output_loss(transformer.apply(params, x, cfg.head_dim), y)


class MLP(nnx.Module):
    def __init__(self, params: dict[str, np.ndarray], dtype, rules: Rules | None = None, param_dtype=None):
        dim = next(iter(params.values())).shape[0]
        self.layers = nnx.List(
            nnx.Linear(dim, dim, use_bias=False, kernel_init=transformer.fixture_init(params, name, rules),
                       dtype=dtype, param_dtype=param_dtype or dtype, rngs=nnx.Rngs(0))
            for name in params
        )
        # mixed precision (param_dtype float32, dtype bf16): the output handed to the loss in float32
        self.out_dtype = param_dtype if param_dtype not in (None, dtype) else None

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = gelu(layer(x))  # (B, D)
        return x if self.out_dtype is None else x.astype(self.out_dtype)


def build_model(cfg: Config, problem: Problem, mesh=None, kernel_axes: tuple | None = None,
                rules: Rules | None = None) -> nnx.Module:
    """The model of ``cfg.model`` holding the fixture parameters. With ``mesh`` and ``rules``
    (name, shape -> mesh axes; ``kernel_axes``: the same axes for every MLP kernel) the
    parameters are created sharded: the module is built inside ``nnx.jit`` under the mesh, so
    each device only ever holds its shard."""
    if kernel_axes is not None:
        rules = lambda name, shape: kernel_axes
    if cfg.model == "mlp":
        make = lambda: MLP(problem.params, compute_dtype(cfg), rules, jax_dtype(cfg))
    else:
        make = lambda: transformer.Transformer(problem.params, cfg.heads, compute_dtype(cfg), rules, cfg.topk,
                                               jax_dtype(cfg))
    if rules is None:
        return make()
    with jax.set_mesh(mesh):
        return nnx.jit(make)()


def named_params(model: nnx.Module) -> dict[str, jax.Array]:
    """{name: array} in shared.problem.param_names order, fixture orientation."""
    if isinstance(model, MLP):
        return {f"layers.{l}.linear.weight": layer.kernel[...] for l, layer in enumerate(model.layers)}
    return transformer.named_params(model)


def module_fixture(graphdef, state) -> list[np.ndarray]:
    """The model ``nnx.merge(graphdef, state)``'s parameters (or a gradient state shaped like them)
    as float64 fixture arrays in param_names order: what a jit step's Setup reports."""
    return [to_numpy(a) for a in named_params(nnx.merge(graphdef, state)).values()]


def spec(rule: Rules, name: str, shape) -> P:
    """A rules function's answer for one parameter as a PartitionSpec."""
    return P(*rule(name, tuple(shape)))


def params_of(model: nnx.Module) -> list[jax.Array]:
    return list(named_params(model).values())


def inputs(cfg: Config, problem: Problem) -> jax.Array:
    """MLP: (B, D) in the run's dtype; transformer: (B, T) int32 token ids."""
    if problem.targets is not None:
        return jnp.asarray(problem.inputs, jnp.int32)
    return jnp.asarray(problem.inputs, jax_dtype(cfg))  # (B, D)


def targets(cfg: Config, problem: Problem) -> jax.Array | None:
    """Transformer: (B, T) next-token ids (int32); MLP: None."""
    return None if problem.targets is None else jnp.asarray(problem.targets, jnp.int32)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW with torch semantics. optax's weight_decay default (1e-4) differs from torch's
    (0.01), so every hyper-parameter is passed explicitly."""
    return optax.adamw(cfg.lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)


def to_numpy(x) -> np.ndarray:
    """An array (a gradient, a parameter, a loss) as float64 NumPy, from any process (``fetch``)."""
    return np.asarray(fetch(x), dtype=np.float64)


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
