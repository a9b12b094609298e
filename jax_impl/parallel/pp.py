"""Pipeline parallelism (GPipe, 1F1B) for ANY Flax NNX model that offers a stage split: the twin of
torch_impl/parallel/pp.py. jax_impl/pp.py has the pattern (the circular SPMD pipeline, 1F1B, ZB-H1 by hand) for the
project's stacked blocks; here the stages may differ in everything but the message between them.

What a model must offer (the seam): a forward that IS a chain of submodules, given as module paths
per stage — ``stages=[["embed", "blocks.0"], ["blocks.1", "norm", "head"]]`` — so that
``model(x) == head(norm(blocks.1(blocks.0(embed(x)))))``; ``parallelize`` checks that equality on
the first micro-batch and refuses a model whose forward is something else. Every Param must belong
to one stage (a tie across stages is refused). Every stage boundary carries the same activation
shape and dtype (the "message"); the loss is ``loss(output, *targets)`` on the last stage's output,
a mean over the micro-batch's rows.

    trainer = pipeline(model, stages, loss, optax.adamw(...), mesh, microbatches=4)   # axis "pp"
    loss_value = trainer.train_step(x, y)
    pipeline(..., schedule="1f1b")   # at most min(S, M) micro-batches' activations per stage, not M

Sharded: each stage's Params flattened into ONE vector, zero-padded to the longest stage's length,
stacked (S, Φ_max) and split over "pp": device s holds stage s's parameters and AdamW moments (the
padding is zero, gets zero gradients and stays zero under AdamW, which is elementwise). The batch is
cut into M micro-batches, replicated. Device s runs its stage by ``lax.switch`` on the device index (the
stages are different programs).
  gpipe  the circular GPipe of jax_impl/pp.py — M + S − 1 iterations; in iteration t device s runs micro-batch
         t − s and the message moves s → s+1 (``ppermute``); bubbles compute on stale inputs and are masked
         to zero (zero value, zero gradient). Backward: jax.grad of the unrolled schedule, every shift
         transposed: all M micro-batches' residuals live at once.
  1f1b   jax_impl/parallel/pp_schedules.run, the runner's 1F1B by hand, one program per stage: 2·(M + S − 1) unit
         ticks; F(mb) = jax.vjp of stage s with respect to its weights (read from the packed row outside
         the vjp, so not stashed), its residuals stashed until B(mb) pulls the incoming gradient back,
         through the read into the packed row, and sends dx to s−1. At most min(S − s, M) micro-batches
         stashed on stage s; SPMD: every device allocates min(S, M) slots of the largest stage's residuals.
Collectives per step per device: collective-permutes of one message — GPipe 2·(M + S − 2), 1F1B one per tick
in which some stage sends (M + 2 at S = 2, 2·(M + S − 1) − 1 at S ≥ 3) — plus the all-reduce of the (S,)
per-stage losses' sum (one element per device).

The optimizer sees the packed (S, Φ_max) array, not the model's tree: ``recipe.check`` refuses, before
anything compiles, a ``tx`` that would update otherwise (masks, multi_transform labels: no paths in a
packed row). Global-norm clipping is exact (the whole packed gradient; padding zero): ``clip=max_norm``
uses torch's formula (parallel/recipe.py, docs/recipe.md). ``compute_dtype=jnp.bfloat16``: the stages
compute in bf16 from the float32 packed master (cast inside each micro-batch's stage call), the
messages travel in bf16, the loss is summed in the master dtype; float16 adds dynamic loss scaling
(parallel/scaling.py; the packed gradient is global: XLA all-reduces the skip flag), GPipe only (1F1B's
by-hand backward would need the scale inside its schedule: refused in one line).
Papers: GPipe, Huang et al. 2019 (arXiv:1811.06965); 1F1B, Narayanan et al. 2021 (arXiv:2104.04473).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.parallel import pp_schedules, recipe, scaling
from jax_impl.parallel.tree import WrapError, fetch, key_of, param_holders, stacked, submodules

AXIS = "pp"
SCHEDULES = ("gpipe", "1f1b")


class Stage:
    """One stage: its modules (path, graphdef, treedef, shapes) packed into one flat vector."""

    def __init__(self, model, paths: Sequence[str], mods: dict, compute_dtype=None):
        self.paths, self.parts, self.compute_dtype = list(paths), [], compute_dtype
        for p in self.paths:
            gdef, state = nnx.split(mods[p])
            leaves, treedef = jax.tree_util.tree_flatten(state)
            self.parts.append((gdef, treedef, [(a.shape, a.dtype) for a in leaves]))
        self.values = [a for p in self.paths for a in jax.tree.leaves(nnx.split(mods[p])[1])]
        self.keys = [f"{p}.{key_of(k)}" for p in self.paths
                     for k, _ in jax.tree_util.tree_flatten_with_path(nnx.split(mods[p])[1])[0]]
        self.size = sum(int(np.prod(s)) for part in self.parts for s, _ in part[2])

    def pack(self, length: int, dtype) -> jax.Array:
        flat = jnp.concatenate([jnp.ravel(a).astype(dtype) for a in self.values] + [jnp.zeros(0, dtype)])
        return jnp.pad(flat, (0, length - self.size))  # (Φ_max,)

    def leaves(self, flat: jax.Array, cast: bool = True) -> list[list[jax.Array]]:
        """Per module, its parameter arrays read from ``flat`` (Φ_max,), the floating ones in
        ``compute_dtype`` where given and ``cast`` (the cast inside the step: the gradient flows back to
        ``flat``); ``cast=False``: in their own dtypes (the trained model)."""
        out, at = [], 0
        for _, _, shapes in self.parts:
            out.append([])
            for shape, dtype in shapes:
                n = int(np.prod(shape))
                if cast and self.compute_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                    dtype = self.compute_dtype
                out[-1].append(flat[at:at + n].reshape(shape).astype(dtype))
                at += n
        return out

    def modules(self, flat: jax.Array, cast: bool = True) -> list:
        """The stage's modules holding the parameters read from ``flat`` (``leaves``)."""
        return self.assemble(self.leaves(flat, cast))

    def assemble(self, leaves: list[list[jax.Array]]) -> list:
        return [nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, ls))
                for (gdef, treedef, _), ls in zip(self.parts, leaves)]

    def __call__(self, flat, h):
        return self.apply(self.leaves(flat), h)

    def apply(self, leaves, h):
        for m in self.assemble(leaves):
            h = m(h)
        return h


