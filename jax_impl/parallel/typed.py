"""JAX's third mode, sharding in types ("typed"; JAX's own name: Explicit axes), for the ZeRO
stages of ``jax_impl.parallel.fsdp.parallelize(..., style="typed")``, and the helpers the runners
(jax_impl/tp.py, cp.py, ep.py, mesh.py) use too.

The mesh's axes are ``AxisType.Explicit``: every array's sharding is part of its type
(``jax.typeof(w)`` prints ``float64[32@dp,16]``: dim 0 split over 'dp'), ops propagate it by
fixed rules, and where the program wants another layout it says so — ``reshard(x, P(...))``, or
``out_sharding=`` on einsum/dot — or JAX refuses the op at trace time. XLA still picks the
collective each stated change becomes (an all-gather, an all-reduce + slice, a reduce-scatter).

The steps here are ONE function for dp, zero1, zero2, zero3; the variant changes only the types:

    params    dp/zero1/zero2: P() (replicated); zero3: the row-split ones P('dp', None, …)
    batch     P('dp'): every batch array's rows split
    forward   zero3: ``reshard(w, P())`` per row-split parameter, stated at the start of the loss
              (its transpose, in backward, hands the gradient back typed P('dp', None, …))
    gradient  the loss is the global mean: a contraction over the dp-split batch leaves each
              weight's gradient replicated (XLA's all-reduce), zero3: typed like the param
    update    ``reshard(g, rows)`` and ``reshard(w, rows)`` to the moments' layout (zero1: every
              array whose dim 0 N divides; zero2/zero3: the >= 2-D ones; dp: none), AdamW there,
              ``reshard(w_new, P())`` back where the param is replicated (the ZeRO all-gather)

Every ``reshard`` the step issues goes through ``Stated.reshard``, which records at trace time
what was stated (the types in and out, the bytes of the full array): ``Trained.extra["stated"]``,
next to the collectives XLA issued (``Trained.comm``).

No torch twin: sharding in types is JAX's own (Explicit axes); DTensor placements are torch's nearest.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

from jax_impl.parallel import recipe, scaling, theory
from jax_impl.parallel.tree import WrapError, flat_state, put_child, rule, shard_rows, submodules


def explicit_mesh(mesh) -> Mesh:
    """The same devices and axis names, every axis Explicit (sharding in types)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


def spec_text(spec: P) -> str:
    """P('dp', None) as written; a replicated spec as P() (typeof prints P(None, None)); an
    unreduced one as P(unreduced={'tp'})."""
    parts = list(spec.partitions)
    while parts and parts[-1] is None:
        parts.pop()
    words = [repr(s) for s in parts] + ([f"unreduced={set(sorted(spec.unreduced))}"] if spec.unreduced else [])
    return "P(" + ", ".join(words) + ")"


def moves(before: P, after: P) -> str:
    """What a change of layout needs, read from the specs: "reduce" (or "reduce-scatter", when the
    result is split) when an unreduced partial sum is reduced, "all-to-all" when an axis moves from
    one dim to another, "gather" when a split axis is dropped
    (devices need blocks they lack), "slice" when axes are only added (each keeps a part of what it
    holds: no communication), "none" otherwise."""
    if reduced := before.unreduced - after.unreduced:  # scattered when the summed axis splits the result
        split = {ax for a in after.partitions if a for ax in ((a,) if isinstance(a, str) else a)}
        return "reduce-scatter" if reduced & split else "reduce"
    dims = max(len(before.partitions), len(after.partitions))
    pad = lambda s: [((a,) if isinstance(a, str) else tuple(a or ())) for a in (*s, *[None] * (dims - len(s)))]
    b, a = pad(before.partitions), pad(after.partitions)
    dropped = {ax for x, y in zip(b, a, strict=True) for ax in set(x) - set(y)}
    added = {ax for x, y in zip(b, a, strict=True) for ax in set(y) - set(x)}
    if dropped & added:
        return "all-to-all"  # an axis moves from one dim to another
    return "gather" if dropped else "slice" if added else "none"


