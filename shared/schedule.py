"""Pipeline schedules as data: the order of operations on every rank, an ideal timeline, the bubble.

Pure Python (no NumPy): the executed schedules (torch_impl/pp.py, jax_impl/pp.py) record their
per-rank order and the tests assert it equals ``order``; ``simulate`` gives the timeline they would
have with zero-cost messages and fixed unit costs, its bubble and the activations each rank holds.

  gpipe        all M forwards, then all M backwards (Huang et al. 2019, arXiv:1811.06965).
  1f1b         PipeDream-Flush as scheduled in Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473
               §2.2): rank r runs min(p−r−1, M) warm-up forwards, then F(w+i), B(i), then a cool-down.
  interleaved  Megatron's interleaved 1F1B (same paper, §2.2.2): v model chunks per rank, rank r
               chunk c is virtual stage c·p + r. Forwards go round the chunks p micro-batches at a
               time (k-th forward: chunk (k // p) % v, micro-batch (k // (p·v))·p + k % p), backwards
               the same with the chunks reversed; warm-up 2·(p−r−1) + (v−1)·p forwards, capped at v·M
               (torch's ScheduleInterleaved1F1B gives the same order). Requires M % p == 0.
  zb           ZB-H1 (Qi et al. 2024, arXiv:2401.10241 §2.1; torch's ScheduleInterleavedZeroBubble
               at one chunk): 1F1B with each backward split into B (input gradient, on the critical
               path) and W (weight gradient); rank r delays its W's by r, so every rank holds at most
               p micro-batches from F to W (1F1B's peak, on stage 0) and the W's fill the cool-down.

Bubble (idle / (ranks · span)), f = b = w = 1, M ≥ p (``closed_form_bubble``):
  gpipe, 1f1b  (p−1)/(M+p−1);  interleaved (p−1)/(v·M+p−1);  zb (p−1)/(3M+p−1).
ZB-H1's idle time per rank is (p−1)·(f+b−w) against 1F1B's (p−1)·(f+b+w): a third at f = b = w
(the fraction is (p−1)/(3M+p−1), slightly more than a third of 1F1B's (p−1)/(M+p−1)).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


@dataclass(frozen=True)
class Op:
    kind: str  # "F" forward; "B" backward (input and weight gradient; under "zb" input only); "W" weight grad
    mb: int  # micro-batch 0..M−1
    chunk: int = 0  # model chunk on this rank (interleaved 0..v−1: virtual stage chunk·p + rank)


@dataclass(frozen=True)
class Event:
    rank: int
    op: Op
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    events: list[Event]  # sorted by (rank, start)
    span: float  # end of the last op
    bubble: float  # idle / (ranks · span)
    peak_in_flight: list[int]  # per rank: most (mb, chunk)s alive at once (F until B; under zb until W)


def validate(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Raise ValueError (one line) for inputs no schedule can run. layers % (p·v) is the caller's."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise ValueError(f"{schedule}: stages={stages}, microbatches={microbatches}, virtual={virtual} must be ≥ 1")
    if virtual > 1 and schedule != "interleaved":
        raise ValueError(f"{schedule}: virtual={virtual} > 1 needs the interleaved schedule")
    if schedule == "interleaved" and microbatches % stages:
        raise ValueError(f"interleaved: microbatches={microbatches} is not divisible by stages={stages} (Megatron)")


def _one_f_one_b(fwd: list[Op], bwd: list[Op], warmup: int) -> list[Op]:
    """Warm-up forwards, then alternate F(warmup + i), B(i), then the remaining backwards."""
    steady = len(fwd) - warmup
    ops = fwd[:warmup]
    for i in range(steady):
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[steady:]


def _rank_order(schedule: str, p: int, m: int, v: int, r: int) -> list[Op]:
    if schedule == "gpipe":
        return [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]
    if schedule == "1f1b":
        return _one_f_one_b([Op("F", i) for i in range(m)], [Op("B", i) for i in range(m)], min(p - r - 1, m))
    if schedule == "interleaved":
        mb = lambda k: (k // (p * v)) * p + k % p  # noqa: E731
        fwd = [Op("F", mb(k), (k // p) % v) for k in range(v * m)]
        bwd = [Op("B", mb(k), v - 1 - (k // p) % v) for k in range(v * m)]
        return _one_f_one_b(fwd, bwd, min(2 * (p - r - 1) + (v - 1) * p, v * m))
    # zb (ZB-H1): 1F1B's F/B order; after the i-th B, rank r runs the oldest pending W once i ≥ r
    ops, done = [], 0
    for op in _one_f_one_b([Op("F", i) for i in range(m)], [Op("B", i) for i in range(m)], min(p - r - 1, m)):
        ops.append(op)
        if op.kind == "B" and op.mb >= r:
            ops.append(Op("W", done))
            done += 1
    return ops + [Op("W", i) for i in range(done, m)]


def order(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Op]]:
    """The operation order on every rank (list index = rank = stage)."""
    validate(schedule, stages, microbatches, virtual)
    return [_rank_order(schedule, stages, microbatches, virtual, r) for r in range(stages)]


def simulate(schedule: str, stages: int, microbatches: int, virtual: int = 1,
             f: float = 1.0, b: float = 1.0, w: float = 1.0) -> Timeline:
    """Ideal timeline: every rank runs ``order`` in turn; an op starts when its rank is free and its
    dependency is done (F of mb on virtual stage k after F on k−1; B on k after B on k+1; the last
    virtual stage's B after its F; W after the B of the same (mb, chunk)); messages cost nothing.
    Costs: F = f, B = b (+ w unless the schedule splits the backward), W = w. Raises RuntimeError
    if the orders deadlock (an op waits on one that can never run)."""
    p, last = stages, stages * virtual - 1
    ops = order(schedule, stages, microbatches, virtual)
    cost = {"F": f, "B": b if schedule == "zb" else b + w, "W": w}
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) -> end time
    free, nxt, events = [0.0] * p, [0] * p, []

    def dependency(r: int, op: Op) -> tuple[str, int, int] | None:
        k = op.chunk * p + r  # virtual stage
        if op.kind == "F":
            return ("F", op.mb, k - 1) if k > 0 else None
        if op.kind == "B":
            return ("F", op.mb, k) if k == last else ("B", op.mb, k + 1)
        return ("B", op.mb, k)

    while any(nxt[r] < len(ops[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(ops[r]):
                op = ops[r][nxt[r]]
                dep = dependency(r, op)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep is not None else 0.0)
                free[r] = start + cost[op.kind]
                done[(op.kind, op.mb, op.chunk * p + r)] = free[r]
                events.append(Event(r, op, start, free[r]))
                nxt[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: ops[r][nxt[r]] for r in range(p) if nxt[r] < len(ops[r])}
            raise RuntimeError(f"{schedule} p={p} M={microbatches} v={virtual}: deadlock, ranks wait at {stuck}")
    span = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events)
    events.sort(key=lambda e: (e.rank, e.start))
    return Timeline(events, span, (p * span - busy) / (p * span), [peak_in_flight(schedule, o) for o in ops])


def peak_in_flight(schedule: str, ops: list[Op]) -> int:
    """Most (mb, chunk)s of one rank's order alive at once: from F until B (zb: until W)."""
    free_at = "W" if schedule == "zb" else "B"
    alive = peak = 0
    for op in ops:
        alive += (op.kind == "F") - (op.kind == free_at)
        peak = max(peak, alive)
    return peak


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1,
                       f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """Textbook bubble fractions. gpipe / 1f1b (p−1)/(m+p−1) and interleaved (p−1)/(v·m+p−1) for any
    costs (Narayanan et al. 2021 §2.2); zb (ZB-H1, Qi et al. 2024 §2.1, m ≥ p, w ≤ f + b): idle
    (p−1)·(f+b−w) per rank over a span of m·(f+b+w) + (p−1)·(f+b−w); (p−1)/(3m+p−1) at f = b = w."""
    validate(schedule, p, m, v)
    if schedule == "zb":
        idle = (p - 1) * (f + b - w)
        return idle / (m * (f + b + w) + idle)
    return (p - 1) / (v * m + p - 1)


def measured_costs(timeline: list[dict]) -> dict[str, float]:
    """Mean duration per kind of a measured timeline (dicts with "kind", "start", "end"), as
    ``simulate``'s f, b, w (w = 0 when the run has no separate weight-gradient op)."""
    mean = {}
    for kind in "FBW":
        spans = [e["end"] - e["start"] for e in timeline if e["kind"] == kind]
        mean[kind.lower()] = sum(spans) / len(spans) if spans else 0.0
    return mean
