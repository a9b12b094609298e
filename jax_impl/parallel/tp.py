"""A tensor-parallel PLAN applied to any Flax NNX model: the twin of torch_impl/parallel/tp.py, with
parallel.fsdp.parallelize's surface (jax_impl/tp.py runs the project's transformer through it).

    plan = {"emb": "vocab_embed", "blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.o": "rowwise",
            "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise", "head": "colwise_vocab"}
    trainer = apply_plan(model, plan, lambda m, x, y: cross_entropy(m(x), y), optax.adamw(1e-3), mesh)
    loss_value = trainer.train_step(x, y)      # the batch replicated over "tp"

Styles (nnx.Linear kernel (in, out)): colwise P(None, "tp") with f before; colwise_heads (a fused
[q|k|v] kernel split by whole heads); rowwise P("tp", None) with g after (the bias added once);
vocab_embed (nnx.Embed rows split); colwise_vocab (logits stay (B, T, V/tp) for ``cross_entropy``).
Collectives: f = pcast(x, to="varying") (identity fwd, psum bwd), g = psum (identity bwd); siblings
reading the same array share one f; the loss: pmax + one psum of (2, B, T), backward local.
Bytes per step per device, a Llama-style model: (4L+2)·B·T·D·b + 3·B·T·b
(shared.theory.tp_transformer_comm). Memory: split weights /tp (padded to ⌈V/tp⌉ rows), the rest whole.
shard_map (check_vma) swaps the planned modules for stand-ins carrying f / g; jit places the same
shards and XLA (GSPMD) inserts the collectives.
``check_plan`` refuses what cannot be split exactly with one ``PlanError`` (what, module path, fix):
docs/tp.md, "Bring your own model (JAX apply_plan)".
Recipe (parallel/recipe.py, docs/recipe.md): optax sees the whole dict, vocabulary leaves padded and
colwise_heads' columns reordered (``recipe.check`` refuses a ``tx`` that reads those shapes);
``clip=max_norm`` (torch's formula), ``compute_dtype=`` (the Params cast inside the step). A loss that
maps over the model's state (nnx.split -> astype -> nnx.merge) meets the stand-ins: refused at the
first trace, naming compute_dtype=. float16 adds dynamic loss scaling (parallel/scaling.py; the
gradients leave the shard_map global: XLA all-reduces the skip flag, 1 byte per split leaf).
Papers: Megatron-LM, Shoeybi et al. 2019 (arXiv:1909.08053 §3).
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.parallel import recipe, scaling
from jax_impl.parallel.tree import fetch, key_of, matches, param_holders, put_child, submodules

STYLES = ("colwise", "colwise_heads", "rowwise", "vocab_embed", "colwise_vocab")
KIND = {"colwise": nnx.Linear, "colwise_heads": nnx.Linear, "rowwise": nnx.Linear, "colwise_vocab": nnx.Linear,
        "vocab_embed": nnx.Embed}
SPLIT_DIM = {"colwise": -1, "colwise_heads": -1, "colwise_vocab": -1, "rowwise": 0, "vocab_embed": 0}  # kernel / table
PADDED = ("vocab_embed", "colwise_vocab")


class PlanError(ValueError):
    """A plan ``apply_plan`` cannot carry out exactly on this model: what, module path, how to fix."""


def split_dim(style: str, ndim: int) -> int:
    """The dim a planned array splits: colwise styles the last (a kernel's outputs; a (D, 3, D) held
    [q|k|v] its heads), rowwise and vocab_embed dim 0; a vector (a colwise bias) dim 0."""
    return 0 if ndim <= 1 or style is None else SPLIT_DIM[style] % ndim


def spec(style: str | None, ndim: int, axis: str = "tp") -> P:
    """The PartitionSpec of an array the plan gives ``style`` (None: replicated)."""
    return P() if style is None else P(*[axis if i == split_dim(style, ndim) else None for i in range(ndim)])


def plan_rules(plan: dict[str, str], axis: str = "tp") -> Callable[[str, tuple], P]:
    """The plan as a rule over parameter NAMES ("blocks.0.attn.qkv.weight", its module path + leaf):
    (name, shape) -> PartitionSpec, for a model held as a {name: array} dict (jax_impl/mesh.py's
    transformer). The same vocabulary and glob rule as ``apply_plan``; a rowwise bias stays whole."""

    def rule(name: str, shape: tuple) -> P:
        path, _, leaf = name.rpartition(".")
        style = next((st for k, st in plan.items() if matches(path, k)), None)
        if style == "rowwise" and len(shape) == 1 or leaf not in ("weight", "kernel", "embedding", "bias"):
            style = None
        return spec(style, len(shape), axis)

    return rule


def _refuse(path, m, style, what, fix):
    raise PlanError(f"tp plan: {style!r} at {path!r} ({type(m).__name__}): {what}. Fix: {fix}")


def _paths(model, path: str = "", inside: frozenset = frozenset()) -> list[tuple[str, nnx.Module]]:
    """Every (path, submodule), a module held in two places under both paths."""
    out = [(path, model)]
    for k, child in nnx.iter_children(model) if id(model) not in inside else ():
        if isinstance(child, nnx.Module):
            out += _paths(child, f"{path}.{k}" if path else str(k), inside | {id(model)})
    return out


def planned_modules(model, plan: dict[str, str]) -> list[tuple[str, nnx.Module, str]]:
    """[(module path, module, style)] in model order; refuses unknown styles, keys matching nothing,
    a module given two styles."""
    mods, chosen = dict(_paths(model)), {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise PlanError(f"tp plan: key {pattern!r} has unknown style {style!r}. Fix: use one of {STYLES}")
        hits = [p for p in mods if p and matches(p, pattern)]
        if not hits:
            names = [p for p in mods if p]
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            raise PlanError(f"tp plan: key {pattern!r} ({style}) matches no module of {type(model).__name__} ('*' = "
                            f"one segment, '**' any). Fix: correct the key (close: {close or names[:6]}) or drop it")
        for p in hits:
            if p in chosen and chosen[p][0] != style:
                raise PlanError(f"tp plan: module {p!r} is matched by {chosen[p][1]!r} ({chosen[p][0]}) and by "
                                f"{pattern!r} ({style}). Fix: give each module one style")
            chosen.setdefault(p, (style, pattern))
    return [(p, mods[p], chosen[p][0]) for p in mods if p in chosen]


def check_plan(model, plan: dict[str, str], tp: int) -> dict[str, str]:
    """Every precondition of ``apply_plan`` at ``tp`` devices, nothing changed: raises ONE PlanError
    for the first problem. Returns {Param path: style} of every split Param (kernels, embeddings,
    colwise biases; rowwise biases are replicated)."""
    _, _, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        bad = sorted({key_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(rest)[0]})
        raise PlanError(f"tp plan: {type(model).__name__} holds state other than nnx.Param ({', '.join(bad[:4])}): "
                        "apply_plan trains Params only. Fix: build it without BatchNorm statistics / Dropout RNG state")
    mods, holders, out = dict(_paths(model)), param_holders(model), {}
    refs = Counter(id(m) for m in mods.values())
    for path, m, style in planned_modules(model, plan):
        if type(m) is not KIND[style]:
            _refuse(path, m, style, f"this style splits an nnx.{KIND[style].__name__} (exactly: a subclass may "
                    "compute otherwise); this module is not one", f"plan the nnx.{KIND[style].__name__}(s) inside "
                    f"{path!r}, or leave it out of the plan (replicated)")
        if refs[id(m)] > 1:
            _refuse(path, m, style, f"the module is reachable from {refs[id(m)]} places; only one would be split",
                    "hold it in one place, or leave it replicated")
        for name, v in nnx.iter_children(m):
            if isinstance(v, nnx.Variable) and len(holders.get(id(v), ())) > 1:
                others = [p for p in holders[id(v)] if p != path]
                _refuse(path, m, style, f"its Param {name!r} is also held by {others} (tied)", "untie it, or "
                        "leave every holder replicated")
        if style == "vocab_embed":
            out[f"{path}.embedding"] = style
            continue
        if m.kernel.ndim != 2:
            _refuse(path, m, style, f"its kernel has shape {m.kernel.shape}, not (in, out) (stacked layers: "
                    "nnx.scan / vmap)", "plan unstacked nnx.Linear layers, or leave it replicated")
        d_in, d_out = m.kernel.shape
        split = d_in if style == "rowwise" else d_out // 3 if style == "colwise_heads" else d_out
        hd = getattr(mods[path.rpartition(".")[0]], "head_dim", None)  # an attention module's
        if style == "colwise_heads" and (d_out % 3 or not isinstance(hd, int)):
            _refuse(path, m, style, f"it needs a fused [q|k|v] kernel (D, 3·H·dh) and its parent's head_dim: "
                    f"out_features={d_out}, head_dim={hd}", "give the attention module a head_dim attribute and "
                    "equal q, k, v widths, or plan separate q, k, v with 'colwise'")
        if style != "colwise_vocab" and isinstance(hd, int) and (split % hd or (split // hd) % tp):
            _refuse(path, m, style, f"it would split {split / hd:g} heads of head_dim={hd} over tp={tp}: a device "
                    "would hold part of a head", "use a tp that divides every head count (GQA: the k/v heads too), "
                    "or leave the attention replicated")
        if style != "colwise_vocab" and split % tp:
            which = "in_features" if style == "rowwise" else "out_features"
            _refuse(path, m, style, f"{which}={split} is not divisible by tp={tp}", f"make {which} a multiple of "
                    f"{tp}, use a tp that divides it, or leave the layer replicated (only the vocabulary styles pad)")
        out[f"{path}.kernel"] = style
        if m.bias is not None and style != "rowwise":
            out[f"{path}.bias"] = style
    return out


def local_shapes_refusal(e: Exception) -> str:
    """One line for a forward that failed on tp-local shards (shard_map): the usual causes and fixes."""
    return (f"tp plan: the model's forward fails on this device's shards ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120]}): a module reads a head count or width from its config, not from its "
            "weights (H/tp heads' columns reshaped as H), or a colwise output (out/tp features) reaches a module "
            "that expects them all. Fix: derive counts from the kernel (q.reshape(b, t, -1, head_dim)), as torch's "
            "plan does; pair each colwise with the rowwise that consumes it; or leave the module out of the plan")


def heads_perm(cols: int, n: int) -> np.ndarray:
    """Column order of a fused [q|k|v] kernel that hands device r the block [q_r|k_r|v_r]."""
    c = cols // 3
    return np.concatenate([np.arange(c // n) + j * c + r * (c // n) for r in range(n) for j in range(3)])


def _matmul(m: nnx.Linear, x):
    """nnx.Linear's product without its bias."""
    x, k = m.promote_dtype((x, m.kernel[...]), dtype=m.dtype)
    kw = {} if m.preferred_element_type is None else {"preferred_element_type": m.preferred_element_type}
    return m.dot_general(x, k, (((x.ndim - 1,), (0,)), ((), ())), precision=m.precision, **kw)


