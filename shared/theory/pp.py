"""Pipeline parallelism: messages, bubble, stage parameters and in-flight activations.

Papers: GPipe, Huang et al. 2019 (arXiv:1811.06965); 1F1B (PipeDream-Flush), Narayanan et al. 2021
(arXiv:2006.09503); interleaved 1F1B, Narayanan et al. 2021 (arXiv:2104.04473); zero bubble ZB-H1, Qi
et al. 2023 (arXiv:2401.10241). Quantities: point-to-point bytes and counts per rank (torch
send/recv), collective-permutes of the JAX schedules (circular, 1F1B and the tick grids), the
bubble (p−1)/(M+p−1), parameters per stage, and the micro-batches a stage holds at its peak.
"""

from __future__ import annotations

from shared.config import Config
from shared.theory.layout import Layout

# Every message is one activation (or its gradient). JAX's (circular, 1F1B, ticks) in the compute dtype,
# b = cfg.compute_bytes (its mixed runs cast every parameter: bf16); torch's (pp_p2p_bytes*) in
# cfg.bytes_per_element (under autocast the transformer's residual stream is float32, the MLP's stage
# outputs are cast to it: Stage.out_dtype). Under pure the two are the same.


def pp_p2p_bytes(cfg: Config, virtual: int = 1) -> int:
    """Pipeline, whole pipeline per step: per stage boundary and micro-batch one activation
    (B/M, D) forward and one gradient backward: 2·(S−1)·M·(B/M)·D·b = 2·(S−1)·B·D·b
    (transformer: (B/M, T, D) messages, 2·(S−1)·B·T·D·b; see pp_activation_elements).
    Interleaved, v chunks per rank: S·v − 1 boundaries between virtual stages, every one
    between ranks when S > 1: 2·(S·v − 1)·B·D·b."""
    boundaries = cfg.world_size * virtual - 1 if cfg.world_size > 1 else 0
    return 2 * boundaries * pp_activation_elements(cfg) * cfg.bytes_per_element  # torch: float32 boundaries


def pp_bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe / 1F1B idle fraction: (p − 1) / (M + p − 1)."""
    return (stages - 1) / (microbatches + stages - 1)


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
    mb_bytes = pp_activation_elements(cfg) // cfg.microbatches * cfg.compute_bytes
    return pp_circular_permute_count(cfg, style) * mb_bytes


def pp_1f1b_permute_count(cfg: Config) -> int:
    """JAX 1F1B by hand (jax_impl/parallel/pp_schedules.py), collective-permutes per step on every device: one
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
    return pp_1f1b_permute_count(cfg) * (pp_activation_elements(cfg) // cfg.microbatches * cfg.compute_bytes)


def pp_ticks_permute_count(cfg: Config, schedule: str = "1f1b", virtual: int = 1) -> int:
    """JAX's schedules by hand (jax_impl/parallel/pp_schedules.py: 1f1b, zb, interleaved), collective-permutes per
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
    mb_bytes = pp_activation_elements(cfg) // cfg.microbatches * cfg.compute_bytes
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


def in_flight(layout: Layout, stage: int) -> int:
    """Most (micro-batch, chunk)s whose activations stage ``stage`` holds at once: 1F1B min(pp − s, M)
    (warm-up pp − s − 1 forwards, then one in, one out); interleaved Megatron's warm-up
    (pp − s − 1)·2 + (v − 1)·pp chunk forwards + 1, at most v·M (= shared.schedule's simulator)."""
    p, v, m = layout.pp, layout.virtual, layout.microbatches
    return min(p - stage, m) if v == 1 else min((p - stage - 1) * 2 + (v - 1) * p + 1, v * m)


def chunk_layers(layout: Layout, layers: int, stage: int) -> list[int]:
    """Blocks in each of stage ``stage``'s v model chunks: (L + 2·trim)/(pp·v) each, less ``trim`` taken from
    the first stage's first chunks and the last stage's last ones (the embedding's and the head's own
    chunks: Llama 3 §3.3.2, Megatron's --account-for-embedding-in-pipeline-split)."""
    v = layout.virtual
    per = (layers + 2 * layout.trim) // layout.pp
    base = [per // v + (c < per % v) for c in range(v)]
    cut = layout.trim * (stage in (0, layout.pp - 1))
    order = range(v) if stage == 0 else range(v - 1, -1, -1)
    for c in order:
        take = min(cut, base[c])
        base[c] -= take
        cut -= take
    return base


def peak_blocks(layout: Layout, layers: int, stage: int) -> float:
    """Most blocks whose activations stage ``stage`` holds at once: in_flight × the chunk's blocks, or, where
    the chunks of an interleaved stage differ (trim), the largest sum over the (micro-batch, chunk)s alive
    along Megatron's order on that rank (shared.schedule: from each F until its B)."""
    chunks = chunk_layers(layout, layers, stage)
    if layout.virtual == 1 or len(set(chunks)) == 1 or layout.microbatches % layout.pp:
        return in_flight(layout, stage) * sum(chunks) / layout.virtual
    from shared.schedule import order

    alive = peak = 0
    for op in order("interleaved", layout.pp, layout.microbatches, layout.virtual)[stage]:
        alive += chunks[op.chunk] * ((op.kind == "F") - (op.kind == "B"))
        peak = max(peak, alive)
    return peak
