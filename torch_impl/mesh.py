"""N-D parallelism with torch.distributed: dp/fsdp × pp × cp × tp composed on one device mesh (the
transformer). The layout is ``cfg.mesh`` (e.g. dp=2,tp=2,pp=2): axes in device order, innermost
last (rank = row-major index, shared.theory.mesh_coords), so tp sits on neighbouring ranks.

Sharded (each axis as its 1-D pattern on local sizes; shared/theory/mesh.py):
  data (dp | fsdp)  sequences per data index; fsdp also splits every tp-local ≥2-D weight by rows
  pp                blocks per stage (embeddings on the first, head on the last); M micro-batches, 1F1B
  cp                tokens per cp index; ring attention over the tp-local heads
  tp                Megatron (TRANSFORMER_PLAN, no sequence parallelism); vocab-parallel loss
Replicated gradients are averaged over the data axis and cp together: ONE group ("dp+cp").
  ep (--experts)    a data axis for the dense weights (one more gradient all-reduce over ep); every MoE
                    layer's experts split E/ep per ep rank behind a Dispatcher (``ExpertsOnEp``), replicated
                    over dp × fsdp × tp; per layer a counts all-gather and 4 all-to-alls (routing-dependent
                    bytes: priced from the recorded step's counts, shared.theory.mesh_moe_comm_torch; HSDP
                    × ep beside tp unpriced); ep beside pp / cp refused (Config)

Collectives per step, by axis (A = m·(T/c)·D·b; shared.theory.mesh_comm_torch):
  tp    all-reduces: per micro-batch 4 per block + embedding g + head f of A, + the loss's
  cp    send/recv: per micro-batch and block 3c−2 messages of K|V (or dK|dV)
  pp    send/recv: M activations forward, M gradients back, of A
  grad  dp: one flat all-reduce of the stage's gradients; fsdp: all-gathers fwd + bwd and
        reduce-scatters per micro-batch per unit, one all-reduce of the norm gains
The ledger records every op under its group's axis (CommLedger.label_groups).

explicit  process groups from ``init_device_mesh``; the hand-written patterns per axis.
builtin   torchtitan's composition: DTensor TP, FSDP2 per block, DDP or HSDP over dp,
          PipelineStage + Schedule1F1B (docs/mesh.md); cp refused (BUILTIN_REFUSAL).
Papers: Megatron-LM PTD-P, Narayanan et al. 2021 (arXiv:2104.04473); torchtitan, Liang et al. 2024
(arXiv:2410.06511).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import (
    cp_positions,
    mesh_comm_bytes_torch,
    mesh_comm_torch,
    mesh_coords,
    mesh_grad_axes,
    mesh_micro,
    mesh_moe_comm_torch,
    mesh_state_bytes_torch,
)
from torch_impl import pp, recipe
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import (
    TORCH_DTYPES,
    empty_model,
    inputs,
    load_fixture,
    loss_fn,
    targets,
    to_fixture,
    torch_dtype,
)
from torch_impl.parallel.compose_axes import (
    apply_ddp,
    apply_fsdp,
    apply_pp,
    apply_tp,
    global_clip_,
    local_logits,
    micro_major_rows,
    stage_loss,
)
from torch_impl.parallel.cp import RingCore
from torch_impl.parallel.ep import ALL_TO_ALL, Dispatcher
from torch_impl.parallel.fsdp import FSDP, average_flat
from torch_impl.parallel.tp import unshard
from torch_impl.parallel.tp_ops import heads_perm
from torch_impl.transformer import TRANSFORMER_PLAN

UNITS = ["blocks.*"]  # FSDP2's units: one all-gather / reduce-scatter group per block (the root: the rest)

STYLES = ("explicit", "builtin")
# Known, harmless noise of the builtin composition on every rank: FSDP2 wraps the last stage's output
# (a view of the head's DTensor logits) for its pre-backward hook, and gathering the fixture's fsdp × tp
# weights (full_tensor, outside the ledger) takes two all-gathers. Neither changes a result.
warnings.filterwarnings("ignore", message=".*returned a view tensor.*", category=UserWarning)
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
# {group name: ledger label} of every layout this process ran. DTensor caches its sharding decisions
# keyed by DeviceMesh equality, which ignores process groups: a later layout whose sub-mesh equals
# an earlier one's (same ranks, layout and axis name; e.g. tp of dp=2,tp=2 and of fsdp=2,tp=2) may
# run its DTensor collectives on the earlier mesh's group, which therefore keeps its (same) label.
_LABELS: dict[str, str] = {}
# Layouts a style cannot run, and why (variants(cfg) omits them).
BUILTIN_REFUSAL = {
    "cp": "builtin: torch's context_parallel runs only on CUDA (NCCL) in float32/bfloat16 "
          "(torch_impl.cp.BUILTIN_REFUSAL), so it is not composed into the mesh: no builtin row for cp > 1",
}


def builtin_refusal(cfg: Config) -> str | None:
    """Why the builtin style cannot run ``cfg``'s layout (None: it can)."""
    return BUILTIN_REFUSAL["cp"] if cfg.axis("cp") > 1 else None


