"""Data parallelism and ZeRO-1: bytes per step and state per rank.

Papers: PyTorch DDP, Li et al. 2020 (arXiv:2006.15704); ZeRO, Rajbhandari et al. 2020
(arXiv:1910.02054), stage 1 (optimizer state sharded). Quantities: payload S per step per rank
(DP all-reduce Φ·b; ZeRO-1 reduce-scatter + all-gather 2·Φ·b); params / grads / AdamW moments per
rank, in the runs' one dtype (``adam_state_bytes``) or the ZeRO paper's mixed precision
(``zero_state``: K = 12 bytes of fp32 state per parameter), one formula for both.
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
    """Per-rank bytes of parameters, gradients and AdamW state (two moments) in the run's one dtype:
    dp: all full; zero1: optimizer/N; zero2: grads+optimizer/N; zero3: everything/N (``zero_state``)."""
    stage = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[variant]
    return zero_state(cfg.n_params, cfg.world_size, stage, "pure", cfg.bytes_per_element)


def zero_state(params: float, shards: float, zero: int, precision: str = "mixed", b: int = 2) -> dict[str, float]:
    """Bytes of ``params`` parameters' state, ZeRO stage ``zero`` over ``shards`` ranks (the ZeRO paper's
    Figure 1): stage 1 shards the optimizer, 2 also the gradients, 3 also the parameters. pure: b, b, 2b
    bytes per parameter (one dtype, as the runs); mixed: 2 (bf16), 2 (bf16), K = 12 (fp32 master, m, v):
    16Φ unsharded, 4Φ + 12Φ/N at ZeRO-2, 16Φ/N at ZeRO-3; mixed-fp32-grads: Megatron-LM's fp32 main
    gradients (--accumulate-allreduce-grads-in-fp32), 2 + 4 + 12 = 18 bytes per parameter."""
    pb, gb, ob = {"pure": (b, b, 2 * b), "mixed-fp32-grads": (2, 4, 12)}.get(precision, (2, 2, 12))
    cut = lambda k, per: params * per / shards if zero >= k else params * per
    return {"params": cut(3, pb), "grads": cut(2, gb), "optimizer": cut(1, ob)}
