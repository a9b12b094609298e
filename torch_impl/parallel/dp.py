"""Data parallelism's wrappers for ANY nn.Module: the batch is sharded, weights and gradients
replicated (ZeRO-1: the AdamW state split in N slices).

    allreduce_gradients(model, group)     CS336 lecture 8: after backward, one all-reduce per gradient
    model = BucketedDDP(model, bucket_mb)  DDP in Python (Li et al. 2020, VLDB): ~bucket_mb buckets in
                                          reverse order, each all-reduced asynchronously from gradient
                                          hooks during backward; then finish_gradient_synchronization()
    opt = Zero1Optimizer(params, AdamW)    ZeRO-1 (Rajbhandari et al. 2020): reduce-scatter the flat
                                          gradients, AdamW on this rank's 1/N slice, all-gather params

The recipe (docs/recipe.md, "## torch"): ``net.clip_grad_norm_`` / ``opt.clip_grad_norm_`` give the
global norm (parallel/recipe.py); ``net.no_sync()`` for accumulation; Zero1Optimizer takes param
groups (one flat buffer each) and is a torch.optim.Optimizer, so lr schedulers drive it.

Bytes per step per rank (Φ trainable, b bytes each): all-reduce Φ·b (naive, bucketed); ZeRO-1 a
reduce-scatter and an all-gather of the flat Φ padded to N, 2·Φ·b. ``comm_theory()`` /
``state_theory()`` of each wrapper come from the module wrapped (parallel/theory.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _unflatten_dense_tensors
from torch.utils._python_dispatch import _disable_current_modes

from torch_impl.parallel import recipe, theory
from torch_impl.parallel.ep import refuse_split_experts


def local_batch(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous 1/N of the rows. Refuses B % N != 0: unequal shards make the mean of
    the ranks' mean gradients weight rows unequally (and dropping the rest loses them)."""
    if x.shape[0] % world_size:
        raise ValueError(f"local_batch: {x.shape[0]} rows do not split evenly over {world_size} ranks; data "
                         f"parallelism averages per-rank means, so uneven shards train wrongly. Fix: a batch that "
                         f"is a multiple of {world_size} (drop or pad the last rows)")
    rows = x.shape[0] // world_size
    return x[rank * rows:(rank + 1) * rows]  # (B/dp, …): MLP (B/dp, D), tokens (B/dp, T)


def check_even_batch(args, kwargs, group, who: str) -> None:
    """Refuse (ValueError on every rank alike) local batches of different sizes on the ranks of
    ``group``: the gradient all-reduce averages per-rank means, which is the global mean only when
    every rank holds as many rows. The batch is the first tensor argument's dim 0. One all-reduce
    of two integers, hidden from dispatch modes (the CommLedger does not count it)."""
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    if x is None:
        return
    rows = x.shape[0]
    t = torch.tensor([rows, -rows], dtype=torch.int64, device=x.device)
    with _disable_current_modes():  # a check, not the model's communication
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    most, least = int(t[0]), -int(t[1])
    if most != least:
        raise ValueError(f"{who}: the ranks' local batches differ ({least} to {most} rows; this rank has {rows}); "
                         "the averaged gradient would weight rows unequally. Fix: give every rank the same number "
                         "of rows (drop or pad the last batch, e.g. DistributedSampler(drop_last=True))")


# --- naive: the CS336 version -------------------------------------------------------------------

def allreduce_gradients(module: nn.Module, group=None) -> None:
    """After the whole backward: all-reduce (sum) every gradient, one call per tensor, then /N.
    It never sees the batch: equal local batches are the caller's (``local_batch`` refuses B % N)."""
    n = dist.get_world_size(group)
    refuse_split_experts(module.named_parameters(), "allreduce_gradients")
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)  # same shape as p, summed over ranks
            p.grad.div_(n)
            recipe.refresh([p.grad])


# --- bucketed: what DDP does, in Python ---------------------------------------------------------

