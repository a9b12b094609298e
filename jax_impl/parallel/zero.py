"""The ZeRO steps under shard_map, by hand: the collectives of ZeRO-0 (dp), -1, -2 and -3 for any Flax
NNX model, as the methods of ``ZeroSteps``, which parallel/fsdp.py's ``Trainer`` inherits (its
plumbing: placing the state, building the jitted step, the jit style, the users' methods).

    dp     _dp_step     every gradient pmean-ed: an all-reduce of Φ·b
    zero1  _zero1_step  the flat padded gradient psum_scatter-ed, AdamW on this device's 1/N of it, the
                        update all_gather-ed: 2·Φ·b
    zero2  _zero_step   each row-split gradient psum_scatter-ed, AdamW on the rows, the rows all_gather-ed;
                        the replicated vectors' gradients in ONE flat psum
    zero3  _zero_step   params, grads and AdamW state as row blocks; each unit's rows all_gather-ed at its
                        call inside jax.checkpoint (``_Gathering``), again in backward; autodiff transposes
                        each gather into its gradient's psum_scatter: 3·Φ·b less what need not re-gather

Bytes per step: parallel/theory.py, from the model wrapped. Papers: ZeRO, Rajbhandari et al. 2020
(arXiv:1910.02054); FSDP, Zhao et al. 2023 (arXiv:2304.11277).

No torch twin: torch's ZeRO stages are wrappers around its module and optimizer (torch_impl/parallel/dp.py
Zero1Optimizer; torch_impl/parallel/fsdp.py FSDP, Zero2); JAX's are these step functions, apart from
fsdp.py's Trainer so that the collectives read on their own.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

from jax_impl.parallel import recipe, scaling
from jax_impl.parallel.tree import ShardReadError, key_of, put_child, submodules, unit_of


class ZeroSteps:
    """The shard_map steps of ``Trainer`` (parallel/fsdp.py), one per ZeRO stage: each ``(params,
    opt_state, scale_state | None, batch) -> (params, opt_state, scale_state, loss, grads, bad)``, run
    inside the step's shard_map over ``self.axis``. They read the Trainer's state (variant, axis, n,
    keys, shapes, sharded, units, clip, _tx) and its helpers (_batch_loss, _merge, _unscale, _skip)."""

    def _local(self, params, batch, share: bool, sc=None):
        """This device's loss and the gradient of its share (loss / N: the psum gives the mean) or of
        the local loss (dp's pmean), w.r.t. varying copies: check_vma would psum invariant ones.
        Scaling: the share times the scale, the gradient divided by it (``_unscale``)."""
        mine = {k: a if k in self.sharded and self.variant == "zero3" else lax.pcast(a, self.axis, to="varying")
                for k, a in params.items()}
        f = self._zero3_loss if self.variant == "zero3" else self._batch_loss
        n, s = self.n if share else 1, 1.0 if sc is None else sc["scale"]
        (_, loss), grads = jax.value_and_grad(lambda p: ((l := f(p, batch)) / n * s, l), has_aux=True)(mine)
        return loss, self._unscale(grads, sc)

    def _agreed(self, grads) -> jax.Array:
        """shard_map: this device's non-finite flag over its gradient pieces, pmax-ed over the axis
        (ONE scalar all-reduce: comm_theory) so every device skips the same step."""
        return lax.pmax(scaling.nonfinite(grads), self.axis)

    def _dp_step(self, params, opt_state, sc, batch):
        # scaling: each device's share (loss / N, psum-ed) so its float16 backward carries the reference's
        # magnitudes (a local mean's would be N× larger and overflow where one device's does not)
        loss, grads = self._local(params, batch, share=sc is not None, sc=sc)
        grads = lax.pmean(grads, self.axis) if sc is None else lax.psum(grads, self.axis)  # all-reduce Φ·b
        # scaling: the sum is whole and equal on every device (an inf anywhere is in it): no collective
        bad = None if sc is None else scaling.nonfinite(grads)
        clipped = grads if self.clip is None else recipe.scale_by_norm(grads, recipe.sumsq(grads), self.clip)
        updates, new_opt = self._tx.update(clipped, opt_state, params)
        params, opt_state, sc = self._skip(bad, sc, (optax.apply_updates(params, updates), new_opt),
                                           (params, opt_state))
        return params, opt_state, sc, loss[None], grads, bad

    def _flatten(self, tree: dict):
        flat = jnp.concatenate([tree[k].reshape(-1) for k in self.keys])  # (Φ,)
        return jnp.pad(flat, (0, -flat.size % self.n))  # (Φ_pad,)

    def _unflatten(self, flat) -> dict:
        sizes = np.cumsum([0] + [int(np.prod(self.shapes[k])) for k in self.keys])
        return {k: flat[a:b].reshape(self.shapes[k]) for k, a, b in zip(self.keys, sizes[:-1], sizes[1:])}

    def _zero1_step(self, params, opt_state, sc, batch):
        loss, grads = self._local(params, batch, share=True, sc=sc)
        g = lax.psum_scatter(self._flatten(grads), self.axis, tiled=True)  # (Φ_pad/N,) of the mean
        shard = g.shape[0]
        w = lax.dynamic_slice_in_dim(self._flatten(params), lax.axis_index(self.axis) * shard, shard)
        bad = None if sc is None else self._agreed(g)
        clipped = g if self.clip is None else recipe.scale_by_norm(g, lax.psum(recipe.sumsq(g), self.axis), self.clip)
        updates, new_opt = self._tx.update(clipped, opt_state, w)
        w, opt_state, sc = self._skip(bad, sc, (optax.apply_updates(w, updates), new_opt), (w, opt_state))
        flat = lax.all_gather(w, self.axis, tiled=True, to="invarying")  # (Φ_pad,)
        return self._unflatten(flat), opt_state, sc, loss[None], g, bad

    def _zero_step(self, params, opt_state, sc, batch):
        """zero2 / zero3: row-split gradients psum_scatter-ed (zero3: by autodiff, the transpose of
        the gathers), the vectors' in ONE flat psum; AdamW on the rows; zero2 gathers them back."""
        loss, grads = self._local(params, batch, share=True, sc=sc)
        rows, vec = [k for k in self.keys if k in self.sharded], [k for k in self.keys if k not in self.sharded]
        if self.variant == "zero2":
            grads |= {k: lax.psum_scatter(grads[k], self.axis, scatter_dimension=0, tiled=True) for k in rows}
        rows_sq = None if self.clip is None else recipe.sumsq([grads[k] for k in rows])  # this device's blocks
        folded = False
        if vec:
            flat = jnp.concatenate([grads[k].reshape(-1) for k in vec])
            if rows_sq is not None and flat.dtype.itemsize >= 4:  # the blocks' Σg² rides in the same psum
                flat = lax.psum(jnp.concatenate([flat, rows_sq.astype(flat.dtype)[None]]), self.axis)
                flat, rows_sq, folded = flat[:-1], flat[-1], True
            else:
                flat = lax.psum(flat, self.axis)  # (Σ vectors,)
            grads |= self._unflatten_some(flat, vec, grads)
        r = lax.axis_index(self.axis)
        mine = {k: lax.dynamic_slice_in_dim(a, r * (a.shape[0] // self.n), a.shape[0] // self.n)
                if k in rows and self.variant == "zero2" else a for k, a in params.items()}
        bad = None if sc is None else self._agreed(grads)  # row blocks and the (whole) vectors
        clipped = grads
        if self.clip is not None:  # row blocks' squares summed over the axis, the replicated vectors' once
            sq = (rows_sq if folded else lax.psum(rows_sq, self.axis)) + recipe.sumsq([grads[k] for k in vec])
            clipped = recipe.scale_by_norm(grads, sq, self.clip)
        updates, new_opt = self._tx.update(clipped, opt_state, mine)
        mine, opt_state, sc = self._skip(bad, sc, (optax.apply_updates(mine, updates), new_opt), (mine, opt_state))
        if self.variant == "zero2":
            mine |= {k: lax.all_gather(mine[k], self.axis, axis=0, tiled=True, to="invarying") for k in rows}
        return mine, opt_state, sc, loss[None], grads, bad

    @staticmethod
    def _unflatten_some(flat, keys: list[str], like: dict) -> dict:
        sizes = np.cumsum([0] + [like[k].size for k in keys])
        return {k: flat[a:b].reshape(like[k].shape) for k, a, b in zip(keys, sizes[:-1], sizes[1:])}

    # --- zero3: each unit gathered at its call -------------------------------------------------

    def _zero3_loss(self, mine: dict, batch: tuple):
        """shard_map/zero3: the root's row blocks gathered now, each unit's at its call."""
        mine = {k: lax.all_gather(a, self.axis, axis=0, tiled=True)
                if k in self.sharded and unit_of(k, self.units) is None else a for k, a in mine.items()}
        model = self._merge(recipe.cast(mine, self.compute_dtype))
        ids = {id(a) for a in jax.tree.leaves(batch)}
        mods, calls = submodules(model)[0], {}

        def record(path, args):  # (calls, re-gathers); a unit fed only by the data, or an Embed,
            arrays = [a for a in jax.tree.leaves(args) if isinstance(a, jax.Array)]  # needs no weight in backward
            again = not all(id(a) in ids for a in arrays) and not isinstance(mods[path], nnx.Embed)
            c, r = calls.get(path, (0, 0))
            calls[path] = (c + 1, r + again)
        for u in self.units:
            if any(unit_of(k, [u]) for k in self.sharded):
                parent, _, name = u.rpartition(".")
                put_child(mods[parent], name, stand_in := _Gathering(mods[u], u, self.sharded, self.axis, record))
                stand_in._armed = True
        try:
            loss = self._loss(model, *batch)
        except (TypeError, ValueError) as e:  # a unit handed to a JAX transform (scan / vmap) instead of called
            if "_Gathering" not in str(e):
                raise
            first = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            raise ShardReadError(f"zero3: a unit was passed into a JAX transform instead of being called ({first}); "
                                 f"units called so far: {sorted(calls)}. Fix: make the module that runs the transform "
                                 "the unit (or leave the stack to the root), or style='jit'") from None
        self.unit_calls = calls
        return loss


class _Gathering:
    """Stands in for a zero3 unit in the merged model: calling it gathers the unit's row blocks
    (inside jax.checkpoint, so the backward gathers again) and calls the unit on full weights."""

    def __init__(self, unit: nnx.Module, path: str, sharded: set[str], axis: str, record: Callable):
        self._unit, self._path, self._sharded, self._axis, self._record = unit, path, sharded, axis, record
        self._armed = False  # set once it is in the model: from then on, reading the state refuses

    def _flatten(self):
        """A pytree of nothing while it is being put in place; then a refusal. The loss split or mapped
        the model's state (nnx.split / nnx.state / jax.tree over it): the unit's weights are not in that
        state (row blocks behind this stand-in), so a cast, a stop_gradient or an L2 term over it would
        silently miss them (a frozen unit trained on: seen)."""
        if not self._armed:
            return (), None
        raise ShardReadError(
            f"zero3: the loss read the model's state (nnx.split / nnx.state / a tree map) where unit "
            f"{self._path!r} stands in for its row blocks, so that state misses its weights. Fix: compute_dtype= "
            "for casts, freeze and mask through the optimizer (optax.multi_transform, mask=), an L2 term through "
            "weight_decay, or style='jit' / 'typed' (the whole model is traced there)")

    def __call__(self, *args, **kwargs):
        self._record(self._path, args)
        gdef, state = nnx.split(self._unit)

        def run(state, *args):
            full = jax.tree_util.tree_map_with_path(
                lambda p, a: lax.all_gather(a, self._axis, axis=0, tiled=True)
                if f"{self._path}.{key_of(p)}" in self._sharded else a, state)  # (R, …) from (R/N, …)
            return nnx.merge(gdef, full)(*args, **kwargs)
        return jax.checkpoint(run, policy=jax.checkpoint_policies.checkpoint_dots)(state, *args)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in recipe.ARRAY_ATTRS:
            raise ShardReadError(f"zero3: {recipe.as_array(self._path, name)}")
        raise ShardReadError(
            f"zero3: {name!r} of unit {self._path!r} ({type(self._unit).__name__}) was read by its parent instead "
            f"of calling the unit; there it is a row block. Make the reader the unit: units=[<the parent's path>]")


jax.tree_util.register_pytree_node(_Gathering, _Gathering._flatten, lambda aux, children: None)
