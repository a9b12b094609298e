"""The N-D composition's steps, one per mesh axis, and its refusals: what compose.py's Trainer runs in
torchtitan's order for ANY nn.Module, and what torch_impl/mesh.py (the project's own ``--mesh`` runs)
calls for its transformer. The twin: jax_impl/parallel/compose_axes.py.

    check(layout, style, loss, plan)       refusals that need no process group (ComposeError, one line)
    check_stages / check_vocab             a parameter in two stages or none; builtin tp of V % tp != 0
    transformers_plan(model)               plan="auto": a transformers model's own tp plan, prefixed, + the vocabulary
    apply_tp(module, plan, mesh["tp"], style)      the plan's entries naming a module of this stage
    apply_fsdp(module, data_mesh, units, ignored)  FSDP2 per unit + root (a 2-D (dp, shard=1) mesh: HSDP; ep's
                                                   experts ignored)
    apply_ddp(module, group)                       DDP over 1-D dp (plain tensors only: DDP takes no DTensor)
    apply_pp(module, s, S, mesh["pp"], loss, M)    PipelineStage + ScheduleGPipe / Schedule1F1B
    stage_loss(loss, styles, mesh["tp"], style)    the loss on this stage's (vocabulary-split) logits

Collectives: tp's all-reduces (2 per layer forward, 2 backward; the vocabulary CE's), FSDP2's
all-gathers and reduce-scatters per unit, DDP's bucketed all-reduces, pp's one message per
micro-batch and boundary each way (compose.py's docstring counts them per step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from torch_impl.parallel import recipe
from torch_impl.parallel.tp import apply_dtensor_plan, apply_plan, matches
from torch_impl.parallel.tp_ops import VocabParallelCrossEntropy

AXES = ("dp", "fsdp", "ep", "pp", "cp", "tp")  # ep: a data axis whose experts split (compose_ep.py)
STYLES = ("builtin", "explicit")
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# gathering fsdp × tp weights whole (full_tensor, bookkeeping) takes two all-gathers: harmless, said once per call
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


class ComposeError(ValueError):
    """A layout, style or model that the composition cannot train exactly (raised before any change)."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean CE over every token: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sizes(mesh: DeviceMesh) -> dict[str, int]:
    return dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True))


# --- refusals before anything changes ---------------------------------------------------------------


def check(layout: dict[str, int], style: str, loss: Callable, plan: dict | None) -> None:
    """The refusals that need no process group (one line each)."""
    if style not in STYLES:
        raise ComposeError(f"compose: unknown style {style!r}; choose from {STYLES}")
    bad = [a for a in layout if a not in AXES]
    if bad:
        raise ComposeError(f"compose: unknown mesh axes {bad}; name the DeviceMesh's dims from {AXES}")
    if style == "explicit" and layout.get("tp", 1) > 1 and plan and loss is not cross_entropy:
        raise ComposeError("compose explicit: tp splits the head's vocabulary, so the loss must be the "
                           "vocabulary-parallel CE; fix: loss=compose.cross_entropy (or style='builtin')")


def check_stages(model: nn.Module, stage: Callable, stages: int) -> None:
    """Every trainable parameter in exactly one stage (a tie across stages would train two copies apart)."""
    if stages == 1:
        return
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(repr(n))
    held: dict[int, int] = {}
    for s in range(stages):
        for p in stage(model, s, stages).parameters():
            if held.setdefault(id(p), s) != s:
                tied = " = ".join(names.get(id(p), ["?"]))
                raise ComposeError(f"compose pp: parameter {tied} is held by stages {held[id(p)]} and {s} "
                                   "(tied): pp would train two copies apart; fix: untie it or put its holders in "
                                   "one stage")
    lost = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if lost:
        raise ComposeError(f"compose pp: {lost[:3]} in no stage (would never train); fix: the stage builder must "
                           "hold every module the model's forward uses")


def check_vocab(model: nn.Module, plan: dict[str, str], tp: int, style: str) -> None:
    """builtin tp: DTensor shards a vocabulary V % tp != 0 unevenly, which the pipeline's fixed
    message shapes and the loss's re-wrapping of local logits do not describe: refused."""
    if style != "builtin" or tp == 1:
        return
    for path, m in model.named_modules():
        style_of = next((st for k, st in plan.items() if path and matches(path, k)), None)
        if style_of in ("vocab_embed", "colwise_vocab") and m.weight.shape[0] % tp:
            raise ComposeError(f"compose builtin: {path!r} ({style_of}) has {m.weight.shape[0]} rows, not divisible "
                               f"by tp={tp}; fix: style='explicit' (pads the vocabulary) or V divisible by tp")


# transformers' tp plan styles -> this project's (the rest, e.g. "colwise_rep", "local_rowwise", the MoE
# ones, have no exact twin here: refused by name)
HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "embedding_rowwise": "vocab_embed",
             "colwise_gather_output": "colwise_vocab"}


