"""Pipeline parallelism (GPipe, 1F1B) with torch.distributed point-to-point, trained end to end.

Sharded: the L layers, in contiguous stages — rank s holds layers s·L/S … (s+1)·L/S − 1 (their
weights, grads and AdamW state: Φ/S each). The batch (B, D) is cut into M micro-batches (B/M, D).

Communication per step, all point-to-point between neighbours (no collective in training):
  fwd: stage s sends each micro-batch's activation (B/M, D) to s+1      — M sends unless last
  bwd: stage s sends each activation-gradient (B/M, D) back to s−1      — M sends unless first
  per rank: ((s < S−1) + (s > 0))·B·D·b on the wire (shared.theory.pp_p2p_bytes_per_rank).
Reporting only (outside the ledger): the last stage broadcasts the step's loss (b bytes), and
rank 0 gathers grads / params / timelines at the end.

Loss: each micro-batch's loss is mean(y²)/M, so the sum over micro-batches is the full-batch
mean and the accumulated gradients equal the single-device ones.

Schedules (Huang et al. 2019 "GPipe"; Narayanan et al. 2019 "PipeDream", 1F1B as in Megatron-LM):
  gpipe  all M forwards, then all M backwards: every stage stashes M micro-batches' activations.
  1f1b   warm-up of S−s−1 forwards, steady one-forward-one-backward, cool-down: ≤ S−s stashed.
Both idle (p−1)/(M+p−1) of the time (the bubble); 1F1B only saves memory.

Deadlock freedom: every exchange goes through ``exchange`` = one dist.batch_isend_irecv that
posts the sends and receives together (NCCL groups them), and both neighbours issue the same
sequence of exchanges (the steady state fuses "send activation + receive gradient" on s with
"send gradient + receive activation" on s+1, as Megatron's p2p_communication does). This holds
for any M ≥ 1, including M < S.

builtin: torch.distributed.pipelining (PipelineStage + ScheduleGPipe / Schedule1F1B).
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import pp_bubble_fraction, pp_p2p_bytes_per_rank
from torch_impl.launch import RankContext
from torch_impl.model import (
    MLP,
    fixture_grads,
    fixture_weights,
    inputs,
    loss_fn,
    make_optimizer,
    optimizer_state_bytes,
    tensor_bytes,
    torch_dtype,
)

VARIANTS = (("explicit", "gpipe"), ("explicit", "1f1b"), ("builtin", "gpipe"), ("builtin", "1f1b"))


def build_stage(cfg: Config, problem: Problem, stage: int, device) -> MLP:
    """Stage ``stage``'s slice of the MLP: blocks for layers stage·L/S … (stage+1)·L/S − 1."""
    per = cfg.layers // cfg.world_size
    module = MLP(per, cfg.dim, torch_dtype(cfg), device)
    with torch.no_grad():
        for block, w in zip(module.layers, problem.weights[stage * per:(stage + 1) * per]):
            block.linear.weight.copy_(torch.from_numpy(w.T.copy()))  # (D, D) == W_l.T
    return module


def exchange(ctx: RankContext, send_fwd=None, send_bwd=None, recv_fwd=None, recv_bwd=None):
    """One batched exchange with the neighbours: send an activation to s+1 / a gradient to s−1,
    receive into the given buffers an activation from s−1 / a gradient from s+1. Ops that point
    past either end of the pipeline are dropped. Returns (activation, gradient) received."""
    s, last = ctx.rank, ctx.world_size - 1
    ops = []
    if send_fwd is not None and s < last:
        ops.append(dist.P2POp(dist.isend, send_fwd, s + 1))
    if send_bwd is not None and s > 0:
        ops.append(dist.P2POp(dist.isend, send_bwd, s - 1))
    x = recv_fwd if recv_fwd is not None and s > 0 else None
    dy = recv_bwd if recv_bwd is not None and s < last else None
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in ((x, s - 1), (dy, s + 1)) if t is not None]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return x, dy


