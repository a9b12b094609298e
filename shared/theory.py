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
    (B/M, D) forward and one gradient backward: 2·(S−1)·M·(B/M)·D·b = 2·(S−1)·B·D·b
    (transformer: (B/M, T, D) messages, 2·(S−1)·B·T·D·b; see pp_activation_elements)."""
    return 2 * (cfg.world_size - 1) * pp_activation_elements(cfg) * cfg.bytes_per_element


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
    s is first: ((s < S−1) + (s > 0))·B·D·b (transformer: (B/M, T, D) messages, B·T·D·b).
    Summed over ranks: pp_p2p_bytes."""
    s, last = rank, cfg.world_size - 1
    return ((s < last) + (s > 0)) * pp_activation_elements(cfg) * cfg.bytes_per_element


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
    message (B/M, D): count·(B/M)·D·b (shard_map: 2·(M + S − 2)·(B/M)·D·b); transformer
    messages are (B/M, T, D)."""
    mb_bytes = pp_activation_elements(cfg) // cfg.microbatches * cfg.bytes_per_element
    return pp_circular_permute_count(cfg, style) * mb_bytes


def pp_peak_activations(schedule: str, stages: int, microbatches: int, rank: int) -> int:
    """Micro-batches whose activations stage ``rank`` holds at once: GPipe M; 1F1B min(M, S − s)."""
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