def hsdp_dp(cfg: Config) -> bool:
    """builtin dp × tp: FSDP2 HSDP on a (dp, dp_shard = 1) mesh instead of DDP, whose first broadcast
    fails on DTensor weights ('aten.cat.default got mixed torch.Tensor and DTensor')."""
    return cfg.axis("dp") > 1 and cfg.axis("tp") > 1 and cfg.replicate == 1


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    """The variant of every style is the layout itself, so the rows of one layout line up."""
    return tuple((style, cfg.mesh_name) for style in STYLES if style == "explicit" or builtin_refusal(cfg) is None)


@dataclass
class Layout:
    """This rank's place on the mesh: the DeviceMesh, coordinates, one group per axis and the
    gradient group (data + cp), {group: ledger label}, and (ep with fsdp) the experts' group over the
    other data axes (dp × fsdp)."""

    dm: DeviceMesh
    coords: dict[str, int]
    groups: dict[str, Any]
    grad_group: Any
    labels: dict[Any, str]
    experts_group: Any = None


def axes_group(cfg: Config, names: tuple[str, ...], axes: list[str]):
    """One group per set of ranks that differ only in their ``axes`` coordinates (several axes:
    new_subgroups_by_enumeration, every rank the same list); this rank's."""
    others = [a for a in names if a not in axes]
    key = lambda r: tuple(mesh_coords(cfg, r)[a] for a in others)
    ranks = sorted(range(cfg.world_size), key=key)
    enumeration = [list(g) for _, g in itertools.groupby(ranks, key=key)]
    return dist.new_subgroups_by_enumeration(enumeration)[0]


def make_layout(cfg: Config, ctx: RankContext, style: str = "explicit") -> Layout:
    names, sizes = zip(*cfg.mesh, strict=True)
    dims = tuple(cfg.mesh)
    if style == "builtin" and hsdp_dp(cfg):  # a size-1 shard axis right inside dp (builtin_setup)
        i = names.index("dp") + 1
        dims = dims[:i] + (("dp_shard", 1),) + dims[i:]
    dm = init_device_mesh(ctx.device.type, [n for _, n in dims], mesh_dim_names=[a for a, _ in dims])
    groups = {a: dm[a].get_group() for a in names}
    labels = {g: a for a, g in groups.items()}
    data = ("fsdp",) if cfg.replicate > 1 else ("dp", "fsdp")  # HSDP: shard over fsdp(+cp), dp replicates
    grad_axes = [a for a in names if a in data + ("cp",) and cfg.axis(a) > 1]
    grad_group = groups[grad_axes[0]] if len(grad_axes) == 1 else None
    if len(grad_axes) > 1:  # ranks that differ only in their data and cp coordinates: one group each
        grad_group = axes_group(cfg, names, grad_axes)
        labels[grad_group] = mesh_grad_axes(cfg)
    if grad_group is not None:  # ep replicates the dense weights: its all-reduce follows (ExpertsOnEp)
        want = cfg.data_size // cfg.replicate // cfg.axis("ep") * cfg.axis("cp")
        assert dist.get_world_size(grad_group) == want, dist.get_world_size(grad_group)
    experts_group = None  # ep under FSDP / FSDP2 (which ignore them): the experts averaged over dp × fsdp
    if cfg.moe and (cfg.axis("fsdp") > 1 or (style == "builtin" and hsdp_dp(cfg))):
        other = [a for a in names if a in ("dp", "fsdp") and cfg.axis(a) > 1]
        experts_group = groups[other[0]] if len(other) == 1 else axes_group(cfg, names, other)
        labels.setdefault(experts_group, "+".join(other))
    return Layout(dm, mesh_coords(cfg, ctx.rank), groups, grad_group, labels, experts_group)


