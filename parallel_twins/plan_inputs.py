"""``compare.py plan``'s inputs, bounded and checked before the search (issue 47): every number flag
finite and in range (a zero peak used to divide by zero, NaN α–β ranked layouts with negative step
times and "nan%" MFU, a huge global batch built a string of its micro-batches), and every file it
reads (--calibrate, --measured; --profile is shared/efficiency.py's) size- and depth-capped before
parsing (/dev/zero refused at once) and checked to be what it claims before it is used. Each refusal is
one line (ValueError) naming the flag or the file.
"""

from __future__ import annotations

import math

from shared.bounded import BadFile, number, read_json

MAX_BENCH_BYTES = 64 << 20  # a bench --json is a few hundred kB
MAX_GLOBAL_BATCH = 1 << 20  # sequences per step: 4× the largest published (16M tokens of 4K ≈ 4096 sequences) × 64
# model sizes far beyond any published model (the search enumerates the layers' and experts' divisors)
LIMITS = {"layers": 4096, "dim": 1 << 20, "heads": 1 << 16, "kv_heads": 1 << 16, "vocab": 1 << 24, "seq": 1 << 26,
          "mlp_ratio": 1024, "ffn": 1 << 24, "experts": 1 << 16, "topk": 1 << 16, "gpus": 1 << 24,
          "gpus_per_node": 1 << 16, "top": 1 << 16}


def check_args(args) -> None:
    """Every number flag of ``compare.py plan``: finite, in range; ValueError naming the flag."""
    for name, top in LIMITS.items():
        value = getattr(args, name, None)
        low = 0 if name in ("experts", "kv_heads", "ffn") else 1  # 0: dense, H, R·D
        number(f"--{name.replace('_', '-')}", value, low=low, high=top, integer=True)
    number("--global-batch", args.global_batch, low=1, high=MAX_GLOBAL_BATCH, integer=True)
    for flag in ("peak_flops", "gpu_memory", "hbm_bandwidth", "beta_intra", "beta_inter"):
        number(f"--{flag.replace('_', '-')}", getattr(args, flag), low=0, low_open=True)
    for flag in ("alpha_intra", "alpha_inter"):
        number(f"--{flag.replace('_', '-')}", getattr(args, flag), low=0)
    number("--efficiency", args.efficiency, low=0, high=1, low_open=True)
    number("--headroom", args.headroom, low=0, high=1)
    if args.headroom == 1:
        raise ValueError("--headroom 1: nothing of the GPU's memory would be usable; a fraction in [0, 1)")
    if args.topk is not None and args.experts is not None and args.topk > max(args.experts, 1):
        raise ValueError(f"--topk {args.topk}: more experts per token than --experts {args.experts}")


def read_bench(path: str) -> dict:
    """A ``compare.py bench --json`` file for --calibrate: bounded, and its fits and compute rates
    numbers that make sense (α >= 0, β > 0 or null/inf: not fitted, rates > 0, world size >= 1)."""
    from shared.theory import BUSBW_FACTOR

    what = "a compare.py bench --json file"
    try:
        bench = read_json(path, what, MAX_BENCH_BYTES)
    except BadFile as exc:
        raise ValueError(f"--calibrate {exc}") from None
    bad = lambda why: ValueError(f"--calibrate {path}: {why}: not {what}")  # noqa: E731
    if not isinstance(bench, dict) or not isinstance(bench.get("fits"), list):
        raise bad("no list 'fits' at the top level")
    n = bench.get("world_size")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise bad(f"world_size {n!r} is not a number of ranks")
    for i, fit in enumerate(bench["fits"]):
        if not isinstance(fit, dict) or not {"framework", "op", "alpha_s", "beta_bytes_per_s"} <= set(fit):
            raise bad(f"fits[{i}] lacks framework, op, alpha_s or beta_bytes_per_s")
        if fit["op"] not in BUSBW_FACTOR:
            raise bad(f"fits[{i}].op {fit['op']!r} is not a collective it times")
        alpha, beta = fit["alpha_s"], fit["beta_bytes_per_s"]
        if not _real(alpha) or alpha < 0:
            raise bad(f"fits[{i}].alpha_s {alpha!r} is not a latency >= 0")
        if beta is not None and not (_real(beta, inf=True) and beta > 0):
            raise bad(f"fits[{i}].beta_bytes_per_s {beta!r} is not a bandwidth > 0")
    compute = bench.get("compute", {})
    if not isinstance(compute, dict) or not all(
            isinstance(rates, dict) and all(str(k).isdigit() and _real(r) and r > 0 for k, r in rates.items())
            for rates in compute.values()):
        raise bad("'compute' is not {dtype: {size: FLOP/s > 0}}")
    return bench


def read_measured(path: str) -> dict:
    """A compare.py --json result for --measured: bounded and validated against
    docs/results-schema.json (shared.diff.load)."""
    from shared.diff import BadInput, load

    try:
        return load(path)
    except BadInput as exc:
        raise ValueError(f"--measured {exc}") from None


def _real(x, inf: bool = False) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (math.isfinite(x) or (inf and x == math.inf))
