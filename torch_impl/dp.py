"""Data parallelism (DP) and ZeRO-1 with torch.distributed, the runner: every rank holds the whole
model, trains on its slice of the batch, and the gradients are averaged before the update.

Sharded: the batch only (rank r: rows r·B/N … (r+1)·B/N). Weights and gradients are replicated;
so is the AdamW state, except in ZeRO-1, which splits it in N slices.

    explicit/naive     after backward, one blocking all-reduce per gradient (CS336 lecture 8)
    explicit/bucketed  DDP-style buckets in reverse order, each all-reduced asynchronously from
                       gradient hooks during backward (overlapping the rest of it)
    explicit/zero1     reduce-scatter the gradients, AdamW on this rank's 1/N, all-gather params
    builtin/ddp        torch.nn.parallel.DistributedDataParallel
    compiled/ddp       torch.compile(DDP(model)) (torch_impl/compiled.py): the same all-reduce, eager

Collectives: none in forward; in backward an all-reduce of every gradient (zero1: a reduce-scatter,
then an all-gather of the updated parameters after the step).
Bytes per step per rank (payload S as nccl-tests counts it; shared/theory/dp.py): dp, bucketed,
DDP Φ·b; zero1 2·Φ·b (the same wire traffic as one all-reduce: ZeRO-1 saves memory, not bytes).
``comm_theory`` comes from the module wrapped (torch_impl/parallel/theory.py), right for any module.
The loss is averaged over ranks after the recorded step, outside the ledger.

Mixed precision (--precision mixed): float32 parameters, gradients and AdamW state, the step under
autocast (bf16 / float16 matmuls); every reduction moves the float32 gradients (4 bytes per element).
float16: dynamic loss scaling (torch_impl/recipe.loss_scaler), + one 4-byte all-reduce of the found-inf flag.
The wrappers live in torch_impl/parallel/dp.py; this runner builds the project's models around them
(make_setup) and runs them through harness.train_loop.
Papers: PyTorch DDP, Li et al. 2020 (arXiv:2006.15704); ZeRO, Rajbhandari et al. 2020 (arXiv:1910.02054).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from torch_impl import compiled, recipe
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
from torch_impl.parallel.dp import BucketedDDP, Zero1Optimizer, allreduce_gradients, local_batch
from torch_impl.parallel.theory import comm_bytes, dp_comm

VARIANTS = (("explicit", "naive"), ("explicit", "bucketed"), ("explicit", "zero1"), ("builtin", "ddp"))
# The compiled style (torch_impl/compiled.py; compare.py --styles compiled): torch.compile(DDP(model)).
COMPILED = (("compiled", "ddp"),)


# --- the dp Setup: what one step does, for any model --------------------------------------------

def make_setup(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Setup:
    """One dp variant's step on this rank, for any model (the loop: torch_impl.harness.train_loop)."""
    cfg.check("dp", "torch")
    if (style, variant) not in VARIANTS + COMPILED:
        raise ValueError(f"dp: unknown style/variant {style}/{variant}; choose from {VARIANTS + COMPILED}")
    n, group = ctx.world_size, ctx.group
    model = build_model(cfg, problem, ctx.device)
    x = local_batch(inputs(cfg, problem, ctx.device), ctx.rank, n)  # MLP (B/dp, D) | tokens (B/dp, T)
    y = targets(cfg, problem, ctx.device)  # None | (B, T) next-token ids
    y = None if y is None else local_batch(y, ctx.rank, n)  # (B/dp, T)
    assert x.shape[0] == cfg.batch // n, x.shape
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    recipe.freeze_(model, cfg)  # before any wrapper: frozen parameters get no hook, bucket or slice
    groups = recipe.param_groups(model.named_parameters(), cfg)  # --decay-mask: matrices / vectors
    net, sync, quiet, clip = model, lambda: None, None, recipe.local_clip(params)
    scaler = recipe.loss_scaler(cfg, group, share=n)  # float16: the skip agreed; local means averaged over n
    if variant == "naive":
        opt = make_optimizer(groups, cfg)
        sync = lambda: allreduce_gradients(model, group)
    elif variant == "bucketed":
        net = BucketedDDP(model, cfg.bucket_mb, group)
        opt, sync, quiet, clip = make_optimizer(groups, cfg), net.finish_gradient_synchronization, net.no_sync, \
            net.clip_grad_norm_
    elif variant == "zero1":
        opt = Zero1Optimizer(groups, torch.optim.AdamW, group, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, weight_decay=cfg.weight_decay)
        sync, clip = opt.reduce_gradients, opt.clip_grad_norm_  # reduce-scatter; then the slices' global norm
    else:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=device_ids, process_group=group,
                                      bucket_cap_mb=cfg.bucket_mb)
        opt, quiet = make_optimizer(groups, cfg), net.no_sync
        if style == "compiled":  # torch's documented way: compile the DDP module (DDPOptimizer splits the
            compiled.begin(ctx.device.type)  # graph at DDP's buckets; the reducer all-reduces eagerly)
            net = torch.compile(net)

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        # local mean over this rank's B/dp rows (· T positions); --accumulate K: K parts, reduced once
        loss = recipe.accumulate(cfg, x, y, lambda xs, ys: loss_fn(net(xs), ys), quiet, scaler)
        sync()  # gradients averaged over ranks (zero1: this rank's averaged slice)
        return loss

    def fixture(tensors: list[torch.Tensor]) -> list:
        return [to_fixture(model, name, t) for name, t in zip(names, tensors)]

    zero1 = variant == "zero1"
    theory = opt.comm_theory() if zero1 else net.comm_theory() if variant == "bucketed" else dp_comm(model)
    # + the norm's scalar all-reduce (zero1: the slices are sharded; the others hold the whole gradient)
    extra_bytes = (recipe.clip_bytes(cfg) if zero1 else 0) + recipe.scaler_bytes(cfg)  # + float16's found-inf flag
    buckets = [b["flat"] for b in getattr(net, "buckets", [])]
    state = lambda: {"params": tensor_bytes(opt.flats if zero1 else params),  # zero1: flat, padded
                     "grads": tensor_bytes(buckets or params),  # bucketed: p.grad are bucket views
                     "optimizer": optimizer_state_bytes(opt.local if zero1 else opt)}
    return Setup(
        forward_backward=forward_backward,
        # clip, AdamW (zero1: on the slice + all-gather), the schedule
        update=recipe.stepper(opt, cfg, clip, scaler=scaler),
        grads=(lambda: [s.grad for s in opt.shards]) if zero1 else (lambda: [p.grad for p in params]),
        fixture=fixture,
        grads_fixture=(lambda g: fixture(zero1_grads(opt, params, g))) if zero1 else None,
        params=params,
        optimizer=opt,
        comm_theory=comm_bytes(theory) + extra_bytes,  # from the model wrapped (= shared.theory's on ours)
        loss_reduction="mean",  # equal shards: the mean of local means is the global mean
        group=group,
        state=state,
        extra={"local_batch": cfg.batch // n, "bucket_bytes": [tensor_bytes([b]) for b in buckets]},
        scaler=scaler,
        compiled=[""] if style == "compiled" else None,  # "": the whole DDP module
    )


def zero1_grads(opt: Zero1Optimizer, params, slices) -> list[torch.Tensor]:
    """ZeRO-1's averaged gradient slices (one per param group) gathered back into one tensor per
    parameter, in ``params`` order; a frozen parameter (in no group) as zeros."""
    full = {id(p): g for i, s in enumerate(slices) for p, g in zip(opt.param_lists[i], opt.gather_flat(s, i))}
    return [full.get(id(p), torch.zeros_like(p)) for p in params]


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    return train_loop(cfg, ctx, make_setup(cfg, problem, style, variant, ctx))
