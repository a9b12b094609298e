"""ZeRO-2 / ZeRO-3 (FSDP) with torch.distributed, the runner, for the MLP and the transformer.

Sharded: the batch as in DP; each parameter with >= 2 dims is a "unit" split along dim 0 (padded
to a multiple of N); vectors (norm gains) stay replicated, their gradients averaged by ONE flat
all-reduce. The wrappers (model-generic): torch_impl/parallel/fsdp.py.

explicit/zero3  ``FSDP(module)``: params, grads, AdamW state sharded.
    fwd: each unit all-gathered just before its module runs (the next one prefetched), then dropped.
    bwd: re-gathered where autograd needs the weight (not embeddings, not the MLP's layer 0);
         each unit's gradient reduce-scattered asynchronously; the vectors' one all-reduce.
    bytes: MLP 3Φb − D²b; transformer 3Φb − (V+T)·D·b − (2L+1)·D·b (shared.theory.fsdp_comm).
explicit/zero2  ``Zero2(module)``: full params; each matrix's gradient reduce-scattered as autograd
    produces it; AdamW on the row shards; the updated shards all-gathered:
    2·(Φ − vectors)·b + vectors·b.
builtin/fsdp2   ``fully_shard`` per block and on the root: per block an all-gather fwd, again bwd,
    one reduce-scatter; the root gathered once (shared.theory.fsdp_comm(cfg, "fsdp2")).
compiled/fsdp2  the same with each block compiled (torch_impl/compiled.py): the same collectives, eager.

Mixed precision (--precision mixed): float32 shards and AdamW state, the step under autocast;
zero3 ``FSDP(compute_dtype=bf16)`` and fsdp2 ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=float32)`` cast before the all-gather (2-byte gathers, 4-byte reductions; their reference
makes the same casts: MIXED_CASTS); zero2 gathers and reduces float32. float16: the same with dynamic
loss scaling (torch_impl/recipe.loss_scaler; DTensor gradients unscaled locally), + one 4-byte all-reduce.
Gradient scale: each rank differentiates its local mean; the reduce-scatter sums the N gradients,
then / N. docs/fsdp.md has the hooks, the refusals (ShardReadError) and the "bit for bit" check.
Papers: ZeRO, Rajbhandari et al. 2020 (arXiv:1910.02054); FSDP, Zhao et al. 2023 (arXiv:2304.11277).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shared.config import Config
from shared.problem import Problem
from shared.theory import fsdp_comm_bytes
from torch_impl import compiled, recipe
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import (
    TORCH_DTYPES,
    build_model,
    inputs,
    loss_fn,
    optimizer_state_bytes,
    targets,
    tensor_bytes,
    to_fixture,
)
from torch_impl.parallel.fsdp import FSDP, Zero2, gather_full
from torch_impl.parallel.theory import comm_bytes

VARIANTS = (("explicit", "zero3"), ("explicit", "zero2"), ("builtin", "fsdp2"))
# The compiled style (torch_impl/compiled.py): FSDP2 with each block compiled (torchtitan's per-block compile).
COMPILED = (("compiled", "fsdp2"),)
# Mixed precision: zero3 (FSDP(compute_dtype=bf16)) and fsdp2 (MixedPrecisionPolicy) cast every weight and
# every float input of a sharded module to bf16 before computing, not only autocast's ops: their
# single-device reference makes the same casts (torch_impl/reference.py, casts="params").
MIXED_CASTS = {"zero3": "params", "fsdp2": "params"}


# --- builtin/fsdp2 -----------------------------------------------------------------------------


def fsdp2_model(model: nn.Module, ctx: RankContext, cfg: Config | None = None, compile: bool = False) -> nn.Module:
    """``fully_shard`` per block and on the root; mixed precision (cfg.precision "mixed") through FSDP2's
    own ``MixedPrecisionPolicy``: float32 shards (master weights, AdamW state), cast to bf16 before the
    all-gather (bf16 bytes on the wire), gradients reduce-scattered in float32."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    mp = {}
    if cfg is not None and cfg.precision == "mixed":
        mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[cfg.dtype], reduce_dtype=torch.float32)}
    for block in getattr(model, "blocks", None) or model.layers:
        fully_shard(block, mesh=mesh, **mp)  # one all-gather / reduce-scatter group per block
        if compile:  # the block's compute compiled; FSDP2's hooks (gathers, reduce-scatters) stay eager
            compiled.compile_units(block, [""])
    fully_shard(model, mesh=mesh, **mp)  # root: the embeddings, final norm and head (MLP: nothing)
    return model