class BucketedDDP(nn.Module):
    """Wrap any module like DDP. Broadcasts rank 0's parameters and buffers; skips frozen
    parameters; a parameter shared by two layers is one tensor, so it is sent once. Call
    ``finish_gradient_synchronization()`` between ``backward()`` and ``optimizer.step()``.
    ``check_batch``: each forward first checks that every rank got as many rows (check_even_batch;
    torch's DDP does not, and trains wrongly on 3 + 2 rows)."""

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, group=None, check_batch: bool = True):
        super().__init__()
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        refuse_split_experts(module.named_parameters(), "BucketedDDP")
        self.module = module  # the only registered child: the wrapper adds no parameters
        self.group, self.world_size = group, dist.get_world_size(group)
        self._infos = theory.describe(module)
        self.require_sync, self.check_batch = True, check_batch
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
        if self.check_batch:
            check_even_batch(args, kwargs, self.group, "BucketedDDP")
        return self.module(*args, **kwargs)

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """Per step: one all-reduce per bucket, the trainable gradients' bytes (parallel/theory.py)."""
        return theory.bucketed_comm(b["flat"].numel() * b["flat"].element_size() for b in self.buckets)

    def state_theory(self) -> dict[str, int]:
        """Per rank with AdamW: the module's parameters, trainable gradients, 2 moments of each."""
        return theory.dp_state(self._infos)

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

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """After ``finish_gradient_synchronization()`` every rank holds the whole averaged gradient,
        so the global norm is the local one: torch's ``clip_grad_norm_`` as is, no communication."""
        return torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad], max_norm)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside the block communicate nothing."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True


# --- ZeRO-1: shard the optimizer state ----------------------------------------------------------

