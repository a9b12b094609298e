"""N-D layouts (dp/fsdp × pp × cp × tp on one device mesh): bytes per mesh axis and state per rank.

Papers: Megatron-LM's 3-D parallelism, Narayanan et al. 2021 (arXiv:2104.04473); torchtitan's
composition (Liang et al. 2024, arXiv:2410.06511: FSDP2 × TP × PP on one DeviceMesh). Quantities:
a rank's mesh coordinates, the gradient group, micro-batch shapes, parameters per stage, and per
mesh axis per op (count, bytes) of one step for the torch styles (per rank) and the JAX styles (one
SPMD program); state per rank. Built from the 1-D patterns' formulas.
"""

from __future__ import annotations

from shared.config import Config
from shared.theory.dp import zero_state
from shared.theory.layout import Layout, Model

# --- mesh (N-D layouts: dp/fsdp × pp × cp × tp on one device mesh, the transformer) -------------
# Config.mesh lists the axes in device order (outermost first): rank r's coordinates are r's
# row-major index over the sizes. Every style composes the 1-D patterns (their sections above):
# the data axis splits the batch (rows i·B/d …), cp the sequence (contiguous T/cp, the ring), pp the
# blocks (stage s: L/pp blocks; embeddings on stage 0, final norm + head on the last), tp the
# weights (Megatron, no SP). The replicated weights' gradients are averaged over the data and cp
# axes together: one group, labelled with both names in mesh order ("dp+cp"); fsdp shards over
# that same group (torchtitan's dp_shard_cp; JAX's shard_map rows, jax_impl.parallel.compose, over
# fsdp alone: their theory is Composed.comm_theory). Axes of size 1 communicate nothing.


def mesh_coords(cfg: Config, rank: int) -> dict[str, int]:
    """{axis: index} of ``rank`` on the layout (row-major, innermost axis last)."""
    out = {}
    for name, size in reversed(cfg.mesh):
        out[name] = rank % size
        rank //= size
    return {name: out[name] for name, _ in cfg.mesh}


def mesh_grad_axes(cfg: Config) -> str | None:
    """The label of the group the gradients are averaged (dp) or sharded (fsdp) over: the data
    axis and cp, those of size > 1, in mesh order, joined by "+"; None if neither. HSDP: fsdp (+cp),
    the shard group (dp, the replicas, all-reduces the shards: its own group, "dp")."""
    data = ("fsdp",) if cfg.replicate > 1 else ("dp", "fsdp")
    names = [a for a, n in cfg.mesh if a in data + ("cp",) and n > 1]
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
# torch_impl/mesh.py, and compare.py plan at any size (Model, Layout: shared/theory/layout.py;
# ZeRO-1/2, sequence parallelism, MoE, mixed precision beyond the runs). Rank r of the layout sits
# at stage s = its pp coordinate (S = pp stages), holds the tp-local weights of that stage, and runs
# M micro-batches of m sequences × T/cp tokens ((M, m, Tc) = mesh_micro). A = m·Tc·D·b is one
# micro-batch's residual stream on one rank (the pipeline's message, and the size of every Megatron
# all-reduce). Labels: the mesh axis of the group an op ran on; the gradient group is
# mesh_grad_axes(cfg) (e.g. "dp+cp").


