"""A tensor-parallel PLAN applied to any ``nn.Module``: each planned weight split over the tp ranks,
every rank seeing the full batch.

    styles = check_plan(model, {"layers.*.attn.q": "colwise", "layers.*.attn.o": "rowwise"}, tp=2)
    styles = apply_plan(model, plan, group)            # explicit: shards + Megatron's f/g as hooks
    styles = apply_dtensor_plan(model, plan, mesh)     # builtin: parallelize_module with the same styles
    full = full_tensors(model, styles, group)          # every parameter whole again (padding dropped)
    norm = clip_grad_norm_(model, max_norm, group)     # the global norm, either style (parallel/recipe.py)

A plan maps module paths (``*`` = one path segment) to a style (weights as nn.Linear stores them):
colwise (output rows split; f before: identity fwd, all-reduce bwd), colwise_heads (whole heads),
rowwise (input columns split; g after: all-reduce fwd, identity bwd), vocab_embed, colwise_vocab
(logits stay vocab-split for VocabParallelCrossEntropy), colwise_out / colwise_gather (the MLP's
all-gather schemes), sequence / positions (sequence parallelism: replicated, on T/tp tokens).
Sibling projections reading the same input share one f (``SharedEnter``). Under sequence
parallelism f becomes an all-gather of the sequence (bwd reduce-scatter) and g a reduce-scatter
(bwd all-gather): the same wire bytes. The collectives: parallel/tp_ops.py.
Bytes per step per rank, a Llama-style block: 2 all-reduces of B·T·D·b forward and 2 backward,
plus the embedding's g, the head's f and the loss's (shared.theory.tp_transformer_comm).
``check_plan`` refuses what ``apply_plan`` cannot carry out exactly with one ``PlanError`` (what,
module path, fix), before anything changes: docs/tp.md, "Bring your own model".
Papers: Megatron-LM, Shoeybi et al. 2019 (arXiv:1909.08053 §3); sequence parallelism, Korthikanti
et al. 2022 (arXiv:2205.05198 §4.2.2).
"""

from __future__ import annotations

import difflib
from fnmatch import fnmatch

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torch_impl.parallel import recipe
from torch_impl.parallel.ep import refuse_split_experts
from torch_impl.parallel.tp_ops import (
    CopyToTP,
    GatherColumns,
    ReduceFromTP,
    heads_perm,
    local_positions,
    sp_gather,
    sp_scatter,
)

DTENSOR_STYLES = {
    "vocab_embed": lambda: RowwiseParallel(input_layouts=Replicate()),  # as torchtitan's tok_embeddings
    "colwise_heads": lambda: ColwiseParallel(),  # rows pre-permuted by heads_perm
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_vocab": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    "colwise_out": lambda: ColwiseParallel(output_layouts=Replicate()),
}
# Sequence parallelism: the same splits, and the modules between the matmuls run on this rank's
# T/tp tokens. Their weights stay replicated with partial gradients.
SEQUENCE_STYLES = ("sequence", "positions")
DTENSOR_SP_STYLES = {  # torchtitan's parallelize_llama with sequence parallel
    "vocab_embed": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "colwise_heads": lambda: ColwiseParallel(input_layouts=Shard(1)),  # all-gather the sequence first
    "colwise": lambda: ColwiseParallel(input_layouts=Shard(1)),
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter to the sequence shard
    "colwise_vocab": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    "sequence": lambda: SequenceParallel(),
    "positions": lambda: SequenceParallel(sequence_dim=0, use_local_output=True),  # after local_positions
}
SHARD_DIM = {"colwise": 0, "colwise_heads": 0, "colwise_vocab": 0, "colwise_out": 0, "colwise_gather": 0,
             "rowwise": 1, "vocab_embed": 0}  # dim of the torch weight that is split


def matches(path: str, pattern: str) -> bool:
    """``*`` matches one path segment (parallelize_module's rule)."""
    a, b = path.split("."), pattern.split(".")
    return len(a) == len(b) and all(fnmatch(x, y) for x, y in zip(a, b, strict=True))


