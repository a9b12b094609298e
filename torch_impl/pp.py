"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, ZB-H1) with torch.distributed point-to-point.

Sharded: the blocks, in contiguous stages (rank s: blocks s·L/S … (s+1)·L/S − 1, their grads and
AdamW state); the transformer's embeddings on stage 0, final norm, head and loss on stage S−1
(shared.theory.pp_stage_param_count). ``Stage`` is torchtitan's split: parameter names stay the
model's. The batch is cut into M micro-batches; each micro-batch loss is divided by M.

Collectives: none in training, only send/recv between neighbours. fwd: each micro-batch's
activation to s+1; bwd: its gradient to s−1. Message (B/M, D) (MLP) or (B/M, T, D) (transformer);
per rank ((s < S−1) + (s > 0))·M messages (shared.theory.pp_p2p_bytes_per_rank). Every exchange is
one batch_isend_irecv that both neighbours issue in the same order: no deadlock for any M ≥ 1.

    gpipe        all M forwards, then all M backwards
    1f1b         warm-up, one-forward-one-backward, cool-down: ≤ S−s micro-batches stashed
    zb           ZB-H1: each backward split into B (input gradient) and W (weight gradient, deferred)
    interleaved  v = cfg.virtual_stages chunks per rank (torch_impl/pp_schedules.py)
Bubble (theory): (p−1)/(M+p−1); interleaved (p−1)/(v·M+p−1); ZB-H1 a third of 1F1B's at F = B = W.
Every stage's order is shared.schedule.order's (asserted).
builtin: torch.distributed.pipelining on the same ``Stage`` modules (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble). compiled: the same with each stage compiled.
Mixed precision (--precision mixed): float32 stages and AdamW state, the step under autocast; every
stage hands on float32 (``Stage.out_dtype``), so the messages are 4 bytes per element. float16: the last
stage's loss scaled (torch_impl/recipe.loss_scaler), + one 4-byte all-reduce of the found-inf flag.
Papers: GPipe, Huang et al. 2019 (arXiv:1811.06965); PipeDream 1F1B, Narayanan et al. 2019
(arXiv:1806.03377); ZB-H1, Qi et al. 2024 (arXiv:2401.10241).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.schedule import closed_form_bubble, measured_costs, simulate
from shared.schedule import order as schedule_order
from shared.theory import pp_p2p_bytes_per_rank, pp_stage_param_count, pp_state_bytes
from torch_impl import compiled, recipe
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import (
    empty_model,
    inputs,
    load_fixture,
    loss_fn,
    targets,
    to_fixture,
    torch_dtype,
)
from torch_impl.parallel import recipe as parallel_recipe
from torch_impl.pp_schedules import StepClock, interleaved_step

VARIANTS = (("explicit", "gpipe"), ("explicit", "1f1b"), ("explicit", "interleaved"), ("explicit", "zb"),
            ("builtin", "gpipe"), ("builtin", "1f1b"), ("builtin", "interleaved"), ("builtin", "zb"))


# The compiled style (torch_impl/compiled.py): pipelining's schedules over stages that are each compiled.
# No zb: torch_impl/compiled.py VARIANT_REFUSALS (a compiled stage has one fused backward).
COMPILED = (("compiled", "gpipe"), ("compiled", "1f1b"), ("compiled", "interleaved"))


def compiled_variants(cfg: Config) -> list[tuple[str, str]]:
    return [sv for sv in COMPILED if sv[1] != "interleaved" or cfg.microbatches % cfg.world_size == 0]


def variants(cfg: Config) -> list[tuple[str, str]]:
    """Every variant; interleaved only where M % S == 0 (Megatron's constraint; with v > 1
    Config.check refuses the rest). It runs cfg.virtual_stages chunks per rank, the others one."""
    return [sv for sv in VARIANTS if sv[1] != "interleaved" or cfg.microbatches % cfg.world_size == 0]


