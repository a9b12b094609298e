"""Tensor parallelism's collectives as autograd Functions (Megatron-LM, Shoeybi et al. 2019,
arXiv:1909.08053 §3; sequence parallelism, Korthikanti et al. 2022, arXiv:2205.05198 §4.2.2). The
plan machinery (parallel/tp.py) hooks them into a model; runners and the mesh use them directly.

    f  CopyToTP            identity fwd, all-reduce bwd (before a column-parallel matmul)
    g  ReduceFromTP        all-reduce fwd, identity bwd (after a row-parallel matmul)
       GatherColumns       all-gather of the features fwd; reduce-scatter (or a slice) bwd
    SP sp_gather/sp_scatter all-gather <-> reduce-scatter along the sequence (Transposed)
       VocabParallelCrossEntropy  the loss from vocab-split logits: all-reduce MAX (B, T), SUM (2, B, T)
Bytes per step: shared.theory.tp_comm_bytes / tp_sp_comm.

No JAX twin: under shard_map these are psum / all_gather / psum_scatter written inline
(jax_impl/parallel/tp.py), and their transposes come from JAX's autodiff.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
    are partial. One flat all-reduce (Megatron-LM's sequence-parallel gradient all-reduce). Parameters
    without a gradient (frozen: requires_grad=False, the same on every rank) are skipped."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(summed.view_as(g))


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocab-split logits (B, T, V/tp): all-reduce MAX of the row max (B, T),
    then one SUM of (2, B, T): the target logit (found on one rank, zero elsewhere) and Σexp.
    Backward is local: (softmax − onehot) on the own vocab slice, no collective. Every rank holds
    the same width ⌈V/tp⌉ (rank r: ids r·⌈V/tp⌉ …); padding columns must be −inf, as a
    'colwise_vocab' head makes them (exp(−inf) = 0: out of Σexp and of the gradient). Under autocast
    the (bf16) logits are upcast first, as autocast does for F.cross_entropy: its reductions in float32."""

    @staticmethod
    def forward(ctx, logits, target, group):
        if torch.is_autocast_enabled(logits.device.type):  # as F.cross_entropy under autocast: in float32
            logits = logits.float()  # (its backward hands autograd float32: cast back to the input's dtype)
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
