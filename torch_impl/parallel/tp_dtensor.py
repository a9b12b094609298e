"""The builtin tensor parallelism: the same plan (torch_impl/parallel/tp_plan.py's styles) through
DTensor's ``parallelize_module``, each style a DTensor parallel style (``DTENSOR_STYLES``; under sequence
parallelism ``DTENSOR_SP_STYLES``, as torchtitan's parallelize_llama): DTensor issues the all-reduces
(SP: the all-gathers and reduce-scatters) of Megatron's f and g. ``apply_dtensor_plan`` permutes a
fused qkv by whole heads first, cuts the positions to this rank's, ties tied parameters again after
parallelize_module, and (``replicate_unplanned``) makes every other parameter a Replicate DTensor, so
that torch's own ``clip_grad_norm_`` works.

No JAX twin: DTensor is torch's builtin; JAX's counterparts are jit with the plan's shardings (XLA
inserts the collectives: jax_impl/parallel/tp.py) and the typed style (jax_impl/tp_typed.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torch_impl.parallel import recipe
from torch_impl.parallel.tp_ops import heads_perm, local_positions
from torch_impl.parallel.tp_plan import SHARD_DIM, PlanError, check_module_types, planned_modules, styles_of

DTENSOR_STYLES = {
    "vocab_embed": lambda: RowwiseParallel(input_layouts=Replicate()),  # as torchtitan's tok_embeddings
    "colwise_heads": lambda: ColwiseParallel(),  # rows pre-permuted by heads_perm
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_vocab": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    "colwise_out": lambda: ColwiseParallel(output_layouts=Replicate()),
}
DTENSOR_SP_STYLES = {  # torchtitan's parallelize_llama with sequence parallel
    "vocab_embed": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "colwise_heads": lambda: ColwiseParallel(input_layouts=Shard(1)),  # all-gather the sequence first
    "colwise": lambda: ColwiseParallel(input_layouts=Shard(1)),
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter to the sequence shard
    "colwise_vocab": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    "sequence": lambda: SequenceParallel(),
    "positions": lambda: SequenceParallel(sequence_dim=0, use_local_output=True),  # after local_positions
}


def apply_dtensor_plan(model: nn.Module, plan: dict[str, str], mesh, sequence_parallel: bool = False,
                       replicate_rest: bool = True) -> dict[str, str]:
    """The same plan through ``parallelize_module``. W_qkv's rows are permuted first (heads_perm),
    so DTensor's contiguous Shard(0) hands rank r [q_r; k_r; v_r]. Sequence parallel: wpe's
    positions are cut to this rank's first (local_positions, registered before SequenceParallel's
    input hook, which takes a plain tensor for the local shard). A tied Parameter (an embedding and
    its head) stays one Parameter: parallelize_module distributes each holder's copy apart, so the
    copies are tied again after it (a plan splitting them differently: PlanError, before anything changes).
    ``replicate_rest``: every parameter the plan leaves alone becomes a Replicate DTensor too
    (``replicate_unplanned``), so that every parameter is a DTensor and torch's own
    ``clip_grad_norm_`` works (as torchtitan's models are, FSDP2 over TP); compose passes False, as
    FSDP2 / DDP take over those parameters. Returns {parameter name: style}."""
    check_module_types(planned_modules(model, plan, True))  # parallelize_module's own error is torch's, untyped
    styles, table = styles_of(model, plan), DTENSOR_SP_STYLES if sequence_parallel else DTENSOR_STYLES
    ties = _tied_holders(model)
    for holders in ties:  # refused before anything changes
        dims = {SHARD_DIM.get(styles.get(f"{path}.{attr}")) for path, attr in holders}  # None: replicated
        if len(dims) > 1:
            where = ", ".join(f"'{path}.{attr}' ({styles.get(f'{path}.{attr}', 'replicated')})"
                              for path, attr in holders)
            raise PlanError(f"tp plan (DTensor): one Parameter (tied) is used as {where}: a plan must split a tied "
                            "parameter the same way in every module that holds it. Fix: plan every holder alike "
                            "(e.g. 'vocab_embed' embedding + 'colwise_vocab' head), or untie it")
    with torch.no_grad():
        for name in (k for k, s in styles.items() if s == "colwise_heads"):
            w = model.get_parameter(name)  # (3D, D)
            w.copy_(w[heads_perm(w.shape[0], mesh.size(), w.device)])
    for name in (k for k, s in styles.items() if s == "positions"):
        model.get_submodule(name.removesuffix(".weight")).register_forward_pre_hook(
            local_positions(mesh.get_local_rank(), mesh.size()))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, mesh, {k: table[s]() for k, s in plan.items()})
    _retie(model, ties)
    for name, p in model.named_parameters():  # torch 2.13's SequenceParallel re-creates the gains as
        if name in frozen:  # nn.Parameter(DTensor) with requires_grad=True: a frozen gain would train
            p.requires_grad_(False)
    if replicate_rest:
        replicate_unplanned(model, mesh)
    return styles


def replicate_unplanned(model: nn.Module, mesh) -> None:
    """Every plain parameter (one the plan left alone, equal on every rank) becomes ONE Replicate DTensor
    on ``mesh`` in every module that holds it, made from the local tensor (no collective). Its module's
    code, written for plain tensors, sees the plain local tensor (``to_local``, differentiable: the
    gradient comes back a Replicate DTensor, with no collective) while the root model runs and while any
    holder runs (an activation-checkpoint recompute, a pipeline stage): a forward pre-hook swaps it in,
    a forward hook swaps the DTensor back. So the forward and its collectives are unchanged and every
    gradient is a DTensor: torch's ``clip_grad_norm_`` counts the replicated ones once, as it should.
    An optimizer built BEFORE this holds the old Parameters: refused at its first step."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, m in model.named_modules():
        for attr, p in m._parameters.items():
            if p is not None and not isinstance(p, DTensor):
                holders.setdefault(id(p), []).append((m, attr))
    if not holders:
        return
    old = {n: p for n, p in model.named_parameters() if id(p) in holders}
    for held in holders.values():
        p = held[0][0]._parameters[held[0][1]]
        new = nn.Parameter(DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False),
                           requires_grad=p.requires_grad)
        new._tp_unplanned = True  # what the hooks swap (not a rowwise bias's or SP norm's Replicate)
        for m, attr in held:
            m._parameters[attr] = new
    mods = {id(m): m for held in holders.values() for m, _ in held} | {id(model): model}
    for m in mods.values():
        m.register_forward_pre_hook(_to_local_params)
        m.register_forward_hook(_to_dtensor_params, always_call=True)
    recipe.refuse_stale(old, "apply_dtensor_plan", "build the optimizer (and its param groups) AFTER "
                        "apply_dtensor_plan, from model.named_parameters(): it makes every parameter a DTensor")