class Stage(nn.Module):
    """Stage ``stage`` of ``stages`` cut from a full model (torchtitan's split: keep this stage's
    modules, drop the rest). MLP: ``layers`` s·L/S … ; transformer: ``wte``/``wpe`` on the first
    stage, ``blocks`` s·L/S …, ``normf``/``head`` on the last. Blocks sit in a ModuleDict keyed by
    their global index, so ``named_parameters()`` gives the full model's names, in its order."""

    def __init__(self, model: nn.Module, stage: int, stages: int):
        super().__init__()
        self.stack = "blocks" if hasattr(model, "blocks") else "layers"  # transformer / MLP
        blocks = getattr(model, self.stack)
        per = len(blocks) // stages
        self.embeds = self.stack == "blocks" and stage == 0
        self.heads = self.stack == "blocks" and stage == stages - 1
        if self.embeds:
            self.wte, self.wpe = model.wte, model.wpe
        setattr(self, self.stack, nn.ModuleDict({str(l): blocks[l] for l in range(stage * per, (stage + 1) * per)}))
        if self.heads:
            self.normf, self.head = model.normf, model.head
        # mixed precision: the MLP's blocks compute in bf16 under autocast; every stage hands on (and
        # receives, its buffers are in the parameters' dtype) float32, as the transformer's residual stream
        self.out_dtype = next(model.parameters()).dtype

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.embeds:  # x: (B/M, T) token ids; ``positions``: their global positions (cp), default arange(T)
            positions = torch.arange(x.shape[1], device=x.device) if positions is None else positions
            x = self.wte(x) + self.wpe(positions)  # (B/M, T, D)
        for block in getattr(self, self.stack).values():
            x = block(x)  # (B/M, D) MLP, (B/M, T, D) transformer
        out = self.head(self.normf(x)) if self.heads else x  # last transformer stage: (B/M, T, V) logits
        return out.to(self.out_dtype)  # a no-op unless mixed precision (bf16 -> float32: exact)


def build_stage(cfg: Config, problem: Problem, stage: int, device, stages: int | None = None) -> Stage:
    """Stage ``stage`` of ``stages`` (default: one per rank; interleaved: S·v virtual stages) holding
    the fixture's parameters; only its own modules are allocated."""
    module = Stage(empty_model(cfg, "meta"), stage, stages or cfg.world_size).to_empty(device=device)
    return load_fixture(module, problem.params)


def activation(cfg: Config) -> tuple[int, ...]:
    """Shape of one micro-batch's activation between stages: (B/M, D) MLP, (B/M, T, D) transformer."""
    rows = cfg.batch // cfg.microbatches
    return (rows, cfg.dim) if cfg.model == "mlp" else (rows, cfg.seq, cfg.dim)


@dataclass(frozen=True)
class Pipe:
    """Where this rank sits in a pipeline: stage ``stage`` of ``stages``, the stages being the
    ranks of ``group`` in group order (None: the world, stage = rank; the N-D mesh passes its pp
    group, whose neighbours' global ranks ``peer`` looks up)."""

    stage: int
    stages: int
    group: Any = None

    def peer(self, stage: int) -> int:
        return stage if self.group is None else dist.get_global_rank(self.group, stage)


def exchange(pipe: Pipe, send_fwd=None, send_bwd=None, recv_fwd=None, recv_bwd=None):
    """One batched exchange with the neighbours: send an activation to s+1 / a gradient to s−1,
    receive into the given buffers an activation from s−1 / a gradient from s+1. Ops that point
    past either end of the pipeline are dropped. Returns (activation, gradient) received."""
    s, last, g = pipe.stage, pipe.stages - 1, pipe.group
    ops = []
    if send_fwd is not None and s < last:
        ops.append(dist.P2POp(dist.isend, send_fwd, pipe.peer(s + 1), g))
    if send_bwd is not None and s > 0:
        ops.append(dist.P2POp(dist.isend, send_bwd, pipe.peer(s - 1), g))
    x = recv_fwd if recv_fwd is not None and s > 0 else None
    dy = recv_bwd if recv_bwd is not None and s < last else None
    ops += [dist.P2POp(dist.irecv, t, pipe.peer(peer), g) for t, peer in ((x, s - 1), (dy, s + 1)) if t is not None]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return x, dy


