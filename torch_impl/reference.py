"""Single-device reference: the shared model (MLP or transformer) trained with AdamW on one device.

Every parallel implementation is checked against this run (same fixture, same steps). Mixed precision
(cfg.precision "mixed"): float32 parameters and AdamW state, the forward and backward under
``torch.autocast`` to bfloat16 / float16 — the casts every mixed run makes; float16 with the runs' dynamic
loss scaling (torch_impl/recipe.loss_scaler, a local skip decision: one process). ``split=2`` trains the same run with
each step's batch cut in two halves whose gradients are added (the mixed runs' measured floor:
shared/tolerances.py; the MoE transformer: ``moe_step``, f of the balancing loss from the whole micro-batch).
The MoE transformer under --accumulate K: each micro-batch with its own balancing loss (``moe_step``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from torch_impl import recipe
from torch_impl.model import (
    TORCH_DTYPES,
    autocast,
    aux_loss,
    build_model,
    expert_load,
    fixture_grads,
    fixture_weights,
    inputs,
    loss_fn,
    optimizer_state_bytes,
    targets,
    tensor_bytes,
)
from torch_impl.transformer import MoE


def train(cfg: Config, problem: Problem, device="cpu", split: int = 1, casts: str = "autocast") -> Trained:
    """``casts`` (mixed precision): "autocast" — autocast's casts only; "params" — every parameter and
    the float input cast to the compute dtype first, as FSDP2's MixedPrecisionPolicy (param_dtype=bf16)
    and FSDP(compute_dtype=bf16) do (the gradient of each cast is the float32 parameter's)."""
    model = build_model(cfg, problem, device)
    recipe.freeze_(model, cfg)  # the recipe (torch_impl/recipe.py): frozen globs, decay mask, schedule, clip, K
    opt = recipe.optimizer(model.named_parameters(), cfg)
    scaler = recipe.loss_scaler(cfg, reduce=False)  # float16: the same scaling, skips and scale as the runs
    update = recipe.stepper(opt, cfg, recipe.local_clip(model.parameters()), scaler=scaler)
    x, y = inputs(cfg, problem, device), targets(cfg, problem, device)  # (B, D) | (B, T), None | (B, T)
    if cfg.precision == "mixed" and casts == "params":
        low = TORCH_DTYPES[cfg.dtype]
        net = lambda xs: torch.func.functional_call(  # noqa: E731
            model, {n: p.to(low) for n, p in model.named_parameters()}, (xs.to(low) if xs.is_floating_point() else xs,))
    else:
        net = model
    losses, step_times, grads0, loads = [], [], None, []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if cfg.moe:  # + the balancing loss of every MoE layer, per micro-batch; its routing: (L, B, E) counts
            loss, load = moe_step(cfg, model, net, x, y, split, scaler)
            loads.append(load)
        elif split > 1:  # the same step over the batch in `split` equal parts, gradients added;
            n = split * cfg.accumulate  # --accumulate K: each of its K parts in `split` (else the same sums)
            loss = 0.0
            for xs, ys in zip(x.chunk(n), [None] * n if y is None else y.chunk(n)):
                with autocast(cfg, device):
                    part = loss_fn(net(xs), ys) / n
                    recipe.backward(part, scaler)
                loss = loss + part.detach()
        elif cfg.accumulate > 1:  # K micro-batches, loss / K each (the recipe's accumulation)
            loss = recipe.accumulate(cfg, x, y, lambda xs, ys: loss_fn(net(xs), ys), scaler=scaler)
        else:
            with autocast(cfg, device):
                loss = loss_fn(net(x), y)
                recipe.backward(loss, scaler)
        if step == 0:  # float16: the true (unscaled) gradients; a power of 2, exact
            grads0 = [g / (scaler.get_scale() if scaler else 1.0) for g in fixture_grads(model)]
        update()  # clip (torch's clip_grad_norm_: the whole model is here), AdamW, the schedule
        losses.append(loss.item())  # .item() syncs, so the step time is real on GPU too
        step_times.append(time.perf_counter() - t0)
    params = list(model.parameters())
    return Trained(
        losses=losses,
        grads0=grads0,
        params=fixture_weights(model),
        step_times=step_times,
        timed=[k > 0 for k in range(len(step_times))],  # step 0: warm-up and the step-0 gradients' copy
        state_bytes={
            "params": tensor_bytes(params),
            "grads": tensor_bytes(params),
            "optimizer": optimizer_state_bytes(opt),
        },
        extra=({"expert_load": np.stack(loads)} if cfg.moe else {})  # (steps, L, B, E) int64
        | ({"loss_scale": scaler.get_scale(), "skipped_steps": list(scaler.skipped_at)} if scaler else {}),
    )


def moe_step(cfg: Config, model, net, x, y, split: int, scaler) -> tuple[torch.Tensor, np.ndarray]:
    """The MoE transformer's forward and backward of one step: mean CE + Σ_l aux_l of each of the
    cfg.accumulate micro-batches (B/K whole sequences, in order; loss / K each: a micro-batch's balancing
    loss from ITS routing, as Megatron-LM's per-micro-batch aux loss), their routing (L, B, E) in batch order.
    ``split`` > 1 (the mixed runs' floor): each micro-batch in ``split`` parts whose gradients are added, the
    balancing loss's f from the whole micro-batch's counts (a no-grad pass first: f is a constant) and P from
    the part — what ep's ranks compute — so the parts sum to the micro-batch's gradient up to rounding."""
    k, device = cfg.accumulate, x.device
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    total, loads = None, []
    for xk, yk in zip(x.chunk(k), y.chunk(k)):
        if split > 1:
            with torch.no_grad(), autocast(cfg, device):
                net(xk)
            counts = [m.load.sum(0) for m in moes]  # (E,) per layer over the micro-batch
            for m, c in zip(moes, counts):
                m.global_counts = lambda _, c=c: c
        try:
            for xs, ys in zip(xk.chunk(split), yk.chunk(split)):
                with autocast(cfg, device):
                    part = (loss_fn(net(xs), ys) + aux_loss(model)) / (k * split)
                    recipe.backward(part, scaler)
                loads.append(expert_load(model))
                total = part.detach() if total is None else total + part.detach()
        finally:
            for m in moes:
                m.global_counts = None
    return total, np.concatenate(loads, axis=1)  # (L, B, E)
