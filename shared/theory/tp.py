"""Tensor parallelism (Megatron) and sequence parallelism: bytes per step and state per rank.

Papers: Megatron-LM, Shoeybi et al. 2019 (arXiv:1909.08053, §3: f and g); sequence parallelism,
Korthikanti et al. 2022 (arXiv:2205.05198, §4.2.2: g and ḡ). Quantities: per op (count, bytes) of one
step for the MLP (all-gather TP, Megatron pairs) and the transformer (4L + 2 all-reduces of B·T·D·b
and the vocab-parallel loss's reductions; SP: as many all-gathers and reduce-scatters); state per
rank (split weights / tp, replicated norms and positions whole); the norms' activations SP saves.
"""

from __future__ import annotations

from shared.config import Config

# Tensor parallelism (Megatron-LM). Every rank sees the full batch; every collective moves one
# (B, D) activation or activation-gradient: S = B·D·b. Each function returns op -> (count, bytes).
# b of an activation is the compute dtype's (cfg.compute_bytes: bf16 under mixed precision); the loss's
# reductions (its logits in float32 under mixed precision) and parameter gradients use the reduce
# dtype's (cfg.bytes_per_element); the two are equal under --precision pure.


def tp_allgather_comm(cfg: Config, autocast: bool = False) -> dict[str, tuple[int, int]]:
    """TP with every layer column-parallel (the CS336 seed), per step per rank:
    fwd: L all-gathers of the layer output, L·S; bwd: L−1 reduce-scatters of the partial dL/dx of
    layers 1…L−1, (L−1)·S. The last gather feeds the loss, which every rank computes from the same
    full output, so its backward is a local slice (no collective); layer 0's input is x (no grad).
    ``autocast`` (torch, mixed precision): every activation and its gradient is bf16 too."""
    s, l = cfg.batch * cfg.dim * cfg.compute_bytes, cfg.layers
    out = {"all_gather": (l, l * s)}
    if l > 1:
        out["reduce_scatter"] = (l - 1, (l - 1) * s)
    return out


def tp_megatron_comm(cfg: Config, autocast: bool = False) -> dict[str, tuple[int, int]]:
    """Megatron TP (column- then row-parallel pairs), per step per rank:
    all-reduce: ⌊L/2⌋ in fwd (g, after each pair) + ⌈L/2⌉−1 in bwd (f, before each column-parallel
    layer whose input needs a gradient: not layer 0, whose input is x), S each;
    odd L: the last layer is column-parallel + 1 all-gather of S (its backward is a local slice).
    ``autocast``: as tp_allgather_comm."""
    s, l = cfg.batch * cfg.dim * cfg.compute_bytes, cfg.layers
    n_ar = l // 2 + (l + 1) // 2 - 1
    out = {"all_reduce": (n_ar, n_ar * s)} if n_ar else {}
    if l % 2:
        out["all_gather"] = (1, s)
    return out


def tp_comm(cfg: Config, variant: str, autocast: bool = False) -> dict[str, tuple[int, int]]:
    """variant "allgather" or "megatron" (DTensor's Colwise/Rowwise plan is "megatron");
    "megatron_sp" / "dtensor_sp" (sequence parallel, transformer only): tp_sp_comm. ``autocast``: the
    torch runs' mixed precision, where only the activations autocast computes travel in bf16."""
    if variant == "megatron_sp":
        return tp_sp_comm(cfg, autocast=autocast)
    if variant == "dtensor_sp":  # loss_parallel: 3 all-reduces; one redistribute per SP parameter
        return tp_sp_comm(cfg, loss_all_reduces=3, param_all_reduces=2 * cfg.layers + 2, autocast=autocast)
    if cfg.model == "transformer":
        return tp_transformer_comm(cfg, loss_all_reduces=3 if variant == "dtensor" else 2, autocast=autocast)
    return tp_allgather_comm(cfg, autocast) if variant == "allgather" else tp_megatron_comm(cfg, autocast)


