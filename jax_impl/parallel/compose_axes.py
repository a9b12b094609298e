"""The composition's refusals and its per-axis pieces for ANY Flax NNX model: what compose.py's
``Composed`` checks at wrap time and runs inside the step. The twin: torch_impl/parallel/compose_axes.py.

    refusal(layout, style)              an axis, size or style compose cannot run (one line)
    check_split(model, split, S)        the stage split: tied parts, blocks that are no nnx.List of
                                        identical modules (a scan/vmap-stacked module is refused), L % S
    check_plan(model, split, plan, tp)  the tp plan: colwise / colwise_heads (a fused [q|k|v] kernel) /
                                        rowwise nnx.Linear inside the blocks (biases: colwise split,
                                        rowwise added once after the psum), whole heads; and Flax's own
                                        nnx.MultiHeadAttention's nnx.LinearGeneral (``flax_mha_plan``)
    flat(module)                        (graphdef, treedef, keys, {key: array}): what pp stacks per stage
    Col / Row, stand_ins                Megatron's f (pcast to varying: psum of dL/dx in backward, one per
                                        input array) and g (psum over "tp"; then a rowwise bias) around
                                        the local shard (an nnx.LinearGeneral: its own steps, ``general``)

Module paths match by ONE glob rule (parallel.tree.matches: ``*`` one segment, ``**`` any), shared
with parallel.tp's plans and parallel.fsdp's units. Collectives: tp's f and g above (2 all-reduces
of the (m, T/c, D) stream per block forward, 2 backward); the rest: compose.py's docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_impl.parallel.tree import WrapError, key_of, matches, param_holders, put_child, stacked, submodules

AXES = ("dp", "fsdp", "ep", "pp", "cp", "tp")  # ep: compose_ep.py
CP_VARIANTS = ("ring", "ring_zigzag", "ulysses")  # parallel.cp's seam
PLAN_STYLES = ("colwise", "colwise_heads", "rowwise")  # parallel.tp's names for the same splits
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


def one(axes):
    """None, the one axis, or the tuple: a PartitionSpec entry over ``axes``."""
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
    return None



# --- refusals before anything changes ---------------------------------------------------------------


def check_split(root, sp: Split, stages: int) -> int:
    """Refuses a split compose cannot stack per stage (tied parts, a path that is no module, blocks
    that are no nnx.List of identical modules, a count pp does not divide, a Param outside the
    split); returns the block count L."""
    mods, refs = submodules(root)
    for p in sp.first + sp.last + (sp.blocks,):
        m = resolve(root, p)
        if m is not None and refs.get(id(m), 0) > 1:
            raise ComposeError(f"compose: the module at {p!r} is held in {refs[id(m)]} places (tied); compose "
                               "trains each split part's own Params: untie it")
        if p not in mods:
            raise ComposeError(f"compose: split path {p!r} is no module of {type(root).__name__}; "
                               "fix the split")
    blocks = mods[sp.blocks]
    if not isinstance(blocks, nnx.List) or not len(blocks):
        layered = [why for p, why in stacked(root).items() if p == sp.blocks or p.startswith(sp.blocks + ".")]
        cause = f"; {layered[0]} — compose stacks an nnx.List's blocks per stage itself" if layered else \
            " (a scan/vmap-stacked module is not split)"
        raise ComposeError(f"compose: split.blocks {sp.blocks!r} is a {type(blocks).__name__}, not a non-empty "
                           f"nnx.List of blocks{cause}: hold the blocks in an nnx.List of identical modules")
    L = len(blocks)
    if L % stages:
        raise ComposeError(f"compose: {L} blocks ({sp.blocks}) do not split evenly over pp={stages}; "
                           "use a pp size that divides the block count")
    shapes = lambda m: [(key_of(k), v.shape) for k, v in jax.tree_util.tree_flatten_with_path(
        nnx.state(m, nnx.Param))[0]]
    for i in range(1, L):
        if shapes(blocks[i]) != shapes(blocks[0]) or type(blocks[i]) is not type(blocks[0]):
            raise ComposeError(f"compose: block {sp.blocks}.{i} differs from {sp.blocks}.0 (type or Params); "
                               "the blocks are stacked per stage: make them identical or move it to first/last")
    parts = sp.first + sp.last + tuple(f"{sp.blocks}.{i}" for i in range(L))
    for holder in param_holders(root).values():
        owners = {q for q in parts for h in holder if h == q or h.startswith(q + ".")}
        if len(owners) != 1:
            what = "in no module of the split" if not owners else f"shared by {sorted(owners)} (tied)"
            raise ComposeError(f"compose: a Param of {holder[0]!r} is {what}; compose trains each split part's "
                               "own Params: untie it / add its module to split.first or split.last")
    return L

def check_plan(root, sp: Split, plan: dict[str, str], tp: int) -> dict[str, str]:
    """The plan as {path inside one block: style}; refuses what compose cannot split exactly."""
    mods = submodules(root)[0]
    prefix, out = sp.blocks + ".", {}
    for pattern, style in plan.items():
        hits = [p for p in mods if p and matches(p, pattern)]
        if style not in PLAN_STYLES:
            raise ComposeError(f"compose: plan key {pattern!r} has style {style!r}; compose splits {PLAN_STYLES} "
                               "only (embedding and head stay replicated): drop it or use parallel.tp")
        if not hits:
            raise ComposeError(f"compose: plan key {pattern!r} matches no module ('*' = one segment, '**' any); "
                               "fix the key")
        for p in hits:
            m = mods[p]
            if not p.startswith(prefix) or not isinstance(m, (nnx.Linear, nnx.LinearGeneral)):
                raise ComposeError(f"compose: plan key {pattern!r} hits {p!r} ({type(m).__name__}); compose "
                                   f"splits nnx.Linear (and nnx.MultiHeadAttention's nnx.LinearGeneral) modules "
                                   f"inside {sp.blocks} only: drop the key")
            if isinstance(m, nnx.LinearGeneral):
                out[p[len(prefix):].split(".", 1)[1]] = check_general(p, m, style, tp)
                continue
            if style == "rowwise" and m.bias is not None and type(m).__call__ is not nnx.Linear.__call__:
                raise ComposeError(f"compose: rowwise {p!r} ({type(m).__name__}) has a bias and its own __call__; "
                                   "compose adds a rowwise bias once after the psum by nnx.Linear's own steps: "
                                   "use nnx.Linear, or use_bias=False and add the bias in the parent")
            rel = p[len(prefix):].split(".", 1)[1]
            dim = m.kernel.shape[0 if style == "rowwise" else 1]
            parent = mods[p.rsplit(".", 1)[0]]
            hd = getattr(parent, "head_dim", None)
            if style == "colwise_heads":
                if dim % 3 or not isinstance(hd, int):
                    raise ComposeError(f"compose: colwise_heads {p!r} needs a fused [q|k|v] kernel (D, 3·H·dh) and its "
                                       f"parent's head_dim (out_features={dim}, head_dim={hd}); plan separate q, k, v "
                                       "with 'colwise' or give the attention module a head_dim")
                dim //= 3  # each of q, k, v splits by whole heads: device r holds [q_r|k_r|v_r]
            if dim % tp or (hd and (dim // hd) % tp):
                unit = f"{dim // hd} heads" if hd else f"{dim} features"
                raise ComposeError(f"compose: {style} {p!r} has {unit}, not divisible by tp={tp}; use a tp "
                                   "size dividing every planned module's heads / features")
            out[rel] = style
    return out


def flax_mha_plan(prefix: str) -> dict[str, str]:
    """The tp plan of a ``flax.nnx.MultiHeadAttention`` at module path ``prefix`` (a glob, e.g.
    ``"blocks.*.attn"``): Megatron's over heads. ``query`` / ``key`` / ``value`` colwise (kernels (D, H, dh)
    split on H, biases (H, dh) with them), ``out`` rowwise (kernel (H, dh, D) split on H, its bias added once
    after the psum). tp must divide the heads (and the key-value heads under GQA). Build the attention with
    ``keep_rngs=False`` (compose trains Params only) and, for float64 parity, ``attention_fn=parallel.cp.attention``
    (Flax's default, jax.nn.dot_product_attention, takes its logits in float32: ~1e-7; the seam also runs cp)."""
    return {f"{prefix}.{q}": "colwise" for q in ("query", "key", "value")} | {f"{prefix}.out": "rowwise"}


def check_general(p: str, m, style: str, tp: int) -> str:
    """An nnx.LinearGeneral compose splits exactly: nnx.MultiHeadAttention's shapes, heads that tp divides;
    else refused (one line naming the module and why)."""
    axis = (m.axis,) if isinstance(m.axis, int) else tuple(m.axis)
    shape, name = m.kernel.shape, f"nnx.LinearGeneral {p!r} (kernel {tuple(m.kernel.shape)}, axis={axis})"
    if type(m).__call__ is not nnx.LinearGeneral.__call__ or m.batch_axis:
        raise ComposeError(f"compose: {name} has its own __call__ or batch axes; compose runs nnx.LinearGeneral's "
                           "own steps on the shard: use nnx.LinearGeneral without batch_axis")
    if style == "colwise" and (axis != (-1,) or len(shape) != 3):
        raise ComposeError(f"compose: colwise {name}: compose splits a query/key/value projection (D) -> (H, dh) "
                           "on its heads (kernel (D, H, dh), axis=-1) only: use flax_mha_plan's layout or drop it")
    if style == "rowwise" and (axis != (-2, -1) or len(shape) != 3):
        raise ComposeError(f"compose: rowwise {name}: compose splits an output projection (H, dh) -> D on its "
                           "heads (kernel (H, dh, D), axis=(-2, -1)) only: use flax_mha_plan's layout or drop it")
    if style == "colwise_heads":
        raise ComposeError(f"compose: colwise_heads {name}: its heads are a kernel dim already; plan it 'colwise' "
                           "(flax_mha_plan)")
    heads = shape[1 if style == "colwise" else 0]
    if heads % tp:
        raise ComposeError(f"compose: {style} {p!r} has {heads} heads, not divisible by tp={tp}; use a tp size "
                           "dividing every planned module's heads")
    return style


# --- one piece per axis: pp's flat Params per stage, tp's stand-ins ---------------------------------


def resolve(root, path: str):
    """The module at a dotted path, or None."""
    m = root
    for k in path.split("."):
        try:
            m = m[int(k)] if k.isdigit() else getattr(m, k)
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
    return m


def flat(module):
    """(graphdef, treedef, Param keys, {key: array}) of a module: its state flattened by path."""
    gdef, params, rest = nnx.split(module, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ComposeError(f"compose: {type(module).__name__} holds state other than nnx.Param; compose trains "
                           "Params only: make it a Param or a static attribute")
    gdef, params = nnx.split(module)
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = [key_of(p) for p, _ in pairs]
    return gdef, treedef, keys, dict(zip(keys, (v for _, v in pairs), strict=True))


def varying(x) -> tuple:
    """The mesh axes ``x`` varies over inside shard_map (check_vma's type)."""
    t = jax.typeof(x)
    return tuple(getattr(getattr(t, "mat", None), "varying", None) or getattr(t, "vma", ()))


class Col:
    """colwise stand-in: f (pcast to varying over "tp": psum of dL/dx in backward; one per input array,
    shared by the siblings reading it), then the local shard."""

    def __init__(self, m, f_cache: dict):
        self.m, self.f_cache = m, f_cache

    def f(self, x):
        if "tp" in varying(x):
            return x
        if id(x) not in self.f_cache:  # the array kept with its cast: its id stays unique
            self.f_cache[id(x)] = (x, lax.pcast(x, "tp", to="varying"))
        return self.f_cache[id(x)][1]

    def __call__(self, x):
        return self.m(self.f(x))


class Row:
    """rowwise stand-in: the local shard's partial sums, then g (psum over "tp"), then the bias ONCE (as
    torch's RowwiseParallel: all_reduce(x·W) + b): nnx.Linear's own steps with the bias held back."""

    def __init__(self, m):
        self.m = m

    def __call__(self, x):
        m = self.m
        if m.bias is None:
            return lax.psum(m(x), "tp")
        x, kernel, bias = m.promote_dtype((x, m.kernel[...], m.bias[...]), dtype=m.dtype)
        more = {} if m.preferred_element_type is None else {"preferred_element_type": m.preferred_element_type}
        y = m.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=m.precision, **more)
        return lax.psum(y, "tp") + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))  # (…, D): the bias after g


