"""The ZeRO stages 0-3 as a train step for any Flax NNX model: the twin of torch_impl/parallel/fsdp.py
(FSDP, Zero2) and torch_impl/parallel/dp.py (BucketedDDP, Zero1Optimizer).

    trainer = parallelize(model, loss, optax.adamw(1e-3, weight_decay=0.01), mesh, "zero3", "shard_map")
    for x, y in batches:
        loss_value = trainer.train_step(x, y)       # rows split over the mesh axis "dp"
    model = trainer.module()                        # the trained nnx.Module, full parameters

``loss(model, *batch)`` must be a MEAN over the batch rows; the model may hold ``nnx.Param`` only.
Sharded (``rule``): a parameter with >= 2 dims whose dim 0 N divides is split in N row blocks; the
others ("vectors") are replicated, their gradients averaged by ONE flat psum.

    dp     params replicated; pmean of every gradient: Φ·b
    zero1  psum_scatter of the flat padded gradient, AdamW on 1/N, all_gather of the update: 2·Φ·b
    zero2  psum_scatter per row-split gradient, AdamW on the rows, all_gather of the rows
    zero3  params, grads, AdamW state as row blocks; each unit (default: every topmost module holding
           a Param) all-gathered before its call inside jax.checkpoint, again in backward where
           needed; all_gather's transpose is the unit's psum_scatter (``units=["blocks.*"]``: per block)
Styles: shard_map (these collectives by hand), jit (shardings; XLA picks), typed (sharding in
types: every layout change a stated reshard, jax_impl/parallel/typed.py). Bytes per step:
parallel/theory.py, from the model wrapped.
Refused before anything compiles (``WrapError``) or at the first trace (``ShardReadError``), with
what, where and how to fix: docs/fsdp.md, "Bring your own model (JAX parallelize)".
Recipe (parallel/recipe.py, docs/recipe.md): ``clip=max_norm`` clips by the WHOLE model's gradient
norm (shard_map zero1/2/3: the pieces' squares psum'ed, replicated leaves once; torch's formula);
``compute_dtype=jnp.bfloat16`` casts the Params inside the step (master weights, optimizer state as
given); float16 adds dynamic loss scaling (parallel/scaling.py: shard_map zero1/2/3 pmax the skip flag).
Under shard_map zero1/2/3 optax sees a flat piece or row blocks: ``recipe.check`` probes ``tx``
first and refuses one that would update otherwise (optax's global-norm clipping, masks / labels on
zero1's flat vector, per-tensor statistics).
Papers: ZeRO, Rajbhandari et al. 2020 (arXiv:1910.02054); FSDP, Zhao et al. 2023 (arXiv:2304.11277).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.parallel import recipe, scaling, theory
from jax_impl.parallel.tree import (
    ShardReadError,
    WrapError,
    choose_units,
    fetch,
    flat_state,
    key_of,
    param_holders,
    put_child,
    rule,
    shard_rows,
    submodules,
    unit_of,
)

VARIANTS, STYLES = ("dp", "zero1", "zero2", "zero3"), ("shard_map", "jit", "typed")


FIX = ("use style='jit' or 'typed' (optax sees your whole tree there), or variant 'zero2'/'zero3' where a mask or "
       "labels is the problem (each leaf keeps its path and rank); for global-norm clipping drop it from the chain "
       "and pass clip=max_norm to parallelize (the true norm, every variant and style)")


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


def cpu_options(mesh, style: str, variant: str) -> dict | None:
    """XLA:CPU settings for zero2/zero3 (GPU / TPU need neither). 1) Its default scheduler starts
    every all-gather at the top of the step (they depend on parameters only), so all gathered
    weights are alive at once; the memory-optimized one frees each after use. 2) It drops
    jax.checkpoint's optimization barriers BEFORE its last CSE pass, which would then merge every
    backward re-gather into its forward gather, keeping W alive from forward to backward."""
    if mesh.devices.flat[0].platform != "cpu" or variant not in ("zero2", "zero3"):
        return None
    options = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    if (style, variant) == ("shard_map", "zero3"):
        options["xla_disable_hlo_passes"] = "cse"
    return options


class Trainer:
    """``parallelize``'s result. ``step(params, opt_state, *batch) -> (params, opt_state, loss,
    grads)`` is the jitted pure step (shard_map: ``loss`` holds each device's local mean); ``state``
    the placed (params, opt_state) — params a {path: array} dict —; ``train_step(*batch)`` runs one
    step on ``state`` and returns the mean loss; ``module()`` the model with the trained parameters."""

    def __init__(self, model, loss, tx, mesh, variant, style, axis, units, clip=None, compute_dtype=None,
                 loss_scale=None):
        self.variant, self.style, self.mesh, self.axis = variant, style, mesh, axis
        self.clip, self.compute_dtype = clip, compute_dtype
        self.scaler = scaling.resolve(loss_scale, compute_dtype, f"parallelize {variant}/{style}")
        self.per_step = ("skipped", "loss_scale") if self.scaler else ()  # the step's outputs after grads
        self.n = mesh.shape[axis]
        self.graphdef, self._treedef, params = flat_state(model)
        self.keys = list(params)
        self.shapes = {k: a.shape for k, a in params.items()}
        self.sharded = {k for k, a in params.items()
                        if variant in ("zero2", "zero3") and rule(a.shape, self.n, variant)}
        self.units = choose_units(model, units) if variant == "zero3" and style == "shard_map" else []
        self._check_tied(model)
        self.unit_calls: dict[str, tuple[int, int]] | None = None  # zero3 shard_map, traced: (calls, re-gathers)
        self._loss, self._tx = loss, tx
        self.infos = theory.describe(params, self.sharded, self.units)
        place = lambda specs, tree: {k: jax.device_put(jnp.copy(a), NamedSharding(mesh, specs[k]))  # a copy:
                                     for k, a in tree.items()}  # the step donates it, the model keeps its own
        self.param_specs = {k: P(axis) if variant == "zero3" and k in self.sharded else P() for k in params}
        layout = None if style != "shard_map" or variant == "dp" else (
            recipe.Flat(self.n) if variant == "zero1" else recipe.Rows(self.n, variant))
        recipe.check(tx, params, layout, f"parallelize {variant}/{style}", FIX)
        params = place(self.param_specs, params)
        self._build(params)
        self.compiler_options = cpu_options(mesh, style, variant)
        self._compiled = None

    def _row_spec(self, shape) -> P:
        """Where gradients and moments live: zero1 any dim 0 N divides, zero2/3 the >= 2-D rows."""
        if self.variant == "dp":
            return P()
        return P(self.axis) if rule(tuple(shape), self.n, self.variant) else P()

    def _check_tied(self, model):
        if not self.units:
            return
        for paths in param_holders(model).values():
            owners = {unit_of(p + ".x", self.units) for p in paths}
            if len(paths) > 1 and len(owners) > 1:
                raise WrapError(f"zero3: one Param is held by {', '.join(repr(p) for p in paths)} in different units "
                                "(tied); put its holders in one unit, e.g. their common parent")

    # --- the merged model and the loss --------------------------------------------------------

    def _merge(self, flat: dict):
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._treedef, [flat[k] for k in self.keys]))

    def _batch_loss(self, flat: dict, batch: tuple):
        return self._loss(self._merge(recipe.cast(flat, self.compute_dtype)), *batch)

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

    # --- the steps ----------------------------------------------------------------------------

    def _build(self, params: dict):
        tx, mesh, ax = self._tx, self.mesh, self.axis
        if self.variant == "zero1" and self.style == "shard_map":
            opt_state = tx.init(self._flatten(params))
            o_specs = jax.tree.map(lambda a: P(ax) if a.ndim else P(), opt_state)
        else:
            shapes = jax.eval_shape(tx.init, params)
            o_specs = jax.tree.map(lambda a: self._row_spec(a.shape) if a.ndim else P(), shapes)
            opt_state = jax.jit(tx.init, out_shardings=jax.tree.map(partial(NamedSharding, mesh), o_specs))(params)
        opt_state = jax.device_put(opt_state, jax.tree.map(partial(NamedSharding, mesh), o_specs))
        scaled = self.scaler is not None  # the scale state rides as a third state entry, replicated
        self.state = (params, opt_state) + ((jax.device_put(self.scaler.init(), NamedSharding(mesh, P())),)
                                            if scaled else ())
        ns = len(self.state)
        s_specs = (jax.tree.map(lambda _: P(), self.state[2]),) if scaled else ()
        g_specs = {k: self._row_spec(a.shape) for k, a in params.items()}
        if self.style == "jit":
            self.grad_specs = g_specs
            shard = lambda specs: jax.tree.map(partial(NamedSharding, mesh), specs)
            self.step = jax.jit(lambda *a: self._outputs(self._jit_step, a), donate_argnums=tuple(range(ns)),
                                out_shardings=(shard(self.param_specs), shard(o_specs), *map(shard, s_specs), None,
                                               shard(g_specs), *[None] * len(self.per_step)))
            return
        body = {"dp": self._dp_step, "zero1": self._zero1_step, "zero2": self._zero_step, "zero3": self._zero_step}
        self.grad_specs = P(ax) if self.variant == "zero1" else (
            g_specs if self.variant != "dp" else {k: P() for k in params})

        def step(*args):
            body_map = jax.shard_map(lambda *a: self._outputs(body[self.variant], a), mesh=mesh, check_vma=True,
                                     in_specs=(self.param_specs, o_specs, *s_specs, *[P(ax)] * (len(args) - ns)),
                                     out_specs=(self.param_specs, o_specs, *s_specs, P(ax), self.grad_specs,
                                                *[P()] * len(self.per_step)))
            return body_map(*args)
        self.step = jax.jit(step, donate_argnums=tuple(range(ns)))

    def _outputs(self, body, args):
        """``body(params, opt_state, scale_state | None, batch) -> (params, opt_state, scale_state, loss,
        grads, bad)`` as the step's flat outputs: the scale state after the optimizer's, (skipped, scale)
        after the gradients (``per_step``) when scaling."""
        sc = args[2] if self.scaler else None
        params, opt_state, sc, loss, grads, bad = body(args[0], args[1], sc, args[3 if self.scaler else 2:])
        if not self.scaler:
            return params, opt_state, loss, grads
        return params, opt_state, sc, loss, grads, bad > 0, sc["scale"]

    def _skip(self, bad, sc, new: tuple, old: tuple):
        """Scaling: ``old`` (params, optimizer state) where the agreed flag says skip, and the next scale."""
        if sc is None:
            return (*new, None)
        return (*scaling.keep(bad, new, old), self.scaler.update(sc, bad))

    def _jit_step(self, params, opt_state, sc, batch):
        """XLA inserts the collectives: the loss is the global mean; gradients and moments laid out
        by the rules, the parameters by theirs (out_shardings). Scaling: the finite check reads the
        global gradient tree (XLA reduces it over the shards): every device agrees by construction."""
        mult = 1.0 if sc is None else sc["scale"]
        (_, loss), grads = jax.value_and_grad(lambda p: ((l := self._batch_loss(p, batch)) * mult, l),
                                              has_aux=True)(params)
        grads = self._unscale(grads, sc)
        where = {k: NamedSharding(self.mesh, s) for k, s in self.grad_specs.items()}
        grads = lax.with_sharding_constraint(grads, where)
        bad = None if sc is None else scaling.nonfinite(grads)
        clipped = grads if self.clip is None else recipe.scale_by_norm(grads, recipe.sumsq(grads), self.clip)
        updates, new_opt = self._tx.update(clipped, opt_state, params)
        params, opt_state, sc = self._skip(bad, sc, (optax.apply_updates(params, updates), new_opt),
                                           (params, opt_state))
        return params, opt_state, sc, loss, grads, bad

    def _unscale(self, grads, sc):
        """Scaling: the gradients divided by the scale, before any reduction (a power of two: exact, so
        the same numbers as torch's unscale after its all-reduce), before clipping."""
        return grads if sc is None else self.scaler.unscale(grads, sc)

    def _agreed(self, grads) -> jax.Array:
        """shard_map: this device's non-finite flag over its gradient pieces, pmax-ed over the axis
        (ONE scalar all-reduce: comm_theory) so every device skips the same step."""
        return lax.pmax(scaling.nonfinite(grads), self.axis)

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

    # --- for users ----------------------------------------------------------------------------

    def shard_batch(self, *arrays) -> tuple:
        """Each array's rows split over the axis (dim 0 must divide by N)."""
        return shard_rows(self.mesh, self.axis, arrays)

    def train_step(self, *batch) -> float:
        """One step on ``self.state``; returns the mean loss over the whole batch."""
        batch = self.shard_batch(*batch)
        if self._compiled is None:
            self._compiled = self.step.lower(*self.state, *batch).compile(compiler_options=self.compiler_options)
        out = self._compiled(*self.state, *batch)
        *state, loss, _ = out[:len(out) - len(self.per_step)]
        self.state = tuple(state)
        return float(np.mean(fetch(loss)))

    def full_grads(self, grads) -> dict:
        """The step's ``grads`` output as {path: full array} (zero1: the flat mean, unflattened)."""
        if self.variant == "zero1" and self.style == "shard_map":
            return self._unflatten(jnp.asarray(fetch(grads)))  # fetch: from any process (jax.distributed)
        return dict(grads)

    def module(self, params: dict | None = None):
        """The model holding ``params`` (default: the trained ones), full arrays."""
        return self._merge(params if params is not None else self.state[0])

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """op -> (count, payload bytes) per step per device, from the model wrapped (shard_map: what
        the ledger records; jit: the same ZeRO traffic, XLA may choose otherwise)."""
        out = theory.comm(self.infos, self.variant, self.n, self.unit_calls)
        if self.scaler is not None and self.style == "shard_map" and self.variant != "dp" and out:
            c, b = out.get("all_reduce", (0, 0))  # the agreed non-finite flag: one float32 pmax (parallel.scaling)
            out["all_reduce"] = (c + 1, b + 4)
        if self.clip is not None and self.style == "shard_map" and self.variant != "dp" and out:
            c, b = out.get("all_reduce", (0, 0))  # the global norm's psum: one scalar, float32 or wider
            dtype = lambda keys: jnp.result_type(*[self.state[0][k].dtype for k in keys])
            vec = [k for k in self.keys if k not in self.sharded]
            if self.variant != "zero1" and vec and np.dtype(dtype(vec)).itemsize >= 4:  # in the vectors' psum
                out["all_reduce"] = (c, b + np.dtype(dtype(vec)).itemsize)
            else:
                out["all_reduce"] = (c + 1, b + np.dtype(jnp.promote_types(dtype(self.keys), jnp.float32)).itemsize)
        return out

    def state_theory(self) -> dict[str, int]:
        return theory.state(self.infos, self.variant, self.n, self.style)


class FromApply(nnx.Module):
    """A parameter pytree and ``apply(params, *inputs)`` as an NNX model, for ``parallelize`` (and
    parallel.cp / parallel.pp): ``parallelize(FromApply(params, apply), loss, …)``; ``.pytree()`` gives the
    parameters back in the same structure. Under zero3 it is one unit: the root gathers it whole."""

    def __init__(self, params, apply: Callable):
        self.params = nnx.data(jax.tree.map(nnx.Param, params))
        self.apply = apply

    def pytree(self):
        return jax.tree.map(lambda v: v[...], self.params, is_leaf=lambda v: isinstance(v, nnx.Param))

    def __call__(self, *inputs):
        return self.apply(self.pytree(), *inputs)


def parallelize(model: nnx.Module, loss: Callable, tx: optax.GradientTransformation, mesh, variant: str = "dp",
                style: str = "shard_map", axis: str = "dp", units: Sequence[str] | None = None, *,
                clip: float | None = None, compute_dtype=None, loss_scale=None) -> Trainer:
    """A ZeRO ``variant`` of ``model`` over ``mesh``'s ``axis`` in ``style``; see the module docstring.
    ``clip``: global-norm clipping with the true norm (parallel.recipe); ``compute_dtype``: the loss
    sees the floating Params cast to it (bf16 compute), master weights and optimizer state stay as given.
    ``loss_scale``: dynamic loss scaling (parallel.scaling; on by default for compute_dtype=float16, or a
    model that computes in float16 itself: pass True); its state is ``trainer.state[2]``.
    The trainer trains a COPY of the model's arrays (its jitted step donates them): ``model`` stays
    usable, with its initial weights, and can be parallelized again; ``trainer.module()`` is the
    trained model. The copy costs one model's parameters of memory while the trainer is built."""
    recipe.check_clip(clip, "parallelize", tx)
    if variant not in VARIANTS or style not in STYLES:
        raise WrapError(f"unknown variant/style {variant}/{style}: choose a variant from {VARIANTS}, "
                        f"a style from {STYLES}")
    if axis not in mesh.shape:
        raise WrapError(f"the mesh has axes {tuple(mesh.shape)}, no {axis!r}: pass axis=<one of them>")
    _, _, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        bad = sorted({key_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(rest)[0]})
        raise WrapError(f"{type(model).__name__} holds state other than nnx.Param ({', '.join(bad[:4])}…): parallelize "
                        "trains Params only; build it without BatchNorm / Dropout RNG state")
    if units is not None and (variant != "zero3" or style != "shard_map"):
        raise WrapError("units= is for shard_map/zero3 (the only step that gathers per unit)")
    if style == "typed":  # sharding in types: an Explicit-axes copy of the mesh (jax_impl/parallel/typed.py)
        from jax_impl.parallel.typed import TypedTrainer

        return TypedTrainer(model, loss, tx, mesh, variant, axis, clip, compute_dtype, loss_scale)
    # jax.make_mesh's default axes are Explicit (sharding in types); these steps place arrays with
    # Auto axes (shardings are hints XLA propagates): the same devices, re-typed.
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return Trainer(model, loss, tx, mesh, variant, style, axis, units, clip, compute_dtype, loss_scale)
