"""compose's expert axis ("ep") for a user's NNX mixture-of-experts model: the stacked experts the
``experts=`` globs name split over "ep", the rest of the model data-parallel over it. What
jax_impl/parallel/compose.py's ``Composed`` checks and runs when the layout names "ep" (or experts=).
The twin: torch_impl/parallel/compose_ep.py (the same semantics).

    compose(model, {"fsdp": 2, "ep": 2, "tp": 2}, loss, tx, plan=PLAN, split=SPLIT, units=["layers.*"],
            experts=["layers.*.moe.experts"], aux=model.aux)

The user's MoE layer calls the seam, the same code on one device and under compose:

    out = parallel.ep.dispatch(expert_fn, self.experts_weights, h, top)   # (n, k, D)
    counts = parallel.ep.global_counts(top, E)                           # the balancing loss's f
    self.aux = nnx.Intermediate(coef * E * jnp.sum(f * probs.mean(0)))  # read by aux=

Sharded:
  data      "ep" is a DATA axis: the batch rows split over every data axis (dp, fsdp, ep) in mesh order
            (row-major: the data index); dense Params replicated over ep (fsdp shards them over "fsdp" as
            without ep), their gradients summed over every data device by the transpose of the body's
            invariant -> varying cast (the step differentiates the mean of the devices' mean losses).
  experts   every Param under a module an ``experts=`` glob names (all stacked (E, …), E divisible by
            ep) has spec P("ep", …) (blocks: P(None, None, "ep", …)): device r holds experts
            [r·E/ep, (r+1)·E/ep), replicated over dp × fsdp × tp — never tp-split (a plan entry on them
            is refused), never fsdp-sharded (a unit containing them leaves them out; a unit glob naming
            them is refused). shard_map: inside the body ``parallel.ep.dispatch`` moves the tokens over
            "ep" (capacity C = n local tokens, nothing dropped); the experts' gradient (Σ over the ep
            group's tokens, through the all_to_all's transpose) is summed over dp × fsdp by the cast's
            transpose: with the mean outside, one device's mean-loss gradient (no extra scaling). jit:
            the same spec as a NamedSharding; ``dispatch`` runs unmapped on the global arrays and XLA
            places the collectives.
  balance   ``global_counts`` / ``total_counts`` psum the (E,) counts over every data axis (dp, fsdp, ep;
            × cp without ep) inside the body: the balancing loss's f is the whole batch's, its mean probs
            the device's (the mean over devices of the local losses holds the global P), as one device.
            ``aux=``: a callable reading the layers' balancing losses after each forward (e.g. the model's
            own ``aux`` method, called on this forward's modules), added to each device's loss.

Collectives per step and device (shard_map; n local tokens = B·T/d, d = dp·fsdp·ep):
  ep        per MoE layer call 4 all_to_alls (dispatch, combine; their transposes) of E·n·D'·b each
  data      per MoE layer one all-reduce of the (E,) int32 counts (the balancing loss; none without it)
  dp×fsdp   the experts' gradients join the one all-reduce of every array not split on those axes
  the rest  compose.py's (tp's f / g around the planned Linears, fsdp's gathers, the data all-reduce)
``Composed.comm_theory()`` adds ep's from the last trace (theory.compose_comm: the seam's calls).

Refused before compiling (ComposeError, one line: what, which axes, the fix): ep beside pp or cp; ep > 1
without ``experts=``; an ``experts=`` glob naming no module; a named module whose Params are not all
stacked (E, …) with one E; E not divisible by ep; experts in some blocks and not others; a plan entry or
a ZeRO unit glob naming an expert module or a module inside one; ``aux`` under pp.

Accumulation (``microbatches=K`` without pp) with ep or ``aux``: micro-batch k is the batch's rows
[k·B/K, (k+1)·B/K), as one device accumulating K parts takes them (Megatron's per-micro-batch balancing
loss): each routes and counts its own tokens (the counts summed over every data rank, per micro-batch)
and adds its own balancing loss. shard_map places the rows so that device i's chunk k is its share of
micro-batch k (``Composed._batch``); jit slices the global rows.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import jax
from flax import nnx

from jax_impl.parallel.compose_axes import ComposeError, Split
from jax_impl.parallel.tree import key_of, matches

DATA_AXES = ("dp", "fsdp", "ep")  # the batch rows split over these, row-major in mesh order


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def without_intermediates(model):
    """A model that ran eagerly holds its sown nnx.Intermediate values (a layer's ``aux``): compose trains
    Params only, so it takes a clone without them (the model is not changed)."""
    if not jax.tree.leaves(nnx.state(model, nnx.Intermediate)):
        return model
    model = nnx.clone(model)
    nnx.pop(model, nnx.Intermediate)
    return model


class Experts:
    """The ``experts=`` modules (or Params) of one model: ``rest`` full paths outside the blocks, ``rel``
    paths inside one block (every block alike), ``n`` the ep size, ``E`` the experts per module."""

    def __init__(self, mods: dict, sp: Split, layers: int, layout: dict[str, int], globs, plan, units,
                 microbatches: int | None, aux):
        n, S = layout.get("ep", 1), layout.get("pp", 1)
        self.n, self.globs, self.aux = n, list(globs), aux
        if n > 1:
            beside = [f"{a}={layout[a]}" for a in ("pp", "cp") if layout.get(a, 1) > 1]
            if beside:
                raise ComposeError(f"compose: ep={n} beside {', '.join(beside)} is not composed (pp would stage the "
                                   "MoE layers' all-to-alls, cp would route T/cp tokens per device with the balancing "
                                   "loss's means over them); fix: ep with dp / fsdp / tp only")
            if not self.globs:
                raise ComposeError(f"compose: ep={n} needs experts=[module path globs] naming each MoE layer's stacked "
                                   "experts module (e.g. experts=['layers.*.moe.experts']); fix: name them, or drop ep")
        if aux is not None and S > 1:
            raise ComposeError(f"compose: aux= under pp={S}: the layers' balancing losses sit on every stage; fix: "
                               "drop pp (dp / fsdp / ep / tp / cp carry aux=)")
        held = {key_of(k): tuple(a.shape) for k, a in jax.tree_util.tree_flatten_with_path(
            nnx.state(mods[""], nnx.Param))[0]}  # every Param path: a glob may name Params too
        paths = []
        for glob in self.globs:
            hit = [p for p in list(mods) + list(held) if p and matches(p, glob)]
            if not hit:
                raise ComposeError(f"compose: experts glob {glob!r} names no module; fix: a module path glob ('*' one "
                                   "segment) of the module holding the stacked (E, …) expert weights (or their Params)")
            paths += [p for p in hit if p not in paths]
        self.E = None
        for p in paths:
            shapes = [s for k, s in held.items() if _inside(k, p)]
            lead = {s[0] if s else None for s in shapes}
            if not shapes or len(lead) != 1 or None in lead or (self.E is not None and lead != {self.E}):
                raise ComposeError(f"compose: experts {p!r}: its Params must all be stacked (E, …) on dim 0 with one "
                                   f"E (shapes {shapes}); fix: name the module holding only the stacked expert weights")
            self.E = lead.pop()
        if self.E is not None and self.E % n:
            raise ComposeError(f"compose: experts {paths[0]!r}: {self.E} experts are not divisible by ep={n}; fix: an "
                               "ep size dividing E")
        prefix = sp.blocks + "."
        self.rest = tuple(p for p in paths if not p.startswith(prefix))
        rel = {p[len(prefix):].split(".", 1)[1] for p in paths if p.startswith(prefix) and "." in p[len(prefix):]}
        for r in rel:
            hits = [f"{sp.blocks}.{i}.{r}" in paths for i in range(layers)]
            if not all(hits):
                raise ComposeError(f"compose: experts={self.globs} name {sp.blocks}.*.{r} in {sum(hits)} of the "
                                   f"{layers} blocks; compose stacks the blocks' Params: name it in every block or "
                                   "none")
        self.rel = tuple(sorted(rel))
        self.paths = paths
        if n > 1:
            for what, gl in (("tp plan entry", list(plan or {})), ("ZeRO unit glob", list(units or ()))):
                for glob in gl:
                    hit = next((p for p in mods if p and matches(p, glob) and any(_inside(p, e) for e in paths)), None)
                    if hit:
                        raise ComposeError(f"compose: {what} {glob!r} names {hit!r}, inside the experts that ep={n} "
                                           "splits whole by expert (never tp-split or fsdp-sharded); fix: leave the "
                                           "experts out of it")

    def split(self, part: str, key: str) -> bool:
        """Is compose's leaf ``key`` (part "rest": a full Param path; "blocks": a path inside one block) an
        expert Param that ep splits (ep > 1)?"""
        if self.n == 1:
            return False
        roots = self.rel if part == "blocks" else self.rest
        return any(_inside(key, r) for r in roots)

    def aux_value(self, root, parts: dict, blocks: str, layers: list) -> jax.Array:
        """``aux`` on this forward's modules: a bound method of the model gets a view of them (its
        attributes the split's paths: ``view.layers[i]`` the merged layer i), any other callable the same view."""
        view = SimpleNamespace()

        def put(path, m):
            node, segs = view, path.split(".")
            for s in segs[:-1]:
                if not hasattr(node, s):
                    setattr(node, s, SimpleNamespace())
                node = getattr(node, s)
            setattr(node, segs[-1], m)

        for p, m in parts.items():
            put(p, m)
        put(blocks, list(layers))
        fn: Callable = self.aux
        if getattr(fn, "__self__", None) is root:  # model.aux: its function on the view
            fn = fn.__func__
        return fn(view)
