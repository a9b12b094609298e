"""Tensor parallelism (TP, Megatron-LM: Shoeybi et al. 2019, arXiv:1909.08053, §3): every weight
matrix is split over the tp ranks; every rank sees the full batch.

A TP layout is a PLAN: a small table from module path (``*`` = one path segment, as in
``parallelize_module`` and torchtitan's ``parallelize_llama``) to a parallel style, applied to any
model by one function: ``apply_plan`` (explicit: sharded weights + Megatron's f/g as module hooks)
or ``parallelize_module`` with ``DTENSOR_STYLES[style]`` (builtin). Styles (weights as nn.Linear
stores them, (out, in)):

    colwise        rows of weight (output features) split; f before (identity fwd, all-reduce bwd)
    colwise_heads  colwise over whole heads: rows [q_r; k_r; v_r] of W_qkv (heads_perm reorders)
    rowwise        columns (input features) split; g after (all-reduce fwd, identity bwd)
    vocab_embed    embedding rows [r·V/tp, (r+1)·V/tp); other tokens give zero rows; g after
    colwise_vocab  the LM head: colwise, logits stay split (B, T, V/tp) for vocab_parallel_ce
    colwise_out    colwise + all-gather of the output (MLP, odd L: the last layer; bwd a slice)
    colwise_gather colwise + all-gather, no f (MLP allgather scheme: bwd reduce-scatter)
    sequence       (SP) weight replicated, runs on this rank's T/tp tokens; gradient partial
    positions      (SP) wpe: as sequence, its input (the positions) cut to this rank's T/tp first

Any model (docs/tp.md, "Bring your own model"): ``check_plan`` refuses, before anything changes,
what ``apply_plan`` cannot do exactly (a key matching nothing, a style on a module it cannot split,
sizes not divisible by tp, part of a head on a rank, tied parameters split unlike, SP leaving a
replicated parameter unplanned) with one ``PlanError`` (what, module path, fix). Biases: colwise
splits them, rowwise adds them once after g. Vocabularies: any V (rows padded to ⌈V/tp⌉, the
head's padded logits −inf). Sibling projections reading the same input share one f (SharedEnter).

Transformer (TRANSFORMER_PLAN; norms and wpe replicated): per block 2 all-reduces of B·T·D
forward (g after attn.o, mlp.down) and 2 backward (f before attn.qkv, mlp.up); plus the embedding's
g (fwd) and the head's f (bwd), and the vocab-parallel loss's all-reduces: MAX of the row max
(B, T), SUM of (2, B, T) (target logit, Σexp; DTensor's loss_parallel: 3 of (B, T)); its backward
is local (softmax − onehot on the own vocab slice). Per step per rank: (4L+2)·B·T·D·b + 3·B·T·b
(shared.theory.tp_transformer_comm). The norm gains and wpe see
identical inputs and gradients on every rank (f/g keep the residual stream replicated): no
collective for them, and ``fixture`` asserts the ranks agree. The full logits never exist.

MLP (the CS336 lecture-8 model, ``mlp_plan``): allgather — every layer colwise_gather: L all-gathers
fwd + L−1 reduce-scatters bwd of S = B·D·b (the last gather's bwd is a slice: the loss is computed
from the same full output everywhere); megatron — colwise/rowwise pairs, ⌊L/2⌋ all-reduces fwd +
⌈L/2⌉−1 bwd (layer 0's f has nothing to reduce), odd L: colwise_out (+1 all-gather). allgather is
MLP-only: in a residual network the gradient of the gathered stream is part partial (the next
matmul) and part replicated (the residual path), which is Megatron's f, not a reduce-scatter.

builtin/dtensor: the same plan through ``parallelize_module`` (Colwise/RowwiseParallel; the head
ColwiseParallel(output_layouts=Shard(-1)) and the loss under ``loss_parallel()``); W_qkv's rows are
permuted at load time (heads_perm) so DTensor's contiguous Shard(0) gives each rank [q_r; k_r; v_r],
and un-permuted in ``fixture``. DTensor issues the same collectives, one for one.
Memory per rank: split weights /tp, replicated norms and wpe whole (tp_state_bytes).

Sequence parallelism (megatron_sp / dtensor_sp, Korthikanti et al. 2022, arXiv:2205.05198 §4.2.2;
transformer only; SP_PLAN = the same splits + "sequence" norms and "positions" wpe): between the
matmuls (embedding output, norms, residual adds) the activations are (B, T/tp, D). f becomes g =
all-gather of the sequence before each column-parallel matmul (bwd reduce-scatter), g becomes ḡ =
reduce-scatter after each row-parallel matmul and the embedding (bwd all-gather); the head's input
is gathered, the logits stay (B, T, V/tp). Per step per rank (A = B·T·D·b): (4L+2) all-gathers and
(4L+2) reduce-scatters of A (= Megatron's wire bytes), the loss's all-reduces, and one all-reduce
of the SP parameters' partial gradients ((2L+1)·D + T·D)·b (shared.theory.tp_sp_comm). Saved
activations: each norm's input, rsqrt and output /tp (theory.tp_sp_activation_saving). builtin:
torchtitan's plan (SequenceParallel norms, Colwise(input_layouts=Shard(1)), Rowwise(output_layouts=
Shard(1)), the embedding Rowwise(output_layouts=Shard(1))); wpe = SequenceParallel(sequence_dim=0)
after local_positions. DTensor leaves the SP gradients Partial: ``train`` redistributes them once.
"""