def _to_local_params(m: nn.Module, args) -> None:
    """The module and every module under it compute with the unplanned parameters' local tensors."""
    swapped = [(mod, attr, p) for mod in m.modules() for attr, p in mod._parameters.items()
               if getattr(p, "_tp_unplanned", False)]
    for mod, attr, p in swapped:
        mod._parameters[attr] = p.to_local()
    m.__dict__.setdefault("_tp_swapped", []).append(swapped)


def _to_dtensor_params(m: nn.Module, args, out):
    for mod, attr, p in m.__dict__["_tp_swapped"].pop():
        mod._parameters[attr] = p
    return out


def _tied_holders(model: nn.Module) -> list[list[tuple[str, str]]]:
    """[(module path, attribute)] of every Parameter held under two or more names (a tied embedding/head)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for path, m in model.named_modules():  # a module under two paths: one holder (styles_of's rule)
        for attr, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((path, attr))
    return [h for h in holders.values() if len(h) > 1]


def _retie(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """``parallelize_module`` distributes each module's parameters on their own: a tied Parameter comes
    out as one DTensor per holder, trained apart (silently not the model). Hold the first one everywhere."""
    for holders in ties:
        got = [model.get_submodule(path)._parameters[attr] for path, attr in holders]
        layout = lambda p: (getattr(p, "device_mesh", None), tuple(getattr(p, "placements", ())), tuple(p.shape))
        assert all(layout(p) == layout(got[0]) for p in got), [(h, layout(p)) for h, p in zip(holders, got)]
        for path, attr in holders[1:]:
            setattr(model.get_submodule(path), attr, got[0])