def general(m, x, out_sharding=None):
    """nnx.LinearGeneral's own steps on the local shard without its bias: (x contracted over the kernel's
    input dims, the bias or None). Its ``__call__`` would reshape a tp-local bias to the whole out_features."""
    if out_sharding is not None:
        raise ComposeError("compose: an nnx.LinearGeneral called with out_sharding= under tp; compose places the "
                           "shards itself: call it without out_sharding")
    n = len(m.kernel.shape) - (1 if isinstance(m.out_features, int) else len(m.out_features))
    x, kernel, bias = m.promote_dtype((x, m.kernel[...], m.bias[...] if m.bias is not None else None), dtype=m.dtype)
    dot = m.dot_general_cls() if m.dot_general_cls is not None else m.dot_general or lax.dot_general
    more = {} if m.preferred_element_type is None else {"preferred_element_type": m.preferred_element_type}
    y = dot(x, kernel, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())), precision=m.precision,
            **more)
    return y, bias


def with_bias(y, bias):
    return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)


class ColGeneral(Col):
    """colwise stand-in of an nnx.LinearGeneral (D) -> (H/tp, dh): f, then its steps, its bias's local heads."""

    def __call__(self, x, out_sharding=None):
        return with_bias(*general(self.m, self.f(x), out_sharding))


class RowGeneral(Row):
    """rowwise stand-in of an nnx.LinearGeneral (H/tp, dh) -> D: its steps, g, then its bias once."""

    def __call__(self, x, out_sharding=None):
        y, bias = general(self.m, x, out_sharding)
        return with_bias(lax.psum(y, "tp"), bias)


def stand_ins(layer, rel_plan: dict[str, str], f_cache: dict):
    """``layer`` (one block, tp-local weights) with every planned Linear behind its tp stand-in."""
    for rel, style in rel_plan.items():
        parent, key = layer, rel.rsplit(".", 1)
        for k in key[0].split(".") if len(key) == 2 else ():
            parent = parent[int(k)] if k.isdigit() else getattr(parent, k)
        m = getattr(parent, key[-1])
        gen = isinstance(m, nnx.LinearGeneral)
        put_child(parent, key[-1], (RowGeneral if gen else Row)(m) if style == "rowwise" else
                  (ColGeneral if gen else Col)(m, f_cache))
    return layer

