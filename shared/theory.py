"""Analytic formulas: communication payload, memory per rank, pipeline bubble.

Units: payload bytes per training step per rank, counting each collective as nccl-tests' size S
(all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input;
send/recv: the message). Φ = parameter count, b = bytes per element, N = ranks.

Bus bandwidth (nccl-tests, PERFORMANCE.md): busbw = algbw · factor, with
all-reduce 2(N−1)/N, all-gather / reduce-scatter / all-to-all / gather / scatter (N−1)/N,
broadcast / reduce / sendrecv 1.
"""

from __future__ import annotations

from shared.config import Config

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


# --- communication per step (payload S per rank) -------------------------------------------


def dp_comm_bytes(cfg: Config) -> int:
    """DP (naive, bucketed, DDP): all-reduce every gradient once: Φ·b."""
    return cfg.n_params * cfg.bytes_per_element


def zero1_comm_bytes(cfg: Config) -> int:
    """ZeRO-1 as reduce-scatter(grads) + all-gather(params): S = Φ·b each, 2·Φ·b in all —
    the same wire traffic as one all-reduce (2·Φ·b·(N−1)/N per rank on a ring)."""
    return 2 * cfg.n_params * cfg.bytes_per_element


def zero2_comm_bytes(cfg: Config) -> int:
    """ZeRO-2: reduce-scatter(grads) + all-gather(updated params): 2·Φ·b."""
    return 2 * cfg.n_params * cfg.bytes_per_element


def zero3_comm_bytes(cfg: Config) -> int:
    """ZeRO-3 / FSDP: all-gather W fwd + all-gather W bwd + reduce-scatter dW: 3·Φ·b."""
    return 3 * cfg.n_params * cfg.bytes_per_element


def pp_p2p_bytes(cfg: Config) -> int:
    """Pipeline, whole pipeline per step: per stage boundary and micro-batch one activation
    (B/M, D) forward and one gradient backward: 2·(S−1)·M·(B/M)·D·b = 2·(S−1)·B·D·b."""
    return 2 * (cfg.world_size - 1) * cfg.batch * cfg.dim * cfg.bytes_per_element


def pp_bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe / 1F1B idle fraction: (p − 1) / (M + p − 1)."""
    return (stages - 1) / (microbatches + stages - 1)


# --- memory per rank (ZeRO paper, mixed precision replaced by one dtype) --------------------


def adam_state_bytes(cfg: Config, variant: str) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and AdamW state (two moments) for one dtype:
    dp: all full; zero1: optimizer/N; zero2: grads+optimizer/N; zero3: everything/N."""
    phi, b, n = cfg.n_params, cfg.bytes_per_element, cfg.world_size
    full = {"params": phi * b, "grads": phi * b, "optimizer": 2 * phi * b}
    shard = {"dp": (), "zero1": ("optimizer",), "zero2": ("grads", "optimizer"),
             "zero3": ("params", "grads", "optimizer")}[variant]
    return {k: (v / n if k in shard else v) for k, v in full.items()}


def fp32_adam_bytes(n_params: int, n: int, stage: int) -> float:
    """fp32 AdamW, 4 bytes each of params, grads, m, v (16Φ in all): DP 16Φ;
    ZeRO-1 8Φ + 8Φ/N; ZeRO-2 4Φ + 12Φ/N; ZeRO-3 16Φ/N."""
    phi = n_params
    return {0: 16 * phi, 1: 8 * phi + 8 * phi / n, 2: 4 * phi + 12 * phi / n, 3: 16 * phi / n}[stage]


# --- per-pattern formulas (collectives' α-β fit, TP, FSDP, PP) ----------------------------------


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


def pp_p2p_bytes_per_rank(cfg: Config, rank: int) -> int:
    """Pipeline (torch explicit schedules), payload sent by one rank = stage s per step: M
    activations (B/M, D) to s+1 unless s is last, M activation-gradients (B/M, D) to s−1 unless
    s is first: ((s < S−1) + (s > 0))·B·D·b. Summed over ranks: pp_p2p_bytes."""
    s, last = rank, cfg.world_size - 1
    return ((s < last) + (s > 0)) * cfg.batch * cfg.dim * cfg.bytes_per_element


def pp_p2p_count_per_rank(cfg: Config, rank: int) -> int:
    """Sends per step of stage s (receives likewise, mirrored): ((s < S−1) + (s > 0))·M."""
    s, last = rank, cfg.world_size - 1
    return ((s < last) + (s > 0)) * cfg.microbatches


def pp_circular_permute_count(cfg: Config, style: str = "shard_map") -> int:
    """JAX circular pipeline (SPMD), collective-permutes per step. M + S − 1 iterations with a
    shift after every one but the last: M + S − 2 in forward, each one cyclic permute
    s → s+1 on every device (bubble iterations shift zeros too). Backward transposes each shift:
    shard_map (lax.ppermute) into one reverse permute: 2·(M + S − 2) in all; jit (jnp.roll =
    slice + concatenate) into pad + split, which XLA emits as two permutes (the pairs s+1 → s,
    and the wrap-around 0 → S−1): 3·(M + S − 2) in all — same bytes on the wire per device."""
    shifts = cfg.microbatches + cfg.world_size - 2
    return shifts * (2 if style == "shard_map" else 3)


