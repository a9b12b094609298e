"""Context parallelism for ANY Flax NNX model that offers the attention seam: the twin of
torch_impl/cp_seam.py. cp.py has the pattern (ring, ring_zigzag, ulysses), the collectives and the
bytes; the project's transformer plugs the same ring into its own ``attn`` hook.

What a model must offer (the seam):
  1. its attention through ``cp_seam.attention`` — ``nnx.MultiHeadAttention(..., attention_fn=
     cp_seam.attention)`` — which is CAUSAL attention over (B, T, H, dh) (no mask, no bias, no
     dropout: refused). Outside a cp step it attends over the whole sequence (your single-device
     runs); inside, over this device's T/N positions with the ring (or Ulysses) over "cp".
  2. positions as an input: ``loss(model, *batch, positions)`` gets the GLOBAL position of every
     token it sees (device r's are not 0…T/N−1) and must hand them to the model's position encoding.
  3. a loss that is a mean over the tokens it sees (each device: B·T/N of them).

    trainer = context_parallel(model, loss, optax.adamw(...), mesh, "ring")   # mesh axis "cp"
    loss_value = trainer.train_step(tokens, targets)   # (B, T) each; T split over "cp"

Sharded: every batch array along dim 1 (the sequence; ring_zigzag permutes it on the host so device
r holds chunks r and 2N−1−r), positions P("cp"); every parameter replicated, P(). The shard_map
returns each device's local mean; the step differentiates their mean OUTSIDE the shard_map, so the
replicated weights' gradients come back summed over "cp" by the transpose of the implicit
invariant -> varying cast: an all-reduce of Φ·b. Per attention call (a = one device's K: B·T/N·H·dh·b):
ring 3N−2 collective-permutes of 2a; ulysses 8 all-to-alls of a. jit/seq_sharded: the plain loss
with the sequence split; XLA (GSPMD) picks attention's collectives.
A model that never calls the seam is refused at the first trace (it would attend within its own
T/N tokens only — silently wrong); one that calls it for some attention layers and not others cannot
be detected: route every attention through it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.cp import AXIS, ring_core
from jax_impl.fsdp_wrapper import WrapError, key_of
from jax_impl.model import fetch
from shared.theory import cp_positions

VARIANTS = (("shard_map", "ring"), ("shard_map", "ring_zigzag"), ("shard_map", "ulysses"), ("jit", "seq_sharded"))
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("cp_seam", default=None)  # (variant, n, record)


class SeamError(ValueError):
    """A call of the attention seam, or a model, that context parallelism cannot compute exactly."""


def causal(q, k, v):
    """Causal attention (B, T, H, dh) -> (B, T, H, dh) in the inputs' dtype (not
    jax.nn.dot_product_attention: its logits are float32, which caps float64 parity at ~1e-7)."""
    t = q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))  # (B, H, T, T)
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def attention(query, key, value, bias=None, mask=None, dropout_rate=0.0, deterministic=True, **_):
    """``attention_fn`` for ``nnx.MultiHeadAttention``: causal attention, over "cp" inside a cp step."""
    if bias is not None or mask is not None:
        raise SeamError("cp_seam.attention is causal attention over the global positions; it takes no mask or "
                        "bias (the ring masks by position): call the attention without mask=")
    if dropout_rate and not deterministic:
        raise SeamError("cp_seam.attention has no attention dropout: build the attention with dropout_rate=0")
    active = _ACTIVE.get()
    if active is None:
        return causal(query, key, value)
    variant, n, record = active
    record(key)
    if variant == "ulysses":  # (B, T/N, H, dh) -> (B, T, H/N, dh): all heads' sequence, H/N heads here
        if query.shape[2] % n:
            raise SeamError(f"ulysses splits heads: {query.shape[2]} heads over cp={n}; use ring or H % N == 0")
        to_heads = lambda x: lax.all_to_all(x, AXIS, 2, 1, tiled=True)
        out = causal(to_heads(query), to_heads(key), to_heads(value))  # (B, T, H/N, dh)
        return lax.all_to_all(out, AXIS, 1, 2, tiled=True)  # (B, T/N, H, dh)
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # (B, H, T/N, dh)
    return heads_first(ring_core(variant, n)(*map(heads_first, (query, key, value))))


@contextlib.contextmanager
def _active(variant: str, n: int, record: Callable):
    token = _ACTIVE.set((variant, n, record))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class Trainer:
    """``context_parallel``'s result: ``step(params, opt_state, *batch, positions)``, ``state``,
    ``train_step(*batch)`` (B, T) arrays -> mean loss, ``module()``, ``comm_theory()``."""

    def __init__(self, model, loss, tx, mesh, style, variant):
        self.style, self.variant, self.mesh, self.n = style, variant, mesh, mesh.shape[AXIS]
        self.graphdef, state = nnx.split(model)
        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(state)
        self.keys = [key_of(p) for p, _ in leaves]
        params = {k: jax.device_put(a, NamedSharding(mesh, P())) for k, (_, a) in zip(self.keys, leaves)}
        self.state, self._loss, self._tx = (params, tx.init(params)), loss, tx
        self.calls: list[tuple[int, int]] | None = None  # per seam call at the last trace: (K elements, itemsize)
        self.step = jax.jit(self._step, donate_argnums=(0, 1))
        self._compiled = None

    def _merge(self, flat):
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._treedef, [flat[k] for k in self.keys]))

    def _losses(self, params, *batch):
        """(differentiated, reported): shard_map — the mean of the (N,) local means, and the vector."""
        if self.style == "jit":
            value = self._loss(self._merge(params), *batch)
            return value, value
        calls = []

        def local(params, *batch):
            with _active(self.variant, self.n, lambda k: calls.append((k.size, k.dtype.itemsize))):
                value = self._loss(self._merge(params), *batch)
            if not calls:
                raise SeamError("the model never called cp_seam.attention: each device would attend within its own "
                                "T/N tokens. Build its attention with attention_fn=cp_seam.attention")
            return value[None]
        seq = [P(None, AXIS)] * (len(batch) - 1)
        local_means = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), *seq, P(AXIS)), out_specs=P(AXIS),
                                    check_vma=True)(params, *batch)
        self.calls = calls
        return jnp.mean(local_means), local_means

    def _step(self, params, opt_state, *batch):
        (_, loss), grads = jax.value_and_grad(self._losses, has_aux=True)(params, *batch)
        updates, opt_state = self._tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    def order(self, t: int) -> np.ndarray:
        """The sequence order whose contiguous T/N shards are each device's positions."""
        kind = "ring_zigzag" if self.variant == "ring_zigzag" else "ring"
        chunks = 2 * self.n if kind == "ring_zigzag" else self.n
        if t % chunks:
            raise WrapError(f"cp {self.variant}: sequence length {t} is not divisible by {chunks} "
                            f"({'2·' if kind == 'ring_zigzag' else ''}cp): pad the sequence or change cp")
        return np.concatenate([cp_positions(t, self.n, r, kind) for r in range(self.n)])

    def shard_batch(self, *arrays) -> tuple:
        """(B, T, …) arrays -> their sequence split over "cp" in the variant's order, + positions."""
        order = self.order(arrays[0].shape[1])
        seq = NamedSharding(self.mesh, P(None, AXIS))
        return (*(jax.device_put(jnp.asarray(a)[:, order], seq) for a in arrays),
                jax.device_put(jnp.asarray(order, jnp.int32), NamedSharding(self.mesh, P(AXIS))))

    def train_step(self, *batch) -> float:
        batch = self.shard_batch(*batch)
        if self._compiled is None:
            options = {"xla_disable_hlo_passes": "cse"} if self.variant.startswith("ring") and \
                self.mesh.devices.flat[0].platform == "cpu" else None  # cp.cpu_options: keep the backward hops
            self._compiled = self.step.lower(*self.state, *batch).compile(compiler_options=options)
        *state, loss, _ = self._compiled(*self.state, *batch)
        self.state = tuple(state)
        return float(np.mean(fetch(loss)))

    def module(self):
        return self._merge(self.state[0])

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """op -> (count, bytes) per step per device from the seam calls the last trace saw, and Φ·b."""
        grads = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in self.state[0].values())
        out = {"all_reduce": (1, grads)}
        if self.style == "jit" or not self.calls:
            return out
        n, a = self.n, sum(size * b for size, b in self.calls)  # Σ over calls of one device's K bytes
        if self.variant == "ulysses":
            return out | {"all_to_all": (8 * len(self.calls), 8 * a)}
        return out | {"collective_permute": ((3 * n - 2) * len(self.calls), (3 * n - 2) * 2 * a)} if n > 1 else out


def context_parallel(model: nnx.Module, loss: Callable, tx: optax.GradientTransformation, mesh,
                     variant: str = "ring", style: str | None = None) -> Trainer:
    """Context parallelism over ``mesh``'s "cp" axis for a model with the seam (module docstring)."""
    style = style or ("jit" if variant == "seq_sharded" else "shard_map")
    if (style, variant) not in VARIANTS:
        raise WrapError(f"cp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    if AXIS not in mesh.shape:
        raise WrapError(f"the mesh has axes {tuple(mesh.shape)}, no {AXIS!r}: make one with axis name 'cp'")
    _, _, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise WrapError(f"{type(model).__name__} holds state other than nnx.Param: context_parallel trains Params "
                        "only; build it without BatchNorm / Dropout RNG state")
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return Trainer(model, loss, tx, mesh, style, variant)