from __future__ import annotations

import contextlib
import difflib
from fnmatch import fnmatch

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import tp_comm_bytes
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import build_model, inputs, is_transposed, loss_fn, make_optimizer, targets, to_fixture

VARIANTS = (("explicit", "allgather"), ("explicit", "megatron"), ("builtin", "dtensor"),
            ("explicit", "megatron_sp"), ("builtin", "dtensor_sp"))
SP_VARIANTS = ("megatron_sp", "dtensor_sp")  # sequence parallel: the transformer only

TRANSFORMER_PLAN = {
    "wte": "vocab_embed",
    "blocks.*.attn.qkv": "colwise_heads",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "head": "colwise_vocab",
}
DTENSOR_STYLES = {
    "vocab_embed": lambda: RowwiseParallel(input_layouts=Replicate()),  # as torchtitan's tok_embeddings
    "colwise_heads": lambda: ColwiseParallel(),  # rows pre-permuted by heads_perm
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_vocab": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    "colwise_out": lambda: ColwiseParallel(output_layouts=Replicate()),
}
# Sequence parallelism (megatron_sp, dtensor_sp): the same splits, and the modules between the
# matmuls run on this rank's T/tp tokens. Their weights stay replicated with partial gradients.
SP_PLAN = TRANSFORMER_PLAN | {
    "wpe": "positions",  # rows of this rank's positions: (T/tp, D)
    "blocks.*.norm1": "sequence",  # on (B, T/tp, D)
    "blocks.*.norm2": "sequence",
    "normf": "sequence",
}
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


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    """allgather is MLP-only (see the module docstring); sequence parallelism transformer-only."""
    drop = SP_VARIANTS if cfg.model == "mlp" else ("allgather",)
    return tuple(v for v in VARIANTS if v[1] not in drop)


