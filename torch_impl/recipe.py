"""The recipe of compare.py's own runs in torch (shared/recipe.py says what each flag means): the
pieces every runner and the single-device reference share, so that they apply it the same way.

    freeze_(model, cfg)                    requires_grad=False on the frozen globs, BEFORE any wrapper
    opt = optimizer(named, cfg)            AdamW; --decay-mask: param groups (matrices decayed, vectors not)
    loss = accumulate(cfg, x, y, f, quiet) K micro-batches, loss/K each; ``quiet()`` around all but the last
    update = stepper(opt, cfg, clip)       clip (the layout's global norm), opt.step(), the LambdaLR step
    scaler = loss_scaler(cfg, group)       --dtype float16: a LossScaler (None otherwise); accumulate scales
                                           the loss, stepper unscales, skips (everywhere) or steps, updates

Clipping is the layout's own call (torch_impl/parallel/recipe.py computes the GLOBAL norm: one all-reduce
of one scalar per sharded group; none where every rank holds the whole averaged gradient). Accumulation
skips the gradient reduction of all but the last micro-batch through the wrapper's ``no_sync`` (DDP,
BucketedDDP, FSDP, Zero2) or FSDP2's ``set_requires_gradient_sync``; naive DP and ZeRO-1 reduce after
the last backward anyway. The reported loss is the mean of the parts' losses (equal parts: the batch's).
float16 (mixed): dynamic loss scaling with shared.recipe.LOSS_SCALE (torch.amp.GradScaler's defaults);
the found-inf flag is all-reduced (MAX, one float32: ``scaler_bytes``) over the run's group, so every
rank skips the same steps; a skipped step steps neither AdamW nor the schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from shared.config import Config
from shared.recipe import LOSS_SCALE, decays, is_frozen, lr_factors
from torch_impl.model import make_optimizer
from torch_impl.parallel.recipe import LossScaler


def freeze_(model: torch.nn.Module, cfg: Config) -> None:
    """Freeze the parameters whose (fixture) names match cfg.freeze; call before wrapping the model."""
    for name, p in model.named_parameters():
        if is_frozen(name, cfg.freeze):
            p.requires_grad_(False)


def param_groups(named, cfg: Config):
    """The trainable parameters, as AdamW's param groups: one group (every parameter decayed) or, with
    cfg.decay_mask, the matrices (>= 2 dims: shards of them stay >= 2-D) and the vectors (no decay)."""
    named = [(n, p) for n, p in named if p.requires_grad]
    if not cfg.decay_mask:
        return [p for _, p in named]
    groups = [{"params": [p for _, p in named if decays(p.shape)], "weight_decay": cfg.weight_decay},
              {"params": [p for _, p in named if not decays(p.shape)], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def optimizer(named, cfg: Config) -> torch.optim.Optimizer:
    """AdamW over ``named`` ((name, parameter) pairs) with the recipe's groups."""
    return make_optimizer(param_groups(named, cfg), cfg)


def scheduler(opt, cfg: Config):
    """LambdaLR over shared.recipe.lr_factors (None for the constant schedule)."""
    if cfg.schedule == "constant":
        return None
    table = lr_factors(cfg.schedule, cfg.steps)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: table[min(k, len(table) - 1)])


def parts(x: torch.Tensor, y: torch.Tensor | None, k: int):
    """The K micro-batches of this rank's rows (equal: Config.check refuses B/N % K)."""
    return list(zip(x.chunk(k), [None] * k if y is None else y.chunk(k)))


def loss_scaler(cfg: Config, group=None, reduce: bool = True, share: int = 1) -> LossScaler | None:
    """--dtype float16 (mixed): the run's LossScaler, the skip agreed over ``group`` (``reduce=False``: one
    process, the reference; ``share``: the ranks whose local-mean gradients the layout averages, so each
    rank's scaled float16 gradients have the reference's magnitude); None for every other dtype."""
    if cfg.dtype != "float16":
        return None
    return LossScaler(group, LOSS_SCALE["init"], LOSS_SCALE["growth"], LOSS_SCALE["backoff"], LOSS_SCALE["interval"],
                      reduce=reduce, share=share)


def scaler_bytes(cfg: Config) -> int:
    """The found-inf flag's all-reduce per step per rank (one float32) under float16, else 0."""
    return 4 if cfg.dtype == "float16" else 0


def backward(loss: torch.Tensor, scaler: LossScaler | None = None) -> None:
    """``loss.backward()``, of the scaled loss under a LossScaler."""
    (loss if scaler is None else scaler.scale(loss)).backward()


def accumulate(cfg: Config, x, y, loss_of: Callable, quiet: Callable | None = None,
               scaler: LossScaler | None = None) -> torch.Tensor:
    """Forward and backward of cfg.accumulate micro-batches (loss / K each, gradients summed in p.grad);
    ``quiet()``: the context that skips the gradient reduction, around all but the last; ``scaler``:
    the loss scaled before backward. Returns the detached mean loss (unscaled)."""
    k, total = cfg.accumulate, None
    for i, (xs, ys) in enumerate(parts(x, y, k)):
        with quiet() if quiet is not None and i < k - 1 else contextlib.nullcontext():
            loss = loss_of(xs, ys) / k if k > 1 else loss_of(xs, ys)
            backward(loss, scaler)
        total = loss.detach() if total is None else total + loss.detach()
    return total


def stepper(opt, cfg: Config, clip: Callable[[float], object] | None = None, after: Callable | None = None,
            scaler: LossScaler | None = None):
    """The update: ``scaler.unscale_`` (float16: an inf / NaN on any rank skips the rest, everywhere),
    ``clip(max_norm)`` (when cfg.clip), ``opt.step()``, ``after()`` (e.g. ZeRO-2's all-gather), the
    schedule's step, ``scaler.update()``."""
    sched = scheduler(opt, cfg)

    def update() -> None:
        if scaler is not None and scaler.unscale_(opt):
            scaler.update()  # skipped: no clip, no step, no all-gather, no schedule step
            return
        if cfg.clip is not None:
            clip(cfg.clip)
        opt.step()
        if after is not None:
            after()
        if sched is not None:
            sched.step()
        if scaler is not None:
            scaler.update()

    return update


def local_clip(params) -> Callable[[float], torch.Tensor]:
    """Clipping where every rank holds the whole (averaged) gradient: torch's own, no communication."""
    trainable = [p for p in params if p.requires_grad]
    return lambda max_norm: torch.nn.utils.clip_grad_norm_(trainable, max_norm)


def clip_bytes(cfg: Config, groups: int = 1) -> int:
    """The norm's collective per step per rank: one scalar all-reduced per sharded group (0 unclipped)."""
    return 0 if cfg.clip is None else groups * cfg.bytes_per_element
