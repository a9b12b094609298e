"""Collectives: nccl-tests' bus-bandwidth factors and the latency–bandwidth (α–β) model.

Papers: nccl-tests PERFORMANCE.md (algbw, busbw and the factor per op); Hockney 1994, "The
communication challenge for MPP" (t = α + n/β). Quantities: algbw = S / t and busbw = algbw · factor
(bytes/s) for one op of nccl-tests size S; α (seconds per call) and β (bytes/s) fitted per op.
"""

from __future__ import annotations

BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


def busbw(op: str, size_bytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/second for one op of nccl-tests size S taking ``seconds``."""
    algbw = size_bytes / seconds
    return algbw, algbw * BUSBW_FACTOR[op](n)


# --- collectives: latency-bandwidth (α-β) model ---------------------------------------------


def fit_alpha_beta(sizes_bytes, times_s) -> tuple[float, float]:
    """Least-squares fit of t = α + n/β to measured (size n, time t) points; returns (α seconds,
    β bytes/second). Linear in (α, 1/β); each residual is divided by its t (relative error), so
    the 4 KiB points, where t ≈ α, weigh as much as the 16 MiB ones, where t ≈ n/β — an
    unweighted fit lets the largest sizes decide α alone. β is the asymptote of algbw = n/t;
    multiply by shared.theory.BUSBW_FACTOR[op](N) for the bus bandwidth. A non-positive slope
    (time not growing with size: noise) gives β = inf."""
    import numpy as np  # local: this module otherwise needs only the Config

    n = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if n.size < 2 or n.size != t.size:
        raise ValueError(f"need >= 2 (size, time) pairs of equal length, got {n.size} and {t.size}")
    design = np.stack([np.ones_like(n), n], axis=1) / t[:, None]  # rows [1, n] / t
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)  # (α + n/β)/t ≈ 1
    return float(alpha), (float(1.0 / inv_beta) if inv_beta > 0 else float("inf"))