# --- one Setup per variant, one loop for all ---------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext):
    if (style, variant) not in VARIANTS + COMPILED:
        raise ValueError(f"fsdp: unknown torch variant {style}/{variant}; choose from {VARIANTS + COMPILED}")
    cfg.check("fsdp", "torch")
    n, group, rows = ctx.world_size, ctx.group, cfg.batch // ctx.world_size
    mine = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    x, y = inputs(cfg, problem, ctx.device)[mine], targets(cfg, problem, ctx.device)  # (B/N, D) | (B/N, T)
    y = None if y is None else y[mine]  # (B/N, T)
    assert x.shape[0] == cfg.batch // n, x.shape
    model = build_model(cfg, problem, ctx.device)  # every rank: the same fixture, then sharded
    names = [name for name, _ in model.named_parameters()]
    fixture = lambda full: lambda ts: [to_fixture(model, nm, full(nm, t)) for nm, t in zip(names, ts)]
    # zero3 / fsdp2: the Config formula (zero3's backward re-gathers depend on what the forward keeps,
    # FSDP.comm_theory() reads that after one; fsdp2 groups per block); zero2: from the module below
    mixed = cfg.precision == "mixed"  # zero3 and fsdp2 cast the float32 shards to bf16 before the gather
    comm_theory = fsdp_comm_bytes(cfg, variant, cast_gather=mixed)

    recipe.freeze_(model, cfg)  # before wrapping: frozen parameters are gathered, never reduce-scattered
    scaler = recipe.loss_scaler(cfg, group, share=n)  # float16: the skip agreed (4 bytes); local means averaged
    comm_theory += recipe.scaler_bytes(cfg)
    if variant == "zero3":
        fsdp = FSDP(model, compute_dtype=TORCH_DTYPES[cfg.dtype] if mixed else None, group=group)
        params = [p for _, p in fsdp.module.named_parameters()]  # shards + replicated vectors
        opt = recipe.optimizer(fsdp.module.named_parameters(), cfg)  # shards keep the names, stay >= 2-D
        if cfg.accumulate > 1:  # every micro-batch gathers again: K times the all-gathers
            comm_theory = fsdp_comm_bytes(cfg, variant, cast_gather=mixed, gathers=cfg.accumulate) + \
                recipe.scaler_bytes(cfg)
        comm_theory += recipe.clip_bytes(cfg)  # the norm: the shards' squares all-reduced

        def forward_backward():
            opt.zero_grad(set_to_none=True)
            loss = recipe.accumulate(cfg, x, y, lambda xs, ys: loss_fn(fsdp(xs), ys), fsdp.no_sync, scaler)
            fsdp.finish_gradient_synchronization()
            return loss

        update = recipe.stepper(opt, cfg, fsdp.clip_grad_norm_, scaler=scaler)
        return train_loop(cfg, ctx, Setup(forward_backward, update, lambda: [p.grad for p in params],
                                          fixture(fsdp.full_tensor), params, opt,
                                          None if cfg.freeze else comm_theory, group=group,  # frozen: not modelled
                                          extra={"shard": "dim 0 of each ≥2-D parameter (Linear: columns of W)"},
                                          scaler=scaler))
    if variant == "zero2":
        zero2 = Zero2(model, group)
        comm_theory = comm_bytes(zero2.comm_theory()) + recipe.clip_bytes(cfg) + recipe.scaler_bytes(cfg)
        params = model.parameters()
        opt = recipe.optimizer(zero2.named_parameters(), cfg)  # row shards (>= 2-D) and the vectors

        def forward_backward():
            opt.zero_grad(set_to_none=True)
            loss = recipe.accumulate(cfg, x, y, lambda xs, ys: loss_fn(model(xs), ys), zero2.no_sync, scaler)
            zero2.finish_gradient_synchronization()
            return loss

        update = recipe.stepper(opt, cfg, zero2.clip_grad_norm_, zero2.all_gather_params, scaler)

        full = lambda nm, t: gather_full(zero2.units[nm], t, group) if nm in zero2.units else t.detach()
        state = lambda: {"params": tensor_bytes(model.parameters()),
                         "grads": tensor_bytes(p.grad for p in zero2.params if p.grad is not None),
                         "optimizer": optimizer_state_bytes(opt)}
        whole = dict(model.named_parameters())  # frozen ones are not in zero2.params: the model's, zero gradient
        fill = lambda none: lambda ts: fixture(full)([dict(zip(zero2.names, ts)).get(nm, none(whole[nm]))
                                                      for nm in names])
        return train_loop(cfg, ctx, Setup(forward_backward, update, lambda: [p.grad for p in zero2.params],
                                          fill(lambda p: p), zero2.params, opt, comm_theory, group=group,
                                          state=state, extra={"shard": "dim 0 of each ≥2-D parameter"},
                                          grads_fixture=fill(torch.zeros_like), scaler=scaler))
    if style == "compiled":
        compiled.begin(ctx.device.type)
    model = fsdp2_model(model, ctx, cfg, compile=style == "compiled")
    params = list(model.parameters())  # DTensors, Shard(0)
    opt = recipe.optimizer(model.named_parameters(), cfg)
    if cfg.accumulate > 1:
        comm_theory = fsdp_comm_bytes(cfg, variant, cast_gather=mixed, gathers=cfg.accumulate) + \
            recipe.scaler_bytes(cfg)
    # torch's clip_grad_norm_ over the DTensors: ONE all-reduce of the stacked per-tensor norms (a vector)
    comm_theory += recipe.clip_bytes(cfg, groups=sum(p.requires_grad for p in params))

    @contextlib.contextmanager
    def quiet():  # FSDP2's accumulation: no reduce-scatter for this backward
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def forward_backward():
        opt.zero_grad(set_to_none=True)
        # FSDP2 reduce-scatters with the mean over ranks: no / N here
        return recipe.accumulate(cfg, x, y, lambda xs, ys: loss_fn(model(xs), ys), quiet, scaler)

    update = recipe.stepper(opt, cfg, lambda c: torch.nn.utils.clip_grad_norm_(
        [p for p in params if p.requires_grad], c), scaler=scaler)

    full = lambda nm, t: t.full_tensor() if isinstance(t, DTensor) else t.detach()
    return train_loop(cfg, ctx, Setup(forward_backward, update, lambda: [p.grad for p in params],
                                      fixture(full), params, opt, None if cfg.freeze else comm_theory, group=group,
                                      extra={"shard": "dim 0 of each parameter (DTensor Shard(0))"}, scaler=scaler,
                                      compiled=compiled.units(cfg) if style == "compiled" else None))