def transformers_plan(model: nn.Module) -> dict[str, str]:
    """``plan="auto"``: a transformers model's own tp plan — ``config.base_model_tp_plan`` (paths inside the
    base model, prefixed with ``base_model_prefix``) and the head's class-level ``_tp_plan`` — in this
    project's styles, with Megatron's vocabulary split added: the input embedding ``vocab_embed``, the
    output embedding ``colwise_vocab`` (the vocabulary-parallel CE; any V under the explicit style).
    transformers is not imported: the attributes are read."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        raise ComposeError(f"compose: plan='auto' reads a transformers model's config.base_model_tp_plan; "
                           f"{type(model).__name__} has none: pass plan={{module path: style}}")
    prefix = getattr(model, "base_model_prefix", "")
    prefix = prefix + "." if prefix and hasattr(model, prefix) else ""
    entries = {prefix + k: v for k, v in base.items()} | dict(getattr(model, "_tp_plan", None) or {})
    out = {}
    for path, style in entries.items():
        if style not in HF_STYLES:
            raise ComposeError(f"compose: plan='auto': {type(model).__name__}'s tp plan has {path!r}: {style!r}, "
                               f"which compose has no exact twin of (it takes {tuple(HF_STYLES)}); fix: pass a "
                               "plan of your own without it")
        out[path] = HF_STYLES[style]
    names = {id(m): p for p, m in model.named_modules()}
    for get, style in (("get_input_embeddings", "vocab_embed"), ("get_output_embeddings", "colwise_vocab")):
        module = getattr(model, get, lambda: None)()
        path = names.get(id(module))
        if path and not any(matches(path, k) for k in out):
            out[path] = style
    return out


# --- one step per axis, in torchtitan's order: tp, then the data axis, then pp ----------------------


def apply_tp(module: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh, style: str) -> dict[str, str]:
    """The plan's entries that name a module of ``module`` (a stage holds some), on mesh["tp"]."""
    paths = [p for p, _ in module.named_modules()]
    plan = {k: v for k, v in plan.items() if any(matches(p, k) for p in paths)}
    if style == "builtin":
        return apply_dtensor_plan(module, plan, tp_mesh, replicate_rest=False)  # FSDP2 / DDP take the rest
    return apply_plan(module, plan, tp_mesh.get_group(), missing_ok=True, seal_grads=False)  # its own step scales


def local_logits(module: nn.Module) -> None:
    """builtin tp × pp, last stage: the pipeline passes plain tensors, so ``module``'s DTensor output
    leaves as its local shard (m, T/c, V/t); ``stage_loss`` wraps it again."""
    module.register_forward_hook(lambda m, a, out: out.to_local() if isinstance(out, DTensor) else out)