class Zero1Optimizer(torch.optim.Optimizer):
    """ZeroRedundancyOptimizer-like: ``Zero1Optimizer(params, torch.optim.AdamW, lr=...)``; ``params``
    may be param groups (``[{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay":
    0.0}]``): ONE flat buffer per group, so each group keeps its options. It is a
    ``torch.optim.Optimizer`` whose ``param_groups`` are the local optimizer's (one per group, on
    this rank's slice): LambdaLR or any lr_scheduler drives them. Frozen parameters are skipped.

    Partition: per group one FLAT vector of its parameters (padded to a multiple of N), rank r owns
    the contiguous slice r·Φ/N … (r+1)·Φ/N. This balances memory exactly and maps onto
    reduce-scatter + all-gather (2·Φ·b per group). It cuts tensors apart, which is exact for
    elementwise optimizers (SGD, Adam, AdamW); optimizers with per-tensor statistics (LAMB, Adafactor)
    need a parameter-wise partition instead (round robin, as torch's ZeroRedundancyOptimizer
    does, at the cost of uneven shards and a broadcast per parameter). It never sees the batch:
    equal local batches are the caller's (``local_batch`` refuses B % N).

    Step: ``backward()`` (micro-batches accumulate in p.grad, nothing is sent), optionally
    ``clip_grad_norm_(max_norm)`` (reduce-scatters first, then clips the averaged slices by the
    global norm), ``step()`` (reduce-scatter if not done, the optimizer on the slices, all-gather)."""

    def __init__(self, params, optimizer_cls, group=None, **kwargs):
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            if not isinstance(g, dict) or "params" not in g:
                raise ValueError("Zero1Optimizer: params must be tensors or param groups (dicts with 'params'), not "
                                 "a mix. Fix: give every group as {'params': [...], ...}")
            ps = g["params"]
            g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        self.param_lists = [[p for p in g["params"] if p.requires_grad] for g in groups]
        refuse_split_experts(((f"params[{i}]", p) for ps in self.param_lists for i, p in enumerate(ps)),
                             "Zero1Optimizer")
        self.params = [p for ps in self.param_lists for p in ps]
        if not self.params:
            raise ValueError("Zero1Optimizer: no trainable parameter was given (none, or all frozen). Fix: pass "
                             "the parameters to train")
        if len({id(p) for p in self.params}) < len(self.params):
            raise ValueError("Zero1Optimizer: a parameter appears twice (in two groups, or twice in one). Fix: "
                             "give each parameter once")
        kinds = sorted({f"{p.dtype} on {p.device}" for p in self.params})
        if len(kinds) > 1:
            raise ValueError(f"Zero1Optimizer: one flat buffer holds every parameter, but they are {kinds}: the "
                             f"others would be cast to {self.params[0].dtype} silently. Fix: one Zero1Optimizer per "
                             "dtype and device (or cast the model to one dtype)")
        self.group = group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.n, self._infos = n, theory.describe(self.params)
        self.flats, self.shards, self.numels, local_groups = [], [], [], []
        for g, ps in zip(groups, self.param_lists):
            if not ps:
                continue  # a group of frozen parameters only: nothing to shard or step
            numel = sum(p.numel() for p in ps)  # Φ of this group
            shard = -(-numel // n)  # ceil(Φ/N)
            flat = torch.zeros(shard * n, dtype=ps[0].dtype, device=ps[0].device)  # (Φ_pad,)
            with torch.no_grad():  # the module's parameters become views into flat, so the
                for p, view in zip(ps, _unflatten_dense_tensors(flat[:numel], ps)):
                    view.copy_(p)  # all-gather writes updated weights straight into the model
                    p.data = view
            mine = flat[rank * shard:(rank + 1) * shard]  # (Φ_pad/N,) this rank's slice
            mine.grad = torch.zeros_like(mine)  # (Φ_pad/N,) averaged gradient slice
            self.flats.append(flat), self.shards.append(mine), self.numels.append(numel)
            local_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [mine]})
        self.param_lists = [ps for ps in self.param_lists if ps]
        # one group: the attributes the runner (torch_impl/dp.py) and checkpoints read
        self.flat, self.shard, self.numel = self.flats[0], self.shards[0], self.numels[0]
        self.local = optimizer_cls(local_groups, **kwargs)  # state for 1/N of the parameters
        super().__init__([{"params": [s]} for s in self.shards], self.local.defaults)
        self.param_groups, self.state = self.local.param_groups, self.local.state  # the ones that step
        self._reduced = False
        fix = ("clip with opt.clip_grad_norm_(max_norm) before opt.step() (it reduce-scatters first, then clips by the "
               "global norm)")
        for p in self.params:  # torch's clip_grad_norm_ before step() would see the unreduced LOCAL gradient
            p.register_post_accumulate_grad_hook(lambda p, fix=fix: recipe.seal([p.grad], "Zero1Optimizer", fix))

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """Per step: per group one reduce-scatter and one all-gather of its flat Φ padded to N."""
        out: dict[str, tuple[int, int]] = {}
        for ps in self.param_lists:
            for op, (k, b) in theory.zero1_comm(theory.describe(ps), self.n).items():
                out[op] = (out.get(op, (0, 0))[0] + k, out.get(op, (0, 0))[1] + b)
        return recipe.with_clip(out, self.shard.element_size(), getattr(self, "clipped", False))

    def state_theory(self) -> dict[str, int]:
        """Per rank: the flat padded parameters, full gradients, AdamW state of this rank's slice."""
        return theory.zero1_state(self._infos, self.n)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()
        self._reduced = False

    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("Zero1Optimizer.step takes no closure (LBFGS-style re-evaluation is not sharded)")
        if not self._reduced:
            self.reduce_gradients()
        self.update()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (torch's clip_grad_norm_ on one process), and clip by it: after the
        reduce-scatter (done here if not yet), each rank's averaged slices are disjoint pieces of the
        mean gradient, so Σ slice² all-reduced (one scalar) is ‖g‖². Call before ``step()``."""
        if not self._reduced:
            self.reduce_gradients()
        self.clipped = True  # comm_theory: + the norm's scalar all-reduce
        return recipe.clip_([s.grad for s in self.shards], [], max_norm, self.group, self.shard.dtype)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the local gradients: this rank's slice of their mean in shard.grad, per group."""
        for ps, flat, mine, numel in zip(self.param_lists, self.flats, self.shards, self.numels):
            grads = torch.zeros_like(flat)  # (Φ_pad,) this rank's local gradients, flat
            if any(p.grad is None for p in ps):
                missing = next(i for i, p in enumerate(ps) if p.grad is None)
                raise RuntimeError(f"Zero1Optimizer: trainable parameter #{missing} {tuple(ps[missing].shape)} has no "
                                   "gradient (it took no part in the loss). Fix: freeze it (requires_grad=False) "
                                   "before building the optimizer, or use it")
            recipe.check_sealed(p.grad for p in ps)
            torch.cat([p.grad.reshape(-1) for p in ps], out=grads[:numel])
            dist.reduce_scatter_single(mine.grad, grads, group=self.group)  # (Φ_pad/N,) summed
            mine.grad.div_(dist.get_world_size(self.group))
        self._reduced = True

    @torch.no_grad()
    def update(self) -> None:
        """The optimizer on this rank's slices, then all-gather the updated parameters."""
        self.local.step()  # AdamW on this rank's slices only, in place in the flats
        for flat, mine in zip(self.flats, self.shards):
            dist.all_gather_single(flat, mine, group=self.group)  # in place: (Φ_pad,)
        self._reduced = False

    def gather_flat(self, shard: torch.Tensor, index: int = 0) -> list[torch.Tensor]:
        """Every rank's (Φ_pad/N,) slice of group ``index``, gathered and cut back into per-parameter
        tensors (for inspection, not training)."""
        full = torch.empty_like(self.flats[index])  # (Φ_pad,)
        dist.all_gather_single(full, shard, group=self.group)
        return list(_unflatten_dense_tensors(full[:self.numels[index]], self.param_lists[index]))
