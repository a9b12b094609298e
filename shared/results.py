"""Records that every implementation returns, and the parity checks between them.

``Trained`` is what one training run (one framework, style, variant) hands back: losses per
step, the step-0 gradients and final parameters as full, gathered float64 NumPy arrays in the
fixture orientation (W_l applied as ``x @ W_l``), step times, the communication ledger of one
step, and per-rank state bytes. ``RunResult`` is the row that compare.py prints and writes to
JSON.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shared.recipe import describe as describe_recipe
from shared.recipe import lr_factors
from shared.tolerances import (
    CROSS_FRAMEWORK_FACTOR,
    FLOAT32_FLOOR_PARAMS,
    MIXED_CROSS_FRAMEWORK_FACTOR,
    MIXED_FACTOR,
    MIXED_FLOOR_MIN,
    NOISE_MARGIN,
    NOISE_MAX_FRACTION,
    PURE_FLOOR_FACTOR,
    PURE_FLOOR_STEPS,
    adam_noise_bound,
    floor_tolerance,
    mixed_tolerance,
    tolerance,
)


@dataclass
class Trained:
    losses: list[float]  # (steps,): loss before update k, identical on every rank
    grads0: list[np.ndarray]  # L × (D, D): full step-0 gradients, float64, fixture orientation
    params: list[np.ndarray]  # L × (D, D): full final parameters, float64, fixture orientation
    step_times: list[float] = field(default_factory=list)  # wall seconds per step
    # One steady-state step's communication on the reporting rank, per op:
    # {"all_reduce": {"count": 3, "bytes": 1536}, ...}; bytes follow nccl-tests' size S.
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    comm_theory: int | None = None  # payload bytes per step per rank from shared.theory
    state_bytes: dict[str, int] = field(default_factory=dict)  # per rank: params/grads/optimizer
    extra: dict[str, Any] = field(default_factory=dict)  # pattern-specific (bubble, timeline, …)
    # Where it ran (RunResult's fields of the same names): {"platform": "cpu" | "cuda", "backend":
    # torch's "gloo" | "nccl" (JAX: None), "devices": ["cuda:0", …] one per rank / mesh device,
    # "fallback": the one line saying why --device auto did not take the GPUs, else None}.
    where: dict[str, Any] = field(default_factory=dict)
    # The first step this run trained (a run resumed from a checkpoint of step K starts at K): its
    # ``losses`` are those of steps K.., and ``grads0`` is empty unless it ran step 0.
    start_step: int = 0
    # Per entry of ``step_times``: True where the step was timed alone — not the first (warm-up, the activation
    # meter, the step-0 gradients) nor one the harness recorded (the ledger). Empty: every step but the first.
    timed: list[bool] = field(default_factory=list)
    # Seconds the run spent compiling its step (JAX: lower + compile; torch compiled: the first step minus the
    # median step, i.e. dynamo + inductor or a cache load); None for an eager run.
    compile_s: float | None = None


def comm_bytes(comm: dict[str, dict[str, int]]) -> int:
    """Payload bytes per step per rank: every op's size S, counting a point-to-point message
    once (on the sender), so that torch send/recv and JAX collective-permute compare."""
    return sum(v["bytes"] for op, v in comm.items() if op != "recv")


def rel_err(a, b, finite: bool = False) -> float:
    """max|a-b| / max|b| over one array (or list of arrays: the max over the list). ``finite``: over the
    entries finite in both (a float16 step both runs skipped: its gradients overflowed, in places that
    depend on where each program summed; the skip itself is compared by skip_mismatch)."""
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return math.inf
        return max((rel_err(x, y, finite) for x, y in zip(a, b)), default=0.0)
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf
    if finite:
        both = np.isfinite(a) & np.isfinite(b)
        a, b = a[both], b[both]
    if a.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(b))), np.finfo(np.float64).tiny)
    err = float(np.max(np.abs(a - b))) / scale
    return err if math.isfinite(err) else math.inf


def parity(run: Trained, ref: Trained) -> dict[str, float]:
    """Relative errors of a run against a reference: losses, step-0 grads, final params. A resumed
    run (``start_step`` K > 0) is compared on the steps it ran (the reference's losses from K on);
    it did not run step 0, so it has no step-0 gradients to compare (0.0: nothing differs)."""
    k, skipped0 = run.start_step, 0 in ref.extra.get("skipped_steps", ())  # float16: step 0 skipped
    return {
        "max_rel_err_loss": rel_err(run.losses, ref.losses[k:]),
        "max_rel_err_grad": rel_err(run.grads0, ref.grads0, finite=skipped0) if k == 0 else 0.0,
        "max_rel_err_param": rel_err(run.params, ref.params),
    }


def skip_mismatch(run: Trained, ref: Trained | None) -> str | None:
    """float16's dynamic loss scaling: where ``run`` skipped other steps than ``ref`` (their
    ``extra["skipped_steps"]``), as one line; None when the same, or when ``ref`` records none. A skip is
    discrete (a skipped step leaves the parameters where they were): a run that skips another step has
    trained on other data, so it fails with this line rather than under a looser tolerance."""
    want = None if ref is None else ref.extra.get("skipped_steps")
    if want is None:
        return None
    want = [k for k in want if k >= run.start_step]
    got = run.extra.get("skipped_steps")
    if got is None:
        return f"the reference skipped steps {want} (float16 loss scaling); this run recorded no loss scaling"
    if list(got) != want:
        return f"skipped steps {list(got)} where the reference skipped {want} (float16 loss scaling)"
    return None


def references_skip_apart(a: Trained | None, b: Trained | None) -> str | None:
    """float16, across frameworks: one line when the two frameworks' single-device references skipped
    different steps (None when the same, or either records none). Their float16 programs differ in
    which ops run in float16 (torch autocast keeps reductions, softmax and norms in float32; Flax's
    dtype=float16 casts each module), so a backward may overflow at a loss scale in one framework and
    not in the other: from the first such step on the two train on other steps, and no tolerance
    compares them. The cross-framework check is then NOT COMPARABLE (neither ok nor FAIL); each run is
    still checked against its own framework's reference, skips included."""
    sa = None if a is None else a.extra.get("skipped_steps")
    sb = None if b is None else b.extra.get("skipped_steps")
    if sa is None or sb is None or list(sa) == list(sb):
        return None
    return (f"not comparable across frameworks: their float16 references skipped steps {list(sa)} and {list(sb)} "
            "(the two programs overflow at different loss scales); each run is checked against its own "
            "framework's reference")