def pp_circular_permute_bytes(cfg: Config, style: str = "shard_map") -> int:
    """Payload per device per step of the circular pipeline, each permute counted with its
    message (B/M, D): count·(B/M)·D·b (shard_map: 2·(M + S − 2)·(B/M)·D·b)."""
    mb_bytes = cfg.batch // cfg.microbatches * cfg.dim * cfg.bytes_per_element
    return pp_circular_permute_count(cfg, style) * mb_bytes


def pp_peak_activations(schedule: str, stages: int, microbatches: int, rank: int) -> int:
    """Micro-batches whose activations stage ``rank`` holds at once: GPipe M; 1F1B min(M, S − s)."""
    return microbatches if schedule == "gpipe" else min(microbatches, stages - rank)


# Tensor parallelism (Megatron-LM). Every rank sees the full batch; every collective moves one
# (B, D) activation or activation-gradient: S = B·D·b. Each function returns op -> (count, bytes).


def tp_allgather_comm(cfg: Config) -> dict[str, tuple[int, int]]:
    """TP with every layer column-parallel (the CS336 seed), per step per rank:
    fwd: L all-gathers of the layer output, L·S; bwd: L−1 reduce-scatters of the partial dL/dx of
    layers 1…L−1, (L−1)·S. The last gather feeds the loss, which every rank computes from the same
    full output, so its backward is a local slice (no collective); layer 0's input is x (no grad)."""
    s, l = cfg.batch * cfg.dim * cfg.bytes_per_element, cfg.layers
    out = {"all_gather": (l, l * s)}
    if l > 1:
        out["reduce_scatter"] = (l - 1, (l - 1) * s)
    return out


def tp_megatron_comm(cfg: Config) -> dict[str, tuple[int, int]]:
    """Megatron TP (column- then row-parallel pairs), per step per rank:
    all-reduce: ⌊L/2⌋ in fwd (g, after each pair) + ⌈L/2⌉−1 in bwd (f, before each column-parallel
    layer whose input needs a gradient: not layer 0, whose input is x), S each;
    odd L: the last layer is column-parallel + 1 all-gather of S (its backward is a local slice)."""
    s, l = cfg.batch * cfg.dim * cfg.bytes_per_element, cfg.layers
    n_ar = l // 2 + (l + 1) // 2 - 1
    out = {"all_reduce": (n_ar, n_ar * s)} if n_ar else {}
    if l % 2:
        out["all_gather"] = (1, s)
    return out


def tp_comm(cfg: Config, variant: str) -> dict[str, tuple[int, int]]:
    """variant "allgather" or "megatron" (DTensor's Colwise/Rowwise plan is "megatron")."""
    return tp_allgather_comm(cfg) if variant == "allgather" else tp_megatron_comm(cfg)


def tp_comm_bytes(cfg: Config, variant: str) -> int:
    """Payload S per step per rank. Wire per rank (ring): all-gather / reduce-scatter S·(N−1)/N,
    all-reduce 2·S·(N−1)/N — allgather (2L−1)·S·(N−1)/N, megatron (even L) (2L−2)·S·(N−1)/N."""
    return sum(nbytes for _, nbytes in tp_comm(cfg, variant).values())


def tp_state_bytes(cfg: Config) -> dict[str, float]:
    """Every weight is split tp ways: params Φ·b/N, grads Φ·b/N, AdamW moments 2·Φ·b/N per rank."""
    phi, b, n = cfg.n_params, cfg.bytes_per_element, cfg.world_size
    return {"params": phi * b / n, "grads": phi * b / n, "optimizer": 2 * phi * b / n}


# ZeRO-2 / ZeRO-3 (FSDP), explicit per-layer collectives; every one moves a whole D×D weight or
# weight-gradient: S = D²·b. Each function returns op -> (count, bytes) per step per rank.


def zero2_comm(cfg: Config) -> dict[str, tuple[int, int]]:
    """ZeRO-2: L reduce-scatters of dW_l + L all-gathers of the updated W_l: 2·Φ·b in all."""
    s, l = cfg.dim * cfg.dim * cfg.bytes_per_element, cfg.layers
    return {"reduce_scatter": (l, l * s), "all_gather": (l, l * s)}


def zero3_comm(cfg: Config, regather_first: bool = False) -> dict[str, tuple[int, int]]:
    """ZeRO-3: fwd L all-gathers; bwd an all-gather for every layer whose dX = dY·W_lᵀ is needed —
    L−1, since layer 0's input is x (no grad) — and L reduce-scatters of dW_l: 3·Φ·b − D²·b.
    ``regather_first`` (FSDP2 gathers W_0 in backward anyway): 2L all-gathers, exactly 3·Φ·b."""
    s, l = cfg.dim * cfg.dim * cfg.bytes_per_element, cfg.layers
    n_ag = 2 * l if regather_first else 2 * l - 1
    return {"all_gather": (n_ag, n_ag * s), "reduce_scatter": (l, l * s)}


def zero3_skip_first_comm_bytes(cfg: Config) -> int:
    """ZeRO-3 without layer 0's backward re-gather: zero3_comm_bytes(cfg) − D²·b = (3L−1)·D²·b."""
    return sum(nbytes for _, nbytes in zero3_comm(cfg).values())
