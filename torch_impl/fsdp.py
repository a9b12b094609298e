"""ZeRO-2 / ZeRO-3 (FSDP) with torch.distributed. ZeRO: Rajbhandari et al. 2020, arXiv:1910.02054;
FSDP: Zhao et al. 2023, arXiv:2304.11277.

Batch as in DP: rank r trains on rows r·B/N:(r+1)·B/N, (B/N, D). Weight shards are row blocks of
the fixture weight, W_l[r·D/N:(r+1)·D/N, :], (D/N, D). Why rows: all_gather_single and
reduce_scatter_single concatenate / split along dim 0, so the gathered buffer IS W_l and the row
block of dW_l IS the gradient shard: no transposes, no copies. JAX shards the same rows,
P('dp', None). FSDP2 shards dim 0 of nn.Linear.weight == W_lᵀ, i.e. W_l's columns: another
slice, the same bytes.

explicit/zero3  params, grads and AdamW state all (D/N, D) per rank (16Φ/N bytes for fp32 Adam).
    fwd: all-gather W_l just before layer l, free it right after; the next layer's gather runs
         (async) while this layer computes.
    bwd: all-gather W_l again (nothing kept from fwd) for dX = dY·W_lᵀ — except layer 0, whose
         input is the data — and reduce-scatter dW_l to (D/N, D), async, overlapping layer l−1.
    payload S per step per rank: 2L−1 all-gathers + L reduce-scatters of D²·b = 3·Φ·b − D²·b
    (the textbook 3·Φ·b counts W_0's useless re-gather); each moves S·(N−1)/N on the wire.
    Naive form next to it: GatherQueue(prefetch=False), every gather waited for on the spot.
explicit/zero2  full params on every rank; each dW_l is reduce-scattered by a grad hook the moment
    autograd produces it (the full gradient never exists all at once); AdamW on the (D/N, D) row
    shard; the updated shards are all-gathered back into W_l: 2·Φ·b.
builtin/fsdp2   fully_shard per Block and on the root (DTensor params, Shard(0)): 2L all-gathers
    (W_0 is re-gathered in bwd too) + L reduce-scatters = 3·Φ·b.
Gradient scale: each rank's loss is the mean over its B/N rows and reduce-scatter SUMS the N
gradients, so we divide by N afterwards (exact for N a power of 2); FSDP2 averages by itself.
The reported loss is averaged over ranks after the recorded step (bookkeeping, as in dp.py).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import zero2_comm_bytes, zero3_comm_bytes, zero3_skip_first_comm_bytes
from torch_impl.launch import RankContext
from torch_impl.model import (
    build_model,
    inputs,
    loss_fn,
    make_optimizer,
    optimizer_state_bytes,
    tensor_bytes,
    to_numpy,
    torch_dtype,
)

VARIANTS = (("explicit", "zero3"), ("explicit", "zero2"), ("builtin", "fsdp2"))


def shard_rows(w: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    rows = w.shape[0] // n
    return w[rank * rows:(rank + 1) * rows]  # (D/N, D): a view, no copy


def gather_rows(shard: torch.Tensor, n: int, group, async_op: bool = False):
    """(D/N, D) -> (D, D) buffer and the work handle (None when synchronous)."""
    full = torch.empty((shard.shape[0] * n, *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    work = dist.all_gather_single(full, shard, group=group, async_op=async_op)
    return full, work


class GatherQueue:
    """ZeRO-3's all-gathers in the order they are used: fwd layers 0…L−1, then bwd L−1…1.
    Backward needs W_l only for dX = dY·W_lᵀ, and layer 0's input is data (no gradient), so W_0
    is not gathered again: 2L−1 gathers (JAX's autodiff drops the same one by itself).
    ``take()`` waits for the current gather and starts the next one asynchronously (prefetch),
    so each gather overlaps the layer computed in between. It also collects the async
    reduce-scatters of the weight gradients until ``finish()``."""

    def __init__(self, shards, group, prefetch: bool = True):
        L = len(shards)
        self.shards, self.group, self.prefetch = shards, group, prefetch
        self.n = dist.get_world_size(group)
        self.order = list(range(L)) + list(range(L - 1, 0, -1))  # 2L − 1 gathers per step
        self.k, self.next, self.pending = 0, None, []

    def take(self) -> torch.Tensor:
        if self.next is None:  # nothing prefetched (first gather, or prefetch off)
            self.next = gather_rows(self.shards[self.order[self.k]], self.n, self.group, async_op=True)
        full, work = self.next
        work.wait()
        self.k += 1
        self.next = None
        if self.prefetch and self.k < len(self.order):
            self.next = gather_rows(self.shards[self.order[self.k]], self.n, self.group, async_op=True)
        return full  # (D, D) == W_l

    def reduce_scatter(self, layer: int, dw: torch.Tensor) -> None:
        out = torch.empty_like(self.shards[layer])  # (D/N, D)
        work = dist.reduce_scatter_single(out, dw, group=self.group, async_op=True)
        self.pending.append((layer, out, work, dw))  # dw must live until the work is done

    def finish(self) -> None:
        """Wait for every reduce-scatter; shard.grad = sum over ranks / N (global mean)."""
        for layer, out, work, _ in self.pending:
            work.wait()
            self.shards[layer].grad = out.div_(self.n)  # (D/N, D)
        self.pending.clear()


class Zero3Matmul(torch.autograd.Function):
    """y = x @ W_l where W_l = all_gather(shard) lives only inside forward and inside backward.
    Autograd saves x, not W_l. The shard's gradient is NOT returned through autograd: its
    reduce-scatter is still in flight when backward returns (GatherQueue.finish sets .grad)."""

    @staticmethod
    def forward(ctx, x, shard, queue, layer):
        w = queue.take()  # (D, D), gathered; dropped when forward returns
        ctx.save_for_backward(x)
        ctx.queue, ctx.layer = queue, layer
        return x @ w  # (B/N, D)

    @staticmethod
    def backward(ctx, dy):  # dy: (B/N, D)
        (x,) = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:  # False for layer 0 only: its input is the data
            w = ctx.queue.take()  # (D, D), gathered again
            dx = dy @ w.T  # (B/N, D)
        ctx.queue.reduce_scatter(ctx.layer, x.T @ dy)  # dW_l (D, D) -> this rank's (D/N, D)
        return dx, None, None, None


def zero3_forward_backward(shards, x, group, prefetch: bool = True) -> torch.Tensor:
    n = dist.get_world_size(group)
    assert not x.requires_grad and all(s.shape == (s.shape[1] // n, s.shape[1]) for s in shards)
    queue = GatherQueue(shards, group, prefetch)
    h = x  # (B/N, D)
    for layer, shard in enumerate(shards):
        h = F.gelu(Zero3Matmul.apply(h, shard, queue, layer), approximate="none")  # (B/N, D)
    loss = loss_fn(h)  # mean over this rank's B/N rows
    loss.backward()
    queue.finish()  # shard.grad: (D/N, D) of the global-mean gradient
    return loss.detach()


def zero2_forward_backward(full, shards, x, group) -> torch.Tensor:
    n, pending = dist.get_world_size(group), []

    def reduce_scatter_grad(layer, w):  # runs the moment autograd has W_l's full gradient
        out = torch.empty_like(shards[layer])  # (D/N, D)
        work = dist.reduce_scatter_single(out, w.grad, group=group, async_op=True)
        pending.append((layer, out, work, w.grad))  # keep the (D, D) grad alive until done
        w.grad = None

    hooks = [w.register_post_accumulate_grad_hook(lambda w, l=l: reduce_scatter_grad(l, w))
             for l, w in enumerate(full)]
    h = x  # (B/N, D)
    for w in full:
        h = F.gelu(h @ w, approximate="none")  # (B/N, D)
    loss = loss_fn(h)
    loss.backward()
    for hook in hooks:
        hook.remove()
    for layer, out, work, _ in pending:
        work.wait()
        shards[layer].grad = out.div_(n)  # (D/N, D) shard of the global-mean gradient
    return loss.detach()


def zero2_update(full, shards, opt, group) -> None:
    opt.step()  # AdamW on the (D/N, D) shards, which are views of the full params' rows
    works = [dist.all_gather_single(w.detach(), s, group=group, async_op=True) for w, s in zip(full, shards)]
    for work in works:  # in place: each rank's own rows are already there (NCCL's in-place form)
        work.wait()


def fsdp2_model(cfg: Config, problem: Problem, ctx: RankContext):
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = build_model(cfg, problem, ctx.device)  # full weights, then sharded in place
    for block in model.layers:
        fully_shard(block, mesh=mesh)  # one all-gather / reduce-scatter group per Block
    fully_shard(model, mesh=mesh)  # root: owns no params here; runs lazy init, waits for grads
    return model


def fsdp2_forward_backward(model, x, opt) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x))
    loss.backward()  # FSDP2 reduce-scatters with the mean over ranks: no / N here
    return loss.detach()


def _fixture(tensors, n: int, group) -> list:
    """Full W_l / dW_l (float64 NumPy): gather explicit row shards, or DTensor.full_tensor().T."""
    if isinstance(tensors[0], DTensor):
        return [to_numpy(t.full_tensor().T) for t in tensors]  # weight (out, in) -> W_l (in, out)
    return [to_numpy(gather_rows(t.detach(), n, group)[0]) for t in tensors]


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    if (style, variant) not in VARIANTS:
        raise ValueError(f"fsdp: unknown torch variant {style}/{variant}; choose from {VARIANTS}")
    cfg.check("fsdp")
    n, group, rows = ctx.world_size, ctx.group, cfg.batch // ctx.world_size
    x = inputs(cfg, problem, ctx.device)[ctx.rank * rows:(ctx.rank + 1) * rows]  # (B/N, D)
    assert x.shape == (cfg.batch // n, cfg.dim), x.shape
    # copy=True: for float64 on CPU .to() would alias the fixture's NumPy memory, and ZeRO-2 updates in place
    full = [torch.from_numpy(w).to(ctx.device, torch_dtype(cfg), copy=True) for w in problem.weights]  # W_l
    if variant == "zero3":
        shards = [torch.nn.Parameter(shard_rows(w, ctx.rank, n).clone()) for w in full]  # (D/N, D)
        del full  # ZeRO-3 keeps only its rows
        opt = make_optimizer(shards, cfg)
        forward_backward, update = lambda: zero3_forward_backward(shards, x, group), opt.step
        held, grads = shards, lambda: [s.grad for s in shards]
    elif variant == "zero2":
        full = [w.requires_grad_() for w in full]
        shards = [shard_rows(w.detach(), ctx.rank, n) for w in full]  # (D/N, D) views into W_l
        opt = make_optimizer(shards, cfg)
        forward_backward = lambda: zero2_forward_backward(full, shards, x, group)
        update = lambda: zero2_update(full, shards, opt, group)
        held, grads = full, lambda: [s.grad for s in shards]
    else:
        model = fsdp2_model(cfg, problem, ctx)
        opt = make_optimizer(model.parameters(), cfg)
        forward_backward, update = lambda: fsdp2_forward_backward(model, x, opt), opt.step
        held, grads = list(model.parameters()), lambda: [p.grad for p in model.parameters()]

    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    losses, step_times, grads0 = [], [], None
    for k in range(cfg.steps):
        with ctx.ledger.recording() if k == cfg.steps - 1 else contextlib.nullcontext():
            t0 = time.perf_counter()
            loss = forward_backward()  # () local mean over B/N rows
            if k == 0:
                grads0 = [g.detach().clone() for g in grads()]  # local shards; gathered below
            update()
            loss.item()  # waits for the device
            step_times.append(time.perf_counter() - t0)
        if k == cfg.steps - 1:
            comm = ctx.ledger.summary()
        if k == 0:
            grads0 = _fixture(grads0, n, group)  # the check's all-gathers: outside every ledger
        dist.all_reduce(loss, group=group)  # reporting only, outside the ledger (as in dp.py)
        losses.append(loss.item() / n)

    extra = {"shard": "dim 0 of Linear.weight = columns of W_l" if variant == "fsdp2" else "rows of W_l",
             "textbook_comm_bytes": zero2_comm_bytes(cfg) if variant == "zero2" else zero3_comm_bytes(cfg)}
    if ctx.device.type == "cuda":
        extra["peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    return Trained(
        losses=losses,
        grads0=grads0,
        params=[to_numpy(w) for w in held] if variant == "zero2" else _fixture(held, n, group),
        step_times=step_times,
        comm=comm,
        comm_theory={"zero2": zero2_comm_bytes, "zero3": zero3_skip_first_comm_bytes,
                     "fsdp2": zero3_comm_bytes}[variant](cfg),
        state_bytes={"params": tensor_bytes(held), "grads": tensor_bytes(grads()),  # local shards of DTensors
                     "optimizer": optimizer_state_bytes(opt)},  # AdamW: exp_avg, exp_avg_sq
        extra=extra,
    )
