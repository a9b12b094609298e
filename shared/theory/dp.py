"""Data parallelism and ZeRO-1: bytes per step and state per rank.

Papers: PyTorch DDP, Li et al. 2020 (arXiv:2006.15704); ZeRO, Rajbhandari et al. 2020
(arXiv:1910.02054), stage 1 (optimizer state sharded). Quantities: payload S per step per rank
(DP all-reduce Φ·b; ZeRO-1 reduce-scatter + all-gather 2·Φ·b); params / grads / AdamW moments per
rank, in the runs' one dtype (``adam_state_bytes``) or the ZeRO paper's mixed precision
(``fp32_adam_bytes``: K = 12 bytes of fp32 state per parameter).
"""

from __future__ import annotations

from shared.config import Config

# --- communication per step (payload S per rank) -------------------------------------------


def dp_comm_bytes(cfg: Config) -> int:
    """DP (naive, bucketed, DDP): all-reduce every gradient once: Φ·b."""
    return cfg.n_params * cfg.bytes_per_element


def zero1_comm_bytes(cfg: Config) -> int:
    """ZeRO-1 as reduce-scatter(grads) + all-gather(params): S = Φ·b each, 2·Φ·b in all —
    the same wire traffic as one all-reduce (2·Φ·b·(N−1)/N per rank on a ring)."""
    return 2 * cfg.n_params * cfg.bytes_per_element


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