def rows_like(x: jax.Array, new_dims: int = 1) -> P | None:
    """Under an Explicit-axes trace, ``x``'s spec with ``new_dims`` unsplit dims appended (an
    embedding lookup's out_sharding: ids (B@dp, T) -> vectors (B@dp, T, D)); None elsewhere (jit's
    Auto axes, shard_map's Manual ones), so a model passes it to ``out_sharding=`` unconditionally."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.axis_names or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    return P(*sharding.spec, *[None] * new_dims)


class _StatedEmbed:
    """An nnx.Embed under the typed trace: the lookup of dp-split ids has no inferable layout, so its
    output is stated rows-like the ids (``rows_like``) unless the caller states one; the rest of the
    module (``attend``, ``embedding``) is the Embed's own."""

    def __init__(self, m: nnx.Embed):
        self._m, self._armed = m, False  # armed once in the model: from then on, reading the state refuses

    def _flatten(self):
        """A pytree of nothing while it is put in place; then a refusal: the loss split or mapped the model's
        state (nnx.split / nnx.state / jax.tree over it), where the Embed's table is behind this stand-in,
        so a stop_gradient or a cast over that state would silently miss it (a frozen table trained on)."""
        if not self._armed:
            return (), None
        raise WrapError(
            "typed: the loss read the model's state (nnx.split / nnx.state / a tree map), where the typed step "
            "calls each nnx.Embed through a stand-in that states its lookup's layout, so that state misses the "
            "table. Fix: freeze and mask through the optimizer (optax.multi_transform, mask=), compute_dtype= "
            "for casts, or style='jit'")

    def __call__(self, ids, *args, out_sharding=None, **kwargs):
        return self._m(ids, *args, out_sharding=out_sharding if out_sharding is not None else rows_like(ids), **kwargs)

    def __getattr__(self, name):
        return getattr(self._m, name)


jax.tree_util.register_pytree_node(_StatedEmbed, _StatedEmbed._flatten, lambda aux, children: None)


class Stated:
    """The layout changes a typed step states, recorded while it is traced: ``reshard(x, spec, what)``
    reshards and appends {"what", "from", "to", "bytes"} (the types as ``jax.typeof`` prints them;
    bytes: the full array's, an all-gather's output or an all-reduce's buffer). ``note(what, bytes)``
    records a change stated another way (an ``out_sharding=``, an unreduced sum)."""

    def __init__(self, mesh: Mesh):
        self.mesh, self.entries = mesh, []

    def reshard(self, x: jax.Array, spec: P, what: str) -> jax.Array:
        before = jax.typeof(x)
        out = reshard(x, NamedSharding(self.mesh, spec))
        if str(before) != str(jax.typeof(out)):
            self.entries.append({"what": f"reshard {what} {spec_text(before.sharding.spec)} -> {spec_text(spec)}",
                                 "from": str(before), "to": str(jax.typeof(out)),
                                 "moves": moves(before.sharding.spec, spec),
                                 "bytes": int(np.prod(x.shape)) * x.dtype.itemsize})
        return out

    def note(self, what: str, x: jax.Array, before: str, moves: str) -> None:
        """A change stated otherwise (an out_sharding=, a transpose autodiff writes): ``x`` after it."""
        self.entries.append({"what": what, "from": before, "to": str(jax.typeof(x)), "moves": moves,
                             "bytes": int(np.prod(x.shape)) * x.dtype.itemsize})

    def traced(self, fn: Callable) -> Callable:
        """``fn`` that clears the record each time it is traced (the last trace is the compiled one)."""
        def run(*args):
            self.entries.clear()  # in place: a run's extra["stated"] holds this list
            return fn(*args)
        return run


def summarize(entries: list[dict]) -> dict[str, dict[str, int]]:
    """A run's extra["stated"] by kind of move: {moves: {"count", "bytes"}} (the full arrays' bytes),
    the typed column next to the ledger's {op: {"count", "bytes"}}: each "gather" an all-gather's
    output, each "reduce" an all-reduce's buffer, each "all-to-all" its buffer, if XLA keeps them."""
    out: dict[str, dict[str, int]] = {}
    for e in entries:
        row = out.setdefault(e["moves"], {"count": 0, "bytes": 0})
        row["count"], row["bytes"] = row["count"] + 1, row["bytes"] + e["bytes"]
    return dict(sorted(out.items()))


