"""What one training run hands back (``Trained``) and the comparisons between two of them: relative errors of
losses, step-0 gradients and final parameters (``parity``), the discrete mismatches (float16's skipped steps,
MoE routing), and the verdict against a dtype's tolerance (``within``). The measured floors are in
shared/floors.py; compare.py's row (``RunResult``, ``make_result``) in shared/results.py.

``Trained``: losses per step, the step-0 gradients and final parameters as full, gathered float64 NumPy arrays in
the fixture orientation (W_l applied as ``x @ W_l``), step times, the communication ledger of one step, and
per-rank state bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.tolerances import (
    CROSS_FRAMEWORK_FACTOR,
    floor_tolerance,
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


def references_apart(a: Trained | None, b: Trained | None, mixed: bool) -> str | None:
    """``references_skip_apart``, and under mixed precision (``mixed``) also: the two frameworks' MoE references
    routed tokens differently. Their bf16 programs round the router's input at other points (torch autocast
    keeps the residual stream in float32, Flax's dtype=bfloat16 rounds it), so a near-tie can go another way
    from step 0 on, and from there the two train other experts on other tokens: NOT COMPARABLE (neither ok
    nor FAIL); each run is still checked against its own framework's reference, routing included."""
    apart = references_skip_apart(a, b)
    if apart is not None or not mixed or a is None or b is None:
        return apart
    routing = routing_mismatch(a, b)
    if routing is None:
        return None
    return (f"not comparable across frameworks: their bf16 MoE references route differently ({routing}; the two "
            "programs round the router's input at other points); each run is checked against its own framework's "
            "reference")


def routing_mismatch(run: Trained, ref: Trained, steps: int | None = None) -> str | None:
    """MoE runs: where ``run`` routed tokens unlike ``ref`` (their ``extra["expert_load"]``, (steps, L,
    B, E) counts), as one line; None when the routing is the same (or either run has none).
    ``steps``: the first ``steps`` steps only.

    Routing is discrete: in float64 a run whose losses agree to 1e-12 routes every token as the
    reference does, but in float32 a near-tie (two router probabilities within rounding of each
    other) can send a token elsewhere, after which losses and gradients legitimately differ.
    Such a run is reported as failed with this line, not hidden under a looser tolerance.
    Mixed precision (shared.results.make_result): the router computes in bf16 and, after step 0, on
    parameters that differ from the reference's at the measured floor's level (a bf16 first step moves
    its noise-driven entries by ±lr: shared/tolerances.py NOISE_MARGIN), so only step 0 — the fixture's
    parameters, the same program — must route alike; later near-ties moving are reported
    (``routing_drift``) and their effect is judged by the floor like every other rounding, except the few
    entries the moved token's gradients took past it: those are held to AdamW's bound (shared.floors.mixed_parity,
    ``drift_tol``)."""
    a, b = run.extra.get("expert_load"), ref.extra.get("expert_load")
    if a is not None and b is not None:
        b = b[run.start_step:]  # a resumed run routed the steps from its start on
    if a is None or b is None:
        return None
    a, b = np.asarray(a), np.asarray(b)
    if steps is not None:
        a, b = a[:steps], b[:steps]
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
