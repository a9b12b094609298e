"""N-D layouts (dp/fsdp × pp × cp × tp on one device mesh): bytes per mesh axis and state per rank.

Papers: Megatron-LM's 3-D parallelism, Narayanan et al. 2021 (arXiv:2104.04473); torchtitan's
composition (Liang et al. 2024, arXiv:2410.06511: FSDP2 × TP × PP on one DeviceMesh). Quantities:
a rank's mesh coordinates, the gradient group, micro-batch shapes, parameters per stage, and per
mesh axis per op (count, bytes) of one step for the torch styles (per rank) and the JAX styles (one
SPMD program); state per rank. Built from the 1-D patterns' formulas.
"""

from __future__ import annotations

from shared.config import Config
from shared.theory.pp import pp_state_bytes

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
