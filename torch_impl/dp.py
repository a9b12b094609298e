"""Data parallelism (DP) with torch.distributed: every rank holds the whole model, trains on its
slice of the global batch, and the gradients are averaged across ranks before the update.

Sharded: the batch only. Rank r takes rows r·B/N … (r+1)·B/N, a (B/dp, D) slice. Weights and
gradients are replicated; so is the AdamW state, except in ZeRO-1, which splits it in N slices.

    explicit/naive     CS336 lecture 8: after backward, one blocking all-reduce per gradient.
    explicit/bucketed  A DDP-style wrapper (Li et al. 2020, "PyTorch Distributed", VLDB):
                       gradients are packed into ~bucket_mb buckets, in reverse order of
                       registration, and each bucket's all-reduce starts asynchronously from
                       gradient hooks DURING backward, overlapping the rest of the backward pass.
    explicit/zero1     ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO"): reduce-scatter the
                       gradients, each rank steps AdamW on its 1/N slice only, all-gather params.
    builtin/ddp        torch.nn.parallel.DistributedDataParallel.

Communication per step and rank (payload S as nccl-tests counts it, shared.theory):
    naive, bucketed, DDP   bwd: all-reduce dW over dp            Φ·b   = dp_comm_bytes
    zero1                  reduce-scatter dW + all-gather W      2·Φ·b = zero1_comm_bytes
On a ring both put 2·Φ·b·(N−1)/N bytes on the wire per rank: ZeRO-1 saves memory, not traffic.
The reported loss is the mean of the ranks' local losses, all-reduced AFTER the recorded step:
it is bookkeeping, not training, so the ledger holds gradient (and parameter) traffic only.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import dp_comm_bytes, zero1_comm_bytes
from torch_impl.launch import RankContext
from torch_impl.model import (
    build_model,
    fixture_grads,
    fixture_weights,
    inputs,
    loss_fn,
    make_optimizer,
    optimizer_state_bytes,
    tensor_bytes,
    to_numpy,
)

VARIANTS = (("explicit", "naive"), ("explicit", "bucketed"), ("explicit", "zero1"), ("builtin", "ddp"))


def local_batch(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows = x.shape[0] // world_size
    return x[rank * rows:(rank + 1) * rows]  # (B/dp, D)


# --- naive: the CS336 version -------------------------------------------------------------------

def allreduce_gradients(module: nn.Module, group=None) -> None:
    """After the whole backward: all-reduce (sum) every gradient, one call per tensor, then /N."""
    n = dist.get_world_size(group)
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)  # same shape as p, summed over ranks
            p.grad.div_(n)


# --- bucketed: what DDP does, in Python ---------------------------------------------------------

class BucketedDDP(nn.Module):
    """Wrap any module like DDP. Broadcasts rank 0's parameters and buffers; skips frozen
    parameters; a parameter shared by two layers is one tensor, so it is sent once. Call
    ``finish_gradient_synchronization()`` between ``backward()`` and ``optimizer.step()``."""

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, group=None):
        super().__init__()
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.module = module  # the only registered child: the wrapper adds no parameters
        self.group, self.world_size = group, dist.get_world_size(group)
        self.require_sync = True
        with torch.no_grad():  # every rank starts from rank 0's weights
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, group=group, group_src=0)
        # parameters() yields a shared parameter once; reversed: the last layer's gradient is
        # ready first in backward, so it goes in the first bucket.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.buckets = []  # each: {"params", "flat": (numel,) grads, "views", "ready", "work"}
        cap, group_params, size = bucket_mb * 2**20, [], 0
        for p in params:
            if group_params and (size >= cap or p.dtype != group_params[0].dtype):
                self.buckets.append(self._new_bucket(group_params))
                group_params, size = [], 0
            group_params.append(p)
            size += p.numel() * p.element_size()
        if group_params:
            self.buckets.append(self._new_bucket(group_params))
        self.next_bucket = 0  # buckets launch strictly in order: ranks must match call order
        for bucket in self.buckets:
            for p, view in zip(bucket["params"], bucket["views"]):
                p.register_post_accumulate_grad_hook(self._grad_hook(bucket, view))

    @staticmethod
    def _new_bucket(params: list[nn.Parameter]) -> dict:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                           device=params[0].device)  # (sum of numel,)
        views = list(_unflatten_dense_tensors(flat, params))  # slices of flat, shaped like params
        return {"params": params, "flat": flat, "views": views, "ready": 0, "work": None}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_hook(self, bucket: dict, view: torch.Tensor):
        def hook(p: nn.Parameter) -> None:  # runs when p.grad is complete for this backward
            if not self.require_sync:
                return  # no_sync(): gradients just accumulate in p.grad
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)  # into the bucket (p.grad may already be this view)
            bucket["ready"] += 1
            while (self.next_bucket < len(self.buckets)
                   and self.buckets[self.next_bucket]["ready"] == len(self.buckets[self.next_bucket]["params"])):
                b = self.buckets[self.next_bucket]
                b["flat"].div_(self.world_size)  # sum of g/N over ranks = the mean (gloo has no AVG)
                b["work"] = dist.all_reduce(b["flat"], group=self.group, async_op=True)
                self.next_bucket += 1
        return hook

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket; p.grad becomes its slice of the averaged bucket (no copy)."""
        if not self.require_sync:
            return
        if self.next_bucket < len(self.buckets):
            raise RuntimeError("some parameters got no gradient in this backward; BucketedDDP "
                               "needs every trainable parameter to take part in the loss")
        for b in self.buckets:
            b["work"].wait()
            for p, view in zip(b["params"], b["views"]):
                p.grad = view
            b["ready"], b["work"] = 0, None
        self.next_bucket = 0

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside the block communicate nothing."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True


