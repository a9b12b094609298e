"""Analytic formulas: communication payload, memory per rank, pipeline bubble.

Units: payload bytes per training step per rank, counting each collective as nccl-tests' size S
(all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input;
send/recv: the message). Φ = parameter count, b = bytes per element, N = ranks.

Bus bandwidth (nccl-tests, PERFORMANCE.md): busbw = algbw · factor, with
all-reduce 2(N−1)/N, all-gather / reduce-scatter / all-to-all (N−1)/N, broadcast / reduce 1.
"""

from __future__ import annotations

from shared.config import Config

BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
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


# --- pattern owners add their formulas below (TP, PP, …) ------------------------------------
