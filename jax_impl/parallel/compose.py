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
from dataclasses import dataclass
from fnmatch import fnmatch

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.parallel import cp as cp_seam
from jax_impl.parallel.tree import WrapError, fetch, key_of, param_holders, put_child, submodules
from shared.theory import cp_positions

AXES = ("dp", "fsdp", "pp", "cp", "tp")
CP_VARIANTS = ("ring", "ring_zigzag", "ulysses")  # parallel.cp's seam
STYLES = ("shard_map", "jit")


class ComposeError(WrapError):
    """A layout, plan or split ``compose`` cannot train exactly: raised before compiling."""


@dataclass(frozen=True)
class Split:
    """A model's stage split: ``head(block(…block(embed(x))…))`` equals its forward. ``first`` / ``last``:
    module paths run before / after the blocks; ``blocks``: the path of an nnx.List of identical modules.
    embed(root, mods, tokens, positions), block(root, layer, h, positions), head(root, mods, h): ``mods``
    {path: module} with this device's weights; ``root`` the model (read for static attributes only)."""
    first: tuple[str, ...]
    blocks: str
    last: tuple[str, ...]
    embed: Callable
    block: Callable
    head: Callable


def _matches(path: str, pattern: str) -> bool:  # "*" = one path segment (parallel.tp's rule)
    a, b = path.split("."), pattern.split(".")
    return len(a) == len(b) and all(fnmatch(x, y) for x, y in zip(a, b, strict=True))