def local_batch(cfg: Config, problem: Problem, lay: Layout, device):
    """(tokens, targets) (B/d, T/c) of this rank's data and cp coordinates, and positions (T/c,)."""
    rows, i, j = cfg.batch // cfg.data_size, cfg.data_index(lay.coords), lay.coords.get("cp", 0)
    pos = torch.tensor(cp_positions(cfg.seq, cfg.axis("cp"), j, "ring"), device=device)  # (T/c,) global
    x, y = inputs(cfg, problem, device), targets(cfg, problem, device)  # (B, T) each
    if cfg.moe and cfg.accumulate > 1:  # chunk k = this rank's share of micro-batch k (the balancing loss's)
        pick = micro_major_rows(cfg.batch, cfg.accumulate, cfg.data_size, i, device)  # (B/d,)
        return x[pick][:, pos], y[pick][:, pos], pos
    x, y = x[i * rows:(i + 1) * rows][:, pos], y[i * rows:(i + 1) * rows][:, pos]  # (B/d, T/c)
    return x, y, pos


def build_stage(cfg: Config, problem: Problem, stage: int, device) -> pp.Stage:
    """Stage ``stage`` of pp (the whole model at pp = 1) holding the fixture's parameters."""
    module = pp.Stage(empty_model(cfg, "meta"), stage, cfg.axis("pp")).to_empty(device=device)
    return load_fixture(module, problem.params)


# --- explicit ---------------------------------------------------------------------------------------