def styles_of(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{parameter name: style} for every parameter the plan splits (the rest are replicated)."""
    out = {}
    for path, _ in model.named_modules():
        for pattern, style in plan.items():
            if matches(path, pattern):
                out[f"{path}.weight"] = style
    return out


# --- checking a plan against the model it is applied to ---------------------------------------------

LINEAR_STYLES = ("colwise", "colwise_heads", "rowwise", "colwise_vocab", "colwise_out", "colwise_gather")
EMBEDDING_STYLES = ("vocab_embed", "positions")
STYLES = LINEAR_STYLES + ("vocab_embed",) + SEQUENCE_STYLES
ENTER_STYLES = ("colwise", "colwise_heads", "colwise_vocab", "colwise_out")  # f (SP: all-gather) before
PADDED_STYLES = ("vocab_embed", "colwise_vocab")  # rows padded to a multiple of tp: any vocabulary
HEAD_COUNT_ATTRS = ("heads", "n_heads", "num_heads", "num_attention_heads")


class PlanError(ValueError):
    """A plan ``apply_plan`` cannot carry out exactly on this model: what, where (module path), how
    to fix. Raised by ``check_plan`` before anything is changed or communicated."""


def _refuse(path: str, module: nn.Module, style: str, what: str, fix: str):
    raise PlanError(f"tp plan: {style!r} at {path!r} ({type(module).__name__}): {what}. Fix: {fix}")


def planned_modules(model: nn.Module, plan: dict[str, str],
                    missing_ok: bool = False) -> list[tuple[str, nn.Module, str]]:
    """[(module path, module, style)] in model order, each module once (a module reachable under
    two paths is one module). Refuses an unknown style, a key that matches no module (unless
    ``missing_ok``: a pipeline stage holds part of the model) and a module given two styles."""
    paths = [(path, m) for path, m in model.named_modules(remove_duplicate=False)]
    chosen: dict[int, tuple[str, nn.Module, str, str]] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise PlanError(f"tp plan: key {pattern!r} has unknown style {style!r}. Fix: use one of {STYLES}")
        hits = [(path, m) for path, m in paths if matches(path, pattern)]
        if not hits and not missing_ok:
            names = [path for path, m in paths if path and any(True for _ in m.parameters(recurse=False))]
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            raise PlanError(f"tp plan: key {pattern!r} ({style}) matches no module of {type(model).__name__} "
                            f"('*' matches one path segment). Fix: correct the key (close: {close or names[:6]}) or "
                            "drop it")
        for path, m in hits:
            if id(m) in chosen and chosen[id(m)][2] != style:
                first, _, other, key = chosen[id(m)]
                raise PlanError(f"tp plan: module {path!r} ({type(m).__name__}) is matched by {key!r} ({other}, as "
                                f"{first!r}) and by {pattern!r} ({style}). Fix: give each module one style")
            chosen.setdefault(id(m), (path, m, style, pattern))
    order: dict[int, int] = {}
    for k, (_, m) in enumerate(paths):
        order.setdefault(id(m), k)
    return [(path, m, style) for path, m, style, _ in sorted(chosen.values(), key=lambda c: order[id(c[1])])]


def _head_dim(model: nn.Module, path: str) -> tuple[int | None, int | None]:
    """(heads, head_dim) declared by the module that holds ``path`` (an attention module), if any."""
    parent = model.get_submodule(path.rpartition(".")[0])
    heads = next((v for a in HEAD_COUNT_ATTRS if isinstance(v := getattr(parent, a, None), int)), None)
    dim = getattr(parent, "head_dim", None)
    return heads, dim if isinstance(dim, int) else None


def _split_role(style: str, attr: str, sequence_parallel: bool) -> str | None:
    """How ``apply_plan`` treats parameter ``attr`` of a planned module: a split style (sharded like
    the weight), "sequence" (replicated, gradient partial over tp: SP), or None (replicated, full)."""
    if style in SEQUENCE_STYLES:
        return style
    if attr == "weight":
        return style
    if attr == "bias" and style != "rowwise":
        return style  # colwise: the bias is split with the rows of the weight
    if attr == "bias":  # rowwise: added once after g; under SP after the reduce-scatter, on T/tp tokens
        return "sequence" if sequence_parallel else None
    return "unknown"


def _signature(role: str | None):
    """Parameters tied across modules must be split the same way everywhere (or nowhere)."""
    if role is None or role in SEQUENCE_STYLES:
        return ("replicated", role is not None)  # a partial gradient (SP) is not a full one
    return (SHARD_DIM[role], role in PADDED_STYLES, role == "colwise_heads")


def check_module_types(planned) -> None:
    """Each planned module is what its style splits (an nn.Linear, an nn.Embedding): else PlanError."""
    for path, m, style in planned:
        if style in LINEAR_STYLES and not isinstance(m, nn.Linear):
            _refuse(path, m, style, "this style splits an nn.Linear (weight (out, in), y = x·Wᵀ + b) and hooks its "
                    "input and output; this module is not one", f"plan the nn.Linear(s) inside {path!r}, or leave it "
                    "out of the plan (replicated)")
        if style in EMBEDDING_STYLES and not isinstance(m, nn.Embedding):
            _refuse(path, m, style, "this style splits an nn.Embedding's rows (a lookup table (V, D)); this module is "
                    "not one", f"plan only nn.Embedding modules with {style!r}")


def check_plan(model: nn.Module, plan: dict[str, str], world_size: int, sequence_parallel: bool = False,
               missing_ok: bool = False) -> dict[str, str]:
    """Every precondition of ``apply_plan(model, plan, group of world_size)``, checked before any
    change or collective: raises ONE ``PlanError`` (what, module path, how to fix) for the first
    problem. Returns what ``apply_plan`` returns: {parameter name: style} of every parameter the
    plan splits (weights; colwise biases) or leaves partial under sequence parallelism."""
    n, out = world_size, {}
    planned = planned_modules(model, plan, missing_ok)
    roles: dict[int, list[tuple[str, tuple]]] = {}  # id(param) -> [(owner path.attr, signature)]
    check_module_types(planned)
    for path, m, style in planned:
        if style in SEQUENCE_STYLES and not sequence_parallel:
            _refuse(path, m, style, "this style runs the module on this rank's T/tp tokens, which exist only under "
                    "sequence parallelism", "pass sequence_parallel=True, or leave the module out of the plan")
        if isinstance(m, nn.Linear):
            rows, cols = m.weight.shape  # (out, in)
            heads, hd = _head_dim(model, path)
            if style in ("colwise", "colwise_out", "colwise_gather") and rows % n:
                _refuse(path, m, style, f"out_features={rows} is not divisible by tp={n}", f"make out_features a "
                        f"multiple of {n} (e.g. {-(-rows // n) * n}), use a tp that divides it, or leave the layer "
                        "replicated (only the vocabulary styles 'vocab_embed' / 'colwise_vocab' pad)")
            if style == "rowwise" and cols % n:
                _refuse(path, m, style, f"in_features={cols} is not divisible by tp={n}", f"make in_features a "
                        f"multiple of {n} (with the column-parallel layer before it), or use a tp that divides it")
            if style == "colwise_heads" and (rows % (3 * n) or (heads is not None and heads % n)
                                             or (hd and (rows // 3) % (hd * n))):
                _refuse(path, m, style, f"it needs a fused q|k|v weight (3·H·dh, D) with whole heads per rank: "
                        f"out_features={rows}, heads={heads}, head_dim={hd}, tp={n}", "use a tp that divides the "
                        "number of heads (and a fused 3·H·dh qkv), or separate q, k, v with 'colwise'")
            split = rows if style in ("colwise", "colwise_out", "colwise_gather") else cols if style == "rowwise" else 0
            if split and hd and split % hd == 0 and (split // hd) % n:
                _refuse(path, m, style, f"it would split {split // hd} heads of head_dim={hd} over tp={n}: a rank "
                        "would hold part of a head", "use a tp that divides every head count (GQA: the k/v heads "
                        "too)")
        if isinstance(m, nn.Embedding) and style == "vocab_embed":
            if m.max_norm is not None or m.scale_grad_by_freq:
                _refuse(path, m, style, "max_norm / scale_grad_by_freq act on the looked-up rows of the local table, "
                        "where other ranks' tokens are mapped to row 0 (renormalised, counted)", "drop max_norm and "
                        "scale_grad_by_freq, or leave the embedding replicated")
        for attr, p in m.named_parameters(recurse=style in SEQUENCE_STYLES):
            role = _split_role(style, attr, sequence_parallel)
            if role == "unknown":
                _refuse(path, m, style, f"it has a parameter {attr!r} this style does not know how to split",
                        "plan a plain nn.Linear / nn.Embedding (weight, bias), or leave the module replicated")
            roles.setdefault(id(p), []).append((f"{path}.{attr}" if path else attr, role or "replicated"))
            if role is not None:
                out[f"{path}.{attr}" if path else attr] = role
    planned_ids = {id(m) for _, m, _ in planned}
    for path, m in model.named_modules(remove_duplicate=False):  # the rest hold their parameters replicated
        for attr, p in m.named_parameters(recurse=False) if id(m) not in planned_ids else ():
            roles.setdefault(id(p), []).append((f"{path}.{attr}" if path else attr, "replicated"))
    for uses in roles.values():
        uses = list(dict.fromkeys(uses))
        if len({_signature(None if role == "replicated" else role) for _, role in uses}) > 1:
            where = ", ".join(f"{name!r} ({role})" for name, role in uses)
            raise PlanError(f"tp plan: one Parameter (tied) is used as {where}: a plan must split a tied parameter "
                            "the same way in every module that holds it. Fix: plan every holder alike (e.g. "
                            "'vocab_embed' embedding + 'colwise_vocab' head), or untie it")
    if sequence_parallel:
        for name, p in model.named_parameters():
            if name not in out and p.requires_grad:
                raise PlanError(f"tp plan: under sequence parallelism every replicated parameter sees only this "
                                f"rank's T/tp tokens, and {name!r} is in no plan entry (its gradient would miss the "
                                "other ranks' tokens). Fix: plan its module as 'sequence' (norms) or 'positions' "
                                "(a position embedding), or split it")
    return out


# --- the one function that applies a plan (explicit) ------------------------------------------------


def padded_rows(rows: int, n: int) -> int:
    """Rows per rank of a vocabulary-padded weight: ⌈V/tp⌉ (the last ranks hold zero padding rows)."""
    return -(-rows // n)


def shard(w: torch.Tensor, style: str, rank: int, n: int) -> torch.Tensor:
    """This rank's block of ``w`` (a weight, or the bias of a column-parallel layer: dim 0)."""
    d = SHARD_DIM[style] if w.dim() > 1 else 0
    if style == "colwise_heads":
        w = w[heads_perm(w.shape[0], n, w.device)]
    if style in PADDED_STYLES and w.shape[d] % n:
        pad = padded_rows(w.shape[d], n) * n - w.shape[d]
        w = torch.cat([w, w.new_zeros((pad, *w.shape[1:]))])  # zero rows: never looked up / masked out
    assert w.shape[d] % n == 0, (style, tuple(w.shape), n)  # check_plan refuses the rest
    return w.chunk(n, dim=d)[rank].contiguous()


def unshard(local: torch.Tensor, style: str, group, size: int | None = None) -> torch.Tensor:
    """The full weight (or colwise bias) from every rank's shard (all-gather along the split dim);
    ``size``: its length along that dim before padding (default: the parameter's ``tp_size``, else
    tp × the local length)."""
    d, n = SHARD_DIM[style] if local.dim() > 1 else 0, dist.get_world_size(group)
    size = size if size is not None else getattr(local, "tp_size", None)
    rows = local.detach().movedim(d, 0).contiguous()
    full = rows.new_empty(n * rows.shape[0], *rows.shape[1:])
    dist.all_gather_single(full, rows, group=group)
    full = full[:size].movedim(0, d)  # drop the padding rows
    if style == "colwise_heads":
        full = full[torch.argsort(heads_perm(full.shape[0], n, full.device))]
    return full


def full_tensors(model: nn.Module, styles: dict[str, str], group, grads: bool = False) -> dict[str, torch.Tensor]:
    """{name: full tensor} of ``model``'s parameters (``grads``: their gradients) after
    ``apply_plan``: split ones all-gathered and un-padded, the rest as they are. Call on every rank."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        out[name] = unshard(t, styles[name], group, p.tp_size) if styles.get(name) not in (None, *SEQUENCE_STYLES) \
            else t.detach()
    return out


class SharedEnter:
    """f (sequence parallel: the all-gather) in front of a plan's column-parallel modules. Sibling
    projections reading the SAME input tensor (q, k, v; gate, up) share one: autograd sums their
    partial dL/dx into its output, so backward all-reduces once per input (Megatron's 2 per block)
    instead of once per projection. Exact: the all-reduce is linear. Only the latest input is kept
    (with the grad mode it ran under), and the root module's forward starts and ends without it,
    so nothing crosses a step. ``share=False``: one f per module call."""

    def __init__(self, fn, group, share: bool = True):
        self.fn, self.group, self.share, self.last = fn, group, share, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        if self.last is not None and self.last[0] is x and self.last[1] == grad:
            return self.last[2]
        y = self.fn(x, self.group)
        if self.share:
            self.last = (x, grad, y)
        return y

    def forget(self, *_) -> None:
        self.last = None


def _rowwise_bias_hooks(module: nn.Module, leave, group):
    """y = g(x·W_rᵀ) + b: the bias is added once, after the all-reduce (not on every rank before it)."""

    def pre(m, args):
        m.__dict__["bias"] = None  # nn.Linear reads self.bias: the instance dict is found first

    def post(m, args, out):
        m.__dict__.pop("bias", None)
        return leave(out, group) + m.bias  # (…, out) + (out,); under SP (B, T/tp, out)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def apply_plan(model: nn.Module, plan: dict[str, str], group, sequence_parallel: bool = False,
               shared_f: bool = True, missing_ok: bool = False, seal_grads: bool = True) -> dict[str, str]:
    """Swap in this rank's shard of every planned weight (and colwise bias) and hook in f / g / the
    gather (``sequence_parallel``: the all-gather / reduce-scatter along the sequence). First
    ``check_plan``: a plan it cannot carry out exactly raises ``PlanError`` before anything changes.

    Any nn.Linear / nn.Embedding: biases (colwise: split; rowwise: added once after g), vocabularies
    not divisible by tp ('vocab_embed' / 'colwise_vocab' pad the rows to ⌈V/tp⌉ per rank; the
    head's padded logits are −inf, so ``VocabParallelCrossEntropy`` ignores them), tied parameters
    split alike (one shard), frozen ones. ``shared_f``: sibling projections that read the same input
    share one f (SharedEnter). ``missing_ok``: keys matching nothing are allowed (pipeline stages).
    ``seal_grads``: a split gradient changed in place between backward and the optimizer step (torch's
    clip_grad_norm_ over the local pieces: the LOCAL norm) is refused at the step (recipe.seal);
    compositions whose own step scales the gradients (pipeline schedules) pass False.
    Returns {parameter name: style} (``check_plan``); split parameters carry ``tp_size``, their
    unpadded length along the split dim (``unshard`` / ``full_tensors`` use it)."""
    refuse_split_experts(model.named_parameters(), "apply_plan")
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if any(getattr(m, "_tp_planned", False) for m in model.modules()) or \
            any(hasattr(p, "tp_size") for p in model.parameters()):
        raise PlanError(f"apply_plan: {type(model).__name__} is already planned (its weights are this rank's "
                        "shards). Fix: apply a plan once, to the full model")
    styles = check_plan(model, plan, n, sequence_parallel, missing_ok)
    enter = SharedEnter(sp_gather if sequence_parallel else CopyToTP.apply, group, shared_f)
    leave = sp_scatter if sequence_parallel else ReduceFromTP.apply
    model.register_forward_pre_hook(lambda m, args: enter.forget())
    model.register_forward_hook(lambda m, args, out: enter.forget())
    last = list(plan)[-1]  # the last gather feeds the loss
    shards: dict[int, nn.Parameter] = {}  # id(full parameter) -> its shard: tied parameters stay tied
    for path, module, style in planned_modules(model, plan, missing_ok):
        if style == "positions":
            module.register_forward_pre_hook(local_positions(rank, n))
        if style in SEQUENCE_STYLES:
            continue  # replicated weight on my T/tp tokens: reduce_sequence_grads after backward
        full_rows = module.weight.shape[0]  # V for the vocabulary styles
        for attr in ("weight", "bias"):
            p = module._parameters.get(attr)
            if p is None or _split_role(style, attr, sequence_parallel) in (None, "sequence"):
                continue
            if id(p) not in shards:
                shards[id(p)] = nn.Parameter(shard(p.detach(), style, rank, n), requires_grad=p.requires_grad)
                shards[id(p)].tp_size = p.shape[SHARD_DIM[style] if p.dim() > 1 else 0]
            setattr(module, attr, shards[id(p)])
        if style in ENTER_STYLES:
            module.register_forward_pre_hook(lambda m, args: (enter(args[0]), *args[1:]))
        if style == "rowwise" and module.bias is not None:
            _rowwise_bias_hooks(module, leave, group)
        elif style == "rowwise":
            module.register_forward_hook(lambda m, args, out: leave(out, group))
        if style in ("colwise_out", "colwise_gather"):
            partial = style == "colwise_gather" and not matches(path, last)  # else its grad is replicated
            module.register_forward_hook(lambda m, args, out, p=partial: GatherColumns.apply(out, group, p))
        if style == "colwise_vocab" and full_rows % n:  # padding columns: −inf, out of every softmax
            rows = module.weight.shape[0]  # ⌈V/tp⌉
            pad = torch.arange(rows, device=module.weight.device) >= full_rows - rank * rows  # (V/tp,)
            module.register_forward_hook(lambda m, args, out, pad=pad: out.masked_fill(pad, float("-inf")))
        if style == "vocab_embed":
            rows, mask = module.weight.shape[0], {}
            if module.padding_idx is not None:  # the global padding row, local on its owner only
                local = module.padding_idx - rank * rows
                module.padding_idx = local if 0 <= local < rows else None

            def to_local_ids(m, args, rows=rows, mask=mask, vocab=full_rows, path=path):
                ids = args[0]  # (B, T) global token ids
                if ids.numel() and not bool(((ids >= 0) & (ids < vocab)).all()):  # one host read per forward
                    raise ValueError(f"tp vocab_embed {path!r}: a token id is outside [0, {vocab})")
                local = ids - rank * rows  # (B, T)
                mask["mine"] = (local >= 0) & (local < rows)
                return (torch.where(mask["mine"], local, 0), *args[1:])

            module.register_forward_pre_hook(to_local_ids)
            module.register_forward_hook(
                lambda m, args, out, mask=mask: leave(out * mask["mine"].unsqueeze(-1), group))
    model._tp_planned = True  # a second apply_plan: "already planned", not a head-count puzzle
    fix = "clip with tp.clip_grad_norm_(model, max_norm, group) (split parameters summed over the group, the rest once)"
    for p in model.parameters() if seal_grads else ():  # torch's clip_grad_norm_ over split pieces: the LOCAL norm
        if hasattr(p, "tp_size") and p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p, fix=fix: recipe.seal([p.grad], "tp.apply_plan", fix))
    return styles


def clip_grad_norm_(model: nn.Module, max_norm: float, group=None) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` of the whole (unsharded) model, for a model after ``apply_plan``
    (``group``: its tp group) or ``apply_dtensor_plan`` (group unused). Explicit: the split
    parameters (those carrying ``tp_size``; padding rows have zero gradients) are summed over the
    group by one scalar all-reduce, the replicated ones (norms, rowwise biases, SP's 'sequence'
    parameters after ``reduce_sequence_grads``) counted once. DTensor: torch's own norm over the
    DTensors (plus any plain parameters once, ``recipe.clip_dtensor_``: after ``replicate_rest=False``
    torch's clip_grad_norm_ refuses that mix). Call after backward (and any gradient reduction), on every rank."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied parameter once
    if any(isinstance(p, DTensor) for p in params):
        return recipe.clip_dtensor_(params, max_norm)
    if group is None:
        raise ValueError("tp.clip_grad_norm_: a model after apply_plan needs its tp group: clip_grad_norm_(model, "
                         "max_norm, group)")
    split = [p.grad for p in params if hasattr(p, "tp_size")]
    whole = [p.grad for p in params if not hasattr(p, "tp_size")]
    return recipe.clip_(split, whole, max_norm, group, params[0].dtype)


def apply_dtensor_plan(model: nn.Module, plan: dict[str, str], mesh, sequence_parallel: bool = False,
                       replicate_rest: bool = True) -> dict[str, str]:
    """The same plan through ``parallelize_module``. W_qkv's rows are permuted first (heads_perm),
    so DTensor's contiguous Shard(0) hands rank r [q_r; k_r; v_r]. Sequence parallel: wpe's
    positions are cut to this rank's first (local_positions, registered before SequenceParallel's
    input hook, which takes a plain tensor for the local shard). A tied Parameter (an embedding and
    its head) stays one Parameter: parallelize_module distributes each holder's copy apart, so the
    copies are tied again after it (a plan splitting them differently: PlanError, before anything changes).
    ``replicate_rest``: every parameter the plan leaves alone becomes a Replicate DTensor too
    (``replicate_unplanned``), so that every parameter is a DTensor and torch's own
    ``clip_grad_norm_`` works (as torchtitan's models are, FSDP2 over TP); compose passes False, as
    FSDP2 / DDP take over those parameters. Returns {parameter name: style}."""
    check_module_types(planned_modules(model, plan, True))  # parallelize_module's own error is torch's, untyped
    styles, table = styles_of(model, plan), DTENSOR_SP_STYLES if sequence_parallel else DTENSOR_STYLES
    ties = _tied_holders(model)
    for holders in ties:  # refused before anything changes
        dims = {SHARD_DIM.get(styles.get(f"{path}.{attr}")) for path, attr in holders}  # None: replicated
        if len(dims) > 1:
            where = ", ".join(f"'{path}.{attr}' ({styles.get(f'{path}.{attr}', 'replicated')})"
                              for path, attr in holders)
            raise PlanError(f"tp plan (DTensor): one Parameter (tied) is used as {where}: a plan must split a tied "
                            "parameter the same way in every module that holds it. Fix: plan every holder alike "
                            "(e.g. 'vocab_embed' embedding + 'colwise_vocab' head), or untie it")
    with torch.no_grad():
        for name in (k for k, s in styles.items() if s == "colwise_heads"):
            w = model.get_parameter(name)  # (3D, D)
            w.copy_(w[heads_perm(w.shape[0], mesh.size(), w.device)])
    for name in (k for k, s in styles.items() if s == "positions"):
        model.get_submodule(name.removesuffix(".weight")).register_forward_pre_hook(
            local_positions(mesh.get_local_rank(), mesh.size()))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, mesh, {k: table[s]() for k, s in plan.items()})
    _retie(model, ties)
    for name, p in model.named_parameters():  # torch 2.13's SequenceParallel re-creates the gains as
        if name in frozen:  # nn.Parameter(DTensor) with requires_grad=True: a frozen gain would train
            p.requires_grad_(False)
    if replicate_rest:
        replicate_unplanned(model, mesh)
    return styles


def replicate_unplanned(model: nn.Module, mesh) -> None:
    """Every plain parameter (one the plan left alone, equal on every rank) becomes ONE Replicate DTensor
    on ``mesh`` in every module that holds it, made from the local tensor (no collective). Its module's
    code, written for plain tensors, sees the plain local tensor (``to_local``, differentiable: the
    gradient comes back a Replicate DTensor, with no collective) while the root model runs and while any
    holder runs (an activation-checkpoint recompute, a pipeline stage): a forward pre-hook swaps it in,
    a forward hook swaps the DTensor back. So the forward and its collectives are unchanged and every
    gradient is a DTensor: torch's ``clip_grad_norm_`` counts the replicated ones once, as it should.
    An optimizer built BEFORE this holds the old Parameters: refused at its first step."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, m in model.named_modules():
        for attr, p in m._parameters.items():
            if p is not None and not isinstance(p, DTensor):
                holders.setdefault(id(p), []).append((m, attr))
    if not holders:
        return
    old = {n: p for n, p in model.named_parameters() if id(p) in holders}
    for held in holders.values():
        p = held[0][0]._parameters[held[0][1]]
        new = nn.Parameter(DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False),
                           requires_grad=p.requires_grad)
        new._tp_unplanned = True  # what the hooks swap (not a rowwise bias's or SP norm's Replicate)
        for m, attr in held:
            m._parameters[attr] = new
    mods = {id(m): m for held in holders.values() for m, _ in held} | {id(model): model}
    for m in mods.values():
        m.register_forward_pre_hook(_to_local_params)
        m.register_forward_hook(_to_dtensor_params, always_call=True)
    recipe.refuse_stale(old, "apply_dtensor_plan", "build the optimizer (and its param groups) AFTER "
                        "apply_dtensor_plan, from model.named_parameters(): it makes every parameter a DTensor")


def _to_local_params(m: nn.Module, args) -> None:
    """The module and every module under it compute with the unplanned parameters' local tensors."""
    swapped = [(mod, attr, p) for mod in m.modules() for attr, p in mod._parameters.items()
               if getattr(p, "_tp_unplanned", False)]
    for mod, attr, p in swapped:
        mod._parameters[attr] = p.to_local()
    m.__dict__.setdefault("_tp_swapped", []).append(swapped)


def _to_dtensor_params(m: nn.Module, args, out):
    for mod, attr, p in m.__dict__["_tp_swapped"].pop():
        mod._parameters[attr] = p
    return out


def _tied_holders(model: nn.Module) -> list[list[tuple[str, str]]]:
    """[(module path, attribute)] of every Parameter held under two or more names (a tied embedding/head)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for path, m in model.named_modules():  # a module under two paths: one holder (styles_of's rule)
        for attr, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((path, attr))
    return [h for h in holders.values() if len(h) > 1]


def _retie(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """``parallelize_module`` distributes each module's parameters on their own: a tied Parameter comes
    out as one DTensor per holder, trained apart (silently not the model). Hold the first one everywhere."""
    for holders in ties:
        got = [model.get_submodule(path)._parameters[attr] for path, attr in holders]
        layout = lambda p: (getattr(p, "device_mesh", None), tuple(getattr(p, "placements", ())), tuple(p.shape))
        assert all(layout(p) == layout(got[0]) for p in got), [(h, layout(p)) for h, p in zip(holders, got)]
        for path, attr in holders[1:]:
            setattr(model.get_submodule(path), attr, got[0])