def _varying(x) -> frozenset:
    """The manual axes ``x`` varies over inside shard_map (check_vma): jax 0.10 keeps them in the
    type's ``mat.varying``, earlier versions in ``vma``."""
    t = jax.typeof(x)
    return frozenset(getattr(getattr(t, "mat", None), "varying", None) or getattr(t, "vma", ()))


class _Trace:
    """One trace of the step: the mode, the f cache (one f per input array), the loss checks."""

    def __init__(self, trainer, shard_map: bool):
        self.t, self.shard_map, self.f_cache, self.heads, self.ce = trainer, shard_map, {}, 0, 0

    def at(self, a, *spec):
        return lax.with_sharding_constraint(a, NamedSharding(self.t.mesh, P(*spec)))

    def enter(self, x):
        """f: shard_map: pcast to varying (bwd psum), once per input array; jit: x replicated."""
        if not self.shard_map:
            return self.at(x)
        if id(x) not in self.f_cache or not self.t.shared_f:
            varying = self.t.axis in _varying(x)
            self.f_cache[id(x)] = (x, x if varying else lax.pcast(x, self.t.axis, to="varying"))
        return self.f_cache[id(x)][1]


_ACTIVE: list[_Trace] = []  # the trace in progress (cross_entropy reads it)


class _Split:
    """Stands in for a planned module inside the traced step; its weights are the local shards
    (shard_map) or the sharded globals (jit)."""

    def __init__(self, m, path: str, style: str, trace: _Trace):
        self._m, self._path, self._style, self._tr = m, path, style, trace

    def __call__(self, x, *args, **kwargs):
        m, tr, ax = self._m, self._tr, self._tr.t.axis
        if self._style == "vocab_embed":
            if not tr.shard_map:
                return tr.at(m(x, *args, **kwargs))
            rows = m.embedding.shape[0]  # ⌈V/tp⌉
            local = x - lax.axis_index(ax) * rows  # (B, T)
            mine = (local >= 0) & (local < rows)
            return lax.psum(jnp.where(mine[..., None], m(jnp.where(mine, local, 0)), 0), ax)  # g: (B, T, D)
        if self._style == "rowwise":
            y = _matmul(m, x)  # (…, out) partial sums
            y = lax.psum(y, ax) if tr.shard_map else tr.at(y)  # g
            return y if m.bias is None else y + m.bias[...]  # the bias once, after g
        y = m(tr.enter(x), *args, **kwargs)  # (…, out/tp)
        y = y if tr.shard_map else tr.at(y, *[None] * (y.ndim - 1), ax)
        if self._style == "colwise_heads" and not tr.shard_map:  # [q_0|k_0|v_0|q_1|…] -> [q|k|v]
            y = y[..., np.argsort(heads_perm(y.shape[-1], tr.t.n))]
        if self._style == "colwise_vocab":
            tr.heads += 1
            vocab, cols = tr.t.vocab[self._path], y.shape[-1]
            start = lax.axis_index(ax) * cols if tr.shard_map else 0
            if vocab % tr.t.n:  # padding columns: −inf, out of every softmax
                y = jnp.where(start + jnp.arange(cols) >= vocab, -jnp.inf, y)
        return y

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in recipe.ARRAY_ATTRS:
            raise PlanError(f"tp plan: {recipe.as_array(self._path, name)}")
        value = getattr(self._m, name)
        if isinstance(value, nnx.Variable) or callable(value):
            raise PlanError(f"tp plan: {name!r} of {self._path!r} ({self._style}) was read by its parent; the "
                            "module is split over tp there. Fix: call the module, or leave it out of the plan")
        return value  # plain attributes (features, head counts) are the module's own