def tp_comm_bytes(cfg: Config, variant: str, autocast: bool = False) -> int:
    """Payload S per step per rank. Wire per rank (ring): all-gather / reduce-scatter S·(N−1)/N,
    all-reduce 2·S·(N−1)/N — allgather (2L−1)·S·(N−1)/N, megatron (even L) (2L−2)·S·(N−1)/N."""
    return sum(nbytes for _, nbytes in tp_comm(cfg, variant, autocast).values())


def tp_state_bytes(cfg: Config, variant: str = "megatron") -> dict[str, float]:
    """Every weight is split tp ways: params Φ·b/N, grads Φ·b/N, AdamW moments 2·Φ·b/N per rank."""
    if cfg.model == "transformer":
        return tp_transformer_state_bytes(cfg, variant)
    phi, b, n = cfg.n_params, cfg.bytes_per_element, cfg.world_size
    return {"params": phi * b / n, "grads": phi * b / n, "optimizer": 2 * phi * b / n}


# --- tp (transformer) ---
# Megatron TP of the GPT-style decoder (torch_impl/tp.py TRANSFORMER_PLAN, jax_impl/tp.py
# FIXTURE_PLAN): W_qkv (by heads), W_up, head column-parallel; W_o, W_down row-parallel; wte
# vocab-parallel; wpe and the norm gains replicated. Every rank sees the full batch.


def tp_transformer_comm(cfg: Config, loss_all_reduces: int = 2, autocast: bool = False) -> dict[str, tuple[int, int]]:
    """Per step per rank, all all-reduces. Of A = B·T·D·b (the residual stream): per layer 2 fwd
    (g after W_o and W_down) + 2 bwd (f before W_qkv and W_up; layer 0's runs too: the embedding
    output needs a gradient for wte), the embedding's g (fwd) and the head's f (bwd): (4L+2)·A.
    The vocab-parallel cross-entropy (bwd local): max, target logit and Σexp over (B, T), 3·B·T·b
    in ``loss_all_reduces`` calls: 2 (explicit: the two sums in one (2, B, T)) or 3 (DTensor).
    Mixed precision: JAX casts every parameter (every activation in cfg.compute_bytes); ``autocast``
    (torch): the 2L forward g's sum W_o's and W_down's bf16 outputs (2L·A in cfg.compute_bytes); the f's
    sum gradients of float32 norm outputs, the embedding is float32 and the loss is computed in float32
    (as autocast's cross-entropy): those in float32. The loss's rows: the reduce dtype in both."""
    tokens, n_act = cfg.batch * cfg.seq, 4 * cfg.layers + 2
    low = 2 * cfg.layers if autocast and cfg.precision == "mixed" else n_act  # payloads in the compute dtype
    act = tokens * cfg.dim * ((n_act - low) * cfg.bytes_per_element + low * cfg.compute_bytes)
    return {"all_reduce": (n_act + loss_all_reduces, act + 3 * tokens * cfg.bytes_per_element)}


def tp_transformer_state_bytes(cfg: Config, variant: str = "megatron") -> dict[str, float]:
    """Per rank: split parameters (wte V·D, 12·D² per layer, head D·V) /N, replicated ones (wpe T·D,
    2·D per layer, final norm D) whole; grads the same, AdamW moments twice that. DTensor (variant
    "dtensor") keeps wte's gradient Replicate (its embedding backward is computed in full on every
    rank, sliced in the optimizer step): grads + V·D·b·(N−1)/N."""
    d, n, b = cfg.dim, cfg.world_size, cfg.bytes_per_element
    split = cfg.vocab * d + cfg.layers * 12 * d * d + d * cfg.vocab
    per_rank = (split / n + cfg.seq * d + cfg.layers * 2 * d + d) * b
    grads = per_rank + (cfg.vocab * d * b * (n - 1) / n if variant in ("dtensor", "dtensor_sp") else 0)
    return {"params": per_rank, "grads": grads, "optimizer": 2 * per_rank}


# --- tp + sp (transformer) ---
# Megatron sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, §4.2.2): the tp
# variant "megatron_sp" (torch explicit, JAX shard_map / jit) and "dtensor_sp" (torch builtin).
# Outside the matmuls (embedding output, norms, residual adds) the activations are (B, T/tp, D).


