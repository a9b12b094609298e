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
module path, fix), before anything changes: docs/tp.md, "Bring your own model". The check lives in
parallel/tp_plan.py, the builtin (``apply_dtensor_plan``) in parallel/tp_dtensor.py; both re-exported here.
Papers: Megatron-LM, Shoeybi et al. 2019 (arXiv:1909.08053 §3); sequence parallelism, Korthikanti
et al. 2022 (arXiv:2205.05198 §4.2.2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torch_impl.parallel import recipe
from torch_impl.parallel.ep import refuse_split_experts
from torch_impl.parallel.tp_dtensor import (  # noqa: F401 - the builtin, re-exported
    DTENSOR_SP_STYLES,
    DTENSOR_STYLES,
    apply_dtensor_plan,
    replicate_unplanned,
)
from torch_impl.parallel.tp_ops import (
    CopyToTP,
    GatherColumns,
    ReduceFromTP,
    heads_perm,
    local_positions,
    sp_gather,
    sp_scatter,
)
from torch_impl.parallel.tp_plan import (  # noqa: F401 - the plan's check, re-exported
    EMBEDDING_STYLES,
    ENTER_STYLES,
    LINEAR_STYLES,
    PADDED_STYLES,
    SEQUENCE_STYLES,
    SHARD_DIM,
    STYLES,
    PlanError,
    check_module_types,
    check_plan,
    matches,
    planned_modules,
    split_role,
    styles_of,
)

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
            if p is None or split_role(style, attr, sequence_parallel) in (None, "sequence"):
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
