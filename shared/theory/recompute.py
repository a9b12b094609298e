"""Activation memory and recomputation: elements saved for backward, and the extra forward FLOPs.

Papers: Chen et al. 2016 (arXiv:1604.06174, gradient checkpointing); Korthikanti et al. 2022
(arXiv:2205.05198, §4: activation memory per layer, selective recomputation). Quantities: elements
saved per token of one block under none / selective / full recomputation (flash or math attention),
activation bytes of a run, and the forward FLOPs recomputation adds.
"""

from __future__ import annotations

from shared.config import Config
from shared.theory.layout import Layout, Model
from shared.theory.pp import in_flight, peak_blocks

# --- activation recomputation (the transformer; Korthikanti et al. 2022, arXiv:2205.05198) ---------
# Elements saved for backward, derived op by op for torch_impl/transformer.py (torch 2.13, checked by
# torch_impl.harness.SavedTensorMeter, which counts each storage once). Per token of one block:
#   norm1, norm2  composite RMSNorm x·rsqrt(mean(x²)+ε)·g saves x, rsqrt, x·rsqrt:  2·(2D + 1)
#   W_qkv, W_up   their inputs (the norms' outputs):                             D + D
#   attention     q|k|v (views of ONE qkv storage) 3D; the core's output D (W_o's input is a view
#                 of it); SDPA on CPU runs the flash kernel (float64 too): + its log-sum-exp, H.
#                 The math backend (SDPBackend.MATH) saves copies instead, q·√s, k·√s, v (3D), the
#                 softmax H·T (Korthikanti's a·s/h term) and W_o's input, a copy (D): H·T for H.
#   GELU, W_down  GELU's input 4D, W_down's input 4D
# none = 18D + 2 + H (flash) | 18D + 2 + H·T (math). Korthikanti's 34 + 5·a·s/h bytes (fp16, per
# s·b·h) is the same walk with LayerNorm saving its input only, and dropout masks and biases this
# model lacks. selective = none without the core's own tensors (checkpoint keeps q|k|v and the
# output): 18D + 2. full = the block's input, D (while backward recomputes one block, that block's
# whole set is alive once more, inside the checkpoint, where the meter does not look).
# Outside the blocks: the token and target ids (int64) and the positions; the final norm 2D + 1, the
# head's input D, the log-softmax V per token, and the loss's scalar total weight.


def block_saved_elements(cfg: Config, policy: str, attention: str = "flash") -> int:
    """Elements one block saves for backward per token (see the table above), tensor parallelism off."""
    d, h = cfg.dim, cfg.heads
    if policy == "full":
        return d
    core = 0 if policy == "selective" else h if attention == "flash" else h * cfg.seq
    return 18 * d + 2 + core


def activation_bytes(cfg: Config, policy: str | None = None, sequences: int | None = None,
                     id_sequences: int | None = None, attention: str = "flash") -> int:
    """Peak bytes saved for backward by one forward of the whole transformer over ``sequences``
    sequences of cfg.seq tokens (default cfg.batch): L blocks, the ids, norm, head and loss. The
    ids are int64 (8 bytes whatever the dtype); ``id_sequences``: rows of the storage the token and
    target ids are views of (dp slices the global (B, T) arrays: cfg.batch). Exact for the
    single-device run, dp and fsdp's zero2 / fsdp2 (B/N sequences), cp's ring (T/N tokens: pass
    ``cfg.replace(seq=T//N)``) and each 1F1B stage (in-flight micro-batches × its blocks)."""
    policy = cfg.recompute if policy is None else policy
    n = (cfg.batch if sequences is None else sequences) * cfg.seq  # tokens
    ids = 2 * (cfg.batch if id_sequences is None else id_sequences) * cfg.seq + cfg.seq  # tokens, targets, positions
    outside = (3 * cfg.dim + 1 + cfg.vocab) * n + 1  # final norm 2D+1, head input D, log-softmax V; scalar
    blocks = cfg.layers * block_saved_elements(cfg, policy, attention) * n
    return (blocks + outside) * cfg.bytes_per_element + 8 * ids


def recompute_extra_flops(cfg: Config, policy: str | None = None, sequences: int | None = None) -> dict[str, int]:
    """Extra forward FLOPs of one step from recomputation (matmuls, 2 per multiply-add; softmax, norms
    and GELU not counted), against the step's 3× forward. Per block and sequence: the matmuls 2·T·12D²
    (W_qkv 3D², W_o D², W_up 4D², W_down 4D²), the attention core 2·2·T²·D (QKᵀ and ·V over the whole
    T×T, as JAX's written-out attention and the math backend compute it; a causal kernel that skips
    the masked half does half). full recomputes the block, selective the core."""
    policy = cfg.recompute if policy is None else policy
    s, t, d = cfg.batch if sequences is None else sequences, cfg.seq, cfg.dim
    core, block = 4 * s * t * t * d, 24 * s * t * d * d
    forward = cfg.layers * (block + core) + 2 * s * t * d * cfg.vocab  # + the head
    extra = cfg.layers * {"none": 0, "selective": core, "full": block + core}[policy]
    return {"extra": extra, "step": 3 * forward, "fraction": extra / (3 * forward)}