def cross_entropy(logits, targets):
    """Mean cross entropy over integer ``targets`` (…,). Full logits (…, V): log-sum-exp minus the
    target logit. Inside a shard_map step, logits varying over the axis are a colwise_vocab head's
    split ones (…, ⌈V/tp⌉): pmax of the row max, ONE psum of (2, …) (target logit, Σexp); backward
    local. (Invariant logits are full; jit: the logits are global, XLA splits the same sums.)"""
    tr = _ACTIVE[-1] if _ACTIVE else None
    if tr is not None:
        tr.ce += 1
    if tr is None or not tr.shard_map or tr.t.axis not in _varying(logits):
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)
    ax, rows = tr.t.axis, logits.shape[-1]
    m = lax.pmax(lax.stop_gradient(logits.max(axis=-1)), ax)  # (…,); cancels in the loss
    shifted = logits - m[..., None]
    local = targets - lax.axis_index(ax) * rows
    mine = (local >= 0) & (local < rows)
    picked = jnp.take_along_axis(shifted, jnp.where(mine, local, 0)[..., None], axis=-1)[..., 0]
    picked, sumexp = lax.psum(jnp.stack([jnp.where(mine, picked, 0), jnp.exp(shifted).sum(-1)]), ax)  # (2, …)
    return jnp.mean(jnp.log(sumexp) - picked)


