"""Composition on ONE mesh for ANY Flax NNX model that offers a stage split: dp / fsdp × tp × pp × cp in
one call — what jax_impl/mesh.py does for the project's own transformer, for a user's model, its
module-path tp plan, its stage split, its cp seam and its ZeRO units. Twin: torch_impl/parallel/ (compose).

    trainer = compose(model, {"fsdp": 2, "tp": 2, "pp": 2}, loss, optax.adamw(...), plan=PLAN, split=SPLIT)
    loss_value = trainer.train_step(tokens, targets)     # (B, T) each
    params = trainer.params()                           # {NNX path: global NumPy array}
    step, state, batch = trainer.program(tokens, targets, grads=True)  # the jitted step, for a loop of one's own

The mesh: axes in the layout's order, device id row-major (innermost last). Per axis:

    dp / fsdp  the rows of every batch array; fsdp also splits dim 0 of every >= 2-D Param of the ZeRO
               units (default: all) over "fsdp" — after tp, tp-major — gathered ONCE per step before the
               stages (torchtitan keeps FSDP unsharded across a step's micro-batches under PP); backward:
               the gather's transpose, one reduce-scatter per array.
    tp         Megatron over the plan's Linear modules inside the blocks: colwise (kernel (in, out/tp), f =
               pcast to varying: psum in backward; a bias split with the columns), rowwise (kernel (in/tp,
               out), g = psum after, then its bias once, as torch's RowwiseParallel),
               colwise_heads (a fused [q|k|v] kernel (D, 3·H·dh): shard_map holds its columns permuted,
               device r [q_r|k_r|v_r], parallel.tp.heads_perm; params() / to_paths() put them back).
               Head counts come from the weights, so q/k/v shards must be whole heads (checked). Flax's
               nnx.MultiHeadAttention (``flax_mha_plan``): its nnx.LinearGeneral query/key/value colwise
               over heads (kernel (D, H, dh) on H, bias (H, dh) with it), out rowwise (kernel (H, dh, D)).
    pp         GPipe over ``split``: blocks (identical modules of one nnx.List) evenly over "pp", stacked
               (S, L/S, …); ``first`` / ``last`` replicated over pp, real on stage 0 / S−1; M micro-batches of
               the local rows, M + S − 1 iterations, one ppermute of the message per iteration; the last
               stage's loss, psummed over "pp" (zeros elsewhere).
    cp         the sequence: tokens / targets columns split over "cp" (ring_zigzag: permuted on the host so
               device r holds chunks r and 2c−1−r), positions the global ones; the model's attention goes
               through parallel.cp.attention (the seam): ``cp_variant`` ring / ring_zigzag / ulysses.

shard_map: one body over the whole mesh returns each (data, cp) coordinate's mean loss; the step
differentiates their mean OUTSIDE the body, so replicated weights' gradients are summed by the
transposes of the invariant -> varying casts: the body casts every array ONCE over the axes its inputs
vary on (else check_vma casts at each use: one psum per layer and pipeline iteration). Per step and device
(``comm_theory()``, by the ledger's axis labels; A = one micro-batch's (m, T/c, D) stream in bytes, I =
M + S − 1 iterations, 1 without pp, every local block runs I times): tp per block call an all-reduce
after each rowwise module (forward) and of each distinct colwise input (backward f, shared by the
modules reading it; the trace counts them), A each at the stream's width — Llama: o, down; q|k|v,
gate|up; the project's Transformer: o, down; qkv, up; pp 2·(M + S − 2) permutes of A;
cp the ring's 3c − 2 permutes of K|V (2·m·T/c·(D/t)·b) per attention call (parallel.cp); fsdp one
all-gather + one reduce-scatter per split array, S = the device's gathered (tp-local) layers; and per
group of axes ONE all-reduce (XLA's combiner merges the independent psums): every array's gradient summed
once over the data / cp (/ pp) axes it is not split on, the embedding's output over pp (M·A: it meets the
pipeline's pp-varying state), and the losses' scalars (pp's psum, the data × cp mean). Derived where
the unplanned modules read tp-replicated activations (a norm on a tp-split one adds tp psums) and the
tx has no reductions of its own (global-norm clipping adds them). jit: the same arrays under NamedShardings, the
plain forward (pp: the stages at once under vmap, rolled one stage on per GPipe iteration:
compose_losses.jit_pipeline_loss), XLA picks the collectives (comm_theory() is None, as the mesh runner has
no formula for jit with fsdp or cp). typed: refused (see ``refusal``). Papers: Narayanan et al. 2021
(PTD-P, arXiv:2104.04473); torchtitan (Liang et al. 2024, arXiv:2410.06511).

Refused before compiling (``ComposeError``, one line: what, which axes, fix): an unknown axis or style,
typed, sizes that do not divide (rows, sequence, layers, heads, features, dim 0 under
fsdp), plan keys outside the blocks or on modules other than nnx.Linear / an nnx.LinearGeneral in
nnx.MultiHeadAttention's layout, a rowwise bias on a Linear subclass with its own __call__, a split whose chain is
not the model's forward, a model that never calls the cp seam (at the first trace).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.parallel import cp as cp_seam
from jax_impl.parallel import recipe, theory
from jax_impl.parallel.compose_axes import (  # noqa: F401  (AXES, STYLES, ComposeError, Split: this module's API too)
    AXES,
    CP_VARIANTS,
    STYLES,
    ComposeError,
    Split,
    check_plan,
    check_split,
    flat,
    flax_mha_plan,
    matches,
    one,
    refusal,
    stand_ins,
    varying,
)
from jax_impl.parallel.compose_ep import DATA_AXES, Experts, without_intermediates
from jax_impl.parallel.compose_losses import forward_loss, jit_pipeline_loss, shard_map_loss
from jax_impl.parallel.tp import heads_perm
from jax_impl.parallel.tree import fetch, submodules
from shared.theory import cp_positions


class Composed:
    """The composed trainer: ``train_step(tokens, targets)``, ``params()``, ``mesh``, ``specs``."""

    def __init__(self, model, layout, loss, tx, plan, split, units, style, microbatches, devices, cp_variant,
                 clip=None, freeze=(), experts=(), aux=None):
        why = refusal(layout, style)
        if why:
            raise ComposeError(why)
        recipe.check_clip(clip, "compose", tx)
        self.clip = clip
        if cp_variant not in CP_VARIANTS:
            raise ComposeError(f"compose: unknown cp_variant {cp_variant!r}; use one of {CP_VARIANTS}")
        if style == "jit" and cp_variant != "ring" and layout.get("cp", 1) > 1:
            raise ComposeError(f"compose: cp_variant {cp_variant!r} under jit is refused (jit splits the sequence in "
                               "order and XLA picks attention's collectives); use style='shard_map' or 'ring'")
        self.cp_variant = cp_variant
        self.layout = {a: int(n) for a, n in layout.items()}
        self.style, self.loss, self.tx, self.split, self.root = style, loss, tx, split, model
        size = lambda a: self.layout.get(a, 1)
        self.S, self.tp, self.c, self.f = size("pp"), size("tp"), size("cp"), size("fsdp")
        self.data = tuple(a for a in self.layout if a in DATA_AXES)  # ep: a data axis (compose_ep.py)
        self.d = int(np.prod([self.layout[a] for a in self.data]))
        self.seq = "cp" if "cp" in self.layout else None
        n = int(np.prod(list(self.layout.values())))
        devices = list(devices if devices is not None else jax.devices())
        if len(devices) < n:
            raise ComposeError(f"compose: layout {self.layout} needs {n} devices, {len(devices)} present; "
                               "simulate them (XLA_FLAGS=--xla_force_host_platform_device_count) or shrink it")
        self.mesh = Mesh(np.array(devices[:n]).reshape(tuple(self.layout.values())), tuple(self.layout))
        self.M = microbatches or self.S
        model = self.root = without_intermediates(model)  # a layer's sown aux from an eager call: not trained
        mods, _ = submodules(model)
        self.L = check_split(model, split, self.S)
        self.experts = Experts(mods, split, self.L, self.layout, experts, plan, units, microbatches, aux)
        self.rel_plan = check_plan(model, split, plan or {}, self.tp)
        self.units = list(units) if units is not None else None
        self.block_parts = flat(mods[f"{split.blocks}.0"])
        self.parts = {p: flat(mods[p]) for p in split.first + split.last}
        params, self.specs = self._arrange(mods)
        self.frozen = self._frozen(params, freeze)
        self._probe(tx, params)
        # placed from host copies: the step donates its params, which must not delete the model's own arrays
        # (device_put to a sharding over the array's own device reuses its buffer there, may_alias or not)
        self.params_ = jax.tree.map(lambda a, s: jax.device_put(np.asarray(a), NamedSharding(self.mesh, s)),
                                    params, self.specs)
        replicated = NamedSharding(self.mesh, P())  # optax's scalars (count) too: else step 2 compiles again
        self.opt_state = jax.tree.map(lambda a: a if isinstance(getattr(a, "sharding", None), NamedSharding) else
                                      jax.device_put(a, replicated), tx.init(self.params_))
        self._opt_placed = jax.tree.map(lambda a: a.sharding if isinstance(getattr(a, "sharding", None), NamedSharding)
                                        else None, self.opt_state)
        self._trace: dict | None = None  # the last trace's seam calls, stream and loss: comm_theory
        self._chain_checked = False
        # XLA:CPU drops the seam's optimization barrier before CSE, which then merges the ring's backward
        # K|V rotation into the forward's (2c − 1 permutes per call, not 3c − 2; the blocks kept from forward to
        # backward): a ring step compiles without CSE on CPU, as parallel.cp.Trainer's (jax_impl.cp.cpu_options)
        cpu_ring = style == "shard_map" and self.c > 1 and cp_variant != "ulysses" and \
            self.mesh.devices.flat[0].platform == "cpu"
        self.compiler_options = {"xla_disable_hlo_passes": "cse"} if cpu_ring else None
        self._step = jax.jit(self._step_fn, donate_argnums=(0, 1), compiler_options=self.compiler_options)
        self._step_grads = jax.jit(partial(self._step_fn, grads=True), donate_argnums=(0, 1),
                                   compiler_options=self.compiler_options)

    # --- the arrays: blocks stacked (S, L/S, …), the rest as they are, and their specs ------------------

    def _unit(self, path: str) -> bool:
        """Is this Param in a ZeRO unit (some prefix of its module path matches a unit glob)?"""
        segs = path.split(".")
        return self.units is None or any(matches(".".join(segs[:i]), u) for u in self.units
                                         for i in range(1, len(segs)))

    def _spec(self, path: str, rel: str | None, shape) -> list:
        axes = [None] * len(shape)
        if self.experts.split("blocks" if rel else "rest", rel or path):  # whole experts over ep, nothing else
            return ["ep"] + axes[1:]
        style = self.rel_plan.get(rel.rsplit(".", 1)[0]) if rel else None
        if style and self.tp > 1 and rel.endswith(".kernel"):
            axes[0 if style == "rowwise" else 1] = "tp"
        elif style in ("colwise", "colwise_heads") and self.tp > 1 and rel.endswith(".bias"):
            axes[0] = "tp"
        if self.f > 1 and len(shape) >= 2 and self._unit(path):
            local = shape[0] // (self.tp if axes[0] == "tp" else 1)
            if local % self.f:
                what = f"{local} per tp shard" if axes[0] == "tp" else f"{local} (tp does not split it)"
                raise ComposeError(f"compose: {path} dim 0 = {what} does not divide by fsdp={self.f}; leave its "
                                   "module out of the ZeRO units (units=[...]) or change fsdp")
            axes[0] = one(((axes[0],) if axes[0] else ()) + ("fsdp",))
        return axes

    def _arrange(self, mods):
        sp, S, per = self.split, self.S, self.L // self.S
        rest = {f"{p}.{k}": v for p in sp.first + sp.last for k, v in flat(mods[p])[3].items()}
        layer_states = [flat(mods[f"{sp.blocks}.{i}"])[3] for i in range(self.L)]
        blocks = {k: jnp.stack([s[k] for s in layer_states]).reshape((S, per) + layer_states[0][k].shape)
                  for k in layer_states[0]}
        # colwise_heads (shard_map: each device runs the model on its shard): the fused [q|k|v] columns
        # reordered so that tp device r's block is [q_r|k_r|v_r] (parallel.tp.heads_perm); to_paths puts
        # them back. jit runs the model on the global arrays: the columns stay in order (XLA splits them)
        self.perms = {k: heads_perm(a.shape[-1], self.tp) for k, a in blocks.items() if self.tp > 1 and
                      self.style == "shard_map" and
                      self.rel_plan.get(k.rsplit(".", 1)[0]) == "colwise_heads" and k.endswith((".kernel", ".bias"))}
        blocks = {k: a[..., self.perms[k]] if k in self.perms else a for k, a in blocks.items()}
        stage = "pp" if "pp" in self.layout else None
        specs = {"rest": {k: P(*self._spec(k, None, a.shape)) for k, a in rest.items()},
                 "blocks": {k: P(stage, None, *self._spec(f"{sp.blocks}.0.{k}", k, a.shape[2:]))
                            for k, a in blocks.items()}}
        return {"rest": rest, "blocks": blocks}, specs

    def _frozen(self, params, globs) -> dict[str, set[str]]:
        """{"rest" | "blocks": keys} of the Params ``globs`` freeze (their gradient stopped: zero, so AdamW with
        them out of the decay mask leaves them unchanged, and clip= does not count them). A stacked block
        leaf is all its layers: a glob freezing some layers of it and not the others is refused."""
        out = {"rest": {k for k in params["rest"] if any(matches(k, g) for g in globs)}, "blocks": set()}
        for k in params["blocks"]:
            hits = [any(matches(f"{self.split.blocks}.{i}.{k}", g) for g in globs) for i in range(self.L)]
            if any(hits) and not all(hits):
                raise ComposeError(f"compose: freeze={list(globs)} freezes {sum(hits)} of the {self.L} layers' "
                                   f"{self.split.blocks}.*.{k}; compose stacks the blocks' Params (S, L/S, …): "
                                   "freeze that Param in every layer or in none")
            if all(hits):
                out["blocks"].add(k)
        return out

    def _probe(self, tx, params):
        """optax sees {"rest": {path: array}, "blocks": {block path: (S, L/S, …)}}: refuse (recipe.check)
        a tx that would update that tree otherwise than the model's {path: array} dict (masks or labels
        by ndim or path; a per-tensor statistic over stacked layers)."""
        S, per, b = self.S, self.L // self.S, self.split.blocks
        rest = {k: np.asarray(a) for k, a in params["rest"].items()}
        perm = lambda k, a: a[..., self.perms[k]] if k in self.perms else a  # noqa: E731
        unperm = lambda k, a: a[..., np.argsort(self.perms[k])] if k in self.perms else a  # noqa: E731
        blocks = {k: unperm(k, np.asarray(a)).reshape((self.L,) + a.shape[2:]) for k, a in params["blocks"].items()}
        whole = rest | {f"{b}.{i}.{k}": a[i] for k, a in blocks.items() for i in range(self.L)}
        to = lambda t: {"rest": {k: t[k] for k in rest},  # noqa: E731
                        "blocks": {k: perm(k, np.stack([t[f"{b}.{i}.{k}"] for i in range(self.L)]).reshape(
                            (S, per) + blocks[k].shape[1:])) for k in blocks}}
        back = lambda v: {k: np.asarray(a) for k, a in v["rest"].items()} | {  # noqa: E731
            f"{b}.{i}.{k}": unperm(k, np.asarray(a)).reshape((self.L,) + blocks[k].shape[1:])[i]
            for k, a in v["blocks"].items() for i in range(self.L)}
        what = ('optax sees {"rest": {path: array}, "blocks": {path in a block: (S, L/S, …) the layers stacked}}, '
                "not your {path: array} dict")
        recipe.check(tx, whole, recipe.Whole(what, to, back), "compose", "write the mask / labels for that tree "
                     "(by the path's last names, not ndim; 'blocks' leaves have 2 more dims), or train this recipe "
                     "under parallelize / tp.apply_plan, which hand optax your dict", jit=True)  # the step jits it too

    # --- the forward ---------------------------------------------------------------------------------

    def _record(self, key):
        self._trace["seam"].append((key.size, key.dtype.itemsize))

    def _record_ep(self, kind, *nbytes):
        self._trace["ep"].append((kind, *nbytes))

    def _step_fn(self, params, opt_state, tokens, targets, positions, grads: bool = False):
        stop = lambda p: {part: {k: lax.stop_gradient(a) if k in self.frozen[part] else a  # noqa: E731
                                 for k, a in arrays.items()} for part, arrays in p.items()}
        if self.style == "shard_map":
            losses = shard_map_loss(self)
            value = lambda p: jnp.mean(losses(stop(p), tokens, targets, positions))
        elif self.S > 1:
            value = lambda p: jit_pipeline_loss(self, stop(p), tokens, targets, positions)
        else:
            unstack = lambda p: {"rest": p["rest"], "blocks": {k: a[0] for k, a in p["blocks"].items()}}  # S = 1
            value = lambda p: forward_loss(self, unstack(stop(p)), tokens, targets, positions, False)
        loss, raw = jax.value_and_grad(value)(params)
        g = raw
        if self.clip is not None:  # the global tree (global arrays): its norm is the whole model's
            g = recipe.scale_by_norm(g, recipe.sumsq(g), self.clip)
        updates, opt_state = self.tx.update(g, opt_state, params)
        new = optax.apply_updates(params, updates)
        new = jax.tree.map(lambda a, s: lax.with_sharding_constraint(a, NamedSharding(self.mesh, s)), new, self.specs)
        opt_state = jax.tree.map(lambda a, s: a if s is None else lax.with_sharding_constraint(a, s),  # as it came
                                 opt_state, self._opt_placed, is_leaf=lambda x: x is None)
        return (new, opt_state, loss, raw) if grads else (new, opt_state, loss)  # the gradient before the clip

    # --- public --------------------------------------------------------------------------------------

    def check_batch(self, tokens) -> np.ndarray:
        """Refuses a batch the layout cannot split; returns the sequence order (cp's layout)."""
        rows, T = tokens.shape
        if rows % (self.d * self.M):
            raise ComposeError(f"compose: {rows} rows do not split over data axes {self.data} (={self.d}) × "
                               f"{self.M} micro-batches; use rows divisible by {self.d * self.M}")
        kind = "ring_zigzag" if self.cp_variant == "ring_zigzag" and self.c > 1 else "ring"
        chunks = self.c * (2 if kind == "ring_zigzag" else 1)
        if T % chunks:
            raise ComposeError(f"compose: sequence {T} does not split into {chunks} chunks (cp={self.c}, "
                               f"{self.cp_variant}); use T divisible by {chunks}")
        return np.concatenate([cp_positions(T, self.c, r, kind) for r in range(self.c)])

    def check_chain(self, tokens):
        """The split's chain equals the model's forward on one row (one jitted program, one device): else
        refused."""
        sp, (gdef, state) = self.split, nnx.split(self.root)

        def both(x, state):  # one program (eager ops would compile one by one: seconds on a first run)
            root = nnx.merge(gdef, state)  # merged in the trace: a layer may store values (its aux) while traced
            mods, pos = submodules(root)[0], jnp.arange(x.shape[1])
            h = sp.embed(root, mods, x, pos)
            for i in range(self.L):
                h = sp.block(root, mods[f"{sp.blocks}.{i}"], h, pos)
            out = root(x)  # a model returning (logits, …) (an MoE's aux, routing): its logits
            return out[0] if isinstance(out, tuple) else out, sp.head(root, mods, h)

        want, got = (np.asarray(a) for a in jax.jit(both)(jnp.asarray(tokens[:1]), state))
        if want.shape != got.shape or not np.allclose(got, want, rtol=1e-12, atol=0):
            raise ComposeError(f"compose: the split's chain head(block(…embed(x))) differs from "
                               f"{type(self.root).__name__}(x); fix the split's embed / block / head")
        self._chain_checked = True

    def _batch(self, tokens, targets) -> tuple:
        order = self.check_batch(tokens)  # ring: 0…T−1; ring_zigzag: chunks r and 2c−1−r on device r
        rows = NamedSharding(self.mesh, P(one(self.data), self.seq))
        pick = np.arange(tokens.shape[0])
        if self.style == "shard_map" and self.S == 1 and self.M > 1 and (self.experts.n > 1 or self.experts.aux):
            # accumulation with experts: device i's chunk k = its share of micro-batch k, rows [k·B/M, (k+1)·B/M)
            # (the balancing loss is per micro-batch); (M, d, m) -> (d, M, m)
            pick = pick.reshape(self.M, self.d, -1).swapaxes(0, 1).reshape(-1)
        return (jax.device_put(jnp.asarray(tokens)[pick][:, order], rows),
                jax.device_put(jnp.asarray(targets)[pick][:, order], rows),  # the mean loss ignores token order
                jax.device_put(jnp.asarray(order), NamedSharding(self.mesh, P(self.seq))))

    def compiled_text(self, tokens, targets) -> str:
        """The compiled step's HLO for this batch (the program train_step runs; jit's cache: no recompile
        after a step), for jax_impl.ledger.comm_by_axis."""
        return self._step.lower(self.params_, self.opt_state, *self._batch(tokens, targets)).compile().as_text()

    def _checked(self, step, tokens, targets) -> tuple:
        """The batch placed, after the first call's checks: the chain, and (shard_map) one trace of ``step``
        (comm_theory's record; under cp: the seam called)."""
        batch = self._batch(tokens, targets)
        if not self._chain_checked:
            self.check_chain(tokens)
        if self.style == "shard_map" and (self._trace is None or (self.c > 1 and not self._trace["seam"])):
            step.trace(self.params_, self.opt_state, *batch)
            if self.c > 1 and not self._trace["seam"]:
                raise cp_seam.SeamError("compose: cp > 1 but the model never called parallel.cp.attention: its "
                                    "attention would see its own T/cp tokens only; route attention through the seam")
        return batch

    def train_step(self, tokens, targets) -> float:
        batch = self._checked(self._step, tokens, targets)
        self.params_, self.opt_state, loss = self._step(self.params_, self.opt_state, *batch)
        return float(loss)

    def program(self, tokens, targets, grads: bool = False) -> tuple:
        """(step, state, batch) for a training loop of your own: ``step(*state, *batch)`` -> (params,
        opt_state, loss[, grads]) jitted (the state donated, compile with ``compiler_options``), the
        program train_step runs (``grads``: also the gradients before clip=, laid out like the params: ``to_paths``);
        state = (params, opt_state) as placed; batch = (tokens, targets, positions) placed. The checks of
        train_step's first call are made here."""
        step = self._step_grads if grads else self._step
        return step, (self.params_, self.opt_state), self._checked(step, tokens, targets)

    def comm_theory(self) -> dict[str, dict[str, tuple[int, int]]] | None:
        """{axis label: {op: (count, payload bytes)}} per step and device of the shard_map step, derived
        from the arrays as placed (shapes, dtypes, specs), the plan, the layout, M and the last trace (one
        micro-batch's stream, the seam's calls, the loss's dtype): parallel.theory.compose_comm. Equals
        jax_impl.ledger.comm_by_axis of the compiled step (tests/test_compose_jax.py). jit: None, XLA
        picks the collectives (as mesh_comm_jax has no formula for jit with fsdp or cp); and None with
        clip=: the norm's sums of squares run on the global tree outside the body, where XLA picks their
        reductions (one scalar per split leaf, or fused)."""
        if self.style != "shard_map" or self.clip is not None:
            return None
        if self._trace is None:
            raise ComposeError("compose: comm_theory needs the batch's shape: run one train_step first")
        shape, b = self._trace["stream"]
        calls, widths = theory.tp_widths(self.rel_plan, self.block_parts[3], self._trace["f"]) if self.tp > 1 \
            else (0, 0)
        placed = theory.placed(self.params_, self.specs, self.layout, self.split.first,
                               frozenset(self._trace.get("tied", ())), self.frozen)
        return theory.compose_comm(self.layout, placed, microbatches=self.M,
                                   tp_call=(calls, int(np.prod(shape[:-1])) * b * widths),
                                   stream=int(np.prod(shape)) * b, seam=self._trace["seam"],
                                   cp_variant=self.cp_variant, loss=self._trace["loss"],
                                   ep=[e for e in self._trace.get("ep", ()) if e[0] != "counts" or self.experts.aux])

    def params(self) -> dict[str, np.ndarray]:
        """{NNX Param path: global NumPy array} of the model as trained (blocks unstacked)."""
        return self.to_paths(self.params_)

    def to_paths(self, tree) -> dict[str, np.ndarray]:
        """A tree laid out like the step's params (the params, their gradients, AdamW's moments) as {NNX
        Param path: global NumPy array} in the model's own layout: blocks unstacked, colwise_heads' columns
        back in order."""
        out = {k: fetch(a) for k, a in tree["rest"].items()}
        for k, a in tree["blocks"].items():
            a = fetch(a)
            a = (a[..., np.argsort(self.perms[k])] if k in self.perms else a).reshape((self.L,) + a.shape[2:])
            out |= {f"{self.split.blocks}.{i}.{k}": a[i] for i in range(self.L)}
        return out

    def param_bytes(self) -> int:
        """One device's bytes of the params as the layout places them (shapes, dtypes, specs; not read
        back from the arrays): every dim divided by the sizes of the axes its spec names."""
        names = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)  # noqa: E731
        total = 0
        for part, arrays in self.params_.items():
            for k, a in arrays.items():
                spec = tuple(self.specs[part][k]) + (None,) * a.ndim
                split = [int(np.prod([self.layout[x] for x in names(e)])) for e in spec[:a.ndim]]
                total += int(np.prod([n // d for n, d in zip(a.shape, split, strict=True)])) * a.dtype.itemsize
        return total


def compose(model: nnx.Module, layout: dict[str, int], loss: Callable, tx: optax.GradientTransformation, *,
            plan: dict[str, str] | None = None, split: Split, units=None, style: str = "shard_map",
            microbatches: int | None = None, devices=None, cp_variant: str = "ring",
            clip: float | None = None, freeze=(), experts=(), aux: Callable | None = None) -> Composed:
    """Train ``model`` on one mesh of ``layout`` ({axis: size}, axes dp fsdp pp cp tp); ``loss(logits,
    targets)`` a mean over the tokens it gets; ``plan`` {module path glob: colwise | colwise_heads | rowwise}
    (an nnx.MultiHeadAttention's: ``flax_mha_plan(prefix)``);
    ``split`` the model's stage split; ``units`` module-path globs whose Params fsdp shards (default
    all); ``microbatches`` under pp (default pp); ``cp_variant`` the seam's ring / ring_zigzag / ulysses
    (shard_map); ``clip`` global-norm clipping of the whole model's gradient (torch's formula,
    parallel.recipe), as torch's ``train_step(..., max_norm=)``; ``freeze`` NNX Param-path globs not
    trained (their gradient stopped; keep them out of the tx's decay mask). Gradient accumulation: K
    parts of the batch are ``microbatches=K·M`` under pp (one schedule of K·M micro-batches: the same
    averaged gradient) and ``microbatches=K`` without (K row chunks, their mean losses averaged); both
    differentiate one program (memory: every part's activations live until the one backward). The
    model's attention must call parallel.cp.attention. ``experts`` module-path globs of the MoE layers'
    stacked (E, …) experts, split over a layout axis "ep" (a data axis for the rest; their layer calls
    parallel.ep.dispatch / global_counts); ``aux`` a callable adding the layers' balancing losses to the
    loss after each forward (``model.aux``: called on this forward's modules): compose_ep.py."""
    return Composed(model, layout, loss, tx, plan, split, units, style, microbatches, devices, cp_variant, clip,
                    tuple(freeze), tuple(experts), aux)
