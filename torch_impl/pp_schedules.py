"""Interleaved 1F1B by hand over torch.distributed send/recv, and torch's multi-stage schedules.

A runner module (the project's model; its JAX counterpart, jax_impl/parallel/pp_schedules.py, is
library-level because the JAX pipeline seam's 1F1B runs on it: torch's seam uses torch.distributed.pipelining).

Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters using Megatron-LM", arXiv:2104.04473 §2.2.2). Sharded: the L blocks are cut into S·v
model chunks (virtual stages) of L/(S·v) blocks; rank r holds chunks c = 0..v−1 = virtual stages
c·S + r (the embeddings ride on virtual stage 0, the final norm, head and loss on the last, S·v − 1:
both on the ranks of plain pipelining, so per-rank state is unchanged). Each micro-batch goes round
the ring v times: virtual stage k sends its activation to rank (k+1) mod S (rank S−1 back to rank 0,
its next chunk) and its input-gradient to rank (k−1) mod S. A rank alternates its chunks p
micro-batches at a time; the bubble shrinks v-fold to (S−1)/(v·M+S−1) (every op is 1/v of a stage's),
at v× the messages.

Communication per step on rank r (S > 1), all point-to-point, (B/M, D) / (B/M, T, D) messages:
  fwd: M activations per chunk, but none out of the last virtual stage: M·(v − [r = S−1]) sends
  bwd: M gradients per chunk, but none out of virtual stage 0:          M·(v − [r = 0]) sends
  bytes (2v − [r = 0] − [r = S−1])·B·D·b (transformer ·T): shared.theory.pp_p2p_bytes_per_rank(…, v);
  receives mirror the sends. Summed over ranks 2·(v·S − 1)·B·D·b against plain pipelining's 2·(S−1).

Order: exactly shared.schedule.order("interleaved", S, M, v)[r] (Megatron's; torch's
ScheduleInterleaved1F1B gives the same), recorded per op in the timeline and asserted by the tests.

Deadlock freedom, by construction from the simulator. ``shared.schedule.simulate`` at unit costs
(f = b = 1, no split backward) puts every op at an integer tick: a rank's ops in its order, each
one after the op whose message it needs. Execution walks those ticks: at tick t a rank waits for
its op's input (if it came from another rank), runs the op, then posts — without waiting — ONE
dist.batch_isend_irecv holding exactly the messages that tick's ops send to or from it (the plan
knows every rank's op at every tick, so both ends of a message post it at the same tick, and every
pair of ranks posts its messages in the same order: one op sends at most one message, so per tick
and pair there is at most one each way; no message can be matched to the wrong receive, with tags
or without, gloo or NCCL's grouped p2p). By induction over ticks: an op of tick t only waits for a
message of an earlier tick, which both ends have posted (the sender's op ran: it waited only for
still earlier messages), so it arrives; every rank reaches every tick. A rank waits only for the
messages its next op needs (the sends at the end of the step), as the simulator's timeline does,
and the executed order is the simulator's.

builtin: torch.distributed.pipelining's ScheduleInterleaved1F1B and (zero bubble)
ScheduleInterleavedZeroBubble, with one PipelineStage per chunk (torch_impl/pp.py make_builtin).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shared.config import Config
from shared.schedule import Op, simulate
from torch_impl.launch import RankContext
from torch_impl.model import loss_fn, torch_dtype


def tick_plan(stages: int, microbatches: int, virtual: int) -> list[dict[int, Op]]:
    """{rank: op} for every tick of the simulator's unit-cost interleaved timeline."""
    sim = simulate("interleaved", stages, microbatches, virtual, f=1.0, b=1.0, w=0.0)
    plan: list[dict[int, Op]] = [{} for _ in range(round(sim.span))]
    for e in sim.events:
        assert e.start == int(e.start) and e.end - e.start == 1.0, e  # unit costs: integer ticks
        plan[int(e.start)][e.rank] = e.op
    return plan


def message(stages: int, virtual: int, rank: int, op: Op | None) -> tuple[int, tuple[str, int, int]] | None:
    """Where ``op`` on ``rank`` sends its result: (destination rank, (kind, mb, virtual stage it feeds)),
    or None (the last virtual stage's F feeds its own loss, virtual stage 0's B nobody)."""
    if op is None:
        return None
    k, last = op.chunk * stages + rank, stages * virtual - 1
    if op.kind == "F" and k < last:
        return (k + 1) % stages, ("F", op.mb, k + 1)
    if op.kind == "B" and k > 0:
        return (k - 1) % stages, ("B", op.mb, k - 1)
    return None