class Trainer:
    """``apply_plan``'s result: ``state`` = (params {path: array, split ones padded / reordered},
    opt_state); ``step(params, opt_state, *batch) -> (params, opt_state, loss, grads)`` the jitted pure
    step; ``train_step(*batch)`` -> the loss; ``full_params`` / ``module()`` the trained model."""

    def __init__(self, model, plan, loss, tx, mesh, style, axis, shared_f=True, clip=None, compute_dtype=None,
                 loss_scale=None):
        self.n, self.mesh, self.axis, self.style, self._loss, self._tx = mesh.shape[axis], mesh, axis, style, loss, tx
        self.clip, self.compute_dtype = clip, compute_dtype
        self.scaler = scaling.resolve(loss_scale, compute_dtype, f"tp plan {style}")
        self.per_step = ("skipped", "loss_scale") if self.scaler else ()  # the step's outputs after grads
        self.shared_f = shared_f
        self.styles = check_plan(model, plan, self.n)
        planned = planned_modules(model, plan)
        self.planned = [(p, s) for p, _, s in planned]
        self.vocab = {p: m.kernel.shape[1] for p, m, s in planned if s == "colwise_vocab"}  # V unpadded
        self.graphdef, state = nnx.split(model)
        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(state)
        self.keys = [key_of(p) for p, _ in leaves]
        self.sizes, self.specs = {}, {}
        for k, (_, a) in zip(self.keys, leaves, strict=True):
            s = self.styles.get(k)
            self.specs[k] = spec(s, a.ndim, axis)
        layout = recipe.Whole("optax sees your dict with the vocabulary styles' leaves padded to ⌈V/tp⌉ and "
                              "colwise_heads' columns reordered", self._place, self._unplace, self.n)
        recipe.check(tx, {k: a for k, (_, a) in zip(self.keys, leaves)}, layout, "tp plan",
                     "use an optimizer that reads no shapes (parallelize(..., style='jit') hands optax the "
                     "unpadded tree); for global-norm clipping apply_plan(..., clip=max_norm)")
        placed = self._place({k: a for k, (_, a) in zip(self.keys, leaves)})
        params = {k: jax.device_put(np.asarray(a), NamedSharding(mesh, self.specs[k]))  # host copy: the step donates it
                  for k, a in placed.items()}
        opt_state = jax.jit(tx.init)(params)
        self.state = (params, opt_state)
        shard = {k: NamedSharding(mesh, s) for k, s in self.specs.items()}
        if self.scaler:  # the scale state: a third state entry, replicated (parallel.scaling)
            self.state += (jax.device_put(self.scaler.init(), NamedSharding(mesh, P())),)
            self.step = jax.jit(self._step, donate_argnums=(0, 1, 2),
                                out_shardings=(shard, None, None, None, shard, None, None))
        else:
            self.step = jax.jit(lambda p, o, *batch: self._step(p, o, None, *batch)[:4], donate_argnums=(0, 1),
                                out_shardings=(shard, None, None, shard))
        self._compiled = None

    def _place(self, tree: dict) -> dict:
        """The leaves as the step holds them: the vocabulary styles' padded with zero rows / columns up
        to ⌈V/tp⌉ per device (``sizes``: (dim, V)), colwise_heads' columns reordered: device r [q_r|k_r|v_r]."""
        out, self.sizes = {}, {}
        for k, a in tree.items():
            s = self.styles.get(k)
            d = split_dim(s, a.ndim)
            if s in PADDED and a.shape[d] % self.n:
                self.sizes[k] = (d, a.shape[d])
                a = jnp.pad(a, [(0, -a.shape[d] % self.n if i == d else 0) for i in range(a.ndim)])
            out[k] = a[..., heads_perm(a.shape[-1], self.n)] if s == "colwise_heads" else a
        return out

    def _unplace(self, tree: dict) -> dict:
        """``_place`` undone (NumPy): columns in order, padding dropped."""
        out = {k: np.asarray(a) for k, a in tree.items()}
        out |= {k: a[..., np.argsort(heads_perm(a.shape[-1], self.n))] for k, a in out.items()
                if self.styles.get(k) == "colwise_heads"}
        return {k: np.take(a, np.arange(self.sizes[k][1]), self.sizes[k][0]) if k in self.sizes else a
                for k, a in out.items()}

    def _traced_loss(self, params: dict, batch: tuple, shard_map: bool):
        params = recipe.cast(params, self.compute_dtype)
        model = nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._treedef, [params[k] for k in self.keys]))
        tr, mods = _Trace(self, shard_map), submodules(model)[0]
        for path, style in self.planned:
            parent, _, name = path.rpartition(".")
            put_child(mods[parent], name, _Split(mods[path], path, style, tr))
        _ACTIVE.append(tr)
        try:
            loss = self._loss(model, *batch)
        except TypeError as e:  # JAX's shape errors: a forward that does not run on the tp-local shards
            if not shard_map:
                raise
            raise PlanError(local_shapes_refusal(e)) from None
        finally:
            _ACTIVE.pop()
        if tr.heads and not tr.ce:
            raise PlanError("tp plan: a 'colwise_vocab' head's logits are split over tp, and the loss never called "
                            "parallel.tp.cross_entropy. Fix: compute the loss with jax_impl.parallel.tp.cross_entropy")
        if shard_map and self.axis in _varying(loss):
            raise PlanError(f"tp plan: the loss differs across {self.axis!r}: a split output (colwise) reaches it "
                            "without a rowwise module (g) after it. Fix: pair every colwise with a rowwise, or plan "
                            "the LM head 'colwise_vocab' and use parallel.tp.cross_entropy")
        return loss

    def _step(self, params, opt_state, sc, *batch):
        """Scaling (``sc``): the loss times the scale, the gradients divided by it; they leave the shard_map
        as global arrays (split ones sharded), so the finite check over the tree is global: XLA reduces it."""
        if self.style == "jit":
            loss_of = lambda p: self._traced_loss(p, batch, False)
        else:
            local = lambda p, *b: self._traced_loss(p, b, True)
            loss_of = lambda p: jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs, *[P()] * len(batch)),
                                              out_specs=P(), check_vma=True)(p, *batch)
        mult = 1.0 if sc is None else sc["scale"]
        (_, loss), grads = jax.value_and_grad(lambda p: ((l := loss_of(p)) * mult, l), has_aux=True)(params)
        grads = grads if sc is None else self.scaler.unscale(grads, sc)  # (outside shard_map: invariant stays)
        clipped = grads if self.clip is None else recipe.scale_by_norm(grads, recipe.sumsq(grads), self.clip)
        updates, new_opt = self._tx.update(clipped, opt_state, params)  # padding: zero gradients
        new = optax.apply_updates(params, updates)
        if sc is None:
            return new, new_opt, loss, grads, None, None
        (new, new_opt), sc, bad = self.scaler.settle(sc, grads, (new, new_opt), (params, opt_state))
        return new, new_opt, sc, loss, grads, bad > 0, sc["scale"]

    def replicate(self, *batch) -> tuple:
        """The batch on every device of the mesh (TP: each device sees all of it)."""
        return tuple(jax.device_put(jnp.asarray(a), NamedSharding(self.mesh, P())) for a in batch)

    def train_step(self, *batch) -> float:
        batch = self.replicate(*batch)
        if self._compiled is None:
            self._compiled = self.step.lower(*self.state, *batch).compile()
        out = self._compiled(*self.state, *batch)
        *state, loss, _ = out[:len(out) - len(self.per_step)]
        self.state = tuple(state)
        return float(fetch(loss))

    compiler_options = None  # harness.trainer_setup reads it (parallel.fsdp's Trainer sets XLA:CPU options)

    def full_grads(self, grads) -> dict:
        """The step's ``grads`` output as {path: array} (``module(grads)``: full, padding dropped)."""
        return dict(grads)

    def compiled_text(self) -> str:
        """The compiled step's HLO (after a train_step): jax_impl.ledger.comm_from_hlo reads it."""
        return self._compiled.as_text()

    def full_params(self, params: dict | None = None) -> dict[str, np.ndarray]:
        """{path: full array} of the parameters (or of the step's grads), padding dropped, columns in order."""
        params = self.state[0] if params is None else params
        return self._unplace({k: fetch(a) for k, a in params.items()})  # fetch: from any process (jax.distributed)

    def module(self, params: dict | None = None):
        full = self.full_params(params)
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._treedef, [jnp.asarray(full[k])
                                                                                       for k in self.keys]))


