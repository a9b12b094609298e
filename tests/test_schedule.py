"""The schedule simulator (shared/schedule.py) against the textbook bubble and memory formulas.

Pure Python, no launch. Costs are small integers, so every time in a timeline is an exact float and
the bubble fractions compare with ==. (The orders of "interleaved" and "zb" also equal torch 2.13's
ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble at one chunk for p ≤ 6: checked by hand
through their private _calculate_single_rank_operations, not here: torch is not imported.)
"""

from __future__ import annotations

from collections import Counter

import pytest

import shared.schedule as schedule
from shared.schedule import SCHEDULES, Op, closed_form_bubble, order, simulate, validate
from shared.theory import pp_peak_activations

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]  # p stages, m micro-batches
INTERLEAVED = [(p, m, v) for p in range(1, 7) for m in range(p, 13, p) for v in (1, 2, 3)]


def idle(t) -> float:
    """Idle time summed over ranks."""
    ranks = max(e.rank for e in t.events) + 1
    return ranks * t.span - sum(e.end - e.start for e in t.events)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_1f1b_bubble(name):
    """(p−1)/(m+p−1) exactly, for fused (b = 2, w = 0) and split (b + w summed) backward costs."""
    for p, m in GRID:
        expected = (p - 1) / (m + p - 1)
        assert simulate(name, p, m, f=1, b=2, w=0).bubble == expected, (p, m)
        assert simulate(name, p, m, f=1, b=1, w=1).bubble == expected, (p, m)
        assert closed_form_bubble(name, p, m) == expected


def test_interleaved_bubble():
    """(p−1)/(v·m+p−1) exactly: v chunks cut the bubble v-fold (each chunk costs 1/v of a stage)."""
    for p, m, v in INTERLEAVED:
        assert simulate("interleaved", p, m, v, f=1, b=2, w=0).bubble == (p - 1) / (v * m + p - 1), (p, m, v)
        assert closed_form_bubble("interleaved", p, m, v) == (p - 1) / (v * m + p - 1)


def test_zb_h1_a_third_of_1f1b_idle():
    """ZB-H1 at f = b = w: idle time exactly a third of 1F1B's ((p−1)·(f+b−w) against (p−1)·(f+b+w)
    per rank) when m ≥ p, so its fraction is (p−1)/(3m+p−1); never more than 1F1B's for m < p."""
    for p, m in GRID:
        zb, ofob = simulate("zb", p, m), simulate("1f1b", p, m)
        assert zb.bubble <= ofob.bubble, (p, m)
        if m >= p:
            assert 3 * idle(zb) == idle(ofob), (p, m)
            assert zb.bubble == (p - 1) / (3 * m + p - 1) == closed_form_bubble("zb", p, m), (p, m)


@pytest.mark.parametrize("f, b, w", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (3, 2, 2), (2, 3, 1)])
def test_zb_h1_closed_form_any_costs(f, b, w):
    """Idle (p−1)·(f+b−w) per rank for any costs with w ≤ min(f, b) (the W then fits in each gap)."""
    for p, m in GRID:
        if m >= p:
            assert simulate("zb", p, m, f=f, b=b, w=w).bubble == closed_form_bubble("zb", p, m, f=f, b=b, w=w)


def test_peak_in_flight():
    """GPipe m on every stage; 1F1B min(m, p − s) on stage s (= shared.theory); ZB-H1 holds its
    micro-batches until W, min(m, p) on every stage: 1F1B's peak (stage 0), not more."""
    for p, m in GRID:
        assert simulate("gpipe", p, m).peak_in_flight == [m] * p
        ofob = simulate("1f1b", p, m).peak_in_flight
        assert ofob == [min(m, p - s) for s in range(p)] == [pp_peak_activations("1f1b", p, m, s) for s in range(p)]
        assert simulate("zb", p, m).peak_in_flight == [min(m, p)] * p == [max(ofob)] * p == [
            pp_peak_activations("zb", p, m, s) for s in range(p)]


def test_executed_orders_torch_explicit():
    """The order torch_impl/pp.py's explicit_step runs (and tests/test_pp.py asserts against this
    module): 1F1B warm-up min(S−s−1, M) forwards, steady F(w+i) B(i), cool-down."""
    assert order("1f1b", 4, 6)[1] == [Op("F", 0), Op("F", 1), Op("F", 2), Op("B", 0), Op("F", 3), Op("B", 1),
                                      Op("F", 4), Op("B", 2), Op("F", 5), Op("B", 3), Op("B", 4), Op("B", 5)]
    assert order("zb", 2, 3) == [
        [Op("F", 0), Op("F", 1), Op("B", 0), Op("W", 0), Op("F", 2), Op("B", 1), Op("W", 1), Op("B", 2), Op("W", 2)],
        [Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1), Op("W", 0), Op("F", 2), Op("B", 2), Op("W", 1), Op("W", 2)]]
    assert [(o.kind, o.mb, o.chunk) for o in order("interleaved", 2, 2, 2)[1][:4]] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1)]  # warm-up (v−1)·p = 2 on the last rank


def cases():
    yield from (("gpipe", p, m, 1) for p, m in GRID)
    yield from (("1f1b", p, m, 1) for p, m in GRID)
    yield from (("zb", p, m, 1) for p, m in GRID)
    yield from (("interleaved", p, m, v) for p, m, v in INTERLEAVED)


def test_every_op_once_and_dependencies_hold():
    """Each rank runs F and B (zb: and W) of every (mb, chunk) exactly once; in the timeline no rank
    runs two ops at once, and every op starts after its dependency ends."""
    for name, p, m, v in cases():
        kinds = "FBW" if name == "zb" else "FB"
        for ops in order(name, p, m, v):
            assert Counter(ops) == Counter(Op(k, i, c) for k in kinds for i in range(m) for c in range(v)), name
        t = simulate(name, p, m, v, f=1, b=2, w=1)
        end = {(e.op.kind, e.op.mb, e.op.chunk * p + e.rank): e.end for e in t.events}
        last = p * v - 1
        for e in t.events:
            k = e.op.chunk * p + e.rank
            dep = {"F": ("F", e.op.mb, k - 1) if k else None,
                   "B": ("F", e.op.mb, k) if k == last else ("B", e.op.mb, k + 1), "W": ("B", e.op.mb, k)}[e.op.kind]
            assert dep is None or end[dep] <= e.start, (name, p, m, v, e)
        for a, b in zip(t.events, t.events[1:]):
            assert a.rank != b.rank or a.end <= b.start, (name, a, b)


@pytest.mark.parametrize("args, message", [
    (("pipedream", 2, 4), "unknown schedule 'pipedream'"),
    (("1f1b", 0, 4), "must be ≥ 1"),
    (("gpipe", 2, 0), "must be ≥ 1"),
    (("1f1b", 2, 4, 2), "virtual=2 > 1 needs the interleaved schedule"),
    (("interleaved", 4, 6, 2), "microbatches=6 is not divisible by stages=4"),
])
def test_bad_input_raises(args, message):
    with pytest.raises(ValueError, match=message):
        validate(*args)
    with pytest.raises(ValueError, match=message):
        simulate(*args)


def test_deadlock_raises(monkeypatch):
    """Orders that wait on each other (every rank starts with a backward) raise, never hang."""
    monkeypatch.setattr(schedule, "_rank_order", lambda *a: [Op("B", 0), Op("F", 0)])
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate("1f1b", 2, 1)


def test_schedules_listed():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb")