def tp_sp_comm(cfg: Config, loss_all_reduces: int = 2, param_all_reduces: int = 1,
               autocast: bool = False) -> dict[str, tuple[int, int]]:
    """Per step per rank, op -> (count, payload bytes). A = B·T·D·b.

    Megatron's all-reduce after each row-parallel matmul (g) becomes a reduce-scatter along the
    sequence, (B, T, D) partial -> (B, T/tp, D), and the identity before each column-parallel
    matmul (f) an all-gather, (B, T/tp, D) -> (B, T, D); each one's backward is the other.
    Forward: the embedding's reduce-scatter, per layer an all-gather before W_qkv and W_up and a
    reduce-scatter after W_o and W_down, an all-gather before the head: 2L+1 of each.
    Backward: the same 2L+1 + 2L+1, transposed. Sizes (nccl-tests S): an all-gather's gathered
    output, a reduce-scatter's full input: A each. So (4L+2) all-gathers and (4L+2)
    reduce-scatters, (8L+4)·A payload, twice Megatron's (4L+2)·A of all-reduces, and the same
    bytes on the wire: a ring all-reduce of S moves 2·S·(N−1)/N per rank, an all-gather or a
    reduce-scatter S·(N−1)/N.
    Plus the vocab-parallel loss, 3·B·T·b in ``loss_all_reduces`` calls (as tp_transformer_comm),
    and the parameters used inside the sequence-parallel regions, whose gradients are partial
    (each rank saw T/tp of the tokens): the norm gains (2L+1)·D and wpe T·D (each rank adds its
    own T/tp rows), all-reduced: ((2L+1)·D + T·D)·b in ``param_all_reduces`` calls (torch
    explicit: one flat buffer, as Megatron's sequence-parallel gradient all-reduce; DTensor: one
    per parameter, 2L+2; JAX: XLA's all-reduce combiner merges the transposes' psums).
    ``autocast`` (torch, mixed precision): the 2L reduce-scatters of W_o's / W_down's bf16 outputs and
    their 2L all-gathers backward move cfg.compute_bytes; the rest float32 (as tp_transformer_comm)."""
    b, l = cfg.bytes_per_element, cfg.layers
    tokens, n = cfg.batch * cfg.seq * cfg.dim, 4 * l + 2
    low = 2 * l if autocast and cfg.precision == "mixed" else n  # payloads in the compute dtype (JAX: all)
    act = tokens * ((n - low) * b + low * cfg.compute_bytes)  # of each op: n payloads, `low` of them 16-bit
    sp_params = ((2 * l + 1) * cfg.dim + cfg.seq * cfg.dim) * b
    return {"all_gather": (n, act), "reduce_scatter": (n, act),
            "all_reduce": (loss_all_reduces + param_all_reduces, 3 * cfg.batch * cfg.seq * b + sp_params)}


def tp_sp_activation_saving(cfg: Config, norm_saved_per_token: int | None = None) -> int:
    """Bytes of tensors saved for backward that megatron_sp holds less of than megatron, per rank
    (torch explicit, measured by torch_impl.harness's saved-tensor hooks). Only the norms'
    saved tensors change: torch's composite RMSNorm x·rsqrt(mean(x²) + ε)·g saves its input x
    (B, T, D), rsqrt (B, T, 1) and the normalised x·rsqrt (B, T, D) — 2·D + 1 elements per
    token; under SP each norm runs on T/tp tokens. Everything the matmuls, attention, GELU and
    the loss save is the same (the column-parallel matmuls save their all-gathered (B, T, D)
    input, as Megatron saves the replicated one; Megatron-LM instead saves the shard and
    gathers again in backward). 2L+1 norms: (2L+1)·(2D+1)·B·T·b·(tp−1)/tp.
    ``norm_saved_per_token``: the elements one norm saves per token where a torch release fuses
    RMSNorm differently (a fused kernel saves x and rsqrt: D + 1); default 2·D + 1 (torch 2.13)."""
    n = cfg.world_size
    per_token = 2 * cfg.dim + 1 if norm_saved_per_token is None else norm_saved_per_token
    per_norm = per_token * cfg.batch * cfg.seq * cfg.bytes_per_element
    return (2 * cfg.layers + 1) * per_norm * (n - 1) // n