def stage_params(model: Model, layout: Layout, stage: int) -> dict[str, int]:
    """Elements on one rank of stage ``stage`` before any ZeRO sharding: "units" (≥2-D: wte V·D/t and wpe
    T·D on stage 0, L/pp blocks, the head D·V/t on the last), "n_units", "regathered" (units but the
    embeddings: what ZeRO-3 gathers again for backward), "vectors" (norm gains), "experts" (inside units)
    and "block" (one block with its gains). theory.mesh_stage_units_torch / mesh_stage_param_count."""
    d, t, per = model.dim, layout.tp, layout.stage_layers(model.layers, stage)
    first, last = stage == 0, stage == layout.pp - 1
    n_block, block = model.block_units(t, layout.ep)
    embed = first * (model.vocab * d // t + model.positions * d)
    head = last and not (model.tied and first)  # tied: one matrix when the stage holds both (a copy if pp > 1)
    units = per * block + embed + head * (d * model.vocab // t)
    return {"units": units, "n_units": per * n_block + 2 * first + head, "regathered": units - embed,
            "n_regathered": per * n_block + head,
            "vectors": per * model.vector_elements(t) + last * d * (1 + model.bias),
            "experts": per * model.expert_elements(layout.ep), "block": block + model.vector_elements(t),
            "per": per}


def state(model: Model, layout: Layout, stage: int, b: int, style: str = "builtin",
          precision: str = "pure") -> dict[str, int]:
    """Bytes of params, grads and optimizer on one rank of ``stage`` (theory.mesh_state_bytes_torch,
    ep_state_bytes_torch; ZeRO-1/2 and mixed precision beyond them). g = dp·cp ranks share the ZeRO
    shards (experts: dp·cp/ep). pure: b, b, 2b per element; mixed: 2, 2, 12 (bf16 + fp32 master, m, v)."""
    sp = stage_params(model, layout, stage)
    total = sp["units"] + sp["vectors"]
    g = layout.dp // layout.replicate * layout.cp  # HSDP: the shard group only
    if layout.zero == 3:
        held = total // g if style == "builtin" else sp["units"] // g + sp["vectors"]
        return zero_state(held, 1, 0, precision, b)
    experts = sp["experts"]
    sharded = (total - experts) // g + experts // max(g // layout.ep, 1)  # ZeRO-1/2: experts over edp
    out = zero_state(total, total / sharded if sharded else 1, layout.zero, precision, b)
    out = {k: int(round(v)) for k, v in out.items()}
    if style == "builtin" and stage == 0 and layout.dp == 1 and precision == "pure":
        out["grads"] += model.vocab * model.dim * b * (layout.tp - 1) // layout.tp  # DTensor keeps wte's grad whole
    return out


def comm(model: Model, layout: Layout, stage: int, batch: int, b: int,
         style: str = "builtin", low: int | None = None) -> dict[str, dict[str, tuple[int, int]]]:
    """{axis label: {op: (count, payload bytes)}} per step on one rank of ``stage`` (recv listed, as the
    ledgers; theory.mesh_comm_torch, ep_comm_torch under balanced routing). M micro-batches of
    m = B/(dp·M) sequences × Tc = T/cp tokens; A = m·Tc·D·b.
    tp: per micro-batch Megatron's 4 all-reduces of A per block, the embedding's and the head's, and the
        vocab-parallel loss' 3·m·Tc·b (2 calls explicit, 3 DTensor); with sp each all-reduce becomes an
        all-gather + a reduce-scatter of A, and the sequence-split gains' and wpe's gradients are
        all-reduced once (theory.tp_sp_comm).
    cp: the ring, 3·cp − 2 sends of K|V (2·m·Tc·D/t) per block and micro-batch.
    pp: A (A/t with sp) to the next stage and its gradient back, per micro-batch (and model chunk).
    ep: per MoE block and micro-batch an all-gather of the (E,) int64 counts from ep ranks and 4
        all-to-alls of k·n·D·b each way (dispatch, combine, their transposes; balanced routing).
    gradient group (dp·cp ranks; experts: edp = dp/ep): ZeRO-0 one all-reduce of the stage's gradients
        (DDP's one bucket; HSDP with tp: one per block + root); ZeRO-1 a reduce-scatter of the gradients
        and an all-gather of the updated parameters; ZeRO-2 the same, but the reduce-scatter runs after
        every micro-batch (the full gradient is never kept: why Megatron's distributed optimizer is ZeRO-1);
        ZeRO-3 explicit: per micro-batch every unit gathered forward, again backward (but the
        embeddings), reduce-scattered, the gains all-reduced once;
        FSDP2 (builtin): theory.mesh_builtin_grad_comm_torch.
    ``low`` (torch's autocast, mixed precision): the compute dtype's bytes of what autocast computes
    low — the 2 forward g's per block (W_o's and W_down's outputs) and the ring's K|V; the rest in b.
    The explicit FSDP wrapper casts the weights before gathering (compute_dtype): its gathers, and then
    every activation tp all-reduces (the stream is bf16 from the embedding on), travel low."""
    d, t, c, S = model.dim, layout.tp, layout.cp, layout.pp
    first, last = int(stage == 0), int(stage == S - 1)
    M = layout.microbatches
    m = batch // (layout.dp * M)
    tc = model.seq // c
    act = m * tc * d * b
    sp = stage_params(model, layout, stage)
    per = sp["per"]
    out: dict[str, dict[str, tuple[int, int]]] = {}
    if t > 1:
        loss_calls = 3 if style == "builtin" else 2
        n_act = (4 + 2 * (layout.recompute == "full")) * per + first + last  # full: the forward's 2 again
        loss = (M * loss_calls * last, M * last * 3 * m * tc * b)
        if layout.sp:
            gains = (2 * per + last) * d * (1 + model.bias) + model.bias * per * 2 * d + first * model.positions * d
            out["tp"] = {"all_gather": (M * n_act, M * n_act * act), "reduce_scatter": (M * n_act, M * n_act * act),
                         "all_reduce": (loss[0] + 1, loss[1] + gains * b)}
        else:
            # autocast: W_o's and W_down's outputs low; the explicit FSDP's bf16 gathers (compute_dtype): every one
            n_low = 0 if low is None else n_act if style == "explicit" and layout.zero == 3 else 2 * per
            g_low = n_low * m * tc * d * (b - (low or b))
            out["tp"] = {"all_reduce": (M * n_act + loss[0], M * n_act * act + loss[1] - M * g_low)}
    kv_row = 2 * max(model.kv // t, 1) * model.head_dim * (low or b)  # K|V of one token (GQA: kv heads ≥ 1 per rank)
    if c > 1 and layout.cp_style == "allgather":  # every block: K|V of the whole sequence gathered forward and
        gathers = 2 * M * per  # again for backward (not kept: T·kv memory), dK|dV reduce-scattered back
        whole = m * model.seq * kv_row
        out["cp"] = {"all_gather": (gathers, gathers * whole), "reduce_scatter": (M * per, M * per * whole)}
    elif c > 1:  # autocast: K|V travel in the compute dtype, the dK|dV accumulators (c hops) in b
        hops = M * per * (3 * c - 2)
        msg = m * tc * kv_row
        nbytes = hops * msg if low is None else M * per * m * tc * (kv_row * (2 * c - 2) + kv_row // low * b * c)
        out["cp"] = {"send": (hops, nbytes), "recv": (hops, nbytes)}
    if S > 1:  # interleaved: every chunk's output goes on, but the last virtual stage's (and back, but the first)
        n = (2 * layout.virtual - (stage == S - 1) - (stage == 0)) * M
        scatter = layout.pp_scatter and t > 1 and not layout.sp  # Narayanan et al. 2021 §4.1: each tp rank
        msg = act // t if layout.sp or scatter else act  # sends its 1/t, the receivers all-gather over tp
        out["pp"] = {"send": (n, n * msg), "recv": (n, n * msg)}
        if model.tied and (first or last):  # the embedding group: the two copies' gradients summed once
            out["pp"]["all_reduce"] = (1, model.vocab * d // t * b)
        if scatter:
            out["tp"]["all_gather"] = (n, n * act)
    if model.moe and layout.ep > 1:
        k_n = model.topk * m * tc
        out["ep"] = {"all_gather": (M * per, M * per * layout.ep * model.experts * 8),
                     "all_to_all": (4 * M * per, 4 * M * per * k_n * d * b)}
    label = layout.grad_label
    if label is not None:
        out.setdefault(label, {}).update(_grad_comm(model, layout, stage, b, style, sp, low))
    if layout.replicate > 1:  # HSDP: the shards' gradients all-reduced over the dp replicas
        g, root = layout.dp // layout.replicate * c, sp["units"] + sp["vectors"] - sp["per"] * sp["block"]
        if style == "builtin":  # FSDP2: one per group (each block, the root), its reduce-scattered shard
            out["dp"] = {"all_reduce": (sp["per"] + (root > 0), (sp["units"] + sp["vectors"]) // g * b)}
        else:  # the FSDP wrapper's shards and its whole vectors: one flat all-reduce
            out["dp"] = {"all_reduce": (1, (sp["units"] // g + sp["vectors"]) * b)}
    edp = layout.dp // layout.ep
    if model.moe and layout.ep > 1 and edp > 1 and sp["experts"]:
        op = "all_reduce" if layout.zero == 0 else None
        out["edp"] = {op: (1, sp["experts"] * b)} if op else {"reduce_scatter": (1, sp["experts"] * b),
                                                                "all_gather": (1, sp["experts"] * b)}
    return out


def _grad_comm(model: Model, layout: Layout, stage: int, b: int, style: str, sp: dict, low: int | None = None) -> dict:
    """The gradient group's ops (``comm``); ``low``: the explicit FSDP wrapper casts before its gathers
    (FSDP(compute_dtype=…), mixed precision), its reduce-scatters stay in b."""
    M, total = layout.microbatches, sp["units"] + sp["vectors"]
    dense = total - (sp["experts"] if layout.ep > 1 else 0)  # ep: the experts' gradients go over edp
    if layout.zero in (1, 2):  # ZeRO-2 keeps only its shard of the gradients: it reduces every micro-batch's
        rs = layout.microbatches if layout.zero == 2 else 1
        return {"reduce_scatter": (rs, rs * dense * b), "all_gather": (1, dense * b)}
    if layout.zero == 0:
        root = total - sp["per"] * sp["block"]
        calls = 1 if style != "builtin" or layout.tp == 1 else sp["per"] + (root > 0)
        return {"all_reduce": (calls, dense * b)}
    if style == "builtin":  # FSDP2: fully_shard per block + the stage as root
        root = total - sp["per"] * sp["block"]
        gathers = fsdp2_pipeline_gathers(M, layout.pp, stage)
        return {"all_gather": (sp["per"] * gathers + (root > 0), (sp["per"] * gathers * sp["block"] + root) * b),
                "reduce_scatter": (sp["per"] + (root > 0), total * b)}
    return {"all_gather": (M * (sp["n_units"] + sp["n_regathered"]), M * (sp["units"] + sp["regathered"]) * (low or b)),
            "reduce_scatter": (M * sp["n_units"], M * sp["units"] * b),
            "all_reduce": (1, sp["vectors"] * b)}


def comm_bytes(view: dict) -> dict[str, int]:
    """Payload bytes per axis label, a message counted once (recv skipped: results.comm_bytes' rule)."""
    return {a: sum(nb for op, (_, nb) in ops.items() if op != "recv") for a, ops in view.items()}


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


def mesh_comm_torch(cfg: Config, style: str, rank: int) -> dict[str, dict[str, tuple[int, int]]]:
    """The torch styles' ledger on world rank ``rank`` of a runnable layout: ``comm`` at the run's sizes
    (its stage = the rank's pp coordinate; every rank of a stage sends alike; --accumulate K: K·M
    micro-batches, cfg.pipeline_microbatches; --precision mixed: autocast's low outputs), and --clip's
    global norm: one all-reduce of one scalar (b) over the world ("world", or the axis / group spanning it)."""
    stage = mesh_coords(cfg, rank).get("pp", 0)
    low = cfg.compute_bytes if cfg.precision == "mixed" else None
    out = comm(Model.from_config(cfg), Layout.from_config(cfg), stage, cfg.batch, cfg.bytes_per_element, style, low)
    return _with_clip(cfg, out)


def _with_clip(cfg: Config, out: dict) -> dict:
    """--clip's global norm added to a torch view: one all-reduce of one scalar (b) over the world's default
    group ("world"), or the one axis that spans it."""
    if cfg.clip is not None:
        whole = [a for a, n in cfg.mesh if n == cfg.world_size]
        label = whole[0] if whole else "world"
        k, nb = out.setdefault(label, {}).get("all_reduce", (0, 0))
        out[label]["all_reduce"] = (k + 1, nb + cfg.bytes_per_element)
    return out


def mesh_moe_comm_torch(cfg: Config, style: str, routed_rows: int) -> dict[str, dict[str, tuple[int, int]]] | None:
    """The MoE transformer under a (dp or fsdp) × ep × tp layout, torch's ``style``, one rank: ep is an axis of its
    own (torch_impl/mesh.py ExpertsOnEp), the batch split over dp·fsdp·ep, E/ep experts per rank, whole on every tp rank
    (the MoE layers are not tp-split). Per MoE layer and micro-batch part (M = --accumulate parts): ep all-gathers
    the (E,) int64 counts from its ep ranks and moves the routed rows in 4 all-to-alls (dispatch, combine, their
    reverses: ``routed_rows`` = Σ over layers and parts of the rows this rank sends plus those it receives, from
    the counts; each way once, hence 2·rows·D·b), and dp / fsdp all-reduces the counts (the balancing loss's sums).
    tp: per part Megatron's 2 all-reduces of A = m·T·D·b per block (attention only), the embedding's and the
    head's, and the vocab-parallel loss' (2 calls explicit, 3 DTensor) of 3·m·T·b. Gradients: over dp ONE
    all-reduce of all the rank holds (its tp-local dense weights and its E/ep experts: the flat buffer, DDP's one
    bucket; builtin with tp: FSDP2 on (dp, dp_shard = 1), one per block group and the root, the experts one more),
    then ONE over ep of the dense ones (the experts differ by ep rank; builtin without dp: DTensor keeps wte's
    gradient whole). --clip: one scalar over the world. None where the formula is not held against the ledger
    yet: HSDP × ep beside tp, a dimension fsdp does not divide, --recompute, --freeze.
    fsdp: both wrappers leave the experts out (their ignored parameters): the dense units gathered and
    reduce-scattered as ``_grad_comm`` says for the dense model, the experts' gradients ONE all-reduce over fsdp
    (beside the explicit wrapper's vectors' one), and ep's all-reduce carries the rank's dense shards.
    HSDP (dp and fsdp > 1): the counts and the experts go over the (dp, fsdp) group ("dp+fsdp") instead, and dp
    all-reduces the dense shards and vectors ep does (explicit: one flat call; builtin: FSDP2, one per group)."""
    t, f, dp = cfg.axis("tp"), cfg.axis("fsdp"), cfg.axis("dp")
    rows0 = (cfg.vocab // t, cfg.seq, 3 * cfg.dim // t, cfg.dim, cfg.experts)  # every dense tensor's dim 0
    hsdp = f > 1 and dp > 1
    if cfg.freeze or not cfg.moe or cfg.recompute != "none" or (f > 1 and any(n % f for n in rows0)) or \
            (hsdp and t > 1):
        return None
    model, b = Model.from_config(cfg), cfg.bytes_per_element
    L, E, ep = cfg.layers, cfg.experts, cfg.axis("ep")
    M, m, tc = mesh_micro(cfg)
    layout = Layout(dp=f, tp=t, ep=ep, zero=3 if f > 1 else 0, microbatches=M)
    sp = stage_params(model, layout, 0)
    mine = sp["experts"]  # this rank's E/ep experts of every layer
    dense = sp["units"] + sp["vectors"] - mine  # tp-local
    held = dense  # what ep averages: the rank's dense gradients (fsdp: its shards; explicit: the vectors whole)
    if f > 1:
        n_exp = L * model.mlp_matrices  # the stacked expert tensors: not FSDP units
        units = dict(sp, units=sp["units"] - mine, regathered=sp["regathered"] - mine, n_units=sp["n_units"] - n_exp,
                     n_regathered=sp["n_regathered"] - n_exp, block=sp["block"] - mine // L, experts=0)
        held = (units["units"] // f + units["vectors"]) if style == "explicit" else dense // f
    whole_wte = style == "builtin" and t > 1 and dp == 1 and f == 1  # DTensor's wte gradient, as in ``state``
    out = {"ep": {"all_gather": (L * M, L * M * ep * E * 8),
                  "all_reduce": (1, (held + whole_wte * model.vocab * cfg.dim * (t - 1) // t) * b),
                  "all_to_all": (4 * L * M, 2 * routed_rows * cfg.dim * b)}}
    if t > 1:
        calls = 2 * L + 2 + (3 if style == "builtin" else 2)
        out["tp"] = {"all_reduce": (M * calls, M * ((2 * L + 2) * m * tc * cfg.dim * b + 3 * m * tc * b))}
    if dp > 1 and not hsdp:
        grads = L + 2 if style == "builtin" and t > 1 else 1  # FSDP2 (dp, 1): L blocks + root, + the experts
        out["dp"] = {"all_reduce": (L * M + grads, L * M * E * 8 + (dense + mine) * b)}
    if f > 1:  # the dense units as the dense model's, then the counts and the experts' all-reduce
        out["fsdp"] = _grad_comm(model, layout, 0, b, style, units)
        counts_experts = (L * M + 1, L * M * E * 8 + mine * b)
        if hsdp:  # over (dp, fsdp); dp all-reduces what ep does: the dense shards and the vectors
            out["dp+fsdp"] = {"all_reduce": counts_experts}
            out["dp"] = {"all_reduce": (1 if style == "explicit" else L + 1, held * b)}  # builtin: L blocks + root
        else:
            k, nb = out["fsdp"].get("all_reduce", (0, 0))
            out["fsdp"]["all_reduce"] = (k + counts_experts[0], nb + counts_experts[1])
    return _with_clip(cfg, out)


def mesh_comm_bytes_torch(cfg: Config, style: str, rank: int) -> int:
    """The rank's payload per step: every op's bytes but recv (results.comm_bytes' rule)."""
    return sum(comm_bytes(mesh_comm_torch(cfg, style, rank)).values())


def mesh_state_bytes_torch(cfg: Config, style: str, rank: int) -> dict[str, int]:
    """Params / grads / AdamW bytes on world rank ``rank`` of a runnable layout (one dtype): ``state``."""
    stage = mesh_coords(cfg, rank).get("pp", 0)
    return state(Model.from_config(cfg), Layout.from_config(cfg), stage, cfg.bytes_per_element, style, "pure")


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
    collectives everywhere) of the JAX runner's OWN programs (jax_impl/mesh.py): the jit and typed
    styles. shard_map rows train through parallel.compose, whose theory is
    ``Composed.comm_theory()`` (derived from the model wrapped). S, t = pp, tp; (M, m, Tc) =
    mesh_micro(cfg); A = m·Tc·D·b one micro-batch's residual stream on one device; I = M + S − 1
    pipeline iterations (1 without pp): the circular pipeline runs every block I times on every device,
    bubbles included (pp section). Both forwards are Megatron with the vocabulary split (the embedding
    vocab-parallel, the CE over the tp-split logits).

    "tp" (t > 1; tp_transformer_comm per iteration): all-reduces — per block and iteration Megatron's
        2 g (fwd) + 2 f transposes (bwd) of A; the embedding's g and the head's f once over all M
        micro-batches (M·A each); the vocab-parallel CE's pmax and (2, …) psum, 3·M·m·Tc·b: 4·(L/S)·I + 4
        calls, (4·(L/S)·I + 2M)·A + 3·M·m·Tc·b bytes (S = 1: exactly tp_transformer_comm on the local batch).

    typed (data × tp: jax_impl/mesh_typed.py refuses pp and cp): the reference tests/typed_expect.py reads
    the typed ledger against — "tp" above, and on the data axis the gradients: dp one all-reduce of
    every tp-local array, mesh_stage_param_count(cfg, 0, spmd=True)·b; fsdp (mesh_units_jax) a
    reduce-scatter of every unit, S = the tp-local unit, and the vectors' gradients in one all-reduce.

    jit (XLA's choice, measured; the layouts without cp and fsdp — dp / tp / pp and their products):
    "tp" as above, bytes and count (the one-hot embedding's and the CE's reductions: the target
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
    if style not in ("typed", "jit"):
        raise ValueError(f"mesh_comm_jax: style {style!r} has no formula here (shard_map: Composed.comm_theory)")
    b, d, L = cfg.bytes_per_element, cfg.dim, cfg.layers
    S, t, c = cfg.axis("pp"), cfg.axis("tp"), cfg.axis("cp")
    if c > 1 or (style == "jit" and cfg.data_axis == "fsdp") or (style == "typed" and S > 1):
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
    if cfg.data_axis == "fsdp":
        units, vectors = mesh_units_jax(cfg)
        out["fsdp"] = {"reduce_scatter": (len(units), sum(units.values()) * b),
                       "all_reduce": (1, sum(vectors.values()) * b)}
    elif cfg.data_axis == "dp":
        out["dp"] = {"all_reduce": (1, mesh_stage_param_count(cfg, 0, spmd=True) * b)}
    return out


def mesh_state_bytes_jax(cfg: Config, style: str) -> dict[str, int]:
    """Per device (every device alike: SPMD) of the runner's own programs (jit, typed; the
    compose rows: Composed.param_bytes): params, grads P·b each, AdamW moments 2·P·b, with
    P = mesh_stage_param_count(cfg, s, spmd=True) (the stage slots included), or under fsdp the units
    split over the fsdp(+cp) group (g = fsdp·cp devices) and the vectors whole: units/g + vectors
    (fsdp_state_bytes' zero3). The same in both styles (both place the arrays by mesh.rules)."""
    b = cfg.bytes_per_element
    if cfg.data_axis != "fsdp":
        held = mesh_stage_param_count(cfg, 0, spmd=True)
    else:
        units, vectors = mesh_units_jax(cfg)
        held = sum(units.values()) // (cfg.axis("fsdp") * cfg.axis("cp")) + sum(vectors.values())
    return {"params": held * b, "grads": held * b, "optimizer": 2 * held * b}
