"""Composition on ONE mesh for ANY Flax NNX model that offers a stage split: dp / fsdp × tp × pp × cp in
one call — what jax_impl/mesh.py does for the project's own transformer, for a user's model, its
module-path tp plan, its stage split, its cp seam and its ZeRO units. Twin: torch_impl/parallel/ (compose).

    trainer = compose(model, {"fsdp": 2, "tp": 2, "pp": 2}, loss, optax.adamw(...), plan=PLAN, split=SPLIT)
    loss_value = trainer.train_step(tokens, targets)     # (B, T) each
    params = trainer.params()                           # {NNX path: global NumPy array}

The mesh: axes in the layout's order, device id row-major (innermost last). Per axis:

    dp / fsdp  the rows of every batch array; fsdp also splits dim 0 of every >= 2-D Param of the ZeRO
               units (default: all) over "fsdp" — after tp, tp-major — gathered ONCE per step before the
               stages (torchtitan keeps FSDP unsharded across a step's micro-batches under PP); backward:
               the gather's transpose, one reduce-scatter per array.
    tp         Megatron over the plan's Linear modules inside the blocks: colwise (kernel (in, out/tp), f =
               pcast to varying: psum in backward), rowwise (kernel (in/tp, out), g = psum after).
               Head counts come from the weights, so q/k/v shards must be whole heads (checked).
    pp         GPipe over ``split``: blocks (identical modules of one nnx.List) evenly over "pp", stacked
               (S, L/S, …); ``first`` / ``last`` replicated over pp, real on stage 0 / S−1; M micro-batches of
               the local rows, M + S − 1 iterations, one ppermute of the message per iteration; the last
               stage's loss, psummed over "pp" (zeros elsewhere).
    cp         the sequence: tokens / targets columns split over "cp" (ring_zigzag: permuted on the host so
               device r holds chunks r and 2c−1−r), positions the global ones; the model's attention goes
               through parallel.cp.attention (the seam): ``cp_variant`` ring / ring_zigzag / ulysses.

shard_map: one body over the whole mesh returns each (data, cp) coordinate's mean loss; the step
differentiates their mean OUTSIDE the body, so replicated weights' gradients are summed by the
transposes of the invariant -> varying casts (check_vma inserts them at each use). Per step and device
(A = one micro-batch's (m, T/c, D) message, I = M + S − 1 iterations, every local block runs I times):
tp 2 all-reduces of A per block call forward (after o, down) + 2 backward (the shared f of q|k|v and
gate|up); pp 2·(M + S − 2) permutes of A (+ the (1,) loss psum); cp the ring's 3c − 2 permutes of K|V per
attention call (parallel.cp); fsdp one all-gather + one reduce-scatter per sharded array; dp / cp the
replicated arrays' gradient all-reduces. jit: the same arrays under NamedShardings, the plain forward
(no pp: refused), XLA picks the collectives. typed: refused (see ``refusal``). Papers: Narayanan et al.
2021 (PTD-P, arXiv:2104.04473); torchtitan (Liang et al. 2024, arXiv:2410.06511).

Refused before compiling (``ComposeError``, one line: what, which axes, fix): an unknown axis or style,
pp under jit or typed, sizes that do not divide (rows, sequence, layers, heads, features, dim 0 under
fsdp), plan keys outside the blocks or on non-Linear modules, rowwise biases, a split whose chain is
not the model's forward, a model that never calls the cp seam (at the first trace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.parallel import cp as cp_seam
from jax_impl.parallel import recipe
from jax_impl.parallel.compose_axes import (  # noqa: F401  (AXES, STYLES, ComposeError, Split: this module's API too)
    AXES,
    CP_VARIANTS,
    STYLES,
    ComposeError,
    Split,
    check_plan,
    check_split,
    flat,
    matches,
    one,
    refusal,
    stand_ins,
)
from jax_impl.parallel.tp import local_shapes_refusal
from jax_impl.parallel.tree import fetch, submodules
from shared.theory import cp_positions


class Composed:
    """The composed trainer: ``train_step(tokens, targets)``, ``params()``, ``mesh``, ``specs``."""

    def __init__(self, model, layout, loss, tx, plan, split, units, style, microbatches, devices, cp_variant):
        why = refusal(layout, style)
        if why:
            raise ComposeError(why)
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
        self.data = tuple(a for a in self.layout if a in ("dp", "fsdp"))
        self.d = int(np.prod([self.layout[a] for a in self.data]))
        self.seq = "cp" if "cp" in self.layout else None
        n = int(np.prod(list(self.layout.values())))
        devices = list(devices if devices is not None else jax.devices())
        if len(devices) < n:
            raise ComposeError(f"compose: layout {self.layout} needs {n} devices, {len(devices)} present; "
                               "simulate them (XLA_FLAGS=--xla_force_host_platform_device_count) or shrink it")
        self.mesh = Mesh(np.array(devices[:n]).reshape(tuple(self.layout.values())), tuple(self.layout))
        self.M = microbatches or self.S
        mods, _ = submodules(model)
        self.L = check_split(model, split, self.S)
        self.rel_plan = check_plan(model, split, plan or {}, self.tp)
        self.units = list(units) if units is not None else None
        self.block_parts = flat(mods[f"{split.blocks}.0"])
        self.parts = {p: flat(mods[p]) for p in split.first + split.last}
        params, self.specs = self._arrange(mods)
        self._probe(tx, params)
        self.params_ = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(self.mesh, s)), params, self.specs)
        self.opt_state = tx.init(self.params_)
        self._seam_calls, self._chain_checked = 0, False
        self._step = jax.jit(self._step_fn, donate_argnums=(0, 1))

    # --- the arrays: blocks stacked (S, L/S, …), the rest as they are, and their specs ------------------

    def _unit(self, path: str) -> bool:
        """Is this Param in a ZeRO unit (some prefix of its module path matches a unit glob)?"""
        segs = path.split(".")
        return self.units is None or any(matches(".".join(segs[:i]), u) for u in self.units
                                         for i in range(1, len(segs)))

    def _spec(self, path: str, rel: str | None, shape) -> list:
        axes = [None] * len(shape)
        style = self.rel_plan.get(rel.rsplit(".", 1)[0]) if rel else None
        if style and self.tp > 1 and rel.endswith(".kernel"):
            axes[1 if style == "colwise" else 0] = "tp"
        elif style == "colwise" and self.tp > 1 and rel.endswith(".bias"):
            axes[0] = "tp"
        if self.f > 1 and len(shape) >= 2 and self._unit(path):
            local = shape[0] // (self.tp if axes[0] == "tp" else 1)
            if local % self.f:
                raise ComposeError(f"compose: {path} dim 0 = {local} (per tp shard) does not divide by fsdp={self.f}; "
                                   "leave its module out of the units or change fsdp")
            axes[0] = one(((axes[0],) if axes[0] else ()) + ("fsdp",))
        return axes

    def _arrange(self, mods):
        sp, S, per = self.split, self.S, self.L // self.S
        rest = {f"{p}.{k}": v for p in sp.first + sp.last for k, v in flat(mods[p])[3].items()}
        layer_states = [flat(mods[f"{sp.blocks}.{i}"])[3] for i in range(self.L)]
        blocks = {k: jnp.stack([s[k] for s in layer_states]).reshape((S, per) + layer_states[0][k].shape)
                  for k in layer_states[0]}
        stage = "pp" if "pp" in self.layout else None
        specs = {"rest": {k: P(*self._spec(k, None, a.shape)) for k, a in rest.items()},
                 "blocks": {k: P(stage, None, *self._spec(f"{sp.blocks}.0.{k}", k, a.shape[2:]))
                            for k, a in blocks.items()}}
        return {"rest": rest, "blocks": blocks}, specs

    def _probe(self, tx, params):
        """optax sees {"rest": {path: array}, "blocks": {block path: (S, L/S, …)}}: refuse (recipe.check)
        a tx that would update that tree otherwise than the model's {path: array} dict (masks or labels
        by ndim or path; a per-tensor statistic over stacked layers)."""
        S, per, b = self.S, self.L // self.S, self.split.blocks
        rest = {k: np.asarray(a) for k, a in params["rest"].items()}
        blocks = {k: np.asarray(a).reshape((self.L,) + a.shape[2:]) for k, a in params["blocks"].items()}
        whole = rest | {f"{b}.{i}.{k}": a[i] for k, a in blocks.items() for i in range(self.L)}
        to = lambda t: {"rest": {k: t[k] for k in rest},  # noqa: E731
                        "blocks": {k: np.stack([t[f"{b}.{i}.{k}"] for i in range(self.L)]).reshape(
                            (S, per) + blocks[k].shape[1:]) for k in blocks}}
        back = lambda v: {k: np.asarray(a) for k, a in v["rest"].items()} | {  # noqa: E731
            f"{b}.{i}.{k}": np.asarray(a).reshape((self.L,) + blocks[k].shape[1:])[i]
            for k, a in v["blocks"].items() for i in range(self.L)}
        what = ('optax sees {"rest": {path: array}, "blocks": {path in a block: (S, L/S, …) the layers stacked}}, '
                "not your {path: array} dict")
        recipe.check(tx, whole, recipe.Whole(what, to, back), "compose", "write the mask / labels for that tree "
                     "(by the path's last names, not ndim; 'blocks' leaves have 2 more dims), or train this recipe "
                     "under parallelize / tp.apply_plan, which hand optax your dict")

    # --- the forward ---------------------------------------------------------------------------------

    @staticmethod
    def _module(parts, flat: dict):
        gdef, treedef, keys, _ = parts
        return nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, [flat[k] for k in keys]))

    def _forward_loss(self, params, tokens, targets, positions, manual: bool):
        """Mean loss over the tokens given: this device's (manual, in shard_map) or all (jit)."""
        sp, S, M = self.split, self.S, self.M
        rows, T = tokens.shape
        parts = {}
        for p in sp.first + sp.last:
            flat = {k[len(p) + 1:]: v for k, v in params["rest"].items() if k.startswith(p + ".")}
            parts[p] = self._module(self.parts[p], flat)
        blocks = params["blocks"]
        layers = [self._module(self.block_parts, {k: a[l] for k, a in blocks.items()})
                  for l in range(next(iter(blocks.values())).shape[0])]
        if manual and self.tp > 1:
            f_cache = {}  # one f per input array (q|k|v, gate|up): one backward psum, Megatron's
            layers = [stand_ins(layer, self.rel_plan, f_cache) for layer in layers]

        def stage(h):
            for layer in layers:
                h = sp.block(self.root, layer, h, positions)
            return h

        if S == 1:
            out = stage(sp.embed(self.root, parts, tokens, positions))
            return self.loss(sp.head(self.root, parts, out), targets)
        m = rows // M
        h0 = sp.embed(self.root, parts, tokens, positions)  # (rows, T, D): stage 0's input
        h0 = h0.reshape((M, m) + h0.shape[1:])
        idx, state, outs = lax.axis_index("pp"), jnp.zeros_like(h0[0]), []
        for t in range(M + S - 1):  # stage s runs micro-batch t − s (GPipe); bubbles run on zeros, unused
            out = stage(jnp.where(idx == 0, h0[min(t, M - 1)], state))
            if t >= S - 1:
                outs.append(out)
            state = lax.ppermute(out, "pp", [(s, s + 1) for s in range(S - 1)])
        logits = sp.head(self.root, parts, jnp.concatenate(outs))
        loss = self.loss(logits, targets)  # micro-batch k = rows [k·m, (k+1)·m)
        return lax.psum(jnp.where(idx == S - 1, loss, 0), "pp")

    def _shard_map_loss(self):
        specs, data, seq = self.specs, one(self.data), self.seq

        def gather(a, spec, lead: int, axis: int):  # fsdp: dim 0 of the Param's own dims gathered over "fsdp"
            first = spec[lead] if len(spec) > lead else None
            has = first == "fsdp" or (isinstance(first, tuple) and "fsdp" in first)
            return lax.all_gather(a, "fsdp", axis=axis, tiled=True) if has else a

        def body(params, tokens, targets, positions):  # blocks (1, L/S, …) -> (L/S, …)
            blocks = {k: gather(a[0], specs["blocks"][k], 2, 1) for k, a in params["blocks"].items()}
            rest = {k: gather(a, specs["rest"][k], 0, 0) for k, a in params["rest"].items()}
            ctx = cp_seam._active(self.cp_variant, self.c, self._record) if self.c > 1 else contextlib.nullcontext()
            with ctx:
                try:
                    loss = self._forward_loss({"blocks": blocks, "rest": rest}, tokens, targets, positions, True)
                except TypeError as e:  # JAX's shape errors on tp-local shards (a head count read from config)
                    if self.tp == 1:
                        raise
                    raise ComposeError("compose " + local_shapes_refusal(e)) from None
            return loss[None]

        return jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P(data, seq), P(data, seq), P(seq)),
                             out_specs=P(one(self.data + ((seq,) if seq else ()))), check_vma=True)

    def _record(self, _):
        self._seam_calls += 1

    def _step_fn(self, params, opt_state, tokens, targets, positions):
        if self.style == "shard_map":
            losses = self._shard_map_loss()
            value = lambda p: jnp.mean(losses(p, tokens, targets, positions))
        else:
            unstack = lambda p: {"rest": p["rest"], "blocks": {k: a[0] for k, a in p["blocks"].items()}}  # S = 1
            value = lambda p: self._forward_loss(unstack(p), tokens, targets, positions, False)
        loss, grads = jax.value_and_grad(value)(params)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        new = jax.tree.map(lambda a, s: lax.with_sharding_constraint(a, NamedSharding(self.mesh, s)), new, self.specs)
        return new, opt_state, loss

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
        """The split's chain equals the model's forward on one row (eager, one device): else refused."""
        sp, mods = self.split, submodules(self.root)[0]
        x = jnp.asarray(tokens[:1])
        pos = jnp.arange(x.shape[1])
        h = sp.embed(self.root, mods, x, pos)
        for i in range(self.L):
            h = sp.block(self.root, mods[f"{sp.blocks}.{i}"], h, pos)
        want, got = np.asarray(self.root(x)), np.asarray(sp.head(self.root, mods, h))
        if want.shape != got.shape or not np.allclose(got, want, rtol=1e-12, atol=0):
            raise ComposeError(f"compose: the split's chain head(block(…embed(x))) differs from "
                               f"{type(self.root).__name__}(x); fix the split's embed / block / head")
        self._chain_checked = True

    def train_step(self, tokens, targets) -> float:
        order = self.check_batch(tokens)  # ring: 0…T−1; ring_zigzag: chunks r and 2c−1−r on device r
        if not self._chain_checked:
            self.check_chain(tokens)
        rows = NamedSharding(self.mesh, P(one(self.data), self.seq))
        batch = (jax.device_put(jnp.asarray(tokens)[:, order], rows),
                 jax.device_put(jnp.asarray(targets)[:, order], rows),  # the mean loss ignores token order
                 jax.device_put(jnp.asarray(order), NamedSharding(self.mesh, P(self.seq))))
        if self.style == "shard_map" and self.c > 1 and not self._seam_calls:  # trace once: the seam used?
            self._step.trace(self.params_, self.opt_state, *batch)
            if not self._seam_calls:
                raise cp_seam.SeamError("compose: cp > 1 but the model never called parallel.cp.attention: its "
                                    "attention would see its own T/cp tokens only; route attention through the seam")
        self.params_, self.opt_state, loss = self._step(self.params_, self.opt_state, *batch)
        return float(loss)

    def params(self) -> dict[str, np.ndarray]:
        """{NNX Param path: global NumPy array} of the model as trained (blocks unstacked)."""
        out = {k: fetch(a) for k, a in self.params_["rest"].items()}
        for k, a in self.params_["blocks"].items():
            a = fetch(a).reshape((self.L,) + a.shape[2:])
            out |= {f"{self.split.blocks}.{i}.{k}": a[i] for i in range(self.L)}
        return out


def compose(model: nnx.Module, layout: dict[str, int], loss: Callable, tx: optax.GradientTransformation, *,
            plan: dict[str, str] | None = None, split: Split, units=None, style: str = "shard_map",
            microbatches: int | None = None, devices=None, cp_variant: str = "ring") -> Composed:
    """Train ``model`` on one mesh of ``layout`` ({axis: size}, axes dp fsdp pp cp tp); ``loss(logits,
    targets)`` a mean over the tokens it gets; ``plan`` {module path glob: colwise | rowwise};
    ``split`` the model's stage split; ``units`` module-path globs whose Params fsdp shards (default
    all); ``microbatches`` under pp (default pp); ``cp_variant`` the seam's ring / ring_zigzag / ulysses
    (shard_map). The model's attention must call parallel.cp.attention."""
    return Composed(model, layout, loss, tx, plan, split, units, style, microbatches, devices, cp_variant)