def _check(model, stages: Sequence[Sequence[str]]) -> dict:
    mods = submodules(model)[0]
    listed = [p for stage in stages for p in stage]
    for p in listed:
        if p not in mods or not p:
            raise WrapError(f"pp: {p!r} is not a submodule path of {type(model).__name__} "
                            f"(some: {', '.join(q for q in mods if q)[:200]}); fix the stage list")
        if listed.count(p) > 1:
            raise WrapError(f"pp: {p!r} is listed twice; each module runs in one stage")
    layered = stacked(model)
    for p in listed:
        held = next((q for q in layered if p == q or p.startswith(q + ".")), None)
        if held is not None:
            raise WrapError(f"pp: stage module {p!r}: {layered[held]}; the chain calls each listed module on the "
                            "message, a stacked module runs only inside its parent's nnx.scan. Fix: list the "
                            "parent that runs the scan (the stack stays in one stage) or unstack it into an nnx.List")
    covered = lambda key: any(key == q or key.startswith(q + ".") for q in listed)
    state = nnx.state(model, nnx.Param)
    missing = [key_of(k) for k, _ in jax.tree_util.tree_flatten_with_path(state)[0] if not covered(key_of(k))]
    if missing:
        raise WrapError(f"pp: Param {missing[0]!r} is in no stage (every Param must be in one: a bare Param on the "
                        "root cannot be pipelined; move it into a submodule listed in a stage)")
    stage_of = {q: i for i, stage in enumerate(stages) for q in stage}
    owner = lambda path: next((stage_of[q] for q in listed if path == q or path.startswith(q + ".")), None)
    for paths in param_holders(model).values():
        if len({owner(p) for p in paths}) > 1:
            raise WrapError(f"pp: one Param is held by {', '.join(map(repr, paths))} in different stages (tied); "
                            "put its users in one stage or untie it")
    return mods