def explicit_step(schedule: str, module: MLP, x: torch.Tensor, cfg: Config, ctx: RankContext, t0: float):
    """One training step's forward and backward over M micro-batches. Returns (this stage's
    sum of scaled micro-batch losses — the full-batch loss on the last stage, 0 elsewhere —,
    timeline of F/B blocks, peak number of micro-batches whose activations were stashed)."""
    S, s, M = ctx.world_size, ctx.rank, cfg.microbatches
    first, last = s == 0, s == S - 1
    xs = x.chunk(M)  # M × (B/M, D); only stage 0 reads them
    buf = lambda: torch.empty(cfg.batch // M, cfg.dim, dtype=x.dtype, device=x.device)  # (B/M, D)
    stash, timeline, peak, loss = {}, [], 0, torch.zeros((), dtype=x.dtype, device=x.device)

    def clock():  # seconds since the step began; on GPU wait for the kernels first
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        return time.perf_counter() - t0

    def forward(mb, x_in):
        nonlocal peak, loss
        start = clock()
        x_in = xs[mb] if first else x_in.requires_grad_()  # (B/M, D)
        y = module(x_in)  # (B/M, D)
        if last:
            y = loss_fn(y) / M  # scalar: this micro-batch's share of the full-batch mean
            loss = loss + y.detach()
        stash[mb] = (x_in, y)
        peak = max(peak, len(stash))
        timeline.append({"stage": s, "kind": "F", "mb": mb, "start": start, "end": clock()})
        return None if last else y.detach()

    def backward(mb, dy):
        start = clock()
        x_in, y = stash.pop(mb)
        torch.autograd.backward(y, None if last else dy)  # accumulates this stage's dW
        timeline.append({"stage": s, "kind": "B", "mb": mb, "start": start, "end": clock()})
        return None if first else x_in.grad  # (B/M, D): gradient for stage s−1

    if schedule == "gpipe":
        for mb in range(M):
            x_in, _ = exchange(ctx, recv_fwd=buf())
            exchange(ctx, send_fwd=forward(mb, x_in))
        for mb in range(M):
            _, dy = exchange(ctx, recv_bwd=buf())
            exchange(ctx, send_bwd=backward(mb, dy))
    else:  # 1f1b
        warmup = min(S - s - 1, M)
        for mb in range(warmup):
            x_in, _ = exchange(ctx, recv_fwd=buf())
            exchange(ctx, send_fwd=forward(mb, x_in))
        x_in = exchange(ctx, recv_fwd=buf())[0] if warmup < M else None
        for i in range(M - warmup):  # steady: F(warmup + i), then B(i)
            _, dy = exchange(ctx, send_fwd=forward(warmup + i, x_in), recv_bwd=buf())
            more = i < M - warmup - 1
            x_in, _ = exchange(ctx, send_bwd=backward(i, dy), recv_fwd=buf() if more else None)
        for mb in range(M - warmup, M):  # cool-down
            _, dy = exchange(ctx, recv_bwd=buf())
            exchange(ctx, send_bwd=backward(mb, dy))
    assert not stash, f"stage {s}: micro-batches {sorted(stash)} never went backward"
    return loss, timeline, peak


def make_builtin(variant: str, module: MLP, cfg: Config, ctx: RankContext, x: torch.Tensor):
    """torch.distributed.pipelining's stage and schedule. The schedule calls loss_fn(y, target)
    once per micro-batch and (scale_grads=True) divides the summed gradients by M afterwards:
    mse_loss(y, 0) = mean(y²) of the micro-batch, so the result is the full-batch mean's gradient."""
    S, M = ctx.world_size, cfg.microbatches
    # Static metadata (B/M, D) skips the shape-inference round trip; requires_grad marks which
    # tensors have gradients to send back (every stage's output, inputs except stage 0's).
    meta = lambda grad: torch.empty(cfg.batch // M, cfg.dim, dtype=x.dtype, device=x.device, requires_grad=grad)
    stage = PipelineStage(module, ctx.rank, S, ctx.device, input_args=meta(ctx.rank > 0), output_args=meta(True))
    # Schedule1F1B raises ValueError for M < S (torch 2.13): ScheduleGPipe runs instead (same
    # gradients; stages s > S − M stash M micro-batches, not S − s); extra["builtin_schedule"] says so.
    cls = Schedule1F1B if variant == "1f1b" and M >= S else ScheduleGPipe
    return cls(stage, M, loss_fn=lambda y, target: F.mse_loss(y, target), scale_grads=True)


def builtin_step(schedule, cfg: Config, ctx: RankContext, x: torch.Tensor) -> torch.Tensor:
    first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1  # one stage (S = 1) is both
    args = (x,) if first else ()
    if not last:
        schedule.step(*args)
        return torch.zeros((), dtype=x.dtype, device=x.device)
    losses = []  # M unscaled micro-batch means
    schedule.step(*args, target=torch.zeros_like(x), losses=losses)
    return torch.stack(losses).mean().detach()


def bubble_stats(timeline: list[dict], stages: int) -> dict:
    """Busy / idle seconds per stage over the step (from the barrier to the last block's end)
    and the measured bubble: the mean idle fraction over stages."""
    span = max(e["end"] for e in timeline)
    busy = [sum(e["end"] - e["start"] for e in timeline if e["stage"] == s) for s in range(stages)]
    idle = [span - b for b in busy]
    return {"span_s": span, "busy_s": busy, "idle_s": idle, "bubble_measured": sum(idle) / (stages * span)}


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    cfg.check("pp")
    S, s, M = ctx.world_size, ctx.rank, cfg.microbatches
    assert cfg.world_size == S, (cfg.world_size, S)
    module = build_stage(cfg, problem, s, ctx.device)
    opt = make_optimizer(module.parameters(), cfg)
    x = inputs(cfg, problem, ctx.device)  # (B, D)
    schedule = make_builtin(variant, module, cfg, ctx, x) if style == "builtin" else None
    losses, step_times, grads0 = [], [], None
    for step in range(cfg.steps):
        dist.barrier()  # common start for the timeline
        t0 = time.perf_counter()
        ledger = ctx.ledger.recording() if step == cfg.steps - 1 else contextlib.nullcontext()
        with ledger:  # the last step's training traffic: activations and gradients only
            opt.zero_grad(set_to_none=True)
            if style == "explicit":
                loss, timeline, peak = explicit_step(variant, module, x, cfg, ctx, t0)
            else:
                loss = builtin_step(schedule, cfg, ctx, x)
            if step == 0:
                grads0 = fixture_grads(module)
            opt.step()
        dist.broadcast(loss, src=S - 1)  # reporting: every rank prints the last stage's loss
        losses.append(loss.item())
        step_times.append(time.perf_counter() - t0)
    comm = ctx.ledger.summary()

    # Gather every stage's pieces on every rank (reporting only, after the last step).
    mine = {"grads0": grads0, "params": fixture_weights(module), "comm": comm, "losses": losses}
    if style == "explicit":
        mine.update(timeline=timeline, peak=peak)
    every: list[dict] = [None] * S
    dist.all_gather_object(every, mine)
    extra = {
        "losses_per_rank": [e["losses"] for e in every],
        "comm_per_rank": [e["comm"] for e in every],
        "comm_theory_per_rank": [pp_p2p_bytes_per_rank(cfg, r) for r in range(S)],
        "loss_broadcast_bytes": cfg.bytes_per_element,  # per step, outside the ledger
        "bubble_theory": pp_bubble_fraction(S, M),
    }
    if style == "explicit":
        timeline = sorted((e for r in every for e in r["timeline"]), key=lambda e: (e["stage"], e["start"]))
        extra.update(timeline=timeline, peak_activations=[e["peak"] for e in every], **bubble_stats(timeline, S))
    else:
        extra["builtin_schedule"] = type(schedule).__name__
        # The stage and schedule sit in reference cycles; left to the collector at interpreter
        # exit (after the process group is destroyed) they abort the rank ~1 launch in 20.
        del schedule
        gc.collect()
    params = list(module.parameters())
    return Trained(
        losses=losses,
        grads0=[g for e in every for g in e["grads0"]],
        params=[w for e in every for w in e["params"]],
        step_times=step_times,
        comm=comm,
        comm_theory=pp_p2p_bytes_per_rank(cfg, s),
        state_bytes={"params": tensor_bytes(params), "grads": tensor_bytes(params),
                     "optimizer": optimizer_state_bytes(opt)},
        extra=extra,
    )