def apply_plan(model, plan: dict[str, str], loss: Callable, tx: optax.GradientTransformation, mesh,
               style: str = "shard_map", axis: str = "tp", shared_f: bool = True, *,
               clip: float | None = None, compute_dtype=None, loss_scale=None) -> Trainer:
    """Tensor parallelism of ``model`` by ``plan`` over ``mesh``'s ``axis``; ``loss(model, *batch)``
    a scalar. See the module docstring. ``check_plan`` first: nothing compiles on a refused plan.
    ``shared_f=False``: one f per column-parallel call (for comparison: more backward psums).
    ``clip``: global-norm clipping with the true norm (torch's formula; parallel.recipe); optax sees the
    whole padded tree, probed first (parallel.recipe.check). ``compute_dtype``: the loss sees the floating
    Params cast to it (bf16 compute); master weights and optimizer state stay as given; float16 scales the
    loss (``loss_scale``, parallel.scaling; the scale state is ``state[2]``)."""
    recipe.check_clip(clip, "tp plan", tx)
    if style == "typed":  # issue 33: refused, not built (the project's own transformer has it: jax_impl/tp_typed.py)
        raise PlanError("tp plan: style 'typed' is not built for a plan: under Explicit axes every rowwise product "
                        "contracts a split dim, whose result layout JAX cannot infer, so each planned module's call "
                        "would need an out_sharding the plan cannot add to your code. Fix: style='shard_map' or 'jit'")
    if style not in ("shard_map", "jit"):
        raise PlanError(f"tp plan: unknown style {style!r}. Fix: 'shard_map' or 'jit'")
    if axis not in mesh.shape:
        raise PlanError(f"tp plan: the mesh has axes {tuple(mesh.shape)}, no {axis!r}. Fix: pass axis=<one of them>")
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return Trainer(model, plan, loss, tx, mesh, style, axis, shared_f, clip, compute_dtype, loss_scale)