class InMesh:
    """A jitted step traced and lowered under ``jax.set_mesh(mesh)`` (a bare P in reshard and
    out_sharding needs the mesh in context); ``.lower`` and calls as the jitted function's."""

    def __init__(self, jitted, mesh: Mesh):
        self.jitted, self.mesh = jitted, mesh

    def lower(self, *args):
        """A model op whose layout JAX cannot infer in types is refused here, at the first trace, in one
        line (parallel.tree.WrapError) naming JAX's reason and how to state the layout."""
        with jax.set_mesh(self.mesh):
            try:
                return self.jitted.lower(*args)
            except Exception as e:
                if type(e).__name__ != "ShardingTypeError":
                    raise
                reason = str(e).split("\n")[0]
                raise WrapError(f"typed: the forward cannot be typed on this mesh ({reason}); state that op's layout, "
                                "e.g. nnx.Embed(...)(ids, out_sharding=jax_impl.parallel.typed.rows_like(ids))") from e

    def __call__(self, *args):
        with jax.set_mesh(self.mesh):
            return self.jitted(*args)

    def trace(self, *args):
        """The jitted function's ``trace`` under the mesh; its ``lower(...)`` (e.g. for another
        platform: tests/test_gpu_readiness.py) under the mesh too."""
        with jax.set_mesh(self.mesh):
            traced = self.jitted.trace(*args)
        return _InMeshTraced(traced, self.mesh)