def routing_mismatch(run: Trained, ref: Trained) -> str | None:
    """MoE runs: where ``run`` routed tokens unlike ``ref`` (their ``extra["expert_load"]``, (steps, L,
    B, E) counts), as one line; None when the routing is the same (or either run has none).

    Routing is discrete: in float64 a run whose losses agree to 1e-12 routes every token as the
    reference does, but in float32 a near-tie (two router probabilities within rounding of each
    other) can send a token elsewhere, after which losses and gradients legitimately differ.
    Such a run is reported as failed with this line, not hidden under a looser tolerance."""
    a, b = run.extra.get("expert_load"), ref.extra.get("expert_load")
    if a is not None and b is not None:
        b = b[run.start_step:]  # a resumed run routed the steps from its start on
    if a is None or b is None:
        return None
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return f"expert_load shapes differ: {a.shape} vs {b.shape}"
    diff = np.argwhere(a != b)
    if not len(diff):
        return None
    step, layer = int(diff[0][0]), int(diff[0][1])
    moved = int(np.abs(a[step, layer] - b[step, layer]).sum()) // 2
    return (f"routing differs from the reference from step {step}, layer {layer} on "
            f"({moved} assignment(s) moved: a near-tie in the router)")


def within(errors: dict[str, float], dtype: str, factor: float = 1.0, steps: int | None = None,
           floor: dict[str, float] | None = None) -> bool:
    """Every error within ``dtype``'s tolerance (× ``factor``). ``steps``: the run's optimizer steps —
    the losses and parameters then get the step-aware tolerance (shared/tolerances.py: drift grows with
    the steps), or PURE_FLOOR_FACTOR × the measured ``floor`` of a long run when that is larger
    (``pure_floor``); the step-0 gradients ("max_rel_err_grad") always the one-step one."""
    short = tolerance(dtype) * factor
    long = lambda k: floor_tolerance(dtype, steps, (floor or {}).get(k)) * factor  # noqa: E731
    return all(e <= (short if k == "max_rel_err_grad" else long(k)) for k, e in errors.items())


def cross_framework_ok(errors: dict[str, float], dtype: str, steps: int | None = None,
                       floor: dict[str, float] | None = None) -> bool:
    return within(errors, dtype, CROSS_FRAMEWORK_FACTOR, steps, floor)


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