def mlp_plan(layers: int, variant: str) -> dict[str, str]:
    if variant == "allgather":
        return {f"layers.{l}.linear": "colwise_gather" for l in range(layers)}
    kinds = ["colwise", "rowwise"] * (layers // 2) + ["colwise_out"] * (layers % 2)
    return {f"layers.{l}.linear": k for l, k in enumerate(kinds)}


def plan_for(cfg: Config, variant: str) -> dict[str, str]:
    if cfg.model == "mlp":
        return mlp_plan(cfg.layers, variant)
    return SP_PLAN if variant in SP_VARIANTS else TRANSFORMER_PLAN


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


def heads_perm(rows: int, n: int) -> torch.Tensor:
    """Row order of W_qkv (3D, D) making rank r's contiguous block [q_r; k_r; v_r] (its heads)."""
    return torch.arange(rows).view(3, n, rows // 3 // n).transpose(0, 1).reshape(-1)


# --- Megatron's f and g, the all-gather, as autograd Functions ----------------------------------


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (each rank's dL/dx is partial)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # (…, D)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum the row-parallel partial products), identity backward."""

    @staticmethod
    def forward(ctx, z, group):
        z = z.clone()  # (…, D), partial sum on each rank
        dist.all_reduce(z, group=group)
        return z

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherColumns(torch.autograd.Function):
    """fwd: all-gather (B, D/tp) shards along the feature dim -> (B, D). bwd: grad_is_partial ->
    reduce-scatter (sum every rank's partial dL/dx, keep my columns); else a local slice."""

    @staticmethod
    def forward(ctx, y, group, grad_is_partial: bool):
        n, b, k = dist.get_world_size(group), y.shape[0], y.shape[1]
        ctx.group, ctx.partial, ctx.rank = group, grad_is_partial, dist.get_rank(group)
        out = y.new_empty(n * b, k)  # (tp·B, D/tp): all_gather_single concatenates along dim 0
        dist.all_gather_single(out, y.contiguous(), group=group)
        return out.view(n, b, k).permute(1, 0, 2).reshape(b, n * k)  # (B, D)

    @staticmethod
    def backward(ctx, grad):  # (B, D)
        n = dist.get_world_size(ctx.group)
        b, k = grad.shape[0], grad.shape[1] // n
        if not ctx.partial:
            return grad[:, ctx.rank * k:(ctx.rank + 1) * k], None, None  # (B, D/tp)
        chunks = grad.reshape(b, n, k).permute(1, 0, 2).reshape(n * b, k)  # (tp·B, D/tp)
        out = grad.new_empty(b, k)
        dist.reduce_scatter_single(out, chunks, group=ctx.group)
        return out, None, None


# --- sequence parallelism's g / ḡ (Korthikanti et al. 2022, §4.2.2): all-gather <-> reduce-scatter ------


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/tp, …) -> (B, T, …): every rank's sequence shard, in rank order."""
    n = dist.get_world_size(group)
    rows = x.movedim(1, 0).contiguous()  # (T/tp, B, …): all_gather_single concatenates along dim 0
    out = rows.new_empty(n * rows.shape[0], *rows.shape[1:])  # (T, B, …)
    dist.all_gather_single(out, rows, group=group)
    return out.movedim(0, 1)  # (B, T, …)


def scatter_sequence(z: torch.Tensor, group) -> torch.Tensor:
    """(B, T, …) partial sums -> (B, T/tp, …): the sum over ranks of my sequence shard."""
    n = dist.get_world_size(group)
    rows = z.movedim(1, 0).contiguous()  # (T, B, …)
    assert rows.shape[0] % n == 0, (z.shape, n)
    out = rows.new_empty(rows.shape[0] // n, *rows.shape[1:])  # (T/tp, B, …)
    dist.reduce_scatter_single(out, rows, group=group)
    return out.movedim(0, 1)  # (B, T/tp, …)


class Transposed(torch.autograd.Function):
    """A collective whose backward is its transpose: ``fwd(x, group)`` forward, ``bwd(grad, group)``
    backward (SP's all-gather <-> reduce-scatter along the sequence; cp's Ulysses all-to-alls)."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group), None, None, None


def sp_gather(x: torch.Tensor, group) -> torch.Tensor:
    """g (replaces f before a column-parallel matmul): all-gather the sequence fwd; reduce-scatter
    bwd (each rank's dL/dx of the gathered input is partial: sum, keep my tokens)."""
    return Transposed.apply(x, group, gather_sequence, scatter_sequence)


def sp_scatter(z: torch.Tensor, group) -> torch.Tensor:
    """ḡ (replaces g after a row-parallel matmul / the embedding): reduce-scatter fwd (sum the
    partial products, keep my tokens); all-gather bwd (dL/dz is needed for every token)."""
    return Transposed.apply(z, group, scatter_sequence, gather_sequence)


def local_positions(rank: int, n: int):
    """Forward pre-hook for wpe: its input, the positions (T,), -> this rank's T/tp (a view)."""
    return lambda m, args: (args[0].chunk(n)[rank],)


def reduce_sequence_grads(params: list[torch.Tensor], group) -> None:
    """The SP regions' parameters (norm gains, wpe) saw only this rank's tokens: their gradients
    are partial. One flat all-reduce (Megatron-LM's sequence-parallel gradient all-reduce)."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(summed.view_as(g))


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocab-split logits (B, T, V/tp): all-reduce MAX of the row max (B, T),
    then one SUM of (2, B, T): the target logit (found on one rank, zero elsewhere) and Σexp.
    Backward is local: (softmax − onehot) on the own vocab slice, no collective. Every rank holds
    the same width ⌈V/tp⌉ (rank r: ids r·⌈V/tp⌉ …); padding columns must be −inf, as a
    'colwise_vocab' head makes them (exp(−inf) = 0: out of Σexp and of the gradient)."""

    @staticmethod
    def forward(ctx, logits, target, group):
        v, r = logits.shape[-1], dist.get_rank(group)
        m = logits.amax(dim=-1)  # (B, T)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - m.unsqueeze(-1)  # (B, T, V/tp)
        local = target - r * v  # target ids in my slice: 0 <= local < V/tp
        mine = (local >= 0) & (local < v)
        local = torch.where(mine, local, 0)
        picked = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)  # (B, T)
        exp = shifted.exp()
        sums = torch.stack([picked, exp.sum(dim=-1)])  # (2, B, T): one all-reduce for both sums
        dist.all_reduce(sums, group=group)
        picked, sumexp = sums
        ctx.save_for_backward(exp / sumexp.unsqueeze(-1), local, mine)
        return (sumexp.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), mine.unsqueeze(-1).to(softmax.dtype))
        return (softmax - onehot) * (grad / local.numel()), None, None  # (B, T, V/tp)


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


def check_plan(model: nn.Module, plan: dict[str, str], world_size: int, sequence_parallel: bool = False,
               missing_ok: bool = False) -> dict[str, str]:
    """Every precondition of ``apply_plan(model, plan, group of world_size)``, checked before any
    change or collective: raises ONE ``PlanError`` (what, module path, how to fix) for the first
    problem. Returns what ``apply_plan`` returns: {parameter name: style} of every parameter the
    plan splits (weights; colwise biases) or leaves partial under sequence parallelism."""
    n, out = world_size, {}
    planned = planned_modules(model, plan, missing_ok)
    roles: dict[int, list[tuple[str, tuple]]] = {}  # id(param) -> [(owner path.attr, signature)]
    for path, m, style in planned:
        if style in LINEAR_STYLES and not isinstance(m, nn.Linear):
            _refuse(path, m, style, "this style splits an nn.Linear (weight (out, in), y = x·Wᵀ + b) and hooks its "
                    "input and output; this module is not one", f"plan the nn.Linear(s) inside {path!r}, or leave it "
                    "out of the plan (replicated)")
        if style in EMBEDDING_STYLES and not isinstance(m, nn.Embedding):
            _refuse(path, m, style, "this style splits an nn.Embedding's rows (a lookup table (V, D)); this module is "
                    "not one", f"plan only nn.Embedding modules with {style!r}")
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
        w = w[heads_perm(w.shape[0], n)]
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
        full = full[torch.argsort(heads_perm(full.shape[0], n))]
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
               shared_f: bool = True, missing_ok: bool = False) -> dict[str, str]:
    """Swap in this rank's shard of every planned weight (and colwise bias) and hook in f / g / the
    gather (``sequence_parallel``: the all-gather / reduce-scatter along the sequence). First
    ``check_plan``: a plan it cannot carry out exactly raises ``PlanError`` before anything changes.

    Any nn.Linear / nn.Embedding: biases (colwise: split; rowwise: added once after g), vocabularies
    not divisible by tp ('vocab_embed' / 'colwise_vocab' pad the rows to ⌈V/tp⌉ per rank; the
    head's padded logits are −inf, so ``VocabParallelCrossEntropy`` ignores them), tied parameters
    split alike (one shard), frozen ones. ``shared_f``: sibling projections that read the same input
    share one f (SharedEnter). ``missing_ok``: keys matching nothing are allowed (pipeline stages).
    Returns {parameter name: style} (``check_plan``); split parameters carry ``tp_size``, their
    unpadded length along the split dim (``unshard`` / ``full_tensors`` use it)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
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
                torch._assert_async(((ids >= 0) & (ids < vocab)).all(),
                                    f"tp vocab_embed {path!r}: a token id is outside [0, {vocab})")
                local = ids - rank * rows  # (B, T)
                mask["mine"] = (local >= 0) & (local < rows)
                return (torch.where(mask["mine"], local, 0), *args[1:])

            module.register_forward_pre_hook(to_local_ids)
            module.register_forward_hook(
                lambda m, args, out, mask=mask: leave(out * mask["mine"].unsqueeze(-1), group))
    return styles


def apply_dtensor_plan(model: nn.Module, plan: dict[str, str], mesh, sequence_parallel: bool = False) -> dict[str, str]:
    """The same plan through ``parallelize_module``. W_qkv's rows are permuted first (heads_perm),
    so DTensor's contiguous Shard(0) hands rank r [q_r; k_r; v_r]. Sequence parallel: wpe's
    positions are cut to this rank's first (local_positions, registered before SequenceParallel's
    input hook, which takes a plain tensor for the local shard). Returns {parameter name: style}."""
    styles, table = styles_of(model, plan), DTENSOR_SP_STYLES if sequence_parallel else DTENSOR_STYLES
    with torch.no_grad():
        for name in (k for k, s in styles.items() if s == "colwise_heads"):
            w = model.get_parameter(name)  # (3D, D)
            w.copy_(w[heads_perm(w.shape[0], mesh.size())])
    for name in (k for k, s in styles.items() if s == "positions"):
        model.get_submodule(name.removesuffix(".weight")).register_forward_pre_hook(
            local_positions(mesh.get_local_rank(), mesh.size()))
    parallelize_module(model, mesh, {k: table[s]() for k, s in plan.items()})
    return styles


def check_replicated(t: torch.Tensor, name: str, group) -> None:
    """A replicated parameter (norm gain, wpe) or its gradient must be identical on every rank."""
    n = dist.get_world_size(group)
    every = t.new_empty(n * t.numel())
    dist.all_gather_single(every, t.detach().reshape(-1).contiguous(), group=group)
    assert all(torch.equal(every.view(n, -1)[0], row) for row in every.view(n, -1)), f"{name} differs over ranks"


# --- training ------------------------------------------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    if (style, variant) not in variants(cfg):
        raise ValueError(f"tp: unknown variant {style}/{variant} for the {cfg.model}; choose from {variants(cfg)}")
    cfg.check("tp")
    n, group, transformer, sp = ctx.world_size, ctx.group, cfg.model == "transformer", variant in SP_VARIANTS
    plan = plan_for(cfg, variant)
    model = build_model(cfg, problem, ctx.device)
    x, y = inputs(cfg, problem, ctx.device), targets(cfg, problem, ctx.device)  # full batch on every rank
    if style == "explicit":
        styles = apply_plan(model, plan, group, sp)
        loss_of = (lambda out: VocabParallelCrossEntropy.apply(out, y, group)) if transformer else loss_fn
        parallel_loss = contextlib.nullcontext
        full = lambda t, name: unshard(t, styles[name], group) if name in split else t
    else:
        styles = apply_dtensor_plan(model, plan, init_device_mesh(ctx.device.type, (n,), mesh_dim_names=("tp",)), sp)
        loss_of = lambda out: loss_fn(out, y)
        parallel_loss = loss_parallel if transformer else contextlib.nullcontext  # CE over Shard(-1) logits

        def full(t, name):  # DTensor -> all-gather; un-permute W_qkv's rows
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            return t[torch.argsort(heads_perm(t.shape[0], n))] if styles.get(name) == "colwise_heads" else t

    split = {k: s for k, s in styles.items() if s not in SEQUENCE_STYLES}  # the rest: replicated
    names = [name for name, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    partial = [p for name, p in zip(names, params, strict=True) if styles.get(name) in SEQUENCE_STYLES]
    for name, p in zip(names, params, strict=True):  # rank code: local shapes
        expect = list(problem.params[name].shape[::-1] if is_transposed(model, name) else problem.params[name].shape)
        if name in split:
            expect[SHARD_DIM[styles[name]]] //= n  # e.g. attn.qkv (3D/tp, D), mlp.down (D, 4D/tp), wte (V/tp, D)
        assert list((p.to_local() if hasattr(p, "to_local") else p).shape) == expect, (name, p.shape, expect)
    opt = make_optimizer(params, cfg)

    def forward_backward():
        opt.zero_grad(set_to_none=True)
        with parallel_loss():
            loss = loss_of(model(x))  # logits (B, T, V/tp) stay split; MLP: the full (B, D) output
            loss.backward()
        if partial and style == "explicit":
            reduce_sequence_grads(partial, group)
        elif partial:  # DTensor leaves their .grad Partial(sum): reduce once (else every AdamW op that
            for p in partial:  # reads it all-reduces it again: 3 times per parameter per step)
                p.grad = p.grad.redistribute(placements=[Replicate()])
        return loss.to_local() if hasattr(loss, "to_local") else loss  # replicated on every rank

    def fixture(tensors):
        out = []
        for name, t in zip(names, tensors, strict=True):
            if name not in split:
                check_replicated(t.to_local() if hasattr(t, "to_local") else t, name, group)
            out.append(to_fixture(model, name, full(t, name)))
        return out

    return train_loop(cfg, ctx, Setup(
        forward_backward=forward_backward, update=opt.step, grads=lambda: [p.grad for p in params],
        fixture=fixture, params=params, optimizer=opt, loss_reduction="same", group=group,
        comm_theory=tp_comm_bytes(cfg, variant),
        extra={"plan": plan, "backend": ctx.backend}))
