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


def pp_p2p_bytes(cfg: Config, virtual: int = 1) -> int:
    """Pipeline, whole pipeline per step: per stage boundary and micro-batch one activation
    (B/M, D) forward and one gradient backward: 2·(S−1)·M·(B/M)·D·b = 2·(S−1)·B·D·b
    (transformer: (B/M, T, D) messages, 2·(S−1)·B·T·D·b; see pp_activation_elements).
    Interleaved, v chunks per rank: S·v − 1 boundaries between virtual stages, every one
    between ranks when S > 1: 2·(S·v − 1)·B·D·b."""
    boundaries = cfg.world_size * virtual - 1 if cfg.world_size > 1 else 0
    return 2 * boundaries * pp_activation_elements(cfg) * cfg.bytes_per_element


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


def pp_p2p_bytes_per_rank(cfg: Config, rank: int, virtual: int = 1) -> int:
    """Pipeline (torch explicit schedules), payload sent by one rank = stage s per step: M
    activations (B/M, D) to s+1 unless s is last, M activation-gradients (B/M, D) to s−1 unless
    s is first: ((s < S−1) + (s > 0))·B·D·b (transformer: (B/M, T, D) messages, B·T·D·b).
    Summed over ranks: pp_p2p_bytes. Interleaved (``virtual`` = v chunks, virtual stage c·S + s):
    pp_p2p_count_per_rank(…, v) messages of (B/M)·D·b: (2v − [s = 0] − [s = S−1])·B·D·b."""
    return pp_p2p_count_per_rank(cfg, rank, virtual) * pp_activation_elements(cfg) // cfg.microbatches \
        * cfg.bytes_per_element