# --- ZeRO-1: shard the optimizer state ----------------------------------------------------------

class Zero1Optimizer:
    """ZeroRedundancyOptimizer-like: ``Zero1Optimizer(params, torch.optim.AdamW, lr=...)``.

    Partition: one FLAT vector of all parameters (padded to a multiple of N), rank r owns the
    contiguous slice r·Φ/N … (r+1)·Φ/N. This balances memory exactly and maps onto
    reduce-scatter + all-gather (2·Φ·b). It cuts tensors apart, which is exact for elementwise
    optimizers (SGD, Adam, AdamW); optimizers with per-tensor statistics (LAMB, Adafactor)
    need a parameter-wise partition instead (round robin, as torch's ZeroRedundancyOptimizer
    does, at the cost of uneven shards and a broadcast per parameter)."""

    def __init__(self, params, optimizer_cls, group=None, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)  # Φ
        shard = -(-self.numel // n)  # ceil(Φ/N)
        p0 = self.params[0]
        self.flat = torch.zeros(shard * n, dtype=p0.dtype, device=p0.device)  # (Φ_pad,)
        with torch.no_grad():  # the module's parameters become views into self.flat, so the
            for p, view in zip(self.params, _unflatten_dense_tensors(self.flat[:self.numel], self.params)):
                view.copy_(p)  # all-gather writes updated weights straight into the model
                p.data = view
        self.shard = self.flat[rank * shard:(rank + 1) * shard]  # (Φ_pad/N,) this rank's slice
        self.shard.grad = torch.zeros_like(self.shard)  # (Φ_pad/N,) averaged gradient slice
        self.local = optimizer_cls([self.shard], **kwargs)  # state for 1/N of the parameters

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        n = dist.get_world_size(self.group)
        grads = torch.zeros_like(self.flat)  # (Φ_pad,) this rank's local gradients, flat
        torch.cat([p.grad.reshape(-1) for p in self.params], out=grads[:self.numel])
        dist.reduce_scatter_single(self.shard.grad, grads, group=self.group)  # (Φ_pad/N,) summed
        self.shard.grad.div_(n)
        self.local.step()  # AdamW on this rank's slice only, in place in self.flat
        dist.all_gather_single(self.flat, self.shard, group=self.group)  # in place: (Φ_pad,)

    def full_gradient(self) -> list[torch.Tensor]:
        """Every rank's averaged gradient slice, gathered (for inspection, not training)."""
        full = torch.empty_like(self.flat)  # (Φ_pad,)
        dist.all_gather_single(full, self.shard.grad, group=self.group)
        return list(_unflatten_dense_tensors(full[:self.numel], self.params))


# --- training loop shared by every variant ------------------------------------------------------

def mean_over_ranks(value: torch.Tensor, group=None) -> float:
    total = value.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item() / dist.get_world_size(group)


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    cfg.check("dp")
    if (style, variant) not in VARIANTS:
        raise ValueError(f"dp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    n, group = ctx.world_size, ctx.group
    model = build_model(cfg, problem, ctx.device)
    x = local_batch(inputs(cfg, problem, ctx.device), ctx.rank, n)  # (B/dp, D)
    assert x.shape == (cfg.batch // n, cfg.dim), x.shape
    net, sync = model, lambda: None
    if variant == "naive":
        opt = make_optimizer(model.parameters(), cfg)
        sync = lambda: allreduce_gradients(model, group)
    elif variant == "bucketed":
        net = BucketedDDP(model, cfg.bucket_mb, group)
        opt, sync = make_optimizer(net.parameters(), cfg), net.finish_gradient_synchronization
    elif variant == "zero1":
        opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, group, lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=device_ids, process_group=group,
                                      bucket_cap_mb=cfg.bucket_mb)
        opt = make_optimizer(net.parameters(), cfg)

    losses, step_times, grads0 = [], [], None
    for step in range(cfg.steps):
        # Record the last step: DDP rebuilds its buckets after the first iteration.
        recording = ctx.ledger.recording() if step == cfg.steps - 1 else contextlib.nullcontext()
        t0 = time.perf_counter()
        with recording:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x))  # local mean over B/dp rows
            loss.backward()
            sync()
            if step == 0 and variant != "zero1":
                grads0 = fixture_grads(model)  # averaged over ranks by now
            opt.step()
            loss.item()  # waits for the device
        step_times.append(time.perf_counter() - t0)
        losses.append(mean_over_ranks(loss, group))  # reporting only, outside the ledger
        if step == 0 and variant == "zero1":
            grads0 = [to_numpy(g).T.copy() for g in opt.full_gradient()]

    params = list(model.parameters())
    zero1, buckets = variant == "zero1", [b["flat"] for b in getattr(net, "buckets", [])]
    state = {"params": tensor_bytes([opt.flat] if zero1 else params),  # zero1: flat, padded
             "grads": tensor_bytes(buckets or params),  # bucketed: p.grad are bucket views
             "optimizer": optimizer_state_bytes(opt.local if zero1 else opt)}
    return Trained(
        losses=losses,
        grads0=grads0,
        params=fixture_weights(model),
        step_times=step_times,
        comm=ctx.ledger.summary(),
        comm_theory=zero1_comm_bytes(cfg) if variant == "zero1" else dp_comm_bytes(cfg),
        state_bytes=state,
        extra={"local_batch": cfg.batch // n, "bucket_bytes": [tensor_bytes([b]) for b in buckets]},
    )