def _one(axes):
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def refusal(layout: dict[str, int], style: str) -> str | None:
    """Why ``compose`` refuses this layout in this style, or None."""
    bad = [a for a in layout if a not in AXES]
    if bad:
        return f"compose: unknown axes {bad} in layout {layout}; use {AXES}"
    if any(not isinstance(n, int) or n < 1 for n in layout.values()):
        return f"compose: layout sizes must be positive integers, got {layout}"
    if style == "typed":
        return ("compose: style 'typed' is refused: a composed step mixes manual collectives (pp's ppermute, "
                "cp's ring) with sharding-in-types; use style='shard_map' or 'jit'")
    if style not in STYLES:
        return f"compose: unknown style {style!r}; use one of {STYLES}"
    if style == "jit" and layout.get("pp", 1) > 1:
        return (f"compose: pp={layout['pp']} under jit is refused (the pipeline's schedule is manual); "
                "use style='shard_map' or drop pp from the layout")
    return None


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
        self._check_split(mods)
        self.rel_plan = self._check_plan(mods, plan or {})
        self.units = list(units) if units is not None else None
        self.block_parts = _flat(mods[f"{split.blocks}.0"])
        self.parts = {p: _flat(mods[p]) for p in split.first + split.last}
        params, self.specs = self._arrange(mods)
        self.params_ = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(self.mesh, s)), params, self.specs)
        self.opt_state = tx.init(self.params_)
        self._seam_calls, self._chain_checked = 0, False
        self._step = jax.jit(self._step_fn, donate_argnums=(0, 1))

    # --- wrap-time checks ---------------------------------------------------------------------------

    def _check_split(self, mods):
        sp = self.split
        _, refs = submodules(self.root)
        for p in sp.first + sp.last + (sp.blocks,):
            m = _resolve(self.root, p)
            if m is not None and refs.get(id(m), 0) > 1:
                raise ComposeError(f"compose: the module at {p!r} is held in {refs[id(m)]} places (tied); compose "
                                   "trains each split part's own Params: untie it")
            if p not in mods:
                raise ComposeError(f"compose: split path {p!r} is no module of {type(self.root).__name__}; "
                                   "fix the split")
        blocks = mods[sp.blocks]
        if not isinstance(blocks, nnx.List) or not len(blocks):
            raise ComposeError(f"compose: split.blocks {sp.blocks!r} is a {type(blocks).__name__}, not a non-empty "
                               "nnx.List of blocks (a scan/vmap-stacked module is not split): hold the blocks in one")
        self.L = len(blocks)
        if self.L % self.S:
            raise ComposeError(f"compose: {self.L} blocks ({sp.blocks}) do not split evenly over pp={self.S}; "
                               "use a pp size that divides the block count")
        shapes = lambda m: [(key_of(k), v.shape) for k, v in jax.tree_util.tree_flatten_with_path(
            nnx.state(m, nnx.Param))[0]]
        for i in range(1, self.L):
            if shapes(blocks[i]) != shapes(blocks[0]) or type(blocks[i]) is not type(blocks[0]):
                raise ComposeError(f"compose: block {sp.blocks}.{i} differs from {sp.blocks}.0 (type or Params); "
                                   "the blocks are stacked per stage: make them identical or move it to first/last")
        parts = sp.first + sp.last + tuple(f"{sp.blocks}.{i}" for i in range(self.L))
        for holder in param_holders(self.root).values():
            owners = {q for q in parts for h in holder if h == q or h.startswith(q + ".")}
            if len(owners) != 1:
                what = "in no module of the split" if not owners else f"shared by {sorted(owners)} (tied)"
                raise ComposeError(f"compose: a Param of {holder[0]!r} is {what}; compose trains each split part's "
                                   "own Params: untie it / add its module to split.first or split.last")

    def _check_plan(self, mods, plan) -> dict[str, str]:
        """The plan as {path inside one block: style}; refuses what compose cannot split exactly."""
        prefix, out = self.split.blocks + ".", {}
        for pattern, style in plan.items():
            hits = [p for p in mods if p and _matches(p, pattern)]
            if style not in ("colwise", "rowwise"):
                raise ComposeError(f"compose: plan key {pattern!r} has style {style!r}; compose splits 'colwise' and "
                                   "'rowwise' only (embedding and head stay replicated): drop it or use parallel.tp")
            if not hits:
                raise ComposeError(f"compose: plan key {pattern!r} matches no module ('*' = one segment); fix the key")
            for p in hits:
                m = mods[p]
                if not p.startswith(prefix) or not isinstance(m, nnx.Linear):
                    raise ComposeError(f"compose: plan key {pattern!r} hits {p!r} ({type(m).__name__}); compose "
                                       f"splits nnx.Linear modules inside {self.split.blocks} only: drop the key")
                if style == "rowwise" and m.bias is not None:
                    raise ComposeError(f"compose: rowwise {p!r} has a bias; compose has no rowwise bias: "
                                       "use_bias=False")
                rel = p[len(prefix):].split(".", 1)[1]
                dim = m.kernel.shape[1 if style == "colwise" else 0]
                parent = mods[p.rsplit(".", 1)[0]]
                hd = getattr(parent, "head_dim", None)
                if dim % self.tp or (hd and (dim // hd) % self.tp):
                    unit = f"{dim // hd} heads" if hd else f"{dim} features"
                    raise ComposeError(f"compose: {style} {p!r} has {unit}, not divisible by tp={self.tp}; use a tp "
                                       "size dividing every planned module's heads / features")
                out[rel] = style
        return out

    # --- the arrays: blocks stacked (S, L/S, …), the rest as they are, and their specs ------------------

    def _unit(self, path: str) -> bool:
        """Is this Param in a ZeRO unit (some prefix of its module path matches a unit glob)?"""
        segs = path.split(".")
        return self.units is None or any(_matches(".".join(segs[:len(u.split("."))]), u) for u in self.units)

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
            axes[0] = _one(((axes[0],) if axes[0] else ()) + ("fsdp",))
        return axes

    def _arrange(self, mods):
        sp, S, per = self.split, self.S, self.L // self.S
        rest = {f"{p}.{k}": v for p in sp.first + sp.last for k, v in _flat(mods[p])[3].items()}
        layer_states = [_flat(mods[f"{sp.blocks}.{i}"])[3] for i in range(self.L)]
        blocks = {k: jnp.stack([s[k] for s in layer_states]).reshape((S, per) + layer_states[0][k].shape)
                  for k in layer_states[0]}
        stage = "pp" if "pp" in self.layout else None
        specs = {"rest": {k: P(*self._spec(k, None, a.shape)) for k, a in rest.items()},
                 "blocks": {k: P(stage, None, *self._spec(f"{sp.blocks}.0.{k}", k, a.shape[2:]))
                            for k, a in blocks.items()}}
        return {"rest": rest, "blocks": blocks}, specs

    # --- the forward ---------------------------------------------------------------------------------

    @staticmethod
    def _module(parts, flat: dict):
        gdef, treedef, keys, _ = parts
        return nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, [flat[k] for k in keys]))

    def _stand_ins(self, layer, f_cache: dict):
        for rel, style in self.rel_plan.items():
            parent, key = layer, rel.rsplit(".", 1)
            for k in key[0].split(".") if len(key) == 2 else ():
                parent = parent[int(k)] if k.isdigit() else getattr(parent, k)
            m = getattr(parent, key[-1])
            put_child(parent, key[-1], _Col(m, f_cache) if style == "colwise" else _Row(m))
        return layer

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
            layers = [self._stand_ins(layer, f_cache) for layer in layers]

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
        specs, data, seq = self.specs, _one(self.data), self.seq

        def gather(a, spec, lead: int, axis: int):  # fsdp: dim 0 of the Param's own dims gathered over "fsdp"
            first = spec[lead] if len(spec) > lead else None
            has = first == "fsdp" or (isinstance(first, tuple) and "fsdp" in first)
            return lax.all_gather(a, "fsdp", axis=axis, tiled=True) if has else a

        def body(params, tokens, targets, positions):  # blocks (1, L/S, …) -> (L/S, …)
            blocks = {k: gather(a[0], specs["blocks"][k], 2, 1) for k, a in params["blocks"].items()}
            rest = {k: gather(a, specs["rest"][k], 0, 0) for k, a in params["rest"].items()}
            ctx = cp_seam._active(self.cp_variant, self.c, self._record) if self.c > 1 else contextlib.nullcontext()
            with ctx:
                loss = self._forward_loss({"blocks": blocks, "rest": rest}, tokens, targets, positions, True)
            return loss[None]

        return jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P(data, seq), P(data, seq), P(seq)),
                             out_specs=P(_one(self.data + ((seq,) if seq else ()))), check_vma=True)

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
        rows = NamedSharding(self.mesh, P(_one(self.data), self.seq))
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