def pp_p2p_count_per_rank(cfg: Config, rank: int, virtual: int = 1) -> int:
    """Sends per step of stage s (receives likewise, mirrored): ((s < S−1) + (s > 0))·M.
    Interleaved, v chunks: every chunk sends M activations on, except the last virtual stage's
    (rank S−1's chunk v−1), and M gradients back, except virtual stage 0's (rank 0's chunk 0):
    (2v − [s = 0] − [s = S−1])·M for S > 1, v× plain pipelining's in the middle; S = 1: none
    (every chunk boundary stays on the rank)."""
    s, last = rank, cfg.world_size - 1
    if last == 0:
        return 0
    return (2 * virtual - (s == last) - (s == 0)) * cfg.microbatches


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
    message (B/M, D): count·(B/M)·D·b (shard_map: 2·(M + S − 2)·(B/M)·D·b); transformer
    messages are (B/M, T, D)."""
    mb_bytes = pp_activation_elements(cfg) // cfg.microbatches * cfg.bytes_per_element
    return pp_circular_permute_count(cfg, style) * mb_bytes


def pp_1f1b_permute_count(cfg: Config) -> int:
    """JAX 1F1B by hand (jax_impl/pp_schedules.py), collective-permutes per step on every device: one
    per tick in which some device sends (F sends s → s+1, B sends s → s−1, in ONE permute whose
    pairs are the tick's senders). Unit ticks, 2·(M+S−1) in all: stage s runs F(i) at s+i for
    i < min(S−s, M), F(S−s+j) at 2S−s+2j, B(j) at 2S−1−s+2j. M = 1: the F chain then the B chain,
    2·(S−1); S = 2: stage 0's M F-ticks and stage 1's M B-ticks coincide M−2 times, M + 2;
    S ≥ 3, M ≥ 2: every tick but the last (stage 0's final B, which sends nothing): 2·(M+S−1) − 1."""
    S, M = cfg.world_size, cfg.microbatches
    if S == 1:
        return 0
    if M == 1:
        return 2 * (S - 1)
    return M + 2 if S == 2 else 2 * (M + S - 1) - 1


def pp_1f1b_permute_bytes(cfg: Config) -> int:
    """Payload per device per step of JAX's 1F1B: pp_1f1b_permute_count messages of one
    micro-batch's activation (B/M)·D·b (transformer (B/M)·T·D·b); + b for the loss all-reduce
    is counted by the caller, as for the circular pipeline."""
    return pp_1f1b_permute_count(cfg) * (pp_activation_elements(cfg) // cfg.microbatches * cfg.bytes_per_element)


def pp_ticks_permute_count(cfg: Config, schedule: str = "1f1b", virtual: int = 1) -> int:
    """JAX's schedules by hand (jax_impl/pp_schedules.py: 1f1b, zb, interleaved), collective-permutes per
    step on every device, from shared.schedule's unit-cost timeline (f = b = 1; w = 1 under zb, 0
    otherwise: every op at an integer tick): one per tick in which some op sends — F on virtual
    stage k < S·v − 1 to k+1, B on k > 0 to k−1; W never — and a second where two of the tick's
    messages go to one device (one permute delivers one message per device). 1f1b: equals
    pp_1f1b_permute_count; zb: its W ticks add none, so at most 1F1B's count plus the cool-down's
    longer tail; interleaved: v·M F's and B's per device instead of M."""
    from shared.schedule import simulate  # pure Python

    S, v = cfg.world_size, virtual
    sim = simulate(schedule, S, cfg.microbatches, v, f=1.0, b=1.0, w=1.0 if schedule == "zb" else 0.0)
    last, ticks = S * v - 1, {}  # tick -> [receiving device of each message sent then]
    for e in sim.events:
        k = e.op.chunk * S + e.rank  # virtual stage
        if (e.op.kind == "F" and k < last) or (e.op.kind == "B" and k > 0):
            ticks.setdefault(e.start, []).append((k + (1 if e.op.kind == "F" else -1)) % S)
    return sum(1 if len(set(to)) == len(to) else 2 for to in ticks.values())


def pp_ticks_permute_bytes(cfg: Config, schedule: str = "1f1b", virtual: int = 1) -> int:
    """Payload per device per step: pp_ticks_permute_count messages of one micro-batch's activation
    (B/M)·D·b (transformer (B/M)·T·D·b); the loss's all-reduce (b) is the caller's."""
    mb_bytes = pp_activation_elements(cfg) // cfg.microbatches * cfg.bytes_per_element
    return pp_ticks_permute_count(cfg, schedule, virtual) * mb_bytes


def pp_peak_activations(schedule: str, stages: int, microbatches: int, rank: int, virtual: int = 1) -> int:
    """Micro-batches whose activations stage ``rank`` holds at once: GPipe M; 1F1B min(M, S − s);
    ZB-H1 (zb, held from F until W) min(M, S) on every stage (shared.schedule.simulate agrees);
    interleaved (v chunks; (micro-batch, chunk)s of L/(S·v) blocks each): its warm-up + 1,
    min(2·(S−s−1) + (v−1)·S + 1, v·M) — at v = 1 up to 2(S−s)−1, more than 1F1B's S−s."""
    if schedule == "zb":
        return min(microbatches, stages)
    if schedule == "interleaved":  # (micro-batch, chunk)s, each 1/v of a stage's: warm-up + the steady F
        return min(2 * (stages - rank - 1) + (virtual - 1) * stages + 1, virtual * microbatches)
    return microbatches if schedule == "gpipe" else min(microbatches, stages - rank)


# --- pp (transformer) ---------------------------------------------------------------------------
# Stage s holds blocks s·L/S … (s+1)·L/S − 1; the embeddings (wte, wpe) sit on stage 0, the final
# norm and the head on stage S−1. Messages between stages are one micro-batch's activation.


def pp_activation_elements(cfg: Config) -> int:
    """Elements of the whole batch's activation at a stage boundary (M messages of 1/M each):
    MLP B·D, transformer B·T·D (the embeddings' output, the blocks' input and output)."""
    return cfg.batch * cfg.dim * (cfg.seq if cfg.model == "transformer" else 1)


def pp_stage_param_count(cfg: Config, stage: int) -> int:
    """Φ_s, parameters on stage s (torch): L/S blocks (MLP D² each; transformer 12·D² + 2·D),
    + (V + T)·D embeddings on stage 0, + D + D·V (final norm, head) on stage S−1. Σ_s Φ_s = Φ."""
    d, per, S = cfg.dim, cfg.layers // cfg.world_size, cfg.world_size
    if cfg.model == "mlp":
        return per * d * d
    ends = (stage == 0) * (cfg.vocab + cfg.seq) * d + (stage == S - 1) * (d + d * cfg.vocab)
    return per * (12 * d * d + 2 * d) + ends


def pp_spmd_param_count(cfg: Config) -> int:
    """Parameters per device in the JAX (SPMD) pipeline: every device runs the same program, so
    every device holds a slot of each stacked array: its L/S blocks, and an embedding slot
    ((V + T)·D) and a final-norm + head slot (D + D·V) that are real on stage 0 / S−1 only
    (zeros elsewhere). MLP: Φ/S, as torch."""
    d, per = cfg.dim, cfg.layers // cfg.world_size
    if cfg.model == "mlp":
        return per * d * d
    return per * (12 * d * d + 2 * d) + (cfg.vocab + cfg.seq) * d + d + d * cfg.vocab


def pp_state_bytes(param_count: int, cfg: Config) -> dict[str, int]:
    """Per-rank bytes for ``param_count`` parameters (pp_stage_param_count or
    pp_spmd_param_count): params, grads Φ_s·b each, AdamW moments 2·Φ_s·b."""
    b = cfg.bytes_per_element
    return {"params": param_count * b, "grads": param_count * b, "optimizer": 2 * param_count * b}


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
    """variant "allgather" or "megatron" (DTensor's Colwise/Rowwise plan is "megatron");
    "megatron_sp" / "dtensor_sp" (sequence parallel, transformer only): tp_sp_comm."""
    if variant == "megatron_sp":
        return tp_sp_comm(cfg)
    if variant == "dtensor_sp":  # loss_parallel: 3 all-reduces; one redistribute per SP parameter
        return tp_sp_comm(cfg, loss_all_reduces=3, param_all_reduces=2 * cfg.layers + 2)
    if cfg.model == "transformer":
        return tp_transformer_comm(cfg, loss_all_reduces=3 if variant == "dtensor" else 2)
    return tp_allgather_comm(cfg) if variant == "allgather" else tp_megatron_comm(cfg)


def tp_comm_bytes(cfg: Config, variant: str) -> int:
    """Payload S per step per rank. Wire per rank (ring): all-gather / reduce-scatter S·(N−1)/N,
    all-reduce 2·S·(N−1)/N — allgather (2L−1)·S·(N−1)/N, megatron (even L) (2L−2)·S·(N−1)/N."""
    return sum(nbytes for _, nbytes in tp_comm(cfg, variant).values())


def tp_state_bytes(cfg: Config, variant: str = "megatron") -> dict[str, float]:
    """Every weight is split tp ways: params Φ·b/N, grads Φ·b/N, AdamW moments 2·Φ·b/N per rank."""
    if cfg.model == "transformer":
        return tp_transformer_state_bytes(cfg, variant)
    phi, b, n = cfg.n_params, cfg.bytes_per_element, cfg.world_size
    return {"params": phi * b / n, "grads": phi * b / n, "optimizer": 2 * phi * b / n}


# --- tp (transformer) ---
# Megatron TP of the GPT-style decoder (torch_impl/tp.py TRANSFORMER_PLAN, jax_impl/tp.py
# TRANSFORMER_RULES): W_qkv (by heads), W_up, head column-parallel; W_o, W_down row-parallel; wte
# vocab-parallel; wpe and the norm gains replicated. Every rank sees the full batch.


def tp_transformer_comm(cfg: Config, loss_all_reduces: int = 2) -> dict[str, tuple[int, int]]:
    """Per step per rank, all all-reduces. Of A = B·T·D·b (the residual stream): per layer 2 fwd
    (g after W_o and W_down) + 2 bwd (f before W_qkv and W_up; layer 0's runs too: the embedding
    output needs a gradient for wte), the embedding's g (fwd) and the head's f (bwd): (4L+2)·A.
    The vocab-parallel cross-entropy (bwd local): max, target logit and Σexp over (B, T), 3·B·T·b
    in ``loss_all_reduces`` calls: 2 (explicit: the two sums in one (2, B, T)) or 3 (DTensor)."""
    act, rows, n_act = cfg.batch * cfg.seq * cfg.dim * cfg.bytes_per_element, cfg.batch * cfg.seq * \
        cfg.bytes_per_element, 4 * cfg.layers + 2
    return {"all_reduce": (n_act + loss_all_reduces, n_act * act + 3 * rows)}


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
# The hand-written ZeRO-2/3 (torch_impl.fsdp.FSDP / Zero2, jax_impl.fsdp shard_map) shard every
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


def fsdp_comm(cfg: Config, variant: str) -> dict[str, tuple[int, int]]:
    """op -> (count, payload bytes) per step per rank, for any model (MLP: equal to zero3_comm /
    zero2_comm; it has no vectors, so no all-reduce).
    zero3: all-gather every unit (fwd) + every fsdp_regathered unit (bwd), reduce-scatter every
           unit, 1 all-reduce of the vectors: transformer 3Φb − (V+T)·D·b − (2L+1)·D·b.
    zero2: reduce-scatter + all-gather every unit, 1 all-reduce of the vectors:
           2Φb − (2L+1)·D·b.
    fsdp2: fully_shard per block + root, one flat group each (vectors inside): every block
           gathered fwd and again bwd, 1 reduce-scatter per block; the root's group (transformer:
           wte, wpe, normf, head; MLP: empty) gathered once — the root keeps it from forward to
           backward (reshard_after_forward=False) — and reduce-scattered once: 3Φb − Φ_root·b."""
    b = cfg.bytes_per_element
    units, vectors = fsdp_units(cfg)
    out: dict[str, tuple[int, int]] = {}
    if variant in ("zero2", "zero3"):
        gathered = list(units) + (fsdp_regathered(cfg) if variant == "zero3" else [])
        out["all_gather"] = (len(gathered), sum(units[n] for n in gathered) * b)
        out["reduce_scatter"] = (len(units), sum(units.values()) * b)
        if vectors:
            out["all_reduce"] = (1, sum(vectors.values()) * b)
        return out
    if variant != "fsdp2":
        raise ValueError(f"unknown fsdp variant {variant!r}")
    d, l = cfg.dim, cfg.layers
    block = d * d if cfg.model == "mlp" else 12 * d * d + 2 * d
    root = cfg.n_params - l * block
    n_ag, n_rs = 2 * l + (root > 0), l + (root > 0)
    return {"all_gather": (n_ag, (2 * l * block + root) * b), "reduce_scatter": (n_rs, (l * block + root) * b)}


def fsdp_comm_bytes(cfg: Config, variant: str) -> int:
    return sum(nbytes for _, nbytes in fsdp_comm(cfg, variant).values())


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


def cp_comm(cfg: Config, variant: str) -> dict[str, tuple[int, int]]:
    """Per step per rank, op -> (count, payload bytes).

    ring / ring_zigzag (Liu et al. 2023): per layer, forward N−1 hops of the K|V block (one message
    of 2a); backward (memory-efficient: only the local K, V are saved) N−1 hops of K|V again, and
    N hops of the dK|dV accumulator travelling with it (the last hop brings it home): 2a each.
    So L·(3N−2) sends of 2a (JAX: collective-permutes; none on one rank). The layout does not
    change the bytes.
    ulysses (Jacobs et al. 2023): per layer 4 all-to-alls forward (q, k, v: sequence-sharded ->
    head-sharded; the output back) and their 4 transposes backward, each of buffer a.
    Plus the gradient all-reduce, Φ·b (count 1: one flat buffer or one bucket)."""
    n, l, b = cfg.world_size, cfg.layers, cfg.bytes_per_element
    a = cfg.batch * (cfg.seq // n) * cfg.dim * b
    out = {"all_reduce": (1, cfg.n_params * b)}
    if variant in ("ring", "ring_zigzag"):
        hops = l * (3 * n - 2) if n > 1 else 0
        out["send"] = (hops, hops * 2 * a)
    elif variant == "ulysses":
        out["all_to_all"] = (8 * l, 8 * l * a)
    else:
        raise ValueError(f"cp: no formula for variant {variant!r}")
    return out


def cp_comm_bytes(cfg: Config, variant: str) -> int:
    """Payload per step per rank. Wire: a send moves its message once; an all-to-all moves
    a·(N−1)/N; so ring's attention traffic is (3N−2)·2a per layer vs ulysses' 8a·(N−1)/N — ring
    grows with N at fixed a, ulysses does not (but needs H % N == 0)."""
    return sum(nbytes for _, nbytes in cp_comm(cfg, variant).values())


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


# --- tp + sp (transformer) ---
# Megatron sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, §4.2.2): the tp
# variant "megatron_sp" (torch explicit, JAX shard_map / jit) and "dtensor_sp" (torch builtin).
# Outside the matmuls (embedding output, norms, residual adds) the activations are (B, T/tp, D).


def tp_sp_comm(cfg: Config, loss_all_reduces: int = 2, param_all_reduces: int = 1) -> dict[str, tuple[int, int]]:
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
    per parameter, 2L+2; JAX: XLA's all-reduce combiner merges the transposes' psums)."""
    b, l = cfg.bytes_per_element, cfg.layers
    act, n = cfg.batch * cfg.seq * cfg.dim * b, 4 * l + 2
    sp_params = ((2 * l + 1) * cfg.dim + cfg.seq * cfg.dim) * b
    return {"all_gather": (n, n * act), "reduce_scatter": (n, n * act),
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


# --- mesh (N-D layouts: dp/fsdp × pp × cp × tp on one device mesh, the transformer) -------------
# Config.mesh lists the axes in device order (outermost first): rank r's coordinates are r's
# row-major index over the sizes. Every style composes the 1-D patterns (their sections above):
# the data axis splits the batch (rows i·B/d …), cp the sequence (contiguous T/cp, the ring), pp the
# blocks (stage s: L/pp blocks; embeddings on stage 0, final norm + head on the last), tp the
# weights (Megatron, no SP). The replicated weights' gradients are averaged over the data and cp
# axes together: one group, labelled with both names in mesh order ("dp+cp"); fsdp shards over
# that same group (torchtitan's dp_shard_cp). Axes of size 1 communicate nothing.


def mesh_coords(cfg: Config, rank: int) -> dict[str, int]:
    """{axis: index} of ``rank`` on the layout (row-major, innermost axis last)."""
    out = {}
    for name, size in reversed(cfg.mesh):
        out[name] = rank % size
        rank //= size
    return {name: out[name] for name, _ in cfg.mesh}


def mesh_grad_axes(cfg: Config) -> str | None:
    """The label of the group the gradients are averaged (dp) or sharded (fsdp) over: the data
    axis and cp, those of size > 1, in mesh order, joined by "+"; None if neither."""
    names = [a for a, n in cfg.mesh if a in ("dp", "fsdp", "cp") and n > 1]
    return "+".join(names) or None


def mesh_micro(cfg: Config) -> tuple[int, int, int]:
    """(M micro-batches per step, m sequences per micro-batch on one rank, T/cp tokens per rank)."""
    m_count = cfg.pipeline_microbatches
    return m_count, cfg.batch // (cfg.data_size * m_count), cfg.seq // cfg.axis("cp")


def mesh_stage_param_count(cfg: Config, stage: int, spmd: bool = False) -> int:
    """Parameters one rank holds before any fsdp sharding: stage ``stage``'s L/pp blocks with their
    tp-split weights (W_qkv, W_o, W_up, W_down /tp; norm gains whole), plus stage 0's embeddings
    (wte /tp, wpe whole) and the last stage's final norm and head (/tp). ``spmd`` (the JAX circular
    pipeline): every device holds the embedding and head slots (shared.theory.pp_spmd_param_count)."""
    d, t, pp = cfg.dim, cfg.axis("tp"), cfg.axis("pp")
    first, last = spmd or stage == 0, spmd or stage == pp - 1
    return (cfg.layers // pp) * (12 * d * d // t + 2 * d) + first * (cfg.vocab * d // t + cfg.seq * d) + \
        last * (d + d * cfg.vocab // t)


# --- mesh: torch styles ---------------------------------------------------------------------------
# torch_impl/mesh.py. Rank r of the layout sits at stage s = its pp coordinate (S = pp stages), holds
# the tp-local weights of that stage, and runs M micro-batches of m sequences × T/cp tokens
# ((M, m, Tc) = mesh_micro). A = m·Tc·D·b is one micro-batch's residual stream on one rank (the
# pipeline's message, and the size of every Megatron all-reduce). Labels: the mesh axis of the
# group an op ran on; the gradient group is mesh_grad_axes(cfg) (e.g. "dp+cp").


def mesh_stage_units_torch(cfg: Config, stage: int) -> tuple[dict[str, int], dict[str, int]]:
    """(units, vectors) of stage ``stage`` after tp: element counts of its ≥2-D parameters (tp-local:
    wte V·D/t and wpe T·D on stage 0; per block W_qkv 3D²/t, W_o D²/t, W_up 4D²/t, W_down 4D²/t; the
    head D·V/t on the last stage) and of its vectors (2 norm gains per block; the final norm on the
    last stage). Σ = mesh_stage_param_count(cfg, stage)."""
    d, t, pp = cfg.dim, cfg.axis("tp"), cfg.axis("pp")
    per = cfg.layers // pp
    units, vectors = {}, {}
    if stage == 0:
        units.update({"wte": cfg.vocab * d // t, "wpe": cfg.seq * d})
    for l in range(stage * per, (stage + 1) * per):
        units.update({f"blocks.{l}.attn.qkv": 3 * d * d // t, f"blocks.{l}.attn.o": d * d // t,
                      f"blocks.{l}.mlp.up": 4 * d * d // t, f"blocks.{l}.mlp.down": 4 * d * d // t})
        vectors.update({f"blocks.{l}.norm1": d, f"blocks.{l}.norm2": d})
    if stage == pp - 1:
        units["head"] = d * cfg.vocab // t
        vectors["normf"] = d
    return units, vectors


def mesh_comm_torch(cfg: Config, style: str, rank: int) -> dict[str, dict[str, tuple[int, int]]]:
    """{axis label: {op: (count, payload bytes)}} per step on world rank ``rank`` (recv listed too:
    results.comm_bytes skips it). s, S = the rank's stage and the stage count; first = [s = 0],
    last = [s = S−1]; t, c = tp, cp; (M, m, Tc) = mesh_micro(cfg); A = m·Tc·D·b; L/S blocks per stage.

    "tp" (tp > 1; tp_transformer_comm on the stage's blocks and one micro-batch, M times): per
        micro-batch Megatron's 4 all-reduces of A per block (g after W_o, W_down fwd; f before
        W_qkv, W_up bwd), the embedding's g on stage 0 (fwd), the head's f on the last stage (bwd),
        and the vocab-parallel CE on the last stage: explicit 2 all-reduces (MAX (m, Tc); SUM
        (2, m, Tc)), DTensor's loss_parallel 3, 3·m·Tc·b either way:
        M·(4·L/S + first + last + (2|3)·last) calls, M·[(4·L/S + first + last)·A + last·3·m·Tc·b].
    "cp" (cp > 1; cp_comm's ring on the stage's blocks, the tp-local heads): per micro-batch and
        block 3c−2 sends of the K|V block (or its dK|dV accumulator) 2·m·Tc·(D/t)·b; recv mirrored.
    "pp" (S > 1; pp_p2p_bytes_per_rank on the local activation): ((s < S−1) + (s > 0))·M sends of A
        (activations to s+1, their gradients to s−1); recv mirrored.
    grad group (mesh_grad_axes: the data axis and cp, size g = data·cp > 1):
        dp, or cp without a data axis (explicit): ONE all-reduce of the stage's flat gradients,
            mesh_stage_param_count(cfg, s)·b, after all micro-batches (dp_comm_bytes on the stage).
        fsdp (explicit: torch_impl.fsdp.FSDP over the group, fsdp_comm's zero3 on the tp-local
            units of mesh_stage_units_torch, PER MICRO-BATCH): every unit all-gathered fwd, every
            unit but wte/wpe again bwd (fsdp_regathered), every unit's gradient reduce-scattered
            (S = the full tp-local unit); then one all-reduce of the stage's vectors, (2·L/S + last)·D·b.
        builtin: see mesh_builtin_grad_comm_torch."""
    b, d, L = cfg.bytes_per_element, cfg.dim, cfg.layers
    coords = mesh_coords(cfg, rank)
    S, s = cfg.axis("pp"), coords.get("pp", 0)
    first, last = int(s == 0), int(s == S - 1)
    t, c = cfg.axis("tp"), cfg.axis("cp")
    M, m, tc = mesh_micro(cfg)
    act, per = m * tc * d * b, L // S
    out: dict[str, dict[str, tuple[int, int]]] = {}
    if t > 1:
        loss_calls = 3 if style == "builtin" else 2
        n_act = 4 * per + first + last
        out["tp"] = {"all_reduce": (M * (n_act + loss_calls * last), M * (n_act * act + last * 3 * m * tc * b))}
    if c > 1:
        hops = M * per * (3 * c - 2)
        msg = 2 * m * tc * (d // t) * b
        out["cp"] = {"send": (hops, hops * msg), "recv": (hops, hops * msg)}
    if S > 1:
        n = ((s < S - 1) + (s > 0)) * M
        out["pp"] = {"send": (n, n * act), "recv": (n, n * act)}
    label = mesh_grad_axes(cfg)
    if label is not None:
        if style == "builtin":
            grad = mesh_builtin_grad_comm_torch(cfg, s)
        elif cfg.data_axis == "fsdp":
            units, vectors = mesh_stage_units_torch(cfg, s)
            regathered = [k for k in units if k not in ("wte", "wpe")]
            grad = {"all_gather": (M * (len(units) + len(regathered)),
                                         M * (sum(units.values()) + sum(units[k] for k in regathered)) * b),
                          "reduce_scatter": (M * len(units), M * sum(units.values()) * b),
                          "all_reduce": (1, sum(vectors.values()) * b)}
        else:
            grad = {"all_reduce": (1, mesh_stage_param_count(cfg, s) * b)}
        out.setdefault(label, {}).update(grad)  # cp alone: its ring's sends and the gradients' all-reduce
    return out


def fsdp2_pipeline_gathers(microbatches: int, stages: int, stage: int) -> int:
    """All-gathers of one FSDP2 block group per step under torch.distributed.pipelining's
    Schedule1F1B. The stage runs F^w (B F)^(M−w) B^w, w = min(S − s, M) (1F1B). A forward that finds
    the block sharded gathers it and reshards after (reshard_after_forward); a backward that finds
    it sharded gathers it and, as the pipeline sets reshard_after_backward=False for every
    micro-batch, keeps it unsharded until the step's reduce (PipelineStage.perform_reduce_grad).
    Without a pipeline (S = 1, M = 1): F, B: 2 (fsdp_comm's fsdp2)."""
    w = min(stages - stage, microbatches)
    sharded, gathers = True, 0
    for action in "F" * w + "BF" * (microbatches - w) + "B" * w:
        gathers += sharded
        sharded = action == "F"
    return gathers


def mesh_builtin_grad_comm_torch(cfg: Config, stage: int) -> dict[str, tuple[int, int]]:
    """The gradient group's ops of the builtin style on stage ``stage`` (tp-local sizes):
    dp: DistributedDataParallel on the dp group: one bucket (Φ_s·b ≤ 25 MB here) all-reduced once per
        step (the pipeline runs the non-last micro-batches under no_sync); DDP's one-off bucket
        rebuild (2 broadcasts of the bucket indices, in the second step's forward) is warm-up: the
        ledger records a later step.
    dp with tp > 1: FSDP2 HSDP on the (dp, dp_shard = 1) mesh, fully_shard per block + the stage as
        root (torch_impl.mesh.hsdp_dp): the shard group has one rank, so FSDP2 issues no all-gather
        and no reduce-scatter; each group's (whole tp-local) gradient is all-reduced over dp once per
        step (after the last micro-batch): L/S + [root has parameters] calls, Φ_s·b bytes in all.
    fsdp: FSDP2 fully_shard per block + the stage as root (fsdp_comm's fsdp2 on the stage, one flat
        group per block, gains inside): every block gathered fsdp2_pipeline_gathers(M, S, s) times,
        the root's group (its embeddings / final norm + head, when the stage has any) once (the root
        is not resharded), and each group reduce-scattered once per step (gradients accumulate
        unsharded over micro-batches: requires_gradient_sync only for the step's reduce)."""
    b, d, S = cfg.bytes_per_element, cfg.dim, cfg.axis("pp")
    total = mesh_stage_param_count(cfg, stage)
    per, block = cfg.layers // S, 12 * d * d // cfg.axis("tp") + 2 * d
    root = total - per * block
    if cfg.data_axis != "fsdp":
        return {"all_reduce": (1 if cfg.axis("tp") == 1 else per + (root > 0), total * b)}
    g = fsdp2_pipeline_gathers(cfg.pipeline_microbatches, S, stage)
    return {"all_gather": (per * g + (root > 0), (per * g * block + root) * b),
            "reduce_scatter": (per + (root > 0), total * b)}


def mesh_comm_bytes_torch(cfg: Config, style: str, rank: int) -> int:
    """The rank's payload per step: every op's bytes but recv (results.comm_bytes' rule)."""
    return sum(nbytes for ops in mesh_comm_torch(cfg, style, rank).values()
               for op, (_, nbytes) in ops.items() if op != "recv")


def mesh_state_bytes_torch(cfg: Config, style: str, rank: int) -> dict[str, int]:
    """Per-rank bytes of params, grads and AdamW moments: the stage's tp-local parameters
    P_s = mesh_stage_param_count(cfg, s) (pp_state_bytes); under fsdp the units are split over the
    gradient group (g = fsdp·cp ranks): explicit (fsdp_state_bytes' zero3) units/g + vectors whole;
    builtin (FSDP2 shards the vectors too) P_s/g. builtin without fsdp: DTensor keeps wte's gradient
    Replicate on stage 0, + V·D·b·(t−1)/t of grads (not under dp's HSDP: FSDP2 reduces it to the
    parameter's tp placement)."""
    b, s, t = cfg.bytes_per_element, mesh_coords(cfg, rank).get("pp", 0), cfg.axis("tp")
    if cfg.data_axis != "fsdp":
        out = pp_state_bytes(mesh_stage_param_count(cfg, s), cfg)
        if style == "builtin" and s == 0 and cfg.axis("dp") == 1:  # wte's grad Replicate (tp_transformer_state_bytes)
            out["grads"] += cfg.vocab * cfg.dim * b * (t - 1) // t
        return out
    g = cfg.data_size * cfg.axis("cp")
    units, vectors = mesh_stage_units_torch(cfg, s)
    if style == "builtin":
        held = mesh_stage_param_count(cfg, s) // g
    else:
        held = sum(units.values()) // g + sum(vectors.values())
    return {"params": held * b, "grads": held * b, "optimizer": 2 * held * b}


# --- mesh: JAX styles -----------------------------------------------------------------------------
# jax_impl/mesh.py: ONE SPMD program over the whole mesh, so every device runs the same collectives
# (the per-device view; bubble iterations and stage slots included).


def mesh_units_jax(cfg: Config) -> tuple[dict[str, int], dict[str, int]]:
    """(units, vectors) one device holds before fsdp: element counts of its tp-local ≥2-D arrays per
    block (L/S of them: W_qkv 3D²/t, W_o D²/t, W_up 4D²/t, W_down 4D²/t), and of the stage slots every
    device holds in the SPMD pipeline (wte V·D/t, wpe T·D, head D·V/t; real on stage 0 / S−1);
    vectors: 2 norm gains per block and the final norm. Σ = mesh_stage_param_count(cfg, s, spmd=True)."""
    d, t, per = cfg.dim, cfg.axis("tp"), cfg.layers // cfg.axis("pp")
    units = {"wte": cfg.vocab * d // t, "wpe": cfg.seq * d, "head": d * cfg.vocab // t}
    for l in range(per):
        units.update({f"{l}.qkv": 3 * d * d // t, f"{l}.o": d * d // t, f"{l}.up": 4 * d * d // t,
                      f"{l}.down": 4 * d * d // t})
    vectors = {f"{l}.norm{k}": d for l in range(per) for k in (1, 2)} | {"normf": d}
    return units, vectors


def mesh_comm_jax(cfg: Config, style: str) -> dict[str, dict[str, tuple[int, int]]] | None:
    """{axis label: {op: (count, payload bytes)}} per step on every device (one SPMD program: the same
    collectives everywhere). S, t, c = pp, tp, cp; (M, m, Tc) = mesh_micro(cfg); A = m·Tc·D·b one
    micro-batch's residual stream on one device; I = M + S − 1 pipeline iterations (1 without pp):
    the circular pipeline runs every block I times on every device, bubbles included (pp section).

    shard_map (jax_impl/mesh.py):
    "tp" (t > 1; tp_transformer_comm per iteration): all-reduces — per block and iteration Megatron's
        2 g (fwd) + 2 f transposes (bwd) of A; the embedding's g and the head's f once over all M
        micro-batches (M·A each: the SPMD pipeline embeds and heads every micro-batch at once); the
        vocab-parallel CE's pmax and (2, …) psum, 3·M·m·Tc·b: 4·(L/S)·I + 4 calls,
        (4·(L/S)·I + 2M)·A + 3·M·m·Tc·b bytes (S = 1: exactly tp_transformer_comm on the local batch).
    "cp" (c > 1; cp_comm's ring per iteration, the tp-local heads): (L/S)·I·(3c − 2) collective-permutes
        of the K|V block (or dK|dV), 2·m·Tc·(D/t)·b.
    "pp" (S > 1; pp_circular_permute_count): 2·(M + S − 2) collective-permutes of A, and the scalar
        loss's all-reduce (b) that puts the last stage's loss on every stage.
    gradient group (mesh_grad_axes: data and cp together, size > 1):
        dp / cp: one all-reduce of every array this device holds (each replicated array is cast to
            varying once, so the transpose sums it once): mesh_stage_param_count(cfg, s, spmd=True)·b;
            count 1 = XLA's all-reduce combiner's (it merged all of them at these sizes).
        fsdp (fsdp_comm's zero3 on mesh_units_jax, ONCE per step: gathered before the pipeline, not
            per micro-batch): an all-gather of every unit (fwd) and of every unit but wte / wpe (bwd
            re-gather), a reduce-scatter of every unit, S = the tp-local unit; the vectors' gradients
            in one all-reduce ((2·L/S + 1)·D·b; count: XLA's combiner).

    jit (XLA's choice, measured; the layouts without cp and fsdp — dp / tp / pp and their products):
    "tp" as shard_map, bytes and count (the one-hot embedding's and the CE's reductions: the target
        logit's all-reduce is combined into a backward one, so the count is the combiner's too).
    "pp" 3·(M + S − 2) permutes of A (pp_circular_permute_count's jit: each roll's transpose is two
        permutes) and the scalar loss's all-reduce.
    "dp" the gradients' all-reduce is issued per dot, not per array: every block weight's and norm's
        gradient once per pipeline iteration (I·(L/S) blocks' arrays; XLA on CPU does not reassociate
        the sum of all-reduces), the slots (wte, wpe, head, final norm) once, + the global mean's
        scalar b; count 1 here, but XLA's combiner decides it (1 or 2 seen; the test checks bytes).
    With cp (XLA all-gathers K|V over "cp" and reduces the gradients over cp, then dp, in two groups)
    or fsdp (XLA keeps the gathered weights for backward, all-reduces instead of reduce-scattering,
    never gathers wte): None — the test checks parity and that the per-axis ledger sums to the total."""
    b, d, L = cfg.bytes_per_element, cfg.dim, cfg.layers
    S, t, c = cfg.axis("pp"), cfg.axis("tp"), cfg.axis("cp")
    if style != "shard_map" and (c > 1 or cfg.data_axis == "fsdp"):
        return None
    M, m, tc = mesh_micro(cfg)
    act, per, iters = m * tc * d * b, L // S, (M + S - 1 if S > 1 else 1)
    out: dict[str, dict[str, tuple[int, int]]] = {}
    if t > 1:
        out["tp"] = {"all_reduce": (4 * per * iters + 4, (4 * per * iters + 2 * M) * act + 3 * M * m * tc * b)}
    if style == "jit":
        if S > 1:
            shifts = 3 * (M + S - 2)
            out["pp"] = {"all_reduce": (1, b), "collective_permute": (shifts, shifts * act)}
        if cfg.data_axis is not None:
            units, vectors = mesh_units_jax(cfg)
            slots = units["wte"] + units["wpe"] + units["head"] + vectors["normf"]
            blocks = sum(units.values()) + sum(vectors.values()) - slots
            out[cfg.data_axis] = {"all_reduce": (1, (iters * blocks + slots + 1) * b)}
        return out
    if c > 1:
        hops = per * iters * (3 * c - 2)
        out["cp"] = {"collective_permute": (hops, hops * 2 * m * tc * (d // t) * b)}
    if S > 1:
        shifts = 2 * (M + S - 2)
        out["pp"] = {"all_reduce": (1, b), "collective_permute": (shifts, shifts * act)}
    label = mesh_grad_axes(cfg)
    if label is not None:
        if cfg.data_axis == "fsdp":
            units, vectors = mesh_units_jax(cfg)
            regathered = [k for k in units if k not in ("wte", "wpe")]
            grad = {"all_gather": (len(units) + len(regathered),
                                   (sum(units.values()) + sum(units[k] for k in regathered)) * b),
                    "reduce_scatter": (len(units), sum(units.values()) * b),
                    "all_reduce": (1, sum(vectors.values()) * b)}
        else:
            grad = {"all_reduce": (1, mesh_stage_param_count(cfg, 0, spmd=True) * b)}
        out.setdefault(label, {}).update(grad)  # "cp" alone: the ring's permutes and the gradients' all-reduce
    return out


def mesh_state_bytes_jax(cfg: Config, style: str) -> dict[str, int]:
    """Per device (every device alike: SPMD): params, grads P·b each, AdamW moments 2·P·b, with
    P = mesh_stage_param_count(cfg, s, spmd=True) (the stage slots included), or under fsdp the units
    split over the fsdp(+cp) group (g = fsdp·cp devices) and the vectors whole: units/g + vectors
    (fsdp_state_bytes' zero3). The same in both styles (jit places the arrays by the same rules)."""
    b = cfg.bytes_per_element
    if cfg.data_axis != "fsdp":
        held = mesh_stage_param_count(cfg, 0, spmd=True)
    else:
        units, vectors = mesh_units_jax(cfg)
        held = sum(units.values()) // (cfg.data_size * cfg.axis("cp")) + sum(vectors.values())
    return {"params": held * b, "grads": held * b, "optimizer": 2 * held * b}


# --- ep (expert parallelism, the MoE transformer) ----------------------------------------------
# E experts per MoE layer sharded over N = ep ranks: rank r owns experts [r·E/N, (r+1)·E/N) whole
# and routes B/N of the sequences (EP inside DP, as GShard and DeepSpeed-MoE lay it out): n = B·T/N
# tokens, k·n assignments per rank per layer. The traffic depends on the data: it is a function of
# the routing, which every run reports as ``extra["expert_load"]`` — (steps, L, B, E) counts:
# load[s][l][b][e] = tokens of sequence b that layer l sends to expert e at step s (each token
# counts once for each of its k experts, so every row sums to k·T). The formulas below take one
# step's (L, B, E) slice; pure Python, so nested lists and NumPy arrays both work.


def ep_experts_of(cfg: Config, rank: int) -> range:
    """The experts rank ``rank`` owns."""
    per = cfg.experts // cfg.world_size
    return range(rank * per, (rank + 1) * per)


def ep_owner(cfg: Config, expert: int) -> int:
    return expert // (cfg.experts // cfg.world_size)


def ep_matrix(cfg: Config, load_layer) -> list[list[int]]:
    """C[src][e]: assignments from rank src's tokens (sequences [src·B/N, (src+1)·B/N)) to expert e,
    for one layer: the matrix the counts exchange hands every rank."""
    rows = cfg.batch // cfg.world_size
    return [[sum(int(load_layer[b][e]) for b in range(src * rows, (src + 1) * rows)) for e in range(cfg.experts)]
            for src in range(cfg.world_size)]


def ep_rows(cfg: Config, load_layer, rank: int) -> tuple[int, int]:
    """(sent, received) token rows of rank ``rank``'s dispatch all-to-all in one layer (its own
    share included): sent = k·n always (dropless); received = Σ_src Σ_{e owned} C[src][e]."""
    c = ep_matrix(cfg, load_layer)
    mine = ep_experts_of(cfg, rank)
    return sum(c[rank]), sum(c[src][e] for src in range(cfg.world_size) for e in mine)


def ep_split_sizes(cfg: Config, load_layer, rank: int) -> tuple[list[int], list[int]]:
    """(input_split_sizes, output_split_sizes) of rank ``rank``'s dispatch ``all_to_all_single``:
    rows to each destination (its experts' assignments from my tokens), rows from each source."""
    c = ep_matrix(cfg, load_layer)
    n = cfg.world_size
    send = [sum(c[rank][e] for e in ep_experts_of(cfg, dst)) for dst in range(n)]
    recv = [sum(c[src][e] for e in ep_experts_of(cfg, rank)) for src in range(n)]
    return send, recv


def ep_load(cfg: Config, load_layer) -> dict[str, list[int]]:
    """One layer's load: assignments per expert (global), tokens each rank computes (received rows)."""
    c = ep_matrix(cfg, load_layer)
    per_expert = [sum(c[src][e] for src in range(cfg.world_size)) for e in range(cfg.experts)]
    per_rank = [sum(per_expert[e] for e in ep_experts_of(cfg, r)) for r in range(cfg.world_size)]
    return {"per_expert": per_expert, "per_rank": per_rank}


def ep_capacity(cfg: Config) -> int:
    """Rows of a static-shape (padded) buffer per (source rank, expert) that can never drop a token:
    every one of the n local tokens may pick the same expert (at most once: its k experts differ)."""
    return cfg.batch // cfg.world_size * cfg.seq


def ep_padding(cfg: Config, load) -> dict[str, float]:
    """Waste of the static-shape styles (capacity-padded all-to-alls, GShard's einsums) over one
    step's (L, B, E) load. Their buffer is E·C rows per rank per all-to-all (C = ep_capacity);
    k·n of them carry a token on the way out, whatever the routing: the padded all-to-alls move
    E/k times the rows a dropless one does (``sent_waste`` = 1 − k/E). ``max_received_rows``: the
    busiest rank's real rows in any layer (what a tighter, routing-aware capacity would need)."""
    n = cfg.batch // cfg.world_size * cfg.seq
    rows = cfg.experts * ep_capacity(cfg)
    busiest = max((ep_rows(cfg, layer, r)[1] for layer in load for r in range(cfg.world_size)), default=0)
    return {"buffer_rows": rows, "useful_rows": cfg.topk * n, "sent_waste": 1 - cfg.topk * n / rows,
            "max_received_rows": busiest}


def ep_replicated_params(cfg: Config) -> int:
    """Parameters every ep rank holds whole (embeddings, attention, norms, routers, head): their
    gradients are averaged over ep (one all-reduce); the experts' are not communicated."""
    return cfg.n_params - cfg.expert_params


# --- ep: torch styles ----------------------------------------------------------------------------
# torch explicit / builtin (torch_impl/ep.py), per MoE layer l and step, on rank r (n = B·T/N tokens,
# k·n assignments; sent_l = k·n, received_l = Σ_src Σ_{e of r} C_l[src][e], from ep_rows):
#   forward   all_gather of the (E,) int64 counts -> C (N, E)          N·E·8 bytes (the output)
#             dispatch all_to_all_single, input (sent_l, D)            sent_l·D·b
#             combine  all_to_all_single, input (received_l, D)       received_l·D·b
#   backward  combine's reverse: input dL/d(combined rows) (sent_l, D) sent_l·D·b
#             dispatch's reverse: input dL/d(received rows)           received_l·D·b
# then ONE all-reduce of the replicated gradients (ep_replicated_params·b); the experts' gradients
# stay where they are (scaled by 1/N). all-to-all bytes are the input buffer (nccl-tests' S).


def ep_comm_torch(cfg: Config, style: str, load_last_step, rank: int) -> dict[str, tuple[int, int]]:
    """{op: (count, bytes)} of one step on rank ``rank`` for torch's explicit and builtin styles
    (the same collectives: builtin swaps the hand-written Function for the functional one), from
    that step's (L, B, E) load."""
    if style not in ("explicit", "builtin"):
        raise ValueError(f"ep: no torch theory for style {style!r}")
    b, d, L = cfg.bytes_per_element, cfg.dim, cfg.layers
    rows = sum(sum(ep_rows(cfg, load_last_step[l], rank)) for l in range(L))  # Σ_l sent_l + received_l
    return {"all_gather": (L, L * cfg.world_size * cfg.experts * 8),
            "all_to_all": (4 * L, 2 * rows * d * b),
            "all_reduce": (1, ep_replicated_params(cfg) * b)}


def ep_comm_bytes_torch(cfg: Config, style: str, load_last_step, rank: int) -> int:
    return sum(nbytes for _, nbytes in ep_comm_torch(cfg, style, load_last_step, rank).values())


def ep_state_bytes_torch(cfg: Config) -> dict[str, int]:
    """Per rank: the replicated parameters whole + E/N experts of every layer; gradients the same;
    AdamW two moments of each."""
    held = (ep_replicated_params(cfg) + cfg.expert_params // cfg.world_size) * cfg.bytes_per_element
    return {"params": held, "grads": held, "optimizer": 2 * held}


# --- ep: JAX styles -----------------------------------------------------------------------------
# shard_map/capacity (jax_impl/ep.py): per MoE layer a psum of the (E,) int64 counts (the global f
# of the balancing loss; the split sizes are static), then all-to-alls of the capacity-padded
# (N, E/N, C, D) buffer, E·C·D·b with C = ep_capacity(cfg) = n, whatever the routing: dispatch and
# combine forward, their transposes backward: 4·L of them. Then the replicated gradients' all-
# reduce, ep_replicated_params·b (XLA's all-reduce combiner decides how many ops carry it, and may
# fold the counts' psums into them: compare the all-reduce BYTES, the all-to-all counts).


def ep_comm_jax(cfg: Config, style: str, load_last_step=None) -> dict[str, tuple[int | None, int]] | None:
    """{op: (count, bytes)} of one step per device; count None where XLA's combiner sets it.
    capacity: routing-independent (static buffers). gshard: None (XLA's choice, see
    jax_impl.ep.gshard_comm)."""
    if style == "jit":
        return None
    if style != "shard_map":
        raise ValueError(f"ep: no JAX theory for style {style!r}")
    b, L = cfg.bytes_per_element, cfg.layers
    buffer = cfg.experts * ep_capacity(cfg) * cfg.dim * b  # (N, E/N, C, D)
    return {"all_to_all": (4 * L, 4 * L * buffer),
            "all_reduce": (None, L * cfg.experts * 8 + ep_replicated_params(cfg) * b)}


def ep_state_bytes_jax(cfg: Config, style: str) -> dict[str, int]:
    """Per device (both styles): the replicated parameters whole + E/N experts per layer; gradients
    the same; AdamW's two moments of each (sharded like the parameters)."""
    held = (ep_replicated_params(cfg) + cfg.expert_params // cfg.world_size) * cfg.bytes_per_element
    return {"params": held, "grads": held, "optimizer": 2 * held}


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
