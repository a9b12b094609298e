"""The collectives of torch.distributed, one small function each, checked against NumPy.

Every function runs on every rank of ``group`` with that rank's tensor ``x`` and returns what the
rank holds afterwards (``None`` where a rooted collective leaves nothing defined). Inputs and the
expected outputs come from shared/collectives.py; diff this file against jax_impl/collectives.py
to see each collective written as SPMD code.

Payload per call (nccl-tests size S, what torch_impl.ledger records) for a buffer of n bytes on
N ranks; on a ring the bytes each rank puts on the wire are S · busbw factor:
    broadcast / reduce   S = n           wire ≈ n  (pipelined tree/chain)
    all_reduce           S = n           wire 2(N−1)/N · n  (reduce-scatter + all-gather)
    gather / all_gather  S = N · n_in    wire (N−1)/N · S
    scatter / reduce_scatter / all_to_all   S = the full input, wire (N−1)/N · S
    send / recv          S = the message (counted once, on the sender, in comm_bytes)
The all-reduce built by hand from send/recv (``ring_all_reduce``) sends 2(N−1) chunks of n/N:
2(N−1)/N · n per rank, the all-reduce's bus bytes. Sources: the Ultrascale Playbook's
collectives appendix, CS336 lecture 8, nccl-tests doc/PERFORMANCE.md.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shared.collectives import (
    BENCH_OPS,
    BENCH_SIZES,
    NAMES,
    WITH_ROOT,
    bench_elements,
    expected,
    expected_bytes,
    max_abs_err,
    rank_input,
    root_rank,
)
from shared.theory import busbw
from shared.tolerances import COLLECTIVES

# --- one-to-all and all-to-one: a root rank (group rank ``root``) -----------------------------


def broadcast(x, group, root=0):
    """Every rank gets the root's x."""
    x = x.clone()  # collectives work in place: keep the caller's tensor
    dist.broadcast(x, group=group, group_src=root)
    return x


def reduce(x, group, root=0):
    """The root gets the sum of every rank's x; elsewhere the buffer is scratch."""
    x = x.clone()
    dist.reduce(x, group=group, group_dst=root, op=dist.ReduceOp.SUM)
    return x if dist.get_rank(group) == root else None


def gather(x, group, root=0):
    """The root gets every rank's x, concatenated in rank order."""
    n = dist.get_world_size(group)
    is_root = dist.get_rank(group) == root
    parts = [torch.empty_like(x) for _ in range(n)] if is_root else None  # N × (c,) on the root
    dist.gather(x, parts, group=group, group_dst=root)
    return torch.cat(parts) if is_root else None  # (N·c,)