class StepClock:
    """The F/B/W timeline's stamps for one step, in seconds since ``t0`` (the step's common start).

    CPU: wall time at each call. CUDA: each call records an event on the current stream (no
    ``torch.cuda.synchronize`` around every op, which would serialise the host with the GPU and
    stretch the very bubbles being measured); ``resolve(timeline)`` waits once, at the end of the
    step, and turns the events into seconds after the step's first event (recorded at creation,
    placed at its wall offset from ``t0``). GPU stamps are the compute stream's: when the stream
    reached the op, which is when the op ran there."""

    def __init__(self, device: torch.device, t0: float):
        self.t0, self.cuda = t0, device.type == "cuda"
        if self.cuda:
            self.offset = time.perf_counter() - t0
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()

    def __call__(self):
        if not self.cuda:
            return time.perf_counter() - self.t0
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, timeline: list[dict]) -> list[dict]:
        """The timeline with every stamp in seconds (CUDA: after one synchronize)."""
        if not self.cuda:
            return timeline
        torch.cuda.synchronize()  # once per step
        at = lambda e: e if isinstance(e, float) else self.offset + self.origin.elapsed_time(e) / 1e3  # ms -> s
        return [{**e, "start": at(e["start"]), "end": at(e["end"])} for e in timeline]


def interleaved_step(chunks: list, x: torch.Tensor, y: torch.Tensor | None, cfg: Config, ctx: RankContext,
                     t0: float, shape: tuple[int, ...], loss_of=loss_fn):
    """One step's forward and backward of interleaved 1F1B over this rank's ``chunks`` (chunk c =
    virtual stage c·S + r). ``shape``: one message, (B/M, D) / (B/M, T, D). Returns (the summed scaled
    micro-batch losses on rank S−1, 0 elsewhere; timeline of F/B blocks with their chunk; peak number
    of (micro-batch, chunk)s whose activations were stashed at once)."""
    S, r, M, v = ctx.world_size, ctx.rank, cfg.microbatches, len(chunks)
    last, dtype = S * v - 1, torch_dtype(cfg)
    xs = x.chunk(M)  # M × (B/M, D) or (B/M, T) tokens: virtual stage 0 (rank 0, chunk 0) reads them
    ys = y.chunk(M) if y is not None else [None] * M  # M × (B/M, T) targets: the last virtual stage
    inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, mb, virtual stage) -> received tensor
    stash, timeline, peak = {}, [], 0  # (mb, chunk) -> (input, output)
    loss = torch.zeros((), dtype=dtype, device=x.device)

    clock = StepClock(x.device, t0)  # CPU: seconds since the step began; CUDA: events, resolved at the end

    def run(op: Op) -> torch.Tensor | None:
        """Run ``op``; returns what it sends (an activation or an input-gradient), if anything."""
        nonlocal peak, loss
        k, start = op.chunk * S + r, clock()
        if op.kind == "F":
            x_in = xs[op.mb] if k == 0 else inbox.pop(("F", op.mb, k)).requires_grad_()
            out = chunks[op.chunk](x_in)  # (B/M, D) / (B/M, T, D); last virtual stage (B/M, T, V) logits
            if k == last:
                out = loss_of(out, ys[op.mb]) / M  # scalar: this micro-batch's share of the full-batch mean
                loss = loss + out.detach()
            else:
                assert out.shape == shape, (out.shape, shape)
            stash[op.mb, op.chunk] = (x_in, out)
            peak = max(peak, len(stash))
            sent = None if k == last else out.detach()
        else:
            x_in, out = stash.pop((op.mb, op.chunk))
            torch.autograd.backward(out, None if k == last else inbox.pop(("B", op.mb, k)))  # accumulates dW
            sent = x_in.grad if k > 0 else None  # (B/M, D) / (B/M, T, D), for virtual stage k − 1
        timeline.append({"stage": r, "kind": op.kind, "mb": op.mb, "chunk": op.chunk, "start": start, "end": clock()})
        return sent

    arriving, sending = {}, []  # (kind, mb, virtual stage) -> its receive's work; the sends' works
    for ops in tick_plan(S, M, v):
        p2p, keys = [], []
        if r in ops:
            op = ops[r]
            work = arriving.pop((op.kind, op.mb, op.chunk * S + r), None)  # this op's input, posted earlier
            if work is not None:
                work.wait()
            sent = run(op)
            if sent is not None:
                dest, key = message(S, v, r, op)
                if dest == r:  # S = 1: the next chunk is on this rank
                    inbox[key] = sent
                else:
                    p2p.append(dist.P2POp(dist.isend, sent, dest))
                    keys.append(None)
        for src in sorted({(r - 1) % S, (r + 1) % S} - {r}):  # what the neighbours' ops of this tick send me
            msg = message(S, v, src, ops.get(src))
            if msg is not None and msg[0] == r:
                inbox[msg[1]] = torch.empty(shape, dtype=dtype, device=x.device)  # (B/M, D) / (B/M, T, D)
                p2p.append(dist.P2POp(dist.irecv, inbox[msg[1]], src))
                keys.append(msg[1])
        if p2p:
            works = dist.batch_isend_irecv(p2p)  # posted, not waited on (NCCL: one work for the batch)
            for key, work in zip(keys, works if len(works) == len(p2p) else works * len(p2p), strict=True):
                if key is None:
                    sending.append(work)
                else:
                    arriving[key] = work
    for work in sending:
        work.wait()
    assert not stash and not inbox and not arriving, f"rank {r}: left over {sorted(stash)} {sorted(inbox)}"
    return loss, clock.resolve(timeline), peak