class Trainer:
    """``pipeline``'s result: ``step(params, opt_state, xs, *ys)``, ``state``, ``train_step(x, *y)``,
    ``module()``, ``comm_theory()``."""

    def __init__(self, model, stages, loss, tx, mesh, microbatches, clip=None, compute_dtype=None, schedule="gpipe",
                 loss_scale=None):
        self.model, self.loss, self.tx, self.mesh, self.m, self.clip = model, loss, tx, mesh, microbatches, clip
        self.scaler = scaling.resolve(loss_scale, compute_dtype, "pp")
        self.per_step = ("skipped", "loss_scale") if self.scaler else ()  # the step's outputs after grads
        self.n = mesh.shape[AXIS]
        self.schedule = schedule if self.n > 1 else "gpipe"  # one stage: no pipeline, nothing to order
        self.stash = {}  # 1f1b: the stash's sizes (pp_schedules.run), filled when the step is traced
        if self.scaler and self.schedule != "gpipe":
            raise WrapError("pp: float16 loss scaling is built for schedule='gpipe' only (1F1B's backward by hand "
                            "would need the scale inside its schedule): use schedule='gpipe' with compute_dtype="
                            "jnp.float16")
        if len(stages) != self.n:
            raise WrapError(f"pp: {len(stages)} stages for a mesh with pp={self.n}: give one module list per device")
        mods = _check(model, stages)
        self.stages = [Stage(model, paths, mods, compute_dtype) for paths in stages]
        self.compute_dtype = compute_dtype
        dtype = jnp.result_type(*[a.dtype for s in self.stages for a in s.values])
        self.length = max(s.size for s in self.stages)
        recipe.check(tx, {k: a for s in self.stages for k, a in zip(s.keys, s.values)}, self._layout(dtype), "pp",
                     "pass the optimizer a whole-tree layout sees: the same recipe under parallelize(..., style="
                     "'jit') or apply_plan; for global-norm clipping pipeline(..., clip=max_norm)")
        packed = jnp.stack([s.pack(self.length, dtype) for s in self.stages])  # (S, Φ_max)
        params = jax.device_put(packed, NamedSharding(mesh, P(AXIS)))
        opt_state = tx.init(params)
        where = jax.tree.map(lambda a: NamedSharding(mesh, P(AXIS) if a.ndim else P()), opt_state)
        self.state = (params, jax.device_put(opt_state, where))
        if self.scaler:  # the scale state: a third state entry, replicated (parallel.scaling)
            self.state += (jax.device_put(self.scaler.init(), NamedSharding(mesh, P())),)
        self.message = None  # ShapeDtypeStruct of the activation between stages, set by shard_batch
        step = self._step if self.scaler else lambda p, o, *batch: self._step(p, o, None, *batch)[:4]
        self.step = jax.jit(step, donate_argnums=tuple(range(len(self.state))))
        self._compiled = None

    def _layout(self, dtype) -> recipe.Layout:
        """What optax sees: ONE (S, Φ_max) array, each stage's Params flattened into its row."""
        shapes = {}

        def to(tree):
            shapes.update({k: np.shape(a) for k, a in tree.items()})
            rows = [np.concatenate([np.ravel(tree[k]) for k in s.keys] + [np.zeros(0)]) for s in self.stages]
            return np.stack([np.pad(r, (0, max(map(len, rows)) - len(r))) for r in rows]).astype(dtype)

        def back(packed):
            out = {}
            for s, row in zip(self.stages, packed):
                at = 0
                for k in s.keys:
                    out[k], at = row[at:at + int(np.prod(shapes[k]))].reshape(shapes[k]), at + int(np.prod(shapes[k]))
            return out
        return recipe.Whole(f"optax sees ONE packed ({self.n}, Φ_max) array, each stage's Params flattened "
                            "into its row, not your tree", to, back, self.n)

    def _split(self, a):
        if a.shape[0] % self.m:
            raise WrapError(f"pp: batch dim 0 = {a.shape[0]} is not divisible by microbatches={self.m}")
        return jnp.asarray(a).reshape(self.m, a.shape[0] // self.m, *a.shape[1:])  # (M, B/M, …)

    def shard_batch(self, x, *ys) -> tuple:
        """(B, …) arrays -> (M, B/M, …) micro-batches, replicated; checks the chain and the messages once."""
        xs, yss = self._split(x), [self._split(y) for y in ys]
        if self.message is None:
            self._check_chain(xs[0], [y[0] for y in yss])
        rep = NamedSharding(self.mesh, P())
        return tuple(jax.device_put(a, rep) for a in (xs, *yss))

    def _check_chain(self, x, ys):
        h, shapes = x, []
        flats = [s.pack(self.length, self.state[0].dtype) for s in self.stages]
        for s, (stage, flat) in enumerate(zip(self.stages, flats)):
            try:
                h = stage(flat, h)
            except Exception as e:  # noqa: BLE001 - a module fed what its forward never gives it
                layered = stacked(self.model)  # a listed module holding scan/vmap-stacked layers: name it as the cause
                inside = [(p, why) for p in stage.paths for q, why in layered.items()
                          if q == p or q.startswith(p + ".")]
                if inside:
                    p, why = inside[0]
                    raise WrapError(f"pp: stage {s}'s module {p!r} holds stacked layers ({why}), and calling it on the "
                                    f"message fails ({type(e).__name__}: {str(e)[:120]}): stacked layers run only "
                                    "inside the nnx.scan of the module that owns them. Fix: list that module (its "
                                    "whole stack in one stage) or unstack the layers into an nnx.List") from None
                raise WrapError(f"pp: the chain of the stages' modules fails at stage {s} ({type(e).__name__}: "
                                f"{str(e)[:160]}): the model's forward is not the chain module(…module(x)) (e.g. two "
                                "embeddings added, a tied head): list every module its forward calls, in order, "
                                "or wrap the non-chain parts into one module") from None
            shapes.append(jax.ShapeDtypeStruct(h.shape, h.dtype))
        if len(set(shapes[:-1])) > 1:
            raise WrapError(f"pp: the stage boundaries carry different activations {shapes[:-1]}: a pipeline sends one "
                            "message shape; move the modules that change it into the first or the last stage")
        whole = self.model(x) if self.compute_dtype is None else \
            nnx.merge(*_cast_state(nnx.split(self.model), self.compute_dtype))(x)  # the chain's casts
        if whole.shape != h.shape or not bool(jnp.all(whole == h)):
            raise WrapError("pp: the chain of the stages' modules does not give model(x) (the model's forward does "
                            "more than call them in this order): list every module its forward calls, in order")
        self.message = shapes[0] if self.n > 1 else None

    def _step(self, params, opt_state, sc, xs, *ys):
        """Scaling (``sc``, GPipe only): the loss times the scale, the gradients divided by it; the packed
        gradient is a global (S, Φ_max) array, so the finite check over it is global (XLA's all-reduce of
        the flag)."""
        if self.schedule == "gpipe":
            mult = 1.0 if sc is None else sc["scale"]

            def total(params):
                value = jnp.sum(self._losses(params, xs, *ys))  # the last stage's; the others' are 0
                return value * mult, value
            (_, value), grads = jax.value_and_grad(total, has_aux=True)(params)
            grads = grads if sc is None else self.scaler.unscale(grads, sc)
        else:  # 1F1B: the gradient is computed inside the schedule (no scaling: refused in pipeline())
            losses, grads = self._scheduled(params, xs, *ys)
            value = jnp.sum(losses)
        clipped = grads if self.clip is None else recipe.scale_by_norm(grads, recipe.sumsq(grads), self.clip)
        updates, new_opt = self.tx.update(clipped, opt_state, params)
        new = optax.apply_updates(params, updates)
        if sc is None:
            return new, new_opt, value, grads, None, None
        (new, new_opt), sc, bad = self.scaler.settle(sc, grads, (new, new_opt), (params, opt_state))
        return new, new_opt, sc, value, grads, bad > 0, sc["scale"]

    def _losses(self, params, xs, *ys):
        S, M, msg = self.n, self.m, self.message

        def body(flat, xs, *ys):
            flat, s = flat[0], lax.axis_index(AXIS)  # (Φ_max,): this device's stage
            zero = lax.pcast(jnp.zeros(msg.shape, msg.dtype), AXIS, to="varying")
            branches = [self._branch(i, S) for i in range(S)]
            h, total = zero, jnp.zeros((), flat.dtype)
            for t in range(M + S - 1):  # Python loop: the ledger sees every collective-permute
                mb = t - s  # this device's micro-batch
                x, y = xs[min(t, M - 1)], [a[max(0, min(t - S + 1, M - 1))] for a in ys]
                out, loss = lax.switch(s, branches, flat, x, h, *y)
                valid = (mb >= 0) & (mb < M)
                total = total + jnp.where(valid, loss, 0) / M  # the mean over M equal micro-batches
                if t < M + S - 2:
                    h = lax.ppermute(jnp.where(valid, out, 0), AXIS, [(i, (i + 1) % S) for i in range(S)])
            return total[None]
        return jax.shard_map(body, mesh=self.mesh, in_specs=(P(AXIS), P(), *[P()] * len(ys)), out_specs=P(AXIS),
                             check_vma=True)(params, xs, *ys)

    def _scheduled(self, params, xs, *ys):
        """(S,) losses and the packed gradient of 1F1B by hand (jax_impl/parallel/pp_schedules.run): device s's F is
        jax.vjp of stage s with respect to its weights (read from the packed row outside the vjp: they are
        not stashed), its residuals stashed until its B; the gradient pulled back into the packed row."""
        S, M, msg = self.n, self.m, self.message

        def body(flat, xs, *ys):
            def program(i):
                stage = self.stages[i]

                def fn(leaves, h, mb, c):  # micro-batch mb (traced) from message h; the loss's share on S−1
                    at = lambda a: lax.dynamic_index_in_dim(a, mb, keepdims=False)
                    out = stage.apply(leaves, at(xs) if i == 0 else h)
                    if i < S - 1:
                        return out, lax.pcast(jnp.zeros((), flat.dtype), AXIS, to="varying")
                    loss = self.loss(out, *[at(y) for y in ys]).astype(flat.dtype) / M  # mean over M micro-batches
                    return lax.pcast(jnp.zeros(msg.shape, msg.dtype), AXIS, to="varying"), loss
                return fn, stage.leaves

            loss, grads = pp_schedules.run(None, [flat[0]], msg, S, M, "1f1b", 1, self.stash, flat.dtype,
                                           [program(i) for i in range(S)])
            return loss[None], grads[0][None]
        return jax.shard_map(body, mesh=self.mesh, in_specs=(P(AXIS), P(), *[P()] * len(ys)),
                             out_specs=(P(AXIS), P(AXIS)), check_vma=True)(params, xs, *ys)

    def _branch(self, i: int, S: int):
        stage, msg = self.stages[i], self.message

        def run(flat, x, h, *y):
            out = stage(flat, x if i == 0 else h)
            if i == S - 1:  # the loss on the last stage; it sends nothing meaningful
                loss = self.loss(out, *y).astype(flat.dtype)  # (compute_dtype: a 16-bit loss summed in float32)
                return lax.pcast(jnp.zeros(msg.shape, msg.dtype), AXIS, to="varying"), loss
            return out, lax.pcast(jnp.zeros((), flat.dtype), AXIS, to="varying")
        return run

    def train_step(self, x, *ys) -> float:
        batch = self.shard_batch(x, *ys)
        if self._compiled is None:
            self._compiled = self.step.lower(*self.state, *batch).compile()
        out = self._compiled(*self.state, *batch)
        *state, loss, _ = out[:len(out) - len(self.per_step)]
        self.state = tuple(state)
        return float(fetch(loss))

    def module(self):
        """The model holding the trained parameters (a new object; the one given is unchanged)."""
        flat = fetch(self.state[0])  # from any process (jax.distributed)
        gdef, state = nnx.split(self.model)
        model = nnx.merge(gdef, state)
        mods = submodules(model)[0]
        for stage, row in zip(self.stages, flat):
            for path, trained in zip(stage.paths, stage.modules(jnp.asarray(row), cast=False)):
                nnx.update(mods[path], nnx.state(trained))
        return model

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """Permutes of one message per device (none at S = 1), the losses' all-reduce. GPipe: 2·(M + S − 2);
        1F1B: one per tick in which some stage sends (2·(M+S−1) ticks, F to s+1 and B to s−1 in ONE permute):
        all but the last at S ≥ 3 (stage 0's last B sends nothing), M + 2 at S = 2 (stage 0's F ticks and
        stage 1's B ticks coincide M − 2 times), 2·(S − 1) at M = 1 (shared.theory.pp_1f1b_permute_count)."""
        if self.message is None:
            return {}
        S, M, b = self.n, self.m, int(np.prod(self.message.shape)) * self.message.dtype.itemsize
        k = 2 * (M + S - 2) if self.schedule == "gpipe" else \
            2 * (S - 1) if M == 1 else M + 2 if S == 2 else 2 * (M + S - 1) - 1
        flag = 1 if self.scaler else 0  # scaling: XLA's all-reduce of the packed gradient's 1-byte non-finite flag
        return {"collective_permute": (k, k * b), "all_reduce": (1 + flag, self.state[0].dtype.itemsize + flag)}


def _cast_state(split, dtype):
    """(graphdef, state) with the state's floating arrays in ``dtype``."""
    gdef, state = split
    return gdef, jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)