def _resolve(root, path: str):
    """The module at a dotted path, or None."""
    m = root
    for k in path.split("."):
        try:
            m = m[int(k)] if k.isdigit() else getattr(m, k)
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
    return m


def _flat(module):
    """(graphdef, treedef, Param keys, {key: array}) of a module: its state flattened by path."""
    gdef, params, rest = nnx.split(module, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ComposeError(f"compose: {type(module).__name__} holds state other than nnx.Param; compose trains "
                           "Params only: make it a Param or a static attribute")
    gdef, params = nnx.split(module)
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = [key_of(p) for p, _ in pairs]
    return gdef, treedef, keys, dict(zip(keys, (v for _, v in pairs), strict=True))


class _Col:
    """colwise stand-in: f (pcast to varying over "tp": psum of dL/dx in backward; one per input array,
    shared by the siblings reading it), then the local shard."""

    def __init__(self, m, f_cache: dict):
        self.m, self.f_cache = m, f_cache

    def __call__(self, x):
        t = jax.typeof(x)
        if "tp" in (getattr(getattr(t, "mat", None), "varying", None) or getattr(t, "vma", ())):
            return self.m(x)
        if id(x) not in self.f_cache:  # the array kept with its cast: its id stays unique
            self.f_cache[id(x)] = (x, lax.pcast(x, "tp", to="varying"))
        return self.m(self.f_cache[id(x)][1])


class _Row:
    """rowwise stand-in: the local shard's partial sums, then g (psum over "tp")."""

    def __init__(self, m):
        self.m = m

    def __call__(self, x):
        return lax.psum(self.m(x), "tp")


def compose(model: nnx.Module, layout: dict[str, int], loss: Callable, tx: optax.GradientTransformation, *,
            plan: dict[str, str] | None = None, split: Split, units=None, style: str = "shard_map",
            microbatches: int | None = None, devices=None, cp_variant: str = "ring") -> Composed:
    """Train ``model`` on one mesh of ``layout`` ({axis: size}, axes dp fsdp pp cp tp); ``loss(logits,
    targets)`` a mean over the tokens it gets; ``plan`` {module path glob: colwise | rowwise};
    ``split`` the model's stage split; ``units`` module-path globs whose Params fsdp shards (default
    all); ``microbatches`` under pp (default pp); ``cp_variant`` the seam's ring / ring_zigzag / ulysses
    (shard_map). The model's attention must call parallel.cp.attention."""
    return Composed(model, layout, loss, tx, plan, split, units, style, microbatches, devices, cp_variant)