def explicit_setup(cfg: Config, problem: Problem, ctx: RankContext, lay: Layout) -> Setup:
    S, s, t, c = cfg.axis("pp"), lay.coords.get("pp", 0), cfg.axis("tp"), cfg.axis("cp")
    M, m, tc = mesh_micro(cfg)
    x, y, pos = local_batch(cfg, problem, lay, ctx.device)
    assert x.shape == y.shape == (M * m, tc), (x.shape, (M * m, tc))
    stage = build_stage(cfg, problem, s, ctx.device)
    recipe.freeze_(stage, cfg)  # --freeze: before every wrapper (fixture names)
    styles = apply_tp(stage, TRANSFORMER_PLAN, lay.dm["tp"], "explicit") if t > 1 else {}  # this stage's modules
    ep = ExpertsOnEp(cfg, stage, lay, "explicit", ctx.ledger) if cfg.moe else None  # the MoE layers' mlp: not tp-split
    held = lambda: {(id(o), a): p for o in stage.modules() for a, p in o._parameters.items() if p is not None}
    tp_held = {k for k, p in held().items() if hasattr(p, "tp_size")}  # split over tp (FSDP shards them next)
    loss_of = stage_loss(loss_fn, styles, lay.dm["tp"] if t > 1 else None, "explicit")  # vocab CE on (m, T/c, V/t)
    loss_of = ep.with_aux(loss_of) if ep else loss_of  # + Σ_l the balancing losses (ep: no pp, one stage)
    if c > 1:
        core = RingCore(cfg.seq, "ring", lay.groups["cp"])
        for block in stage.blocks.values():
            block.attn.core = core  # q, k, v: (m, H/t, T/c, dh)
    low = TORCH_DTYPES[cfg.dtype] if cfg.precision == "mixed" else None  # mixed: shards cast before the gather
    fsdp = FSDP(stage, group=lay.grad_group, compute_dtype=low, ignored_params=ep and ep.params) \
        if cfg.data_axis == "fsdp" and lay.grad_group else None
    net = fsdp or stage
    named = list(stage.named_parameters())  # after FSDP: shards (≥2-D) + replicated gains
    params = [p for _, p in named]
    opt = recipe.optimizer(named, cfg)  # --decay-mask: the matrices' shards (≥ 2-D) decay, the gains not
    tp_split = {id(p) for k, p in held().items() if k in tp_held}
    experts = (ep.ids, ep.n) if ep else ()  # ep's (E/ep, …) pieces: each held by world/ep ranks
    clip = lambda max_norm: global_clip_(params, max_norm, S, tp_split, t, fsdp, *experts)  # noqa: E731  (one scalar)
    pipe = pp.Pipe(s, S, lay.groups.get("pp"))
    run = functools.partial(net, positions=pos)  # stage 0 embeds at the global positions
    last_step: dict = {}

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss, last_step["timeline"], last_step["peak"] = pp.explicit_step(
            "1f1b", run, x, y, cfg, ctx, time.perf_counter(), pipe=pipe, microbatches=M,
            act_shape=(m, tc, cfg.dim), loss_of=loss_of)
        if fsdp is not None:
            fsdp.finish_gradient_synchronization()  # M reduce-scatters per unit waited, summed; gains averaged
            if cfg.replicate > 1:  # HSDP: the shards and gains averaged over the dp replicas, one all-reduce
                average_flat([p.grad for p in params if p.grad is not None and not (ep and id(p) in ep.ids)],
                             lay.groups["dp"])  # (ep's experts: averaged over dp × fsdp by ep.finish, once)
        elif lay.grad_group is not None:
            average_flat([p.grad for p in params if p.grad is not None], lay.grad_group)  # ONE all-reduce: data+cp
        if ep is not None:
            ep.finish(params)
        # mean over the world = the global loss: last-stage ranks hold their local mean, scaled by
        # S (only 1/S of the ranks hold one); the tp copies are equal
        return loss * S if s == S - 1 else torch.zeros_like(loss)

    def full(name: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = fsdp.full_tensor(name, tensor) if fsdp is not None else tensor.detach()  # tp-local
        tensor = ep.full(name, tensor) if ep else tensor
        return unshard(tensor, styles[name], lay.groups["tp"]) if name in styles else tensor

    return Setup(forward_backward=forward_backward, update=recipe.stepper(opt, cfg, clip),
                 grads=lambda: [p.grad for p in params],
                 fixture=stage_fixture(cfg, lay, stage, named, full), params=params, optimizer=opt,
                 loss_reduction="mean", group=None,
                 extra={"last_step": last_step, "experts": ep})


def stage_fixture(cfg: Config, lay: Layout, stage: nn.Module, named: list, full):
    """The harness's fixture: this rank's local tensors (``named`` order) -> ``full(name, t)`` (the
    tp-local / DTensor piece made whole) -> every stage's fixture arrays, from every rank."""
    return lambda tensors: gather_stages(cfg, lay, [to_fixture(stage, name, full(name, t))
                                                    for (name, _), t in zip(named, tensors, strict=True)])


def gather_stages(cfg: Config, lay: Layout, mine: list) -> list:
    """Every stage's full arrays (from the rank at coordinates 0 on every other axis), in stage
    order = fixture order (all_gather_object over the world: bookkeeping, outside the ledger)."""
    every: list = [None] * cfg.world_size
    dist.all_gather_object(every, (lay.coords, mine))
    by_stage = {c.get("pp", 0): arrays for c, arrays in every if all(v == 0 for a, v in c.items() if a != "pp")}
    return [a for s in range(cfg.axis("pp")) for a in by_stage[s]]


# --- training ---------------------------------------------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    cfg.check("mesh")
    if (style, variant) not in variants(cfg):
        raise ValueError(builtin_refusal(cfg) or f"mesh: unknown style/variant {style}/{variant}; "
                         f"choose from {variants(cfg)}")
    lay = make_layout(cfg, ctx, style)
    _LABELS.update({g.group_name: label for g, label in lay.labels.items()})
    ctx.ledger.label_groups(_LABELS)
    try:
        setup = explicit_setup(cfg, problem, ctx, lay) if style == "explicit" else builtin_setup(cfg, problem, ctx, lay)
        # --freeze: the frozen parameters skip their reductions and AdamW state (unpriced rows); ep (the MoE
        # transformer): the all-to-alls' bytes follow the routing, priced after training from the recorded step's
        # counts where mesh_moe_comm_torch holds (not HSDP × ep beside tp), else unpriced
        known = not cfg.freeze and not cfg.moe
        setup.comm_theory = mesh_comm_bytes_torch(cfg, style, ctx.rank) if known else None
        theory = {label: {op: {"count": n, "bytes": b} for op, (n, b) in ops.items()}
                  for label, ops in mesh_comm_torch(cfg, style, ctx.rank).items()} if known else None
        setup.extra.update(comm_by_axis_theory=theory,
                           state_bytes_theory=mesh_state_bytes_torch(cfg, style, ctx.rank) if known else None)
        last_step, schedule = setup.extra.pop("last_step", {}), setup.extra.pop("schedule", None)
        experts = setup.extra.pop("experts", None)
        trained = train_loop(cfg, ctx, setup)
        moe = experts and experts.routed and mesh_moe_comm_torch(cfg, style, experts.routed_rows())  # the recorded step
        if moe:
            trained.comm_theory = sum(nb for ops in moe.values() for _, nb in ops.values())  # no recv here
            trained.extra["comm_by_axis_theory"] = {label: {op: {"count": n, "bytes": b} for op, (n, b) in ops.items()}
                                                    for label, ops in moe.items()}
    finally:
        ctx.ledger.label_groups({})
    # every rank's view (bookkeeping after training): stages differ
    mine = {"comm": trained.comm, "comm_by_axis": trained.extra.get("comm_by_axis", {}),
            "comm_by_axis_theory": trained.extra["comm_by_axis_theory"], "state_bytes": trained.state_bytes,
            "state_bytes_theory": trained.extra["state_bytes_theory"],
            "activation_bytes": trained.extra["activation_bytes"], "peak": last_step.get("peak"),
            "order": [(e["kind"], e["mb"]) for e in last_step.get("timeline") or []]}  # the pipeline's F/B order
    every: list[dict] = [None] * cfg.world_size
    dist.all_gather_object(every, mine)
    trained.extra.update({f"{k}_per_rank": [e[k] for e in every] for k in mine})
    trained.extra["coords_per_rank"] = [mesh_coords(cfg, r) for r in range(cfg.world_size)]
    del setup, schedule
    gc.collect()  # pipeline schedules / FSDP2 state sit in reference cycles (see torch_impl.pp.train)
    return trained


# --- builtin ----------------------------------------------------------------------------------------


def builtin_setup(cfg: Config, problem: Problem, ctx: RankContext, lay: Layout) -> Setup:
    S, s, t, dm = cfg.axis("pp"), lay.coords.get("pp", 0), cfg.axis("tp"), lay.dm
    M, m, tc = mesh_micro(cfg)
    x, y, _ = local_batch(cfg, problem, lay, ctx.device)  # (B/d, T): no cp here
    stage = build_stage(cfg, problem, s, ctx.device)
    recipe.freeze_(stage, cfg)  # --freeze: before every wrapper (fixture names)
    styles, parallel_loss, tp_mesh = {}, contextlib.nullcontext, dm["tp"] if t > 1 else None
    if t > 1:
        styles = apply_tp(stage, TRANSFORMER_PLAN, tp_mesh, "builtin")  # W_qkv rows permuted (heads_perm)
        parallel_loss = loss_parallel  # CE over the Shard(-1) logits: 3 all-reduces of (m, T)
        if S > 1 and s == S - 1:  # the pipeline passes plain tensors: local logits out, DTensor again in the loss
            local_logits(stage.head)  # (m, T, V/t)
    ep = ExpertsOnEp(cfg, stage, lay, "builtin", ctx.ledger) if cfg.moe else None
    ignored = set(ep.params) if ep else None  # FSDP2: the experts stay whole (ep's; lay.experts_group averages them)
    quiet = lambda last: contextlib.nullcontext()  # noqa: E731  (accumulation without pp: the reduction once)
    if cfg.replicate > 1:  # HSDP: FSDP2 on the 2-D (dp, fsdp) mesh (builtin has no cp)
        apply_fsdp(stage, dm["dp", "fsdp"], UNITS, ignored)
    elif cfg.data_axis == "fsdp" and cfg.data_size > 1:
        apply_fsdp(stage, dm["fsdp"], UNITS, ignored)  # root: this stage's embeddings / final norm + head
    elif hsdp_dp(cfg):  # HSDP: replicated over dp, "sharded" over dp_shard = 1 (DDP fails on DTensors)
        apply_fsdp(stage, dm["dp", "dp_shard"], UNITS, ignored)
    elif cfg.data_axis == "dp" and cfg.data_size > 1:
        stage = apply_ddp(stage, lay.groups["dp"])  # plain tensors (tp = 1)
        quiet = lambda last: contextlib.nullcontext() if last else stage.no_sync()  # noqa: E731
    if hasattr(stage, "set_requires_gradient_sync"):  # FSDP2: as the pipeline does, reduce once, keep unsharded
        def quiet(last):
            stage.set_requires_gradient_sync(last)
            stage.set_reshard_after_backward(last)
            return contextlib.nullcontext()
    named = list(stage.named_parameters())
    params = [p for _, p in named]
    opt = recipe.optimizer(named, cfg)  # --decay-mask: DTensors report the global shape
    experts = (ep.ids, ep.n) if ep else ()  # ep's plain (E/ep, …) pieces beside the DTensors
    clip = lambda max_norm: global_clip_(params, max_norm, S, set(), t, None, *experts)  # noqa: E731  (placements)
    loss_of = stage_loss(loss_fn, styles, tp_mesh, "builtin")  # the micro-batch's mean CE, a local scalar
    loss_of = ep.with_aux(loss_of) if ep else loss_of  # + Σ_l the balancing losses (ep: no pp, one stage)

    schedule = None
    if S > 1:  # 1F1B, the pipeline scales by 1/M
        meta = lambda shape: torch.empty(shape, dtype=torch_dtype(cfg), device=ctx.device, requires_grad=True)
        act = (m, tc, cfg.dim)
        schedule = apply_pp(stage, s, S, dm["pp"], loss_of, M, "1f1b", device=ctx.device,
                            input_args=x[:m] if s == 0 else meta(act),
                            output_args=meta((m, tc, cfg.vocab // t) if s == S - 1 else act))

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with parallel_loss():
            if schedule is None:  # M = --accumulate parts (1 without it), each loss / M
                loss = 0
                for k, (xs, ys) in enumerate(zip(x.chunk(M), y.chunk(M))):
                    with quiet(k == M - 1):
                        part = loss_of(stage(xs), ys) / M
                        part.backward()
                    torch.clear_autocast_cache()  # FSDP2 re-gathers into the same tensors: no stale bf16 cast
                    loss = loss + part.detach()
                if ep is not None:
                    ep.finish(params)  # after the data axes' reduction (FSDP2 / DDP: in the last backward)
            elif s == S - 1:
                losses = []  # M micro-batch means
                schedule.step(*(() if s else (x,)), target=y, losses=losses)
                loss = torch.stack(losses).mean()
            else:
                schedule.step(*(() if s else (x,)))
                loss = torch.zeros((), dtype=torch_dtype(cfg), device=ctx.device)
        return loss.detach() * S if s == S - 1 else loss.detach()  # as explicit: world mean = global loss

    def full(name: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        tensor = ep.full(name, tensor) if ep else tensor
        if styles.get(name) != "colwise_heads":
            return tensor
        return tensor[torch.argsort(heads_perm(tensor.shape[0], t, tensor.device))]

    return Setup(forward_backward=forward_backward, update=recipe.stepper(opt, cfg, clip),
                 grads=lambda: [p.grad for p in params],
                 fixture=stage_fixture(cfg, lay, stage, named, full), params=params, optimizer=opt,
                 loss_reduction="mean", group=None,
                 extra={"schedule": schedule, "experts": ep})


# --- ep: the MoE transformer's experts ------------------------------------------------------------------


class ExpertsOnEp:
    """ep on the MoE transformer (compose_ep.py's semantics on the project's ``MoE`` seams): every MoE layer
    keeps ep rank r's experts [r·E/ep, (r+1)·E/ep) (``GroupedExperts.shard``), replicated over dp × fsdp × tp
    (not tp-split: TRANSFORMER_PLAN names no MoE module; not fsdp-sharded: ``params`` are FSDP's ignored
    ones), and routes through a ``Dispatcher`` on mesh["ep"] (the explicit / functional all-to-all); the
    balancing loss's counts are summed over every data rank (the Dispatcher's all-gather over ep, then
    one all-reduce over dp × fsdp). After the data axes' reduction (``finish``): the dense gradients
    averaged over ep (ONE flat all-reduce), the experts' averaged over dp × fsdp (the data wrapper's
    all-reduce without fsdp; with fsdp ONE flat all-reduce over ``experts_group``), then / ep."""

    def __init__(self, cfg: Config, stage: nn.Module, lay: Layout, style: str, ledger=None):
        self.n, self.group, self.lay, self.ledger = cfg.axis("ep"), lay.groups["ep"], lay, ledger
        per = cfg.experts // self.n
        mine = range(lay.coords["ep"] * per, (lay.coords["ep"] + 1) * per)
        other = [a for a in ("dp", "fsdp") if cfg.axis(a) > 1]  # the counts: over ep, then over these
        counts_group = lay.experts_group or (lay.groups[other[0]] if other else None)  # (dp, fsdp): experts_group
        self.moes = [block.mlp for block in stage.blocks.values()]
        self.routed: list[int] = []  # per MoE call in a recorded step: the rows this rank sends + receives
        self.calls_per_step = len(self.moes) * cfg.pipeline_microbatches
        for moe in self.moes:
            moe.experts = moe.experts.shard(mine.start, len(mine))
            d = Dispatcher(cfg.experts, moe.experts, self.group, ALL_TO_ALL[style])
            moe.dispatch = d
            counted = functools.partial(self._counted, d)
            moe.global_counts = counted if counts_group is None else functools.partial(_summed, counted, counts_group)
        self.params = [p for moe in self.moes for p in moe.experts.parameters()]
        self.ids = {id(p) for p in self.params}
        self.names = {f"blocks.{k}.mlp.experts.{n}" for k in stage.blocks for n, _ in
                      self.moes[0].experts.named_parameters()}

    def _counted(self, d: Dispatcher, counts: torch.Tensor) -> torch.Tensor:
        """The Dispatcher's counts exchange, noting in the steps the ledger records (not bench --overhead's bare
        steps after them) the rows its all-to-alls will move, from the (ep, E) counts."""
        total = d.global_counts(counts)
        if self.ledger is not None and self.ledger.active:
            self.routed.append(d.rows())
        return total

    def routed_rows(self) -> int:
        """Σ over the last recorded step's MoE calls (layers × parts) of the rows sent + received (the ledger's
        step; shared.theory.mesh_moe_comm_torch)."""
        return sum(self.routed[-self.calls_per_step:])

    def with_aux(self, loss_of):
        return lambda out, y: loss_of(out, y) + sum(moe.aux for moe in self.moes)

    def finish(self, params) -> None:
        local = lambda g: g.to_local() if isinstance(g, DTensor) else g  # noqa: E731
        average_flat([local(p.grad) for p in params if id(p) not in self.ids and p.grad is not None], self.group)
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.lay.experts_group is not None:
            average_flat(grads, self.lay.experts_group)
        for g in grads:
            g.div_(self.n)

    def full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """An expert parameter's (E/ep, …) slice -> (E, …) (ep rank order = expert order; every rank calls it)."""
        if name.removeprefix("module.") not in self.names:  # builtin dp: DDP's prefix
            return t
        out = t.new_empty((self.n * t.shape[0], *t.shape[1:]))
        dist.all_gather_single(out, t.detach().contiguous(), group=self.group)
        return out


def _summed(counts_over_ep, group, counts: torch.Tensor) -> torch.Tensor:
    """(E,) counts -> summed over ep (the Dispatcher's all-gather, which keeps the splits) and ``group``."""
    total = counts_over_ep(counts).clone()
    dist.all_reduce(total, group=group)
    return total
