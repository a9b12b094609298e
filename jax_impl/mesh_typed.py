"""N-D layouts in types ("typed": JAX's Explicit axes, jax_impl/parallel/typed.py): data (dp | fsdp) × tp on
one Explicit-axes mesh (either alone too), mesh.py's ``rules`` for the parameters, every layout
change stated.

    data   tokens and targets (B@data, T); every stated layout keeps the batch dim on the data axis
           (tp_typed.TypedOps(rows=data)).
    tp     tp_typed's Megatron in types: column out_sharding=P(data, …, 'tp'), row-parallel
           einsum(…, out_sharding=P(data, …, unreduced={'tp'})) then reshard(·, P(data, …)) (the
           unreduced -> reduced step), vocab-parallel embedding and CE as one-hot products.
    fsdp   each ≥ 2-D parameter's dim 0 also split over 'fsdp' (mesh.rules: W_up (D@fsdp, 4D@tp));
           the forward states its gather per parameter, ``reshard(w, <its spec without fsdp>)`` —
           the tp shard — and autodiff hands the gradient back typed like the parameter.

The gradients of weights used on data-split rows come back typed like the weights: XLA sums them
over the data axis (and, under fsdp, slices the rows). pp cannot be said in types (pp.TYPED_REFUSAL);
cp layouts are not written in types here (jax_impl/cp_typed.py has cp alone): ``refusal`` says which.

No torch twin: torch has no sharding-in-types style; DTensor on one DeviceMesh (torch_impl/mesh.py, builtin)
is the nearest.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jax_impl.parallel.typed import Stated
from jax_impl.pp import TYPED_REFUSAL
from jax_impl.tp_typed import TypedOps, transformer_loss


def refusal(cfg) -> str | None:
    """Why the typed style cannot run this layout (one line), or None."""
    axes = [a for a, _ in cfg.mesh]
    if "ep" in axes:
        return (f"mesh {cfg.mesh_name}: the typed style has no ep axis (the MoE transformer's experts under compose): "
                "shard_map and jit run it")
    if "pp" in axes:
        return f"mesh {cfg.mesh_name}: the typed style has no pp: {TYPED_REFUSAL}"
    if "cp" in axes:
        return f"mesh {cfg.mesh_name}: the typed style is written for data (dp | fsdp) x tp; cp is typed alone (cp)"
    if getattr(cfg, "recipe_active", False) or getattr(cfg, "precision", "pure") == "mixed":
        return (f"mesh {cfg.mesh_name}: the typed style's step has no recipe (--clip, --accumulate, ...) or mixed "
                "precision: shard_map and jit run them")
    if "dp" in axes and "fsdp" in axes:
        return (f"mesh {cfg.mesh_name}: the typed style is written for ONE data axis (dp | fsdp) x tp; HSDP "
                "(dp x fsdp) runs in shard_map and jit")
    return None


def typed_refusal(pattern: str, cfg) -> str | None:
    """One line naming the pattern and why the typed style cannot run it for ``cfg`` (compare.py: exit
    2 before any process starts), or None. pp: pp.TYPED_REFUSAL; mesh: ``refusal`` (pp, cp)."""
    if pattern == "pp":
        return f"pp: the typed style (sharding in types) is refused: {TYPED_REFUSAL}"
    if pattern == "mesh":
        return refusal(cfg)
    if pattern == "collectives":
        return "collectives: the typed style has no collectives to call: XLA issues them from the types"
    return None


def without(spec: P, axis: str) -> P:
    """``spec`` with ``axis`` taken out of every dim (fsdp's gather: the tp shard stays)."""
    def drop(a):
        if a is None or a == axis:
            return None
        if isinstance(a, str):
            return a
        rest = tuple(x for x in a if x != axis)
        return None if not rest else rest[0] if len(rest) == 1 else rest
    return P(*[drop(a) for a in spec.partitions])


def loss_for(cfg, stated: Stated):
    """loss(tree, tokens, y, pos) -> (1,) the global mean CE, on pp.split's tree with S = 1."""
    data = cfg.data_axis if cfg.data_axis in [a for a, _ in cfg.mesh] else None
    ops = TypedOps(stated, rows=data, tp="tp" in [a for a, _ in cfg.mesh])

    def flat(tree):  # pp.split's (1, …) slots and (1, L, …) blocks -> {fixture name: array}
        p = {k: a[0] for g in ("first", "last") for k, a in tree[g].items()}
        for suffix, a in tree["blocks"].items():
            p |= {f"blocks.{l}.{suffix}": a[0, l] for l in range(a.shape[1])}
        return p

    def gather(p):  # fsdp: each parameter's gather stated, down to its tp shard
        if data != "fsdp":
            return p
        return {k: stated.reshard(a, without(jax.typeof(a).sharding.spec, "fsdp"), k)
                if "fsdp" in str(jax.typeof(a).sharding.spec) else a for k, a in p.items()}

    inner = transformer_loss(cfg.head_dim, ops, gather)
    return lambda tree, tokens, y, pos: inner(flat(tree), tokens, y)[None]
