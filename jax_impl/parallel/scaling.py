"""Dynamic loss scaling for float16 compute under the wrappers of jax_impl/parallel/ (parallelize in every
variant and style, apply_plan, context_parallel, pipeline) and the runners: the twin of torch.amp.GradScaler.
optax has none; this is it. Its torch twin is ``LossScaler`` in torch_impl/parallel/recipe.py (beside the
clipping it must precede), so there is no torch_impl/parallel/scaling.py.

float16 has 5 exponent bits: a gradient entry below 6e-8 flushes to zero in the float16 backward. The
loss is multiplied by ``scale`` before ``grad`` (the float16 backward then carries scale × the true
cotangents), the float32 master gradients divided by it after their reduction (powers of two: exact),
and BEFORE clipping (``clip=`` sees the true gradients). A step whose gradients hold an inf or NaN
anywhere is skipped: parameters and optimizer state (the optax step count included, as torch's
skipped ``optimizer.step()``) stay as they were, the scale is multiplied by ``backoff``; after
``interval`` finite steps in a row it is multiplied by ``growth`` (Micikevicius et al. 2018, "Mixed
Precision Training", arXiv:1710.03740).

The skip must be agreed by every device. Under jit / typed the finite check reads the global gradient
tree (XLA reduces it over the shards itself): global by construction. Under shard_map each device
holds its own piece (zero1's flat slice, zero2/zero3's row blocks): its flag is ``pmax``-ed over the
axis (ONE all-reduce of one float32, 4 bytes: ``comm_theory`` counts it), so all devices skip the same
step. shard_map/dp checks the psum-ed gradient, which is whole and equal on every device (a
non-finite entry on any device makes the sum non-finite everywhere): no collective; nor in
context_parallel, whose gradients leave the ring whole (the transpose's all-reduce).

    scaler = DynamicScale()                      # torch's defaults: 2**16, x2 / 2000 good steps, x0.5
    state = scaler.init()                        # {"scale": f32, "good": i32}, carried by the trainer
    loss * state["scale"] -> grad -> scaler.unscale(g, state); bad = nonfinite(g)   (+ pmax under shard_map)
    params, opt_state = keep(bad, (new_params, new_opt), (params, opt_state)); state = scaler.update(state, bad)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jax_impl.parallel.tree import WrapError


@dataclass(frozen=True)
class DynamicScale:
    """The scale's rule (torch.amp.GradScaler's defaults; shared/recipe.py LOSS_SCALE holds the same)."""

    init_scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000

    def init(self) -> dict:
        return {"scale": jnp.asarray(self.init_scale, jnp.float32), "good": jnp.asarray(0, jnp.int32)}

    def unscale(self, grads, state):
        """The gradients divided by the scale (in their own dtype: float32 master gradients)."""
        return jax.tree.map(lambda g: g / state["scale"].astype(g.dtype), grads)

    def update(self, state, bad) -> dict:
        """After a step: ``bad`` (agreed by every device) halves the scale and resets the count; the
        ``interval``-th good step in a row doubles it (GradScaler's _amp_update_scale_)."""
        good = jnp.where(bad, 0, state["good"] + 1)
        grow = good >= self.interval
        scale = jnp.where(bad, state["scale"] * self.backoff,
                          jnp.where(grow, state["scale"] * self.growth, state["scale"]))
        return {"scale": scale.astype(jnp.float32), "good": jnp.where(grow, 0, good).astype(jnp.int32)}

    def settle(self, state, grads, new, old):
        """The end of a scaled step whose ``grads`` are whole (global arrays, or the same on every device):
        (``new`` or, where any gradient is inf / NaN, ``old``; the next scale state; the flag)."""
        bad = nonfinite(grads)
        return keep(bad, new, old), self.update(state, bad), bad


def resolve(loss_scale, compute_dtype, where: str) -> DynamicScale | None:
    """The wrappers' ``loss_scale=``: a DynamicScale, True (the defaults), False (none), or None — the
    defaults exactly when ``compute_dtype`` is float16 (a float16 backward without scaling underflows)."""
    if loss_scale is None:
        return DynamicScale() if compute_dtype is not None and jnp.dtype(compute_dtype) == jnp.float16 else None
    if loss_scale is True:
        return DynamicScale()
    if loss_scale is False:
        return None
    if isinstance(loss_scale, DynamicScale):
        return loss_scale
    raise WrapError(f"{where}: loss_scale={loss_scale!r}; pass a jax_impl.parallel.scaling.DynamicScale, True "
                    "(torch GradScaler's defaults), False (none) or None (on for compute_dtype=float16)")


@jax.custom_vjp
def scale_cotangent(x, scale):
    """``x`` unchanged; in backward its cotangent times ``scale``: the loss scaled where a step computes
    its gradient by hand (pp's schedules seed the backward per micro-batch) — the same numbers as
    ``loss * scale`` (a power of two, applied before the float16 backward)."""
    return x


def _scale_fwd(x, scale):
    return x, scale


def _scale_bwd(scale, ct):
    return jax.tree.map(lambda c: c * scale.astype(c.dtype), ct), None  # None: no cotangent for the scale


scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


def nonfinite(tree) -> jax.Array:
    """This device's flag: does any leaf hold an inf or NaN? (a float32 0 / 1, ready for pmax)"""
    bad = [jnp.any(~jnp.isfinite(a)) for a in jax.tree.leaves(tree)]
    return jnp.any(jnp.stack(bad)).astype(jnp.float32) if bad else jnp.zeros((), jnp.float32)


def keep(bad, new, old):
    """``old`` where the agreed flag says skip, else ``new`` (every leaf; the optax count too)."""
    return jax.tree.map(lambda n, o: jnp.where(bad > 0, o, n), new, old)
