"""Data parallelism (DP) with torch.distributed: every rank holds the whole model, trains on its
slice of the global batch, and the gradients are averaged across ranks before the update.

Sharded: the batch only. Rank r takes rows r·B/N … (r+1)·B/N: the MLP's (B/dp, D) inputs, the
transformer's (B/dp, T) tokens and targets. Its loss is the local mean (MLP mean(out²),
transformer mean cross-entropy over its B/dp·T positions); equal shards make the mean over ranks
the global mean. Weights and gradients are replicated; so is the AdamW state, except in ZeRO-1,
which splits it in N slices. Nothing here knows the model: any nn.Module, its parameters in
named_parameters() order (the transformer's 1-D norm gains and (V, D) embeddings included).

    explicit/naive     CS336 lecture 8: after backward, one blocking all-reduce per gradient.
    explicit/bucketed  A DDP-style wrapper (Li et al. 2020, "PyTorch Distributed", VLDB):
                       gradients are packed into ~bucket_mb buckets, in reverse order of
                       registration, and each bucket's all-reduce starts asynchronously from
                       gradient hooks DURING backward, overlapping the rest of the backward pass.
    explicit/zero1     ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO"): reduce-scatter the
                       gradients, each rank steps AdamW on its 1/N slice only, all-gather params.
    builtin/ddp        torch.nn.parallel.DistributedDataParallel.

Communication per step and rank (payload S as nccl-tests counts it, shared.theory; Φ of either
model, cfg.n_params; the embedding gradients are dense (V, D) and (T, D) tensors, sent whole):
    naive                  bwd: one all-reduce per parameter tensor   Φ·b   = dp_comm_bytes
    bucketed, DDP          bwd: ⌈Φ·b / bucket⌉ all-reduces, overlapped Φ·b   = dp_comm_bytes
    zero1                  reduce-scatter dW + all-gather W           2·Φ·b = zero1_comm_bytes
On a ring both put 2·Φ·b·(N−1)/N bytes on the wire per rank: ZeRO-1 saves memory, not traffic.
The run's ``comm_theory`` comes from the module wrapped (torch_impl.model_theory: the trainable
parameters, each tied one once, ZeRO-1's flat Φ padded to N), so it is right for any nn.Module;
on the project's models it equals the Config formulas above. The wrappers answer the same
(``BucketedDDP.comm_theory()`` / ``state_theory()``, ``Zero1Optimizer.comm_theory()`` / ``state_theory()``).
The reported loss is the mean of the ranks' local losses, all-reduced AFTER the recorded step
(torch_impl.harness): bookkeeping, so the ledger holds gradient (and parameter) traffic only.
Each variant is a harness.Setup (make_setup); train() runs it through harness.train_loop.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from torch_impl import model_theory
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import (
    build_model,
    inputs,
    loss_fn,
    make_optimizer,
    optimizer_state_bytes,
    targets,
    tensor_bytes,
    to_fixture,
)

VARIANTS = (("explicit", "naive"), ("explicit", "bucketed"), ("explicit", "zero1"), ("builtin", "ddp"))


def local_batch(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows = x.shape[0] // world_size
    return x[rank * rows:(rank + 1) * rows]  # (B/dp, …): MLP (B/dp, D), tokens (B/dp, T)


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
        self._infos = model_theory.describe(module)
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

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """Per step: one all-reduce per bucket, the trainable gradients' bytes (model_theory)."""
        return model_theory.bucketed_comm(b["flat"].numel() * b["flat"].element_size() for b in self.buckets)

    def state_theory(self) -> dict[str, int]:
        """Per rank with AdamW: the module's parameters, trainable gradients, 2 moments of each."""
        return model_theory.dp_state(self._infos)

    def _grad_hook(self, bucket: dict, view: torch.Tensor):
        def hook(p: nn.Parameter) -> None:  # runs when p.grad is complete for this backward
            if not self.require_sync:
                return  # no_sync(): gradients just accumulate in p.grad
            # g/N into the bucket in one pass, as DDP's reducer does: the sum over ranks of g/N is
            # the mean (gloo has no AVG). p.grad may already be this view (no zero_grad between).
            if p.grad.data_ptr() != view.data_ptr():
                torch.div(p.grad, self.world_size, out=view)
            else:
                view.div_(self.world_size)
            bucket["ready"] += 1
            while (self.next_bucket < len(self.buckets)
                   and self.buckets[self.next_bucket]["ready"] == len(self.buckets[self.next_bucket]["params"])):
                b = self.buckets[self.next_bucket]
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
        if not self.params:
            raise ValueError("Zero1Optimizer: no trainable parameter was given (none, or all frozen). Fix: pass "
                             "the parameters to train")
        kinds = sorted({f"{p.dtype} on {p.device}" for p in self.params})
        if len(kinds) > 1:
            raise ValueError(f"Zero1Optimizer: one flat buffer holds every parameter, but they are {kinds}: the "
                             f"others would be cast to {self.params[0].dtype} silently. Fix: one Zero1Optimizer per "
                             "dtype and device (or cast the model to one dtype)")
        self.group = group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.n, self._infos = n, model_theory.describe(self.params)
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

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """Per step: one reduce-scatter and one all-gather of the flat Φ padded to N (model_theory)."""
        return model_theory.zero1_comm(self._infos, self.n)

    def state_theory(self) -> dict[str, int]:
        """Per rank: the flat padded parameters, full gradients, AdamW state of this rank's slice."""
        return model_theory.zero1_state(self._infos, self.n)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()

    def step(self) -> None:
        self.reduce_gradients()
        self.update()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the local gradients: this rank's slice of their mean in shard.grad."""
        grads = torch.zeros_like(self.flat)  # (Φ_pad,) this rank's local gradients, flat
        torch.cat([p.grad.reshape(-1) for p in self.params], out=grads[:self.numel])
        dist.reduce_scatter_single(self.shard.grad, grads, group=self.group)  # (Φ_pad/N,) summed
        self.shard.grad.div_(dist.get_world_size(self.group))

    @torch.no_grad()
    def update(self) -> None:
        """The optimizer on this rank's slice, then all-gather the updated parameters."""
        self.local.step()  # AdamW on this rank's slice only, in place in self.flat
        dist.all_gather_single(self.flat, self.shard, group=self.group)  # in place: (Φ_pad,)

    def gather_flat(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's (Φ_pad/N,) slice, gathered and cut back into per-parameter tensors
        (for inspection, not training)."""
        full = torch.empty_like(self.flat)  # (Φ_pad,)
        dist.all_gather_single(full, shard, group=self.group)
        return list(_unflatten_dense_tensors(full[:self.numel], self.params))


# --- the dp Setup: what one step does, for any model --------------------------------------------

def make_setup(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Setup:
    """One dp variant's step on this rank, for any model (the loop: torch_impl.harness.train_loop)."""
    cfg.check("dp")
    if (style, variant) not in VARIANTS:
        raise ValueError(f"dp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    n, group = ctx.world_size, ctx.group
    model = build_model(cfg, problem, ctx.device)
    x = local_batch(inputs(cfg, problem, ctx.device), ctx.rank, n)  # MLP (B/dp, D) | tokens (B/dp, T)
    y = targets(cfg, problem, ctx.device)  # None | (B, T) next-token ids
    y = None if y is None else local_batch(y, ctx.rank, n)  # (B/dp, T)
    assert x.shape[0] == cfg.batch // n, x.shape
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    net, sync = model, lambda: None
    if variant == "naive":
        opt = make_optimizer(params, cfg)
        sync = lambda: allreduce_gradients(model, group)
    elif variant == "bucketed":
        net = BucketedDDP(model, cfg.bucket_mb, group)
        opt, sync = make_optimizer(net.parameters(), cfg), net.finish_gradient_synchronization
    elif variant == "zero1":
        opt = Zero1Optimizer(params, torch.optim.AdamW, group, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, weight_decay=cfg.weight_decay)
        sync = opt.reduce_gradients  # the reduce-scatter: grads() then reads this rank's slice
    else:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=device_ids, process_group=group,
                                      bucket_cap_mb=cfg.bucket_mb)
        opt = make_optimizer(net.parameters(), cfg)

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)  # local mean over this rank's B/dp rows (· T positions)
        loss.backward()
        sync()  # gradients averaged over ranks (zero1: this rank's averaged slice)
        return loss

    def fixture(tensors: list[torch.Tensor]) -> list:
        return [to_fixture(model, name, t) for name, t in zip(names, tensors)]

    zero1 = variant == "zero1"
    theory = opt.comm_theory() if zero1 else net.comm_theory() if variant == "bucketed" else model_theory.dp_comm(model)
    buckets = [b["flat"] for b in getattr(net, "buckets", [])]
    state = lambda: {"params": tensor_bytes([opt.flat] if zero1 else params),  # zero1: flat, padded
                     "grads": tensor_bytes(buckets or params),  # bucketed: p.grad are bucket views
                     "optimizer": optimizer_state_bytes(opt.local if zero1 else opt)}
    return Setup(
        forward_backward=forward_backward,
        update=opt.update if zero1 else opt.step,  # zero1: AdamW on the slice + all-gather
        grads=(lambda: [opt.shard.grad]) if zero1 else (lambda: [p.grad for p in params]),
        fixture=fixture,
        grads_fixture=(lambda g: fixture(opt.gather_flat(g[0]))) if zero1 else None,
        params=params,
        optimizer=opt,
        comm_theory=model_theory.comm_bytes(theory),  # from the model wrapped (= shared.theory's on ours)
        loss_reduction="mean",  # equal shards: the mean of local means is the global mean
        group=group,
        state=state,
        extra={"local_batch": cfg.batch // n, "bucket_bytes": [tensor_bytes([b]) for b in buckets]},
    )


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    return train_loop(cfg, ctx, make_setup(cfg, problem, style, variant, ctx))