def explicit_step(schedule: str, module: Stage, x: torch.Tensor, y: torch.Tensor | None, cfg: Config,
                  ctx: RankContext, t0: float, pipe: Pipe | None = None, microbatches: int | None = None,
                  act_shape: tuple[int, ...] | None = None, loss_of=loss_fn):
    """One training step's forward and backward over M micro-batches; ``x`` the batch's inputs,
    ``y`` its targets (None for the MLP). Returns (this stage's sum of scaled micro-batch losses —
    the full-batch loss on the last stage, 0 elsewhere —, timeline of F/B blocks, peak number of
    micro-batches whose activations were stashed). The N-D mesh passes its ``pipe`` (pp group),
    ``microbatches``, the local ``act_shape`` (m, T/cp, D), a ``loss_of(out, targets)`` (the
    vocab-parallel CE under tp) and as ``module`` any callable (a stage with its positions bound)."""
    pipe = pipe or Pipe(ctx.rank, ctx.world_size)
    S, s, M = pipe.stages, pipe.stage, microbatches or cfg.microbatches
    first, last = s == 0, s == S - 1
    dtype, shape = torch_dtype(cfg), act_shape or activation(cfg)
    xs = x.chunk(M)  # M × (B/M, D) or (B/M, T) tokens; only stage 0 reads them
    ys = y.chunk(M) if y is not None else [None] * M  # M × (B/M, T) targets; only the last stage
    buf = lambda: torch.empty(shape, dtype=dtype, device=x.device)  # (B/M, D) / (B/M, T, D)
    stash, timeline, peak, loss = {}, [], 0, torch.zeros((), dtype=dtype, device=x.device)
    zb, weights_after, pending = schedule == "zb", {}, {}  # zb: B's micro-batch -> the W's the order runs after it
    for op in schedule_order("zb", S, M)[s] if zb else ():
        if op.kind == "B":
            b_mb = op.mb
        elif op.kind == "W":  # a W always follows a B (or another W)
            weights_after.setdefault(b_mb, []).append(op.mb)

    clock = StepClock(x.device, t0)  # CPU: seconds since the step began; CUDA: events, resolved at the end

    def forward(mb, x_in):
        nonlocal peak, loss
        start = clock()
        x_in = xs[mb] if first else x_in.requires_grad_()  # (B/M, D) / (B/M, T) tokens / (B/M, T, D)
        out = module(x_in)  # (B/M, D) / (B/M, T, D); last transformer stage (B/M, T, V)
        if last:
            out = loss_of(out, ys[mb]) / M  # scalar: this micro-batch's share of the full-batch mean
            loss = loss + out.detach()
        else:
            assert out.shape == shape and out.dtype == dtype, (out.shape, out.dtype, shape, dtype)  # the recv buffers'
        stash[mb] = (x_in, out)
        peak = max(peak, len(stash))
        timeline.append({"stage": s, "kind": "F", "mb": mb, "start": start, "end": clock()})
        return None if last else out.detach()

    def backward(mb, dy):
        start = clock()
        dy = None if last else dy
        if zb:  # B: the input gradient only; the graph stays for W (stage 0 has no input gradient)
            x_in, out = stash[mb]
            dx = None if first else torch.autograd.grad(out, x_in, dy, retain_graph=True)[0]
            pending[mb] = dy
        else:
            x_in, out = stash.pop(mb)
            torch.autograd.backward(out, dy)  # accumulates this stage's dW
            dx = None if first else x_in.grad
        timeline.append({"stage": s, "kind": "B", "mb": mb, "start": start, "end": clock()})
        return dx  # gradient for stage s−1, shaped like the activation

    def weights(b_mb):  # zb: the W's the schedule runs after B(b_mb): accumulate dW, free the stash
        for mb in weights_after.get(b_mb, []):
            start = clock()
            _, out = stash.pop(mb)
            torch.autograd.backward(out, pending.pop(mb), inputs=[p for p in module.parameters() if p.requires_grad])
            timeline.append({"stage": s, "kind": "W", "mb": mb, "start": start, "end": clock()})

    if schedule == "gpipe":
        for mb in range(M):
            x_in, _ = exchange(pipe, recv_fwd=buf())
            exchange(pipe, send_fwd=forward(mb, x_in))
        for mb in range(M):
            _, dy = exchange(pipe, recv_bwd=buf())
            exchange(pipe, send_bwd=backward(mb, dy))
    else:  # 1f1b; zb the same exchanges, W's (no communication) after the B's they follow
        warmup = min(S - s - 1, M)
        for mb in range(warmup):
            x_in, _ = exchange(pipe, recv_fwd=buf())
            exchange(pipe, send_fwd=forward(mb, x_in))
        x_in = exchange(pipe, recv_fwd=buf())[0] if warmup < M else None
        for i in range(M - warmup):  # steady: F(warmup + i), then B(i)
            _, dy = exchange(pipe, send_fwd=forward(warmup + i, x_in), recv_bwd=buf())
            more = i < M - warmup - 1
            x_in, _ = exchange(pipe, send_bwd=backward(i, dy), recv_fwd=buf() if more else None)
            weights(i)
        for mb in range(M - warmup, M):  # cool-down
            _, dy = exchange(pipe, recv_bwd=buf())
            exchange(pipe, send_bwd=backward(mb, dy))
            weights(mb)
    assert not stash, f"stage {s}: micro-batches {sorted(stash)} never went backward"
    return loss, clock.resolve(timeline), peak


