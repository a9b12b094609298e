"""Measured floors: where a verdict depends on the machine's rounding, the bound comes from the run's own
references on that machine (shared/tolerances.py says why each). A long pure run (or a large float32 model) and a
mixed-precision run measure the single-device run against itself with every step's batch split in two; the
parameters of a run below float64 are compared entry by entry (``mixed_parity``), its noise-driven entries held
to AdamW's own bound.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shared.parity import Trained, parity, rel_err
from shared.recipe import lr_factors
from shared.tolerances import (
    FLOAT32_FLOOR_PARAMS,
    MIXED_FLOOR_MIN,
    NOISE_MARGIN,
    NOISE_MAX_FRACTION,
    PURE_FLOOR_FACTOR,
    PURE_FLOOR_STEPS,
    adam_noise_bound,
    mixed_tolerance,
    tolerance,
)

# --- long pure runs: a measured floor past PURE_FLOOR_STEPS (shared/tolerances.py) ----------------


def needs_floor(cfg) -> bool:
    """Whether ``cfg``'s references measure a floor: a pure run longer than PURE_FLOOR_STEPS, or a float32 one
    of FLOAT32_FLOOR_PARAMS parameters or more (compare.py --size gpu), whose batch splits in two (the dense
    models: a split batch would route MoE tokens in other groups)."""
    long = cfg.steps > PURE_FLOOR_STEPS or (cfg.dtype == "float32" and cfg.n_params >= FLOAT32_FLOOR_PARAMS)
    return getattr(cfg, "precision", "pure") == "pure" and long and not cfg.moe and cfg.batch % 2 == 0


def floor_extra(ref: Trained, split: Trained, cfg=None) -> dict[str, Any]:
    """What a long pure run's reference carries (its ``extra``): ``floor``, the single-device run against
    itself with every step's batch split in two (parity(split, ref)), and ``floor_losses``, that distance
    per step as a running maximum (the floor reached by each step; relative to the largest loss)."""
    scale = max(float(np.max(np.abs(ref.losses))), np.finfo(np.float64).tiny)
    per_step = np.abs(np.asarray(split.losses, np.float64) - np.asarray(ref.losses, np.float64)) / scale
    # below float64: its noise-driven entries split off, as a run's are (make_result)
    floor = parity(split, ref) if cfg is None or cfg.dtype == "float64" else mixed_parity(split, ref)[0]
    return {"floor": floor, "floor_losses": [float(v) for v in np.maximum.accumulate(per_step)]}


def pure_floor(*refs: Trained | None) -> dict[str, float] | None:
    """The largest measured floor of ``refs`` per quantity (None when none of them measured one)."""
    floors = [r.extra["floor"] for r in refs if r is not None and "floor_losses" in r.extra]
    return {k: max(f[k] for f in floors) for k in floors[0]} if floors else None


def losses_within_floor(run: Trained, dtype: str, factor: float = 1.0, *refs: Trained) -> bool:
    """A long pure run's losses step by step, against the first of ``refs`` (its reference): step k's
    error within factor × max(tolerance(dtype, k + 1), PURE_FLOOR_FACTOR × the floor reached by step k)
    (the largest of ``refs``' floors). So the chaotic end of a long run is judged by its floor while
    its first steps keep the tight tolerance: a wrong reduction fails there. No floor: True (``within``
    alone decides)."""
    envelopes = [r.extra["floor_losses"] for r in refs if "floor_losses" in r.extra]
    if not envelopes or not run.losses:
        return True
    k0, ref = run.start_step, refs[0]
    mine, losses = np.asarray(ref.losses[k0:], np.float64), np.asarray(run.losses, np.float64)
    if losses.shape != mine.shape:
        return False
    scale = max(float(np.max(np.abs(mine))), np.finfo(np.float64).tiny)
    errs = np.abs(losses - mine) / scale
    return all(err <= factor * max(tolerance(dtype, k0 + k + 1), PURE_FLOOR_FACTOR * max(e[k0 + k] for e in envelopes))
               for k, err in enumerate(errs))


# --- mixed precision: a measured floor instead of a per-dtype constant ----------------------------


def noise_entries(run: Trained, ref: Trained) -> list[np.ndarray] | None:
    """Per parameter array, the entries whose step-0 gradient is rounding noise between ``run`` and ``ref``
    (shared.tolerances.NOISE_MARGIN: 2·|g_run − g_ref| > |g_ref|, a first update whose sign the two do not
    settle). None when there is nothing to split by (a resumed run has no step-0 gradients; shapes that
    differ) or when more than NOISE_MAX_FRACTION of all entries are such (not rounding: no split)."""
    if run.start_step or not run.grads0 or len(run.grads0) != len(ref.grads0) or len(ref.grads0) != len(ref.params):
        return None
    masks = []
    for g, h, p in zip(run.grads0, ref.grads0, ref.params):
        g, h = np.asarray(g, np.float64), np.asarray(h, np.float64)
        if g.shape != h.shape or g.shape != np.shape(p):
            return None
        with np.errstate(invalid="ignore"):  # inf - inf (a float16 step 0 that overflowed): NaN, not noise
            masks.append(NOISE_MARGIN * np.abs(g - h) > np.abs(h))
    total = sum(m.size for m in masks)
    return masks if total and sum(int(m.sum()) for m in masks) <= NOISE_MAX_FRACTION * total else None


def mixed_parity(run: Trained, ref: Trained, cfg=None, drift_tol: float | None = None,
                 ) -> tuple[dict[str, float], dict[str, Any]]:
    """parity(run, ref) for mixed precision (shared/tolerances.py, NOISE_MARGIN): the parameters' error over
    the entries whose step-0 gradients the two runs agree on; the noise-driven ones (``noise_entries``) held
    instead to AdamW's bound on how far apart two runs can move an entry (``cfg``'s lr, schedule, betas;
    without ``cfg``, only split off: the floor's own measurement). Returns (errors, what the split found:
    {"noise_entries", "noise_max_move", "noise_bound"}); an entry past the bound keeps the whole error.

    ``drift_tol``: an MoE run that routed a token unlike its reference after step 0 (``routing_drift``: a
    near-tie the rounding settled otherwise; step 0 must route alike). That token's gradients moved its
    entries (its position's and token's embeddings, the experts it left and joined) from that step on, a
    discrete change the step-0 gradients cannot foresee: the entries whose relative error exceeds
    ``drift_tol`` (the floor's tolerance) are held to AdamW's bound too ("drift_entries"), as long as they
    and the noise-driven ones together are at most NOISE_MAX_FRACTION of all entries."""
    errors = parity(run, ref)
    masks = noise_entries(run, ref)
    if drift_tol is not None and masks is not None:  # (masks: the same shapes, step-0 gradients alike enough)
        drift = [(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                  > drift_tol * max(float(np.max(np.abs(b), initial=0.0)), np.finfo(np.float64).tiny)) & ~m
                 for a, b, m in zip(run.params, ref.params, masks)]
        total, count = sum(m.size for m in masks), sum(int(d.sum()) for d in drift)
        if total and sum(int(m.sum()) for m in masks) + count <= NOISE_MAX_FRACTION * total:
            masks = [m | d for m, d in zip(masks, drift)]
        else:
            count = None
    if masks is None:
        return errors, {}
    determined, move = 0.0, 0.0
    for a, b, m in zip(run.params, ref.params, masks):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        diff = np.abs(a - b)
        scale = max(float(np.max(np.abs(b))), np.finfo(np.float64).tiny) if b.size else 1.0
        determined = max(determined, float(np.max(diff[~m], initial=0.0)) / scale)
        move = max(move, float(np.max(diff[m], initial=0.0)))
    info = {"noise_entries": int(sum(int(m.sum()) for m in masks)), "noise_max_move": move}
    if drift_tol is not None:
        info["drift_entries"] = count  # None: too many to call a routing drift: the floor judges them
    if cfg is not None:
        lrs = [cfg.lr * f for f in lr_factors(cfg.schedule, cfg.steps)][run.start_step:]
        info["noise_bound"] = adam_noise_bound(lrs, cfg.beta1, cfg.beta2, run.start_step)
        if not move <= info["noise_bound"]:  # NaN too: the whole error stands
            return errors, info
    if math.isfinite(determined):
        errors["max_rel_err_param"] = determined
    return errors, info


def mixed_extra(ref: Trained, split: Trained, float64: Trained) -> dict[str, Any]:
    """What a mixed-precision reference carries (its ``extra``): ``floor``, the same single-device mixed
    run against itself with every step's batch split in two (mixed_parity(split, ref): the rounding a
    different summation order alone makes, its noise-driven entries split off as a run's are), and
    ``float64_losses``, the losses of the same run in float64."""
    return {"floor": mixed_parity(split, ref)[0], "float64_losses": [float(v) for v in float64.losses]}


def within_floor(errors: dict[str, float], *refs: Trained, factor: float = 1.0, style: str | None = None,
                 program: bool = False, layout: tuple = (), dtype: str | None = None) -> bool:
    """Every error within ``factor`` × the mixed tolerance of the largest floor of ``refs``
    (shared.tolerances.mixed_tolerance, for ``style`` and ``variant``, "pattern/variant"; ``program``:
    another framework's program). A
    reference without a floor: False (never a silent pass)."""
    floors = [r.extra.get("floor") for r in refs]
    if any(f is None for f in floors):
        return False
    return all(e <= factor * mixed_tolerance(max(f[k] for f in floors), style, program, layout, dtype, k)
               for k, e in errors.items())


def mixed_report(run: Trained, ref: Trained, style: str | None = None, layout: tuple = (),
                 dtype: str | None = None, errors: dict[str, float] | None = None,
                 noise: dict[str, Any] | None = None) -> dict[str, Any]:
    """The row's extra for a mixed run: the floor it was judged by, the tolerances, how far its losses are
    from the float64 run's (reported, not asserted: the issue's bar is 2e-2 relative), and ``noise``
    (mixed_parity's split of the parameters: noise-driven entries, their largest move and AdamW's bound)."""
    floor = ref.extra.get("floor", {})
    f64 = ref.extra.get("float64_losses")
    errors = parity(run, ref) if errors is None else errors
    ratio = max((errors[k] / max(v, MIXED_FLOOR_MIN) for k, v in floor.items()), default=None)
    return {"floor": floor, "tolerance": {k: mixed_tolerance(v, style, layout=layout, dtype=dtype, quantity=k)
                                          for k, v in floor.items()},
            "floor_ratio": ratio,  # the worst error / its floor (MIXED_FACTOR allows up to that)
            "loss_rel_err_vs_float64": rel_err(run.losses, f64[run.start_step:]) if f64 else None,
            **({"noise": noise} if noise else {})}
