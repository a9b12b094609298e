"""The collectives' inputs and expected outputs, in NumPy: what both frameworks are checked against.

Every rank r builds its input with ``rank_input(name, r, N)`` (rank-dependent, as in the CS336
lecture-8 examples: ``[0, 1, 2, 3] + rank`` for the reductions, ``100·rank + arange`` for the
data-movement ops so that a value reads as "rank r's element i") and must end up holding
``expected(name, r, N)`` (``None`` where the collective leaves nothing defined, e.g. a reduce's
non-root ranks). Small integers in float32: every sum is exact, so the check is equality
(shared.tolerances.COLLECTIVES = 0).

``expected_bytes(name, N, itemsize)`` is the payload the comm ledgers must report for one call,
as nccl-tests' size S summed over the calls it makes (a point-to-point message counted once, on
the sender): all-reduce / broadcast / reduce: the buffer; all-gather / gather: the gathered output;
reduce-scatter / scatter: the full input; all-to-all: the buffer; send: the message.
"""

from __future__ import annotations

import numpy as np

from shared.theory import fit_alpha_beta

DTYPE = np.float32

# In the order a tutorial meets them: one-to-all, all-to-one, all-to-all, point-to-point, then
# the all-reduce rebuilt by hand from send/recv and from reduce-scatter + all-gather.
NAMES = (
    "broadcast", "reduce", "all_reduce_sum", "all_reduce_avg", "all_reduce_max",
    "gather", "all_gather", "scatter", "reduce_scatter", "all_to_all",
    "ring_shift", "barrier", "ring_all_reduce", "rs_then_ag",
)

# Collectives with a root rank, and those whose result only the root holds (elsewhere None).
WITH_ROOT = ("broadcast", "reduce", "gather", "scatter")
ROOTED = ("reduce", "gather")

CHUNK = 2  # elements each rank owns in the chunked ops: 2 rather than 1, so slicing bugs show


def root_rank(world: int) -> int:
    """The root of broadcast / reduce / gather / scatter: the LAST rank, so that code which
    silently assumes rank 0 fails the check."""
    return world - 1


def rank_input(name: str, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s input to collective ``name`` (float32)."""
    if name not in NAMES:
        raise ValueError(f"unknown collective {name!r}; choose from {', '.join(NAMES)}")
    n = CHUNK * world  # chunked ops need a length divisible by the world size
    if name in ("reduce", "all_reduce_sum", "all_reduce_avg", "all_reduce_max"):
        x = np.arange(4) + rank  # (4,): CS336 all_reduce seed
    elif name in ("reduce_scatter", "ring_all_reduce", "rs_then_ag"):
        x = np.arange(n) + rank  # (N·c,): CS336 reduce_scatter seed, c = 2 per rank
    elif name in ("broadcast", "barrier"):
        x = 100 * rank + np.arange(4)  # (4,)
    elif name in ("scatter", "all_to_all"):
        x = 100 * rank + np.arange(n)  # (N·c,): chunk j goes to rank j
    else:  # gather, all_gather, ring_shift
        x = 100 * rank + np.arange(CHUNK)  # (c,)
    return x.astype(DTYPE)


def expected(name: str, rank: int, world: int) -> np.ndarray | None:
    """What rank ``rank`` holds after collective ``name`` (None: nothing defined there)."""
    inputs = [rank_input(name, r, world) for r in range(world)]  # N × rank_input
    mine, top = inputs[rank], root_rank(world)
    if name in ROOTED and rank != top:
        return None
    if name == "broadcast":
        return inputs[top]
    if name in ("reduce", "all_reduce_sum", "ring_all_reduce", "rs_then_ag"):
        return np.sum(inputs, axis=0, dtype=DTYPE)
    if name == "all_reduce_avg":
        # The sum, then one division in float32: N·i + N(N−1)/2 divided by N is i + (N−1)/2,
        # a multiple of 1/2, exactly representable — so the average is exact too.
        return np.sum(inputs, axis=0, dtype=DTYPE) / DTYPE(world)
    if name == "all_reduce_max":
        return np.max(inputs, axis=0)
    if name in ("gather", "all_gather"):
        return np.concatenate(inputs)  # (N·c,) in rank order
    if name == "scatter":
        return np.split(inputs[top], world)[rank]  # (c,): chunk r of the root's buffer
    if name == "reduce_scatter":
        return np.split(np.sum(inputs, axis=0, dtype=DTYPE), world)[rank]  # (c,)
    if name == "all_to_all":
        return np.concatenate([np.split(x, world)[rank] for x in inputs])  # chunk r of every rank
    if name == "ring_shift":
        return inputs[(rank - 1) % world]  # from the left neighbour
    if name == "barrier":
        return mine  # data untouched: a barrier only orders time
    raise ValueError(f"unknown collective {name!r}")


def max_abs_err(got: np.ndarray | None, want: np.ndarray | None) -> float:
    """max |got − want| (0 where nothing is defined, inf on a shape mismatch or a missing result)."""
    if want is None:
        return 0.0
    if got is None or got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0))


def expected_bytes(name: str, world: int, itemsize: int = 4) -> int:
    """Payload S of one call per rank, as torch_impl.ledger / jax_impl.ledger count it."""
    n = rank_input(name, 0, world).size * itemsize  # this rank's input buffer in bytes
    if name in ("gather", "all_gather"):
        return n * world  # the gathered output
    if name == "ring_all_reduce":
        return 2 * (world - 1) * (n // world)  # 2(N−1) sends of one chunk n/N
    if name == "rs_then_ag":
        return 2 * n  # reduce-scatter (input n) + all-gather (output n)
    if name == "barrier":
        return 0  # torch: no data (JAX's stand-in, a psum of one int32, adds 4 bytes)
    return n


# --- bandwidth sweep ------------------------------------------------------------------------

BENCH_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
BENCH_SIZES = tuple(4096 * 4**k for k in range(7))  # 4 KiB … 16 MiB (nccl-tests size S), ×4


def bench_elements(op: str, size_bytes: int, world: int, itemsize: int) -> tuple[int, int]:
    """(elements of each rank's input, actual S in bytes) for an op of nominal size S: S is
    rounded down so the buffer splits evenly over N ranks. all_gather's S is the OUTPUT, so
    each rank contributes S/N; the others' input is the full buffer S."""
    per_rank = max(1, size_bytes // itemsize // world)  # elements per chunk
    total = per_rank * world
    return (per_rank if op == "all_gather" else total), total * itemsize


def fit_per_op(rows: list[dict]) -> dict[str, dict[str, float]]:
    """α (latency, s) and β (bytes/s asymptote of algbw) per op from bench rows."""
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        alpha, beta = fit_alpha_beta([r["size_bytes"] for r in mine], [r["time_s"] for r in mine])
        out[op] = {"alpha_s": alpha, "beta_bytes_per_s": beta}
    return out