def apply_fsdp(module: nn.Module, mesh: DeviceMesh, units: list[str],
               ignored: set[nn.Parameter] | None = None) -> list[tuple[str, int, bool]]:
    """FSDP2: ``fully_shard`` every module matching a unit glob, then the root (torchtitan's order);
    on a 2-D (replicate, shard) mesh this is HSDP. Returns each group's (path, bytes all-gathered,
    trainable?), the root last: its (tp-local) parameters with dim 0 padded to a multiple of the
    shard dim's size, as FSDP2 shards them. ``ignored``: FSDP2's ``ignored_params`` (ep's experts:
    neither sharded nor reduced)."""
    n = mesh.size(mesh.ndim - 1)
    paths = [path for path, _ in module.named_modules() if path and any(matches(path, u) for u in units)]
    owner = lambda name: next((u for u in paths if name.startswith(u + ".")), "")  # "" = the root's
    groups: dict[str, list] = {u: [] for u in [*paths, ""]}
    skip = {id(p) for p in ignored or ()}
    for name, p in module.named_parameters():  # each parameter once, before any is sharded
        if id(p) not in skip:
            groups[owner(name)].append(p)

    def nbytes(ps) -> int:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in ps]
        return sum(-(-t.shape[0] // n) * n * t[0].numel() * t.element_size() if t.dim() else t.element_size()
                   for t in local)

    out = [(u, nbytes(ps), any(p.requires_grad for p in ps)) for u, ps in groups.items()]
    ignored = set(ignored or ()) or None  # ep's experts: left whole, their gradients the caller's
    for u in paths:
        fully_shard(module.get_submodule(u), mesh=mesh, ignored_params=ignored)
    fully_shard(module, mesh=mesh, ignored_params=ignored)
    return out


def apply_ddp(module: nn.Module, group) -> nn.Module:
    """torch's DDP over ``group`` (bucketed all-reduces overlapping backward). DDP takes no DTensor
    weights (its first broadcast fails): with tp, use HSDP (``apply_fsdp`` on a (dp, shard = 1) mesh)."""
    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise ComposeError("compose: DDP cannot take DTensor (tp-split) weights; fix: HSDP, apply_fsdp on a "
                           "(dp, dp_shard=1) mesh")
    return DistributedDataParallel(module, process_group=group)


def apply_pp(module: nn.Module, s: int, S: int, pp_mesh: DeviceMesh, loss: Callable, microbatches: int,
             schedule: str = "gpipe", scale_grads: bool = True, device=None, **shapes):
    """This stage in ``torch.distributed.pipelining``: shapes inferred at the first step, or given
    (``input_args`` / ``output_args``, PipelineStage's). scale_grads: the schedule divides the summed
    micro-batch gradients by M (False: the caller does, after a reduction that fills them later —
    the explicit FSDP's shards)."""
    if schedule not in SCHEDULES:
        raise ComposeError(f"compose pp: unknown schedule {schedule!r}; choose from {tuple(SCHEDULES)}")
    stage = PipelineStage(module, s, S, device or torch.device("cpu"), group=pp_mesh.get_group(), **shapes)
    return SCHEDULES[schedule](stage, microbatches, loss_fn=loss, scale_grads=scale_grads)


def stage_loss(loss: Callable, styles: dict[str, str], tp_mesh: DeviceMesh | None, style: str) -> Callable:
    """loss(out, y) on this stage's logits: with the head's vocabulary split over tp (a
    ``colwise_vocab`` entry), explicit runs the vocabulary-parallel CE on the (m, T/c, V/t) shard;
    builtin wraps plain local logits (the pipeline's) as a Shard(-1) DTensor for ``loss_parallel``."""
    vocab = tp_mesh is not None and "colwise_vocab" in styles.values()

    def of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if vocab and style == "explicit":
            return VocabParallelCrossEntropy.apply(out, y, tp_mesh.get_group())
        if vocab and not isinstance(out, DTensor):
            out = DTensor.from_local(out, tp_mesh, [Shard(-1)])
        value = loss(out, y)
        return value.to_local() if isinstance(value, DTensor) else value

    return of


@torch.no_grad()
def global_clip_(params, max_norm: float, stages: int, tp_split: set[int], tp: int, fsdp=None,
                 experts: set[int] = frozenset(), ep: int = 1) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` of the whole model on an N-D layout, on every rank, after the step's
    reductions: each rank's gradient squares, each divided by the number of ranks holding that same piece,
    summed over the world by ONE all-reduce of one scalar. A stage's world/S ranks hold a piece split k
    ways (tp: ``tp_split`` ids, ``tp`` ways, or a DTensor Shard on the tp dim; fsdp: the explicit wrapper's
    shards over its group, or FSDP2's (Strided)Shard; ep: ``experts`` ids, ``ep`` ways) world/(S·k) times;
    stages hold different parameters (summed over pp: Megatron's rule, replicas once). The divisions by
    powers of two are exact."""
    shards = {id(u.shard) for _, _, u in fsdp.units} if fsdp is not None else set()
    per_stage = dist.get_world_size() // stages
    params = [p for p in params if p.grad is not None]
    dt = torch.float64 if params and params[0].dtype == torch.float64 else torch.float32
    sq, grads = torch.zeros((), dtype=dt, device=params[0].device if params else None), []
    for p in params:
        if isinstance(p.grad, DTensor):
            local, split = p.grad.to_local(), 1
            for dim, placement in enumerate(p.grad.placements):  # Shard, FSDP2's _StridedShard: split
                assert not placement.is_partial(), (p.grad.placements, "a gradient not reduced yet")
                split *= 1 if placement.is_replicate() else p.grad.device_mesh.size(dim)
        else:
            local = p.grad
            split = (tp if id(p) in tp_split else 1) * (fsdp.n if id(p) in shards else 1) * \
                (ep if id(p) in experts else 1)
        sq += torch.linalg.vector_norm(local, 2).to(sq.dtype) ** 2 / (per_stage // split)
        grads.append(local)
    dist.all_reduce(sq)
    total = sq.sqrt()
    recipe.scale_(grads, max_norm, total)
    return total


def micro_major_rows(rows: int, parts: int, data: int, i: int, device=None) -> torch.Tensor:
    """(rows/data,) indices: data rank i's share of each of the ``parts`` micro-batches, rows [k·B/K, (k+1)·B/K)
    for k in order, so that its k-th chunk holds the same tokens as one process's k-th accumulation part (what
    a per-micro-batch balancing loss needs; for a plain mean loss any split gives the same gradient)."""
    return torch.arange(rows, device=device).reshape(parts, data, -1)[:, i].reshape(-1)


def group_over(mesh: DeviceMesh, axes: list[str]):
    """(sub-mesh, group) over ``axes`` together (flattened when several), or (None, None)."""
    if not axes:
        return None, None
    sub = mesh[axes[0]] if len(axes) == 1 else mesh[tuple(axes)]._flatten("_".join(axes))
    return sub, sub.get_group()