# --- at any size (compare.py plan): fused RMSNorm, GPU attention kernels, sequence parallelism, MoE ---


def activation_elements(model: Model, layout: Layout, policy: str, attention: str = "flash") -> float:
    """Elements saved for backward per token per block on one rank (b bytes each). Derived from what
    every op of the block saves (the Korthikanti et al. count for this model: no dropout masks, no biases):
    norm1's input D, W_qkv's input D, q, k, v 3D/t, the attention output (W_o's input) D/t; norm2's input
    D, W_up's input D, GELU's input F/t, W_down's input F/t. The norms and the matmul inputs outside the
    tp region are replicated (D each) unless sequence parallelism splits them (D/t). FlashAttention keeps
    only a log-sum-exp per head (2·H/t, fp32); math attention also the (H/t)·T softmax per token.
    MoE (tp = 1): the router's probabilities E, then per routed copy (k) its input D, GELU's input and
    W_down's input 2F, and the expert output D the gate multiplies.
    selective: the attention core (QKᵀ, softmax, ·V) is recomputed: no scores (= none under flash);
    full: only the block's input, D (D/t with sp), is kept.
    ``model.dropout`` (GPT-2/3, Megatron's GPT): the two residual dropouts' 1-byte masks (½ element each
    of a 2-byte dtype: rep in all), and with math attention the softmax dropout's mask and output
    (1.5·(H/t)·T): Korthikanti et al.'s s·b·h·(34 + 5·a·s/h) bytes exactly (FlashAttention regenerates
    its mask from the RNG state: nothing more)."""
    d, f, t = model.dim, model.ffn, layout.tp
    rep = d / t if layout.sp else d  # a replicated (B, T, D) activation
    if policy == "full":
        return rep
    # the core: flash keeps a log-sum-exp per head (fp32: 2 elements), math the (H/t)·T softmax instead;
    # selective recomputes the core and keeps neither (as shared.theory.block_saved_elements measures)
    core = 0 if policy == "selective" else 2 * model.heads / t if attention == "flash" else model.heads * model.seq / t
    if model.dropout and policy == "none" and attention == "math":
        core *= 2.5  # the softmax, its dropout's mask (1 byte) and its dropout's output
    attn = 2 * rep + (2 * d + 2 * model.kv_dim) / t + core  # q, k, v (GQA: k, v of kv_dim), the output
    attn += model.dropout * rep  # the two residual dropouts' 1-byte masks
    g = model.mlp_matrices  # GELU: its input and W_down's; SwiGLU: the gate's and up's outputs and W_down's input
    mlp = 2 * rep + (model.experts + model.topk * (2 * d + g * f) if model.moe else g * f / t)
    return attn + mlp


def activations(model: Model, layout: Layout, stage: int, batch: int, b: int, attention: str = "flash") -> int:
    """Bytes of activations on one rank of ``stage`` at its peak: min(pp − s, M) micro-batches (1F1B) of
    L/pp blocks (interleaved: Megatron's warm-up count of L/(pp·v)-block chunks; trimmed stages' chunks
    counted one by one, pp.peak_blocks) × n = m·T/cp tokens
    (m = B/(dp·M) sequences); with full recompute plus one block's whole set while it is recomputed;
    the last stage adds the micro-batch's logits n·V/t at the loss' peak: the head's output (b bytes each)
    and their fp32 softmax (4), as Megatron's fused vocab-parallel cross-entropy holds them (an unfused
    log-softmax of an fp32 upcast holds a third copy: a lower bound)."""
    m = batch // (layout.dp * layout.microbatches)
    n = m * model.seq // layout.cp
    # uneven stages (trim): the trimmed chunks hold fewer blocks, counted along the schedule (pp.peak_blocks)
    blocks = peak_blocks(layout, model.layers, stage) if layout.trim else \
        in_flight(layout, stage) * (model.layers // (layout.pp * layout.virtual))
    elems = blocks * activation_elements(model, layout, layout.recompute, attention)
    if layout.recompute == "full":
        elems += activation_elements(model, layout, "none", attention)
    logits = (stage == layout.pp - 1) * n * model.vocab // layout.tp * (4 + b)
    return int(elems * n * b) + logits
