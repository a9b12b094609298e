"""Tree utilities for Flax NNX models, shared by the wrappers of jax_impl/parallel/: module paths
(``key_of``, ``submodules``, ``param_holders``, ``put_child``), ZeRO-3's units (``choose_units``) and
row rule (``rule``), the batch placement (``shard_rows``), reading a global array (``fetch``) and the
errors the wrappers raise at wrap time (``WrapError``) and at the first trace (``ShardReadError``).
No torch twin: torch's nn.Module already offers named_modules / named_parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class WrapError(ValueError):
    """A model, unit list or mesh ``parallelize`` cannot train exactly: raised before compiling."""


class ShardReadError(RuntimeError):
    """Under shard_map/zero3 a unit's parameter was read other than by calling the unit."""


def key_of(path) -> str:
    """A pytree / graph path as "blocks.0.attn.kernel" (the ``.value`` of a Variable dropped: its attribute
    key, or a plain "value" last; a module named ``value`` stays: nnx.MultiHeadAttention's ``attn.value.kernel``)."""
    out = []
    for i, k in enumerate(path):
        if (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value") or (k == "value" and i == len(path) - 1):
            continue
        out.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return ".".join(out)


def flat_state(model) -> tuple:
    """``nnx.split(model)`` flattened: (graphdef, treedef, {path: array} in the state's leaf order);
    ``nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, list(params.values())))`` inverts it."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    return graphdef, treedef, {key_of(p): a for p, a in leaves}


def rule(shape: tuple[int, ...], n: int, variant: str) -> bool:
    """Is this array split along dim 0 over the axis? zero2/zero3: >= 2 dims; zero1's moments: any."""
    return len(shape) >= (1 if variant == "zero1" else 2) and shape[0] % n == 0


def submodules(model) -> tuple[dict[str, nnx.Module], dict[int, int]]:
    """({path: module} for every submodule, the root at ""; {id(module): how many places hold it}):
    a shared module is held by more than one (parallel.tp and parallel.pp use these too)."""
    found, refs = {}, {}

    def walk(m, path):
        refs[id(m)] = refs.get(id(m), 0) + 1
        if refs[id(m)] > 1:
            return
        found[path] = m
        for k, child in nnx.iter_children(m):
            if isinstance(child, nnx.Module):
                walk(child, f"{path}.{k}" if path else str(k))
    walk(model, "")
    return found, refs


def param_holders(model) -> dict[int, list[str]]:
    """id(Param) -> the paths of the modules holding it directly."""
    held = {}
    for path, m in submodules(model)[0].items():
        for _, child in nnx.iter_children(m):
            if isinstance(child, nnx.Variable):
                held.setdefault(id(child), []).append(path)
    return held


def matches(path: str, pattern: str) -> bool:
    """THE glob rule of module paths, for ZeRO units and tp / compose plans alike: ``*`` (and fnmatch's
    ``?``, ``[…]``) within one dot-separated segment; a ``**`` segment matches any number of segments
    (none included). "blocks.*" is each block, not its submodules; "**.q_proj" every q_proj."""
    return _match(path.split(".") if path else [], pattern.split("."))


def _match(segs: list[str], pats: list[str]) -> bool:
    if not pats:
        return not segs
    if pats[0] == "**":
        return any(_match(segs[i:], pats[1:]) for i in range(len(segs) + 1))
    return bool(segs) and fnmatchcase(segs[0], pats[0]) and _match(segs[1:], pats[1:])


def _declared(m) -> dict[str, tuple[int, ...]]:
    """{Param name: the shape its module's own attributes declare}, for flax's common layers."""
    if isinstance(m, nnx.Linear):
        return {"kernel": (m.in_features, m.out_features), "bias": (m.out_features,)}
    if isinstance(m, nnx.Embed):
        return {"embedding": (m.num_embeddings, m.features)}
    if isinstance(m, (nnx.LayerNorm, nnx.RMSNorm)):
        return {"scale": (m.num_features,), "bias": (m.num_features,)}
    return {}


def stacked(model) -> dict[str, str]:
    """{module path: what shows it} of every module whose Params carry a leading layer axis before the
    shape its own attributes declare: layers made by ``nnx.vmap`` and run by ``nnx.scan`` (an
    nnx.Linear (8 → 8) holding a (L, 8, 8) kernel). Such a module is passed into a JAX transform."""
    out = {}
    for path, m in submodules(model)[0].items():
        for name, shape in _declared(m).items():
            v = getattr(m, name, None)
            if isinstance(v, nnx.Param) and len(v.shape) == len(shape) + 1 and tuple(v.shape[1:]) == shape:
                out[path] = (f"{type(m).__name__} {path or '<root>'!r} holds {name} {tuple(v.shape)}, declared "
                             f"{shape}: stacked layers (nnx.vmap / nnx.scan)")
                break
    return out


def choose_units(model, units: Sequence[str] | None) -> list[str]:
    """Unit module paths. Default: the topmost modules holding a Param directly, a module of stacked
    layers (``stacked``) left to its parent. Patterns are module path globs (``matches``: "blocks.*"
    = each block); the root ("") is not a unit (it gathers the rest)."""
    mods, refs = submodules(model)
    layered = stacked(model)
    if units is None:
        holders = {p for p, m in mods.items() if p and any(isinstance(c, nnx.Param) for _, c in nnx.iter_children(m))}
        chosen = sorted(p for p in holders if not any(p.startswith(q + ".") for q in holders))
        chosen = [p for p in chosen if not any(p == q or p.startswith(q + ".") for q in layered)]
    else:
        chosen = []
        for pat in units:
            hits = [p for p in mods if p and matches(p, pat)]
            if not hits:
                raise WrapError(f"zero3: unit pattern {pat!r} matches no submodule of {type(model).__name__} "
                                f"(modules: {', '.join(p for p in mods if p)[:300]}); fix the pattern")
            chosen += [p for p in hits if p not in chosen]
    for p in chosen:
        held = next((q for q in layered if p == q or p.startswith(q + ".")), None)
        if held is not None:
            raise WrapError(f"zero3: unit {p!r} is (inside) a module of stacked layers: {layered[held]}; it is "
                            "passed into a JAX transform, where a unit cannot be gathered on call. Fix: leave it out "
                            "of units (its parent gathers it whole: the default units do), or style='jit'")
        inner = [q for q in chosen if q.startswith(p + ".")]
        if inner:
            raise WrapError(f"zero3: unit {inner[0]!r} is inside unit {p!r}; units must not nest: keep one")
        if refs[id(mods[p])] > 1:
            raise WrapError(f"zero3: the module at {p!r} is reachable from {refs[id(mods[p])]} places (shared); "
                            "a unit is gathered where it is called: make their common parent the unit")
    return chosen


def unit_of(key: str, units: list[str]) -> str | None:
    return next((u for u in units if key.startswith(u + ".")), None)


def put_child(parent, key: str, value):
    if isinstance(parent, nnx.List) or key.isdigit() and hasattr(parent, "__setitem__"):
        parent[int(key)] = value
    else:
        setattr(parent, key, value)


def shard_rows(mesh, axis: str, arrays) -> tuple:
    """Each array's rows split over ``mesh``'s ``axis`` (dim 0 must divide by its size)."""
    n = mesh.shape[axis]
    for a in arrays:
        if a.shape[0] % n:
            raise WrapError(f"batch dim 0 = {a.shape[0]} is not divisible by {axis}={n}: "
                            "use a batch size N divides")
    return tuple(jax.device_put(a, NamedSharding(mesh, P(axis))) for a in arrays)


def fetch(x) -> np.ndarray:
    """A (global) array as NumPy in its own dtype. Under several JAX processes an array with shards
    on other processes' devices cannot be ``device_get``: a replicated one is read from this
    process's own copy, any other gathered with ``multihost_utils.process_allgather`` — a
    collective, so every process must fetch the same arrays in the same order."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
