"""Tensor parallelism (TP, Megatron-LM: Shoeybi et al. 2019, arXiv:1909.08053, §3): every weight
matrix is split over the tp ranks; every rank sees the full batch.

A TP layout is a PLAN: a small table from module path (``*`` = one path segment, as in
``parallelize_module`` and torchtitan's ``parallelize_llama``) to a parallel style, applied to any
model by one function of tp_plan.py: ``apply_plan`` (explicit: sharded weights + Megatron's f/g as
module hooks) or ``apply_dtensor_plan`` (builtin: ``parallelize_module`` with ``DTENSOR_STYLES``).
Styles (weights as nn.Linear stores them, (out, in)):

    colwise        rows of weight (output features) split; f before (identity fwd, all-reduce bwd)
    colwise_heads  colwise over whole heads: rows [q_r; k_r; v_r] of W_qkv (heads_perm reorders)
    rowwise        columns (input features) split; g after (all-reduce fwd, identity bwd)
    vocab_embed    embedding rows [r·V/tp, (r+1)·V/tp); other tokens give zero rows; g after
    colwise_vocab  the LM head: colwise, logits stay split (B, T, V/tp) for vocab_parallel_ce
    colwise_out    colwise + all-gather of the output (MLP, odd L: the last layer; bwd a slice)
    colwise_gather colwise + all-gather, no f (MLP allgather scheme: bwd reduce-scatter)
    sequence       (SP) weight replicated, runs on this rank's T/tp tokens; gradient partial
    positions      (SP) wpe: as sequence, its input (the positions) cut to this rank's T/tp first

Any model (tp_plan.py; docs/tp.md, "Bring your own model"): ``check_plan`` refuses, before anything changes,
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

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
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


def heads_perm(rows: int, n: int, device=None) -> torch.Tensor:
    """Row order of W_qkv (3D, D) making rank r's contiguous block [q_r; k_r; v_r] (its heads)."""
    return torch.arange(rows, device=device).view(3, n, rows // 3 // n).transpose(0, 1).reshape(-1)


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
    from torch_impl.tp_plan import apply_dtensor_plan, apply_plan, unshard  # the plan machinery (any model)

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
            return t[torch.argsort(heads_perm(t.shape[0], n, t.device))] if styles.get(name) == "colwise_heads" else t

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
