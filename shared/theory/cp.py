"""Context parallelism: which tokens a rank holds, what attention moves, what work it does.

Papers: ring attention, Liu et al. 2023 (arXiv:2310.01889); the zigzag (load-balanced) layout of
Llama 3 (arXiv:2407.21783, §3.3.2) and Megatron-LM's context parallelism; DeepSpeed-Ulysses,
Jacobs et al. 2023 (arXiv:2309.14509). Quantities: positions and chunks per rank, per op (count,
bytes) of one step (ring: K|V messages; Ulysses: 8L all-to-alls; plus the gradient all-reduce Φ·b),
and the causal attention-score entries each rank computes.
"""

from __future__ import annotations

from shared.config import Config

# --- cp (context parallelism, transformer) -------------------------------------------------------
# The sequence is split over N = cp ranks for the whole model; every rank holds the full batch and
# every weight. a = B·(T/N)·D·b: one rank's share of the residual stream (and of K, of V, of Q).
# Besides attention, only the gradients cross ranks: ONE all-reduce payload Φ·b per step (the
# replicated weights' gradients, averaged over cp; bucketing / XLA's combiner set the call count).


def cp_positions(seq: int, n: int, rank: int, variant: str) -> list[int]:
    """Global positions of the tokens rank ``rank`` holds, in its local order. ring / ulysses:
    T/N consecutive tokens; ring_zigzag: chunk r then chunk 2N−1−r of 2N chunks of T/(2N)."""
    if variant != "ring_zigzag":
        t = seq // n
        return list(range(rank * t, (rank + 1) * t))
    c = seq // (2 * n)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c))


def cp_chunks(n: int, rank: int, variant: str) -> list[int]:
    """The chunk indices a ring rank holds (chunk = T/N tokens for ring, T/(2N) for ring_zigzag)."""
    return [rank, 2 * n - 1 - rank] if variant == "ring_zigzag" else [rank]


def cp_comm(cfg: Config, variant: str, autocast: bool = False) -> dict[str, tuple[int, int]]:
    """Per step per rank, op -> (count, payload bytes).

    ring / ring_zigzag (Liu et al. 2023): per layer, forward N−1 hops of the K|V block (one message
    of 2a); backward (memory-efficient: only the local K, V are saved) N−1 hops of K|V again, and
    N hops of the dK|dV accumulator travelling with it (the last hop brings it home): 2a each.
    So L·(3N−2) sends of 2a (JAX: collective-permutes; none on one rank). The layout does not
    change the bytes.
    ulysses (Jacobs et al. 2023): per layer 4 all-to-alls forward (q, k, v: sequence-sharded ->
    head-sharded; the output back) and their 4 transposes backward, each of buffer a.
    Plus the gradient all-reduce, Φ·b (count 1: one flat buffer or one bucket).
    Mixed precision: q, k, v are 16-bit matmul outputs in both frameworks (torch's ``autocast``, JAX's
    cast): K|V travel and ulysses' all-to-alls move cfg.compute_bytes; the ring's dK|dV accumulators stay
    float32 (as ring flash attention keeps them), so L·N of its sends move 2a in the reduce dtype,
    L·(2N−2) in the compute dtype; Φ in the reduce dtype."""
    n, l, b = cfg.world_size, cfg.layers, cfg.bytes_per_element
    c = cfg.compute_bytes  # q|k|v's dtype (``autocast``: the same; kept for the torch callers)
    a = cfg.batch * (cfg.seq // n) * cfg.dim  # elements
    out = {"all_reduce": (1, cfg.n_params * b)}
    if variant in ("ring", "ring_zigzag"):
        hops = l * (3 * n - 2) if n > 1 else 0
        out["send"] = (hops, l * (2 * n - 2) * 2 * a * c + l * n * 2 * a * b if n > 1 else 0)
    elif variant == "ulysses":
        out["all_to_all"] = (8 * l, 8 * l * a * c)
    else:
        raise ValueError(f"cp: no formula for variant {variant!r}")
    return out


def cp_comm_bytes(cfg: Config, variant: str, autocast: bool = False) -> int:
    """Payload per step per rank. Wire: a send moves its message once; an all-to-all moves
    a·(N−1)/N; so ring's attention traffic is (3N−2)·2a per layer vs ulysses' 8a·(N−1)/N — ring
    grows with N at fixed a, ulysses does not (but needs H % N == 0)."""
    return sum(nbytes for _, nbytes in cp_comm(cfg, variant, autocast).values())


def cp_attention_scores(cfg: Config, variant: str) -> list[int]:
    """Attention score entries (query·key pairs) each rank computes per layer in forward, summed
    over batch and heads; forward FLOPs are 4·dh per entry (QKᵀ and PV). A block on the diagonal
    is computed whole (masked), a block wholly in the future is skipped. Single device: B·H·T².
    ring: rank r computes r+1 blocks of (T/N)² — rank N−1 does N times rank 0's work.
    ring_zigzag: 2N+1 chunk pairs of (T/(2N))² on every rank — balanced.
    ulysses: the full causal T×T for H/N heads on every rank."""
    n, bh = cfg.world_size, cfg.batch * cfg.heads
    if variant == "ulysses":
        return [bh * cfg.seq * cfg.seq // n] * n
    c = cfg.seq // (2 * n if variant == "ring_zigzag" else n)
    return [bh * c * c * sum(1 for q in cp_chunks(n, r, variant) for s in range(n)
                             for k in cp_chunks(n, s, variant) if k <= q) for r in range(n)]