def make_builtin(variant: str, chunks: list[Stage], cfg: Config, ctx: RankContext, x: torch.Tensor,
                 loss_of=loss_fn):
    """torch.distributed.pipelining's stages (one per chunk: virtual stage c·S + rank) and schedule.
    The schedule calls loss_fn(out, target) once per micro-batch and (scale_grads=True) divides the
    summed gradients by M afterwards: loss_fn is the micro-batch mean (MLP mean(y²) against a zero
    target, transformer mean CE), so the result is the full-batch mean's gradient."""
    S, s, M, v = ctx.world_size, ctx.rank, cfg.microbatches, len(chunks)
    # Static metadata skips the shape-inference round trip; requires_grad marks which tensors
    # have gradients to send back (every stage's output, inputs except stage 0's).
    meta = lambda shape: torch.empty(shape, dtype=torch_dtype(cfg), device=x.device, requires_grad=True)
    act = activation(cfg)  # (B/M, D) / (B/M, T, D)
    first_in = torch.empty((cfg.batch // M, *x.shape[1:]), dtype=x.dtype, device=x.device)  # (B/M, D) / (B/M, T) ids
    last_out = act if cfg.model == "mlp" else act[:-1] + (cfg.vocab,)  # (B/M, D) / (B/M, T, V) logits
    stages = [PipelineStage(chunk, k, S * v, ctx.device, input_args=first_in if k == 0 else meta(act),
                            output_args=meta(last_out if k == S * v - 1 else act))
              for k, chunk in ((c * S + s, chunk) for c, chunk in enumerate(chunks))]
    # Schedule1F1B raises ValueError for M < S (torch 2.13): ScheduleGPipe runs instead (same
    # gradients; stages s > S − M stash M micro-batches, not S − s); extra["builtin_schedule"] says so.
    cls = Schedule1F1B if variant == "1f1b" and M >= S else ScheduleGPipe
    mlp_target = lambda out, target: loss_of(out - target)  # mean(y²): the target is zeros
    loss = mlp_target if cfg.model == "mlp" else loss_of
    if variant in ("interleaved", "zb"):  # multi-stage schedules take the list (zb: one stage per rank = ZB-H1)
        multi = ScheduleInterleaved1F1B if variant == "interleaved" else ScheduleInterleavedZeroBubble
        return multi(stages, M, loss_fn=loss, scale_grads=True)
    return cls(stages[0], M, loss_fn=loss, scale_grads=True)


def builtin_step(schedule, cfg: Config, ctx: RankContext, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1  # one stage (S = 1) is both
    args = (x,) if first else ()
    if not last:
        schedule.step(*args)
        return torch.zeros((), dtype=torch_dtype(cfg), device=x.device)
    losses = []  # M unscaled micro-batch means
    schedule.step(*args, target=torch.zeros_like(x) if y is None else y, losses=losses)
    return torch.stack(losses).mean().detach()


def bubble_stats(timeline: list[dict], stages: int) -> dict:
    """Busy / idle seconds per stage over the step (from the barrier to the last block's end)
    and the measured bubble: the mean idle fraction over stages."""
    span = max(e["end"] for e in timeline)
    busy = [sum(e["end"] - e["start"] for e in timeline if e["stage"] == s) for s in range(stages)]
    idle = [span - b for b in busy]
    return {"span_s": span, "busy_s": busy, "idle_s": idle, "bubble_measured": sum(idle) / (stages * span)}


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    cfg.check("pp", "torch")
    recipe_cfg, cfg = cfg, cfg.pipelined()  # --accumulate K: the schedule runs K·M micro-batches (the same mean)
    S, s, M = ctx.world_size, ctx.rank, cfg.microbatches
    assert cfg.world_size == S, (cfg.world_size, S)
    v = cfg.virtual_stages if variant == "interleaved" else 1  # chunk c = virtual stage c·S + s
    if style == "compiled":
        compiled.begin(ctx.device.type)
    chunks = [build_stage(cfg, problem, c * S + s, ctx.device, S * v) for c in range(v)]
    for chunk in chunks:
        recipe.freeze_(chunk, recipe_cfg)  # --freeze: fixture names, before the schedule holds the stage
    units = None
    if style == "compiled":  # each stage compiled whole
        units = [f"stage {c * S + s}" for c, chunk in enumerate(chunks) if compiled.compile_units(chunk, [""])]
    named = [(c, name, p) for c, chunk in enumerate(chunks) for name, p in chunk.named_parameters()]
    opt = recipe.optimizer([(name, p) for _, name, p in named], recipe_cfg)  # --decay-mask: param groups
    trainable = [p for *_, p in named if p.requires_grad]
    clip = lambda max_norm: parallel_recipe.clip_([p.grad for p in trainable], [], max_norm, ctx.group,  # noqa: E731
                                                  torch_dtype(cfg))  # the stages' squares: one scalar all-reduce
    x, y = inputs(cfg, problem, ctx.device), targets(cfg, problem, ctx.device)  # (B, D) / (B, T), (B, T)
    # float16: the last stage's loss scaled (the whole batch's mean: no share), the skip agreed over the stages
    scaler = recipe.loss_scaler(cfg, ctx.group)
    factor = lambda: 1.0 if scaler is None else scaler.get_scale()  # noqa: E731
    scaled = lambda out, t=None: loss_fn(out, t) * factor() if scaler is not None else loss_fn(out, t)  # noqa: E731
    schedule = make_builtin(variant, chunks, cfg, ctx, x, scaled) if style != "explicit" else None
    last_step = {}  # the explicit schedule's timeline and peak stash of the latest step

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        if schedule is not None:  # builtin, compiled
            return builtin_step(schedule, cfg, ctx, x, y) / factor()
        if variant == "interleaved":
            loss, last_step["timeline"], last_step["peak"] = interleaved_step(
                chunks, x, y, cfg, ctx, time.perf_counter(), activation(cfg), loss_of=scaled)
        else:
            loss, last_step["timeline"], last_step["peak"] = explicit_step(
                variant, chunks[0], x, y, cfg, ctx, time.perf_counter(), loss_of=scaled)
        return loss / factor()  # float16: the scaled losses' sum, unscaled (a power of 2: exact)

    def fixture(tensors: list[torch.Tensor]) -> list:
        """Every stage's arrays (fixture orientation), gathered; virtual-stage order = fixture order."""
        mine = [[] for _ in chunks]
        for (c, name, _), t in zip(named, tensors, strict=True):
            mine[c].append(to_fixture(chunks[c], name, t))
        every: list = [None] * S
        dist.all_gather_object(every, mine)
        return [a for k in range(S * v) for a in every[k % S][k // S]]  # virtual stage k: rank k % S, chunk k // S

    setup = Setup(
        forward_backward=forward_backward, grads=lambda: [p.grad for *_, p in named],
        update=recipe.stepper(opt, recipe_cfg, clip, scaler=scaler),  # clip, schedule; float16: unscale, skip
        fixture=fixture, params=[p for *_, p in named], optimizer=opt,
        comm_theory=pp_p2p_bytes_per_rank(cfg, s, v) + recipe.scaler_bytes(cfg) + recipe.clip_bytes(recipe_cfg),
        loss_reduction=f"src:{S - 1}",
        before_step=dist.barrier,  # a common start for every stage's timeline
        scaler=scaler, compiled=units,
    )
    trained = train_loop(cfg, ctx, setup)

    # Gather every stage's view (reporting only, after the last step).
    mine = {"losses": trained.losses, "comm": trained.comm, "state": trained.state_bytes, **last_step}
    every: list[dict] = [None] * S
    dist.all_gather_object(every, mine)
    trained.extra.update({
        "losses_per_rank": [e["losses"] for e in every],
        "comm_per_rank": [e["comm"] for e in every],
        "comm_theory_per_rank": [pp_p2p_bytes_per_rank(cfg, r, v) + recipe.scaler_bytes(cfg) +
                                 recipe.clip_bytes(recipe_cfg) for r in range(S)],
        "state_bytes_per_rank": [e["state"] for e in every],  # uneven: embeddings on 0, head on S−1
        "state_bytes_theory_per_rank": None if recipe_cfg.freeze else  # frozen: no AdamW state (measured)
        [pp_state_bytes(pp_stage_param_count(cfg, r), cfg) for r in range(S)],
        "loss_broadcast_bytes": cfg.bytes_per_element,  # per step, outside the ledger
        # F = B = W; ZB-H1's closed form needs M ≥ S (below, the simulator's)
        "bubble_theory": simulate("zb", S, M).bubble if variant == "zb" and M < S else closed_form_bubble(
            variant, S, M, v),
        "virtual_stages": v,
    })
    if style == "explicit":
        timeline = sorted((e for r in every for e in r["timeline"]), key=lambda e: (e["stage"], e["start"]))
        trained.extra.update(timeline=timeline, peak_activations=[e["peak"] for e in every],
                             **bubble_stats(timeline, S),  # and the simulator's at the measured mean F / B / W
                             bubble_simulated=simulate(variant, S, M, v, **measured_costs(timeline)).bubble)
    else:
        trained.extra["builtin_schedule"] = type(schedule).__name__
        # The stage and schedule sit in reference cycles; left to the collector at interpreter
        # exit (after the process group is destroyed) they abort the rank ~1 launch in 20.
        del schedule, setup
        gc.collect()
    return trained