def pipeline(model: nnx.Module, stages: Sequence[Sequence[str]], loss: Callable, tx: optax.GradientTransformation,
             mesh, microbatches: int = 4, *, schedule: str = "gpipe", clip: float | None = None,
             compute_dtype=None, loss_scale=None) -> Trainer:
    """GPipe (or 1F1B) over ``mesh``'s "pp" axis for a model whose forward is the chain ``stages`` lists.
    ``clip``: global-norm clipping (torch's formula, parallel.recipe) of the whole packed gradient.
    ``compute_dtype``: every stage computes with its floating Params cast to it inside the step (the
    messages then travel in that dtype); the packed master weights, their gradients (summed over the
    micro-batches in the master dtype: one cast per micro-batch) and optax's state stay as they are."""
    if schedule not in SCHEDULES:
        raise WrapError(f"pp: unknown schedule {schedule!r}; choose from {SCHEDULES}")
    recipe.check_clip(clip, "pp", tx)
    if AXIS not in mesh.shape:
        raise WrapError(f"the mesh has axes {tuple(mesh.shape)}, no {AXIS!r}: make one with axis name 'pp'")
    _, _, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise WrapError(f"{type(model).__name__} holds state other than nnx.Param: pipeline trains Params only")
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return Trainer(model, stages, loss, tx, mesh, microbatches, clip, compute_dtype, schedule, loss_scale)