class _InMeshTraced:
    def __init__(self, traced, mesh: Mesh):
        self.traced, self.mesh = traced, mesh

    def lower(self, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.traced.lower(**kwargs)


class TypedTrainer:
    """``parallel.fsdp.Trainer``'s interface (step, state, train_step, full_grads, module,
    compiler_options, shard_batch) for style "typed": see the module docstring."""

    style = "typed"

    def __init__(self, model, loss, tx, mesh, variant: str, axis: str, clip=None, compute_dtype=None,
                 loss_scale=None):
        self.variant, self.axis, self.mesh = variant, axis, explicit_mesh(mesh)
        self.clip, self.compute_dtype = clip, compute_dtype
        self.scaler = scaling.resolve(loss_scale, compute_dtype, f"parallelize {variant}/typed")
        self.per_step = ("skipped", "loss_scale") if self.scaler else ()  # the step's outputs after grads
        self.n = mesh.shape[axis]
        self.graphdef, self._treedef, params = flat_state(model)
        self.keys = list(params)
        row = lambda a: P(axis, *[None] * (a.ndim - 1))
        split = lambda a, v: v != "dp" and rule(a.shape, self.n, v)
        self.sharded = {k for k, a in params.items() if variant in ("zero2", "zero3") and split(a, variant)}
        self.infos = theory.describe(params, self.sharded, [])
        self.param_specs = {k: row(a) if variant == "zero3" and split(a, "zero3") else P() for k, a in params.items()}
        self.row_specs = {k: row(a) if split(a, variant) else P() for k, a in params.items()}
        self._loss, self._tx, self.stated = loss, tx, Stated(self.mesh)
        self.compiler_options = None
        shard = lambda specs: {k: NamedSharding(self.mesh, s) for k, s in specs.items()}
        params = {k: jax.device_put(jax.numpy.copy(a), shard(self.param_specs)[k]) for k, a in params.items()}
        with jax.set_mesh(self.mesh):
            rows = lambda p: {k: reshard(a, self.row_specs[k]) for k, a in p.items()}
            opt_state = jax.jit(lambda p: tx.init(rows(p)))(params)  # moments typed like the rows
        self.state = (params, opt_state)
        if self.scaler:  # the scale state: a third state entry, replicated (parallel.scaling)
            self.state += (jax.device_put(self.scaler.init(), NamedSharding(self.mesh, P())),)
        step = self._step if self.scaler else lambda p, o, *batch: self._step(p, o, None, *batch)[:4]
        self.step = InMesh(jax.jit(self.stated.traced(step), donate_argnums=tuple(range(len(self.state)))),
                           self.mesh)
        self._compiled = None

    def _merge(self, flat: dict):
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._treedef, [flat[k] for k in self.keys]))

    def _batch_loss(self, params: dict, batch: tuple):
        """zero3: the gather of every row-split param stated here, once, as a reshard to P(). Every
        nnx.Embed is called through ``_StatedEmbed``: its lookup's layout stated, the model unedited."""
        full = {k: self.stated.reshard(a, P(), k) if self.param_specs[k] != P() else a for k, a in params.items()}
        model = self._merge(recipe.cast(full, self.compute_dtype))
        for path, m in submodules(model)[0].items():
            if path and isinstance(m, nnx.Embed):
                parent, _, name = path.rpartition(".")
                put_child(submodules(model)[0][parent], name, stand_in := _StatedEmbed(m))
                stand_in._armed = True
        return self._loss(model, *batch)

    def _step(self, params, opt_state, sc, *batch):
        """Scaling (``sc``): the loss times the scale, the gradients divided by it; the finite check
        reads the global gradient tree (XLA reduces it over the shards): agreed by construction."""
        mult = 1.0 if sc is None else sc["scale"]
        (_, loss), grads = jax.value_and_grad(lambda p: ((l := self._batch_loss(p, batch)) * mult, l),
                                              has_aux=True)(params)
        grads = grads if sc is None else self.scaler.unscale(grads, sc)
        for k, s in self.param_specs.items():  # zero3: each gather's transpose, written by autodiff
            if s != P():
                full = f"{grads[k].dtype}[{','.join(map(str, grads[k].shape))}]"
                self.stated.note(f"grad {k} P() -> {spec_text(s)} (the transpose of its reshard, in backward)",
                                 grads[k], full, "slice")  # the sum over dp is the contraction's
        g = {k: self.stated.reshard(a, self.row_specs[k], f"grad {k}") for k, a in grads.items()}
        w = {k: self.stated.reshard(a, self.row_specs[k], k) for k, a in params.items()}
        clipped = g if self.clip is None else recipe.scale_by_norm(g, recipe.sumsq(g), self.clip)
        updates, new_opt = self._tx.update(clipped, opt_state, w)
        new = optax.apply_updates(w, updates)
        if sc is not None:  # a skipped step: the rows and moments as they were
            bad = scaling.nonfinite(g)
            new, opt_state = scaling.keep(bad, (new, new_opt), (w, opt_state))
        else:
            opt_state = new_opt
        new = {k: self.stated.reshard(a, self.param_specs[k], f"updated {k}") for k, a in new.items()}
        if sc is None:
            return new, opt_state, loss, g
        sc = self.scaler.update(sc, bad)
        return new, opt_state, sc, loss, g, bad > 0, sc["scale"]

    # --- for users, as parallel.fsdp.Trainer --------------------------------------------------------

    def shard_batch(self, *arrays) -> tuple:
        return shard_rows(self.mesh, self.axis, arrays)  # the same rows-over-the-axis placement (and refusal)

    def train_step(self, *batch) -> float:
        batch = self.shard_batch(*batch)
        if self._compiled is None:
            self._compiled = self.step.lower(*self.state, *batch).compile()
        out = self._compiled(*self.state, *batch)
        *state, loss, _ = out[:len(out) - len(self.per_step)]
        self.state = tuple(state)
        return float(np.asarray(loss))

    def full_grads(self, grads) -> dict:
        return dict(grads)

    def module(self, params: dict | None = None):
        return self._merge(params if params is not None else self.state[0])

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """The ZeRO traffic of the model wrapped (theory.comm); XLA chooses what it issues."""
        return theory.comm(self.infos, self.variant, self.n, None)

    def state_theory(self) -> dict[str, int]:
        return theory.state(self.infos, self.variant, self.n, "jit")  # zero1: moments split per array