def mixed_parity(run: Trained, ref: Trained, cfg=None) -> tuple[dict[str, float], dict[str, Any]]:
    """parity(run, ref) for mixed precision (shared/tolerances.py, NOISE_MARGIN): the parameters' error over
    the entries whose step-0 gradients the two runs agree on; the noise-driven ones (``noise_entries``) held
    instead to AdamW's bound on how far apart two runs can move an entry (``cfg``'s lr, schedule, betas;
    without ``cfg``, only split off: the floor's own measurement). Returns (errors, what the split found:
    {"noise_entries", "noise_max_move", "noise_bound"}); an entry past the bound keeps the whole error."""
    errors = parity(run, ref)
    masks = noise_entries(run, ref)
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


@dataclass
class RunResult:
    """One row of compare.py's table and one entry of ``--json``'s ``runs``."""

    pattern: str
    framework: str  # "torch" | "jax"
    style: str  # torch: "explicit" | "builtin"; jax: "shard_map" | "jit"
    variant: str
    world_size: int
    dtype: str
    ok: bool
    model: str | None = "mlp"  # "mlp" | "transformer"; None for the collectives (no model)
    precision: str = "pure"  # shared.config.PRECISIONS: "mixed" = float32 master weights, compute in dtype
    losses: list[float] = field(default_factory=list)
    max_rel_err_loss: float = 0.0
    max_rel_err_grad: float = 0.0
    max_rel_err_param: float = 0.0
    step_time_s: float | None = None
    # The same model's step on one device (the single-device reference's median step, the whole batch): what
    # the pattern costs over one device is step_time_s / plain_step_time_s (the table's "× plain").
    plain_step_time_s: float | None = None
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    comm_bytes: int = 0
    comm_bytes_theory: int | None = None
    state_bytes: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # Against the OTHER framework's single-device reference (same fixture): max relative error
    # over losses, step-0 grads and final params, and whether it is within tolerance.
    xfw_max_rel_err: float | None = None
    xfw_ok: bool | None = None
    # Where it ran: "cpu" | "cuda"; torch's process-group backend "gloo" | "nccl" (JAX: None); the
    # ranks' (torch) or the mesh's (JAX) devices, e.g. ["cuda:0", "cuda:1"]; and, when --device auto
    # did not take the GPUs it could see, the one line saying why (else None).
    platform: str | None = None
    backend: str | None = None
    devices: list[str] = field(default_factory=list)
    fallback: str | None = None
    start_step: int = 0  # resumed from a checkpoint of this step: ``losses`` are those of the steps it ran
    recipe: dict[str, Any] | None = None  # shared.recipe.describe: what the step applied (None: plain AdamW)
    compile_s: float | None = None  # seconds compiling the step (Trained.compile_s); None: an eager run

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("max_rel_err_loss", "max_rel_err_grad", "max_rel_err_param", "xfw_max_rel_err"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = None  # JSON has no inf
        return _jsonable(d)


def median_step_time(step_times: list[float], timed: list[bool] | None = None) -> float | None:
    """Median step time over the steps timed alone (``timed``, Trained.timed); without that record (or when no
    step was: a run of 1-2 steps), every step but the first (warm-up / compilation) when there is more than one."""
    if timed and any(timed) and len(timed) == len(step_times):
        return float(np.median([t for t, alone in zip(step_times, timed) if alone]))
    times = step_times[1:] if len(step_times) > 1 else step_times
    return float(np.median(times)) if times else None


def make_result(
    pattern: str,
    framework: str,
    style: str,
    variant: str,
    cfg,
    run: Trained,
    ref: Trained,
    other_ref: Trained | None = None,
) -> RunResult:
    mixed = getattr(cfg, "precision", "pure") == "mixed"
    # below float64 (mixed, float32, bf16): the parameters' noise-driven entries judged by AdamW's bound
    # (mixed_parity; shared/tolerances.py NOISE_MARGIN), as the floors they are held to are
    compare = (lambda a, b: mixed_parity(a, b, cfg)) if mixed or cfg.dtype != "float64" else \
        (lambda a, b: (parity(a, b), {}))
    errors, noise = compare(run, ref)
    apart = references_skip_apart(ref, other_ref)  # float16: the frameworks skipped different steps
    xfw = compare(run, other_ref)[0] if other_ref is not None and apart is None else None
    routing = routing_mismatch(run, ref)
    xfw_routing = routing_mismatch(run, other_ref) if other_ref is not None else None
    extra = run.extra if routing is None else {**run.extra, "routing_mismatch": routing}
    skips, xfw_skips = skip_mismatch(run, ref), skip_mismatch(run, other_ref)
    if skips is not None:
        extra = {**extra, "skip_mismatch": skips}
    if apart is not None:
        extra = {**extra, "xfw_not_comparable": apart}
    if mixed:  # judged against the reference's measured floor (shared/tolerances.py), not a dtype constant
        layout = (pattern, variant)  # shared.tolerances.MIXED_LAYOUT_FACTOR
        extra = {**extra, "mixed": mixed_report(run, ref, style, layout, cfg.dtype, errors, noise)}
        ok = within_floor(errors, ref, style=style, layout=layout, dtype=cfg.dtype) and routing is None
        xfw_ok = (within_floor(xfw, ref, other_ref, factor=MIXED_CROSS_FRAMEWORK_FACTOR / MIXED_FACTOR, style=style,
                               program=True, layout=layout, dtype=cfg.dtype) and xfw_routing is None
                  and xfw_skips is None
                  if xfw else None)
    else:  # past PURE_FLOOR_STEPS the references carry a measured floor (floor_extra): long runs drift
        floor, both = pure_floor(ref), pure_floor(ref, other_ref)
        if floor is not None:
            extra = {**extra, "pure_floor": {"floor": floor, "tolerance": {
                k: floor_tolerance(cfg.dtype, cfg.steps, v) for k, v in floor.items() if k != "max_rel_err_grad"}}}
        ok = within(errors, cfg.dtype, steps=cfg.steps, floor=floor) and routing is None \
            and losses_within_floor(run, cfg.dtype, 1.0, ref)
        xfw_ok = cross_framework_ok(xfw, cfg.dtype, cfg.steps, both) and xfw_routing is None \
            and losses_within_floor(run, cfg.dtype, CROSS_FRAMEWORK_FACTOR, other_ref, ref) if xfw else None
    ok = ok and skips is None
    return RunResult(
        pattern=pattern,
        framework=framework,
        style=style,
        variant=variant,
        model=cfg.model,
        world_size=cfg.world_size,
        dtype=cfg.dtype,
        precision=getattr(cfg, "precision", "pure"),
        ok=ok,
        losses=[float(x) for x in run.losses],
        step_time_s=median_step_time(run.step_times, run.timed),
        plain_step_time_s=median_step_time(ref.step_times, ref.timed),
        comm=run.comm,
        comm_bytes=comm_bytes(run.comm),
        comm_bytes_theory=run.comm_theory,
        state_bytes=run.state_bytes,
        extra=extra,
        xfw_max_rel_err=max(xfw.values()) if xfw else None,
        xfw_ok=xfw_ok,
        platform=run.where.get("platform"),
        backend=run.where.get("backend"),
        devices=list(run.where.get("devices", [])),
        fallback=run.where.get("fallback"),
        start_step=run.start_step,
        recipe=describe_recipe(cfg) if hasattr(cfg, "accumulate") else None,
        compile_s=run.compile_s,
        **errors,
    )


def where_line(rows: list[RunResult]) -> str:
    """Where the rows ran, one clause per framework, for the table's title: e.g.
    "torch: gloo on cpu · jax: cpu", "torch: nccl on cuda ×4 · jax: cuda ×4", plus " (auto fell back:
    …)" once when a framework fell back. Rows that do not say (collectives) are skipped."""
    parts, fallbacks = [], []
    for fw in dict.fromkeys(r.framework for r in rows):
        said = [r for r in rows if r.framework == fw and r.platform]
        if not said:
            continue
        r = said[0]
        places = sorted({x.platform for x in said})
        n = len(r.devices)
        on = "/".join(places) + (f" ×{n}" if n > 1 and places != ["cpu"] else "")
        parts.append(f"{fw}: {r.backend} on {on}" if r.backend else f"{fw}: {on}")
        fallbacks += [x.fallback for x in said if x.fallback and x.fallback not in fallbacks]
    line = " · ".join(parts)
    return line + (f" (auto fell back: {'; '.join(dict.fromkeys(fallbacks))})" if fallbacks else "")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