def scatter(x, group, root=0):
    """Rank r gets chunk r of the root's x (the other ranks' x is not read)."""
    n = dist.get_world_size(group)
    assert x.numel() % n == 0, (x.shape, n)
    chunks = list(x.chunk(n)) if dist.get_rank(group) == root else None  # N × (c,)
    out = x.new_empty(x.numel() // n)  # (c,)
    dist.scatter(out, chunks, group=group, group_src=root)
    return out


# --- all-to-all: every rank contributes and receives ------------------------------------------


def all_reduce_sum(x, group):
    x = x.clone()
    dist.all_reduce(x, group=group, op=dist.ReduceOp.SUM)
    return x


def all_reduce_avg(x, group):
    """Sum, then divide. gloo has no ReduceOp.AVG; NCCL's AVG multiplies each input by 1/N before
    summing, which rounds (1/3 is inexact) — sum-then-divide is exact on small integers."""
    return all_reduce_sum(x, group) / dist.get_world_size(group)


def all_reduce_max(x, group):
    x = x.clone()
    dist.all_reduce(x, group=group, op=dist.ReduceOp.MAX)
    return x


def all_gather(x, group):
    out = x.new_empty(dist.get_world_size(group) * x.numel())  # (N·c,)
    dist.all_gather_single(out, x, group=group)
    return out


def reduce_scatter(x, group):
    """Rank r gets chunk r of the sum."""
    n = dist.get_world_size(group)
    assert x.numel() % n == 0, (x.shape, n)
    out = x.new_empty(x.numel() // n)  # (c,)
    dist.reduce_scatter_single(out, x, group=group, op=dist.ReduceOp.SUM)
    return out


def all_to_all(x, group):
    """Chunk j of rank i's x goes to rank j, landing at position i: a transpose across ranks."""
    assert x.numel() % dist.get_world_size(group) == 0
    out = torch.empty_like(x)  # (N·c,)
    dist.all_to_all_single(out, x, group=group)
    return out


def barrier(x, group):
    """No rank leaves before every rank has arrived; no data moves."""
    dist.barrier(group=group)
    return x


# --- point-to-point, and the all-reduce built from it -----------------------------------------


def ring_shift(x, group):
    """Send x to the right neighbour, receive the left neighbour's: one step of a ring. Both
    messages are posted together (batch_isend_irecv), so no rank blocks on a send whose
    receiver is itself blocked sending — the deadlock of a naive send-then-recv ring."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return x.clone()  # no neighbour: a rank cannot post a send to itself
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), group=group, group_peer=(r + 1) % n),
           dist.P2POp(dist.irecv, out, group=group, group_peer=(r - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def ring_all_reduce(x, group):
    """All-reduce by hand on a ring of N ranks, x split into N chunks of n/N.
    Reduce-scatter phase, N−1 steps: at step s rank r sends chunk (r−s) and adds the chunk
    (r−s−1) it receives; afterwards rank r holds the full sum of chunk (r+1).
    All-gather phase, N−1 steps: at step s rank r sends chunk (r+1−s), a finished sum, and
    overwrites chunk (r−s) with the one it receives. 2(N−1) messages of n/N per rank."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    assert x.numel() % n == 0, (x.shape, n)
    chunks = list(x.clone().chunk(n))  # N × (n/N,), views into one buffer
    for s in range(n - 1):  # reduce-scatter
        chunks[(r - s - 1) % n] += ring_shift(chunks[(r - s) % n], group)
    for s in range(n - 1):  # all-gather
        chunks[(r - s) % n].copy_(ring_shift(chunks[(r + 1 - s) % n], group))
    return torch.cat(chunks)  # (n,)


def rs_then_ag(x, group):
    """all_reduce == reduce_scatter + all_gather: the identity behind ZeRO and FSDP."""
    return all_gather(reduce_scatter(x, group), group)


FUNCTIONS = {
    "broadcast": broadcast, "reduce": reduce, "all_reduce_sum": all_reduce_sum,
    "all_reduce_avg": all_reduce_avg, "all_reduce_max": all_reduce_max, "gather": gather,
    "all_gather": all_gather, "scatter": scatter, "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all, "ring_shift": ring_shift, "barrier": barrier,
    "ring_all_reduce": ring_all_reduce, "rs_then_ag": rs_then_ag,
}


def check_all(ctx) -> list[dict]:
    """Run every collective on this rank (call it on every rank, inside ``launch``), each inside
    a ledger recording; compare with shared.collectives.expected."""
    group, n, r = ctx.group, ctx.world_size, ctx.rank
    rows = []
    for name in NAMES:
        x = torch.from_numpy(rank_input(name, r, n)).to(ctx.device)  # this rank's input
        kwargs = {"root": root_rank(n)} if name in WITH_ROOT else {}
        with ctx.ledger.recording():
            out = FUNCTIONS[name](x, group, **kwargs)
        comm = ctx.ledger.summary()
        got = None if out is None else out.cpu().numpy()
        err = max_abs_err(got, expected(name, r, n))
        row = {"variant": name, "ok": err <= COLLECTIVES, "max_abs_err": err, "comm": comm,
               "expected_bytes": expected_bytes(name, n, x.element_size()),
               "output": None if got is None else got.tolist()}
        if name in ("ring_all_reduce", "rs_then_ag"):  # equal to the library all-reduce?
            lib_err = max_abs_err(got, all_reduce_sum(x, group).cpu().numpy())
            row["vs_library_max_abs_err"] = lib_err
            row["ok"] = row["ok"] and lib_err <= COLLECTIVES
        rows.append(row)
    return rows


# --- bandwidth sweep in the style of nccl-tests -----------------------------------------------


def _call(op, x, out, group):
    """One collective on preallocated buffers (allocation is not what we time)."""
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "all_gather":
        dist.all_gather_single(out, x, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_single(out, x, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, x, group=group)
    else:
        raise ValueError(f"unknown bench op {op!r}; choose from {', '.join(BENCH_OPS)}")


def bench(ctx, ops=BENCH_OPS, sizes_bytes=BENCH_SIZES, iters=10, warmup=2, dtype=torch.float32) -> list[dict]:
    """Per op and size S, after ``warmup`` calls: on CPU the median of ``iters`` calls, each timed alone
    (gloo calls block); on CUDA, as nccl-tests, ``iters`` launches back to back between two CUDA events,
    divided by ``iters`` (a per-call host timer would measure the launch and the synchronisation).
    Then the max of the ranks' times (a collective ends when its slowest rank does).
    algbw = S / t, busbw = algbw · factor(N) as in nccl-tests. Same rows on every rank."""
    group, n, cuda = ctx.group, ctx.world_size, ctx.device.type == "cuda"
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for op in ops:
        for size in sizes_bytes:
            elems, s_bytes = bench_elements(op, size, n, itemsize)
            x = torch.zeros(elems, dtype=dtype, device=ctx.device)  # zeros: repeated sums stay 0
            out_elems = {"all_gather": elems * n, "reduce_scatter": elems // n}.get(op, elems)
            out = torch.empty(out_elems, dtype=dtype, device=ctx.device)
            for _ in range(warmup):
                _call(op, x, out, group)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(ctx.device)
                start.record()
                for _ in range(iters):
                    _call(op, x, out, group)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3 / iters  # elapsed_time: milliseconds
            else:
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    _call(op, x, out, group)
                    times.append(time.perf_counter() - t0)
                seconds = statistics.median(times)
            t = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(t, group=group, op=dist.ReduceOp.MAX)  # the slowest rank's time
            algbw, bus = busbw(op, s_bytes, float(t), n)
            rows.append({"op": op, "size_bytes": s_bytes, "time_s": float(t), "algbw": algbw, "busbw": bus})
    return rows
