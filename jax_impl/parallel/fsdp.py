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
The shard_map steps, each stage's collectives: parallel/zero.py (``ZeroSteps``, which ``Trainer`` inherits);
here the Trainer's plumbing (placing the state, building the step, the jit style, the users' methods),
``FromApply`` and ``parallelize``.
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
    WrapError,
    choose_units,
    fetch,
    flat_state,
    key_of,
    param_holders,
    rule,
    shard_rows,
    unit_of,
)
from jax_impl.parallel.zero import ZeroSteps

VARIANTS, STYLES = ("dp", "zero1", "zero2", "zero3"), ("shard_map", "jit", "typed")


FIX = ("use style='jit' or 'typed' (optax sees your whole tree there), or variant 'zero2'/'zero3' where a mask or "
       "labels is the problem (each leaf keeps its path and rank); for global-norm clipping drop it from the chain "
       "and pass clip=max_norm to parallelize (the true norm, every variant and style)")


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


class Trainer(ZeroSteps):
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
        place = lambda specs, tree: {k: jax.device_put(np.asarray(a), NamedSharding(mesh, specs[k]))  # a copy:
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

    # --- the steps ----------------------------------------------------------------------------

    def _build(self, params: dict):
        tx, mesh, ax = self._tx, self.mesh, self.axis
        if self.variant == "zero1" and self.style == "shard_map":
            opt_state = jax.jit(lambda p: tx.init(self._flatten(p)))(params)  # one program, not one per op and shape
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
