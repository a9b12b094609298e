"""Sharded data parallelism, ZeRO-2 and ZeRO-3 / FSDP: bytes per step and state per rank.

Papers: ZeRO, Rajbhandari et al. 2020 (arXiv:1910.02054), stages 2 and 3; PyTorch FSDP, Zhao et al.
2023 (arXiv:2304.11277). Quantities: the units (parameters with >= 2 dims, sharded along dim 0) and
the replicated vectors; per op (count, bytes) of one step — all-gathers forward and, for the units
autograd saves, again backward; reduce-scatters; one all-reduce of the vectors — for the
hand-written wrappers and FSDP2; params / grads / AdamW moments per rank.
"""

from __future__ import annotations

from shared.config import Config
from shared.theory.dp import adam_state_bytes


def zero2_comm_bytes(cfg: Config) -> int:
    """ZeRO-2: reduce-scatter(grads) + all-gather(updated params): 2·Φ·b."""
    return 2 * cfg.n_params * cfg.bytes_per_element


def zero3_comm_bytes(cfg: Config) -> int:
    """ZeRO-3 / FSDP: all-gather W fwd + all-gather W bwd + reduce-scatter dW: 3·Φ·b."""
    return 3 * cfg.n_params * cfg.bytes_per_element


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


# --- fsdp (generic) ------------------------------------------------------------------------------
# The hand-written ZeRO-2/3 (torch_impl.parallel.fsdp.FSDP / Zero2, jax_impl.fsdp shard_map) shard every
# parameter with >= 2 dims along dim 0 (a "unit": W_l; wte, wpe, W_qkv, W_o, W_up, W_down, W_head)
# and replicate the vectors (RMSNorm gains), whose gradients go through ONE flat all-reduce.
# Exact when each unit's dim 0 (torch: Linear out-features, embedding rows) divides by N, which
# Config.check("fsdp") requires of the transformer (the torch wrapper pads otherwise).


def fsdp_units(cfg: Config) -> tuple[dict[str, int], dict[str, int]]:
    """(sharded units, replicated vectors): parameter name -> element count."""
    from math import prod

    from shared.problem import param_shapes  # NumPy-only, like this module

    shapes = param_shapes(cfg)
    return ({n: prod(s) for n, s in shapes.items() if len(s) >= 2},
            {n: prod(s) for n, s in shapes.items() if len(s) < 2})


def fsdp_regathered(cfg: Config) -> list[str]:
    """Units ZeRO-3 gathers again in backward: those whose op saves the weight, i.e. needs it for
    the input's gradient. Not the embeddings (their backward is a scatter-add over the indices)
    and not the MLP's layer 0 (its input is the data)."""
    units, _ = fsdp_units(cfg)
    skip = {"wte.weight", "wpe.weight"} if cfg.model == "transformer" else {"layers.0.linear.weight"}
    return [n for n in units if n not in skip]


def fsdp_comm(cfg: Config, variant: str, cast_gather: bool = False, gathers: int = 1,
              reduces: int = 1) -> dict[str, tuple[int, int]]:
    """op -> (count, payload bytes) per step per rank, for any model (MLP: equal to zero3_comm /
    zero2_comm; it has no vectors, so no all-reduce).
    zero3: all-gather every unit (fwd) + every fsdp_regathered unit (bwd), reduce-scatter every
           unit, 1 all-reduce of the vectors: transformer 3Φb − (V+T)·D·b − (2L+1)·D·b.
    zero2: reduce-scatter + all-gather every unit, 1 all-reduce of the vectors:
           2Φb − (2L+1)·D·b.
    fsdp2: fully_shard per block + root, one flat group each (vectors inside): every block
           gathered fwd and again bwd, 1 reduce-scatter per block; the root's group (transformer:
           wte, wpe, normf, head; MLP: empty) gathered once — the root keeps it from forward to
           backward (reshard_after_forward=False) — and reduce-scattered once: 3Φb − Φ_root·b.
    ``gathers`` (zero3, fsdp2 under accumulation: K micro-batches, the reductions skipped on all but the
    last): every micro-batch's forward and backward gather again, K× the all-gathers, one reduction;
    ``reduces``: K× the reduce-scatters (JAX zero3/shard_map: the transpose of every gather)."""
    b = cfg.bytes_per_element  # the reduce dtype's (mixed precision: float32)
    # the all-gathers' element: the compute dtype where the weights are cast before the gather (FSDP2's
    # MixedPrecisionPolicy, torch FSDP(compute_dtype=…) under mixed precision: ``cast_gather``), else b
    gb = cfg.compute_bytes if cast_gather or variant == "fsdp2" else b
    units, vectors = fsdp_units(cfg)
    out: dict[str, tuple[int, int]] = {}
    if variant in ("zero2", "zero3"):
        gathered = list(units) + (fsdp_regathered(cfg) if variant == "zero3" else [])
        k = gathers if variant == "zero3" else 1  # zero2 gathers the updated rows once, after the step
        out["all_gather"] = (k * len(gathered), k * sum(units[n] for n in gathered) * gb)
        out["reduce_scatter"] = (reduces * len(units), reduces * sum(units.values()) * b)
        if vectors:
            out["all_reduce"] = (1, sum(vectors.values()) * b)
        return out
    if variant != "fsdp2":
        raise ValueError(f"unknown fsdp variant {variant!r}")
    d, l = cfg.dim, cfg.layers
    block = d * d if cfg.model == "mlp" else 12 * d * d + 2 * d
    root = cfg.n_params - l * block
    n_ag, n_rs = 2 * l + (root > 0), l + (root > 0)
    return {"all_gather": (gathers * n_ag, gathers * (2 * l * block + root) * gb),
            "reduce_scatter": (n_rs, (l * block + root) * b)}


def fsdp_comm_bytes(cfg: Config, variant: str, cast_gather: bool = False, gathers: int = 1,
                    reduces: int = 1) -> int:
    return sum(nbytes for _, nbytes in fsdp_comm(cfg, variant, cast_gather, gathers, reduces).values())


def fsdp_state_bytes(cfg: Config, variant: str) -> dict[str, float]:
    """Per-rank bytes with one dtype: the ZeRO table with the vectors (the transformer's (2L+1)·D
    gains) replicated — a little above Φ/N. zero3: params, grads, AdamW m+v of units / N, vectors
    full; zero2: params full, grads and m+v as zero3. FSDP2 shards the gains too: exactly the table."""
    units, vectors = fsdp_units(cfg)
    b, n = cfg.bytes_per_element, cfg.world_size
    u, v = sum(units.values()) * b, sum(vectors.values()) * b
    if variant == "fsdp2":
        return adam_state_bytes(cfg, "zero3")
    params = u / n + v if variant == "zero3" else u + v
    return {"params": params, "grads": u / n + v, "optimizer": 2 * (u / n + v)}
