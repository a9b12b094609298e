"""compare.py's row: ``RunResult`` (one row of the table and one entry of ``--json``'s ``runs``) and
``make_result``, which judges a run against its references — parity and the dtype tolerances
(shared/parity.py), the measured floors (shared/floors.py) — and reads its step times. Every name of those two
modules is importable from here too (the record and its checks, one import for a runner).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shared.floors import (  # noqa: F401 (re-exported)
    floor_extra,
    losses_within_floor,
    mixed_extra,
    mixed_parity,
    mixed_report,
    needs_floor,
    noise_entries,
    pure_floor,
    within_floor,
)
from shared.parity import (  # noqa: F401 (re-exported)
    Trained,
    comm_bytes,
    cross_framework_ok,
    parity,
    references_apart,
    references_skip_apart,
    rel_err,
    routing_mismatch,
    skip_mismatch,
    within,
)
from shared.recipe import describe as describe_recipe
from shared.tolerances import (
    CROSS_FRAMEWORK_FACTOR,
    MIXED_CROSS_FRAMEWORK_FACTOR,
    MIXED_FACTOR,
    floor_tolerance,
    mixed_tolerance,
)


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
    drift = routing_mismatch(run, ref) if mixed else None  # mixed MoE: a near-tie after step 0 settled otherwise
    measured = ref.extra.get("floor") or {}  # a mixed reference's floor (mixed_extra)
    if drift is not None and "max_rel_err_param" in measured:  # its entries held to AdamW's bound (mixed_parity)
        tol = mixed_tolerance(measured["max_rel_err_param"], style, layout=(pattern, variant), dtype=cfg.dtype,
                              quantity="max_rel_err_param")
        errors, noise = mixed_parity(run, ref, cfg, drift_tol=tol)
    else:
        errors, noise = compare(run, ref)
    apart = references_apart(ref, other_ref, mixed)  # float16: other steps skipped; mixed MoE: other routing
    xfw = compare(run, other_ref)[0] if other_ref is not None and apart is None else None
    routing = routing_mismatch(run, ref, 1 if mixed else None)  # mixed: step 0 (shared.parity.routing_mismatch)
    # mixed, the other framework: another program rounds the router's bf16 input elsewhere from step 0 on
    xfw_routing = routing_mismatch(run, other_ref) if other_ref is not None and not mixed else None
    extra = run.extra if routing is None else {**run.extra, "routing_mismatch": routing}
    if drift is not None:
        extra = {**extra, "routing_drift": drift}
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
