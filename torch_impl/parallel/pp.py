"""Pipeline parallelism (GPipe, 1F1B) for any ``nn.Module`` that offers a stage split, over
torch.distributed.pipelining: the twin of jax_impl/parallel/pp.py. (The project's hand-written
schedules: torch_impl/pp.py.)

The seam: a forward that IS a chain of submodules, given as module paths per stage —
``stages=[["embed", "blocks.0"], ["blocks.1", "norm", "head"]]`` — checked on the first micro-batch;
every parameter in one stage; the same activation shape and dtype at every boundary; the loss a mean
over the micro-batch's rows, on the last stage's output.

    trainer = pipeline(model, stages, loss, lambda ps: torch.optim.AdamW(ps), group, microbatches=4)
    loss_value = trainer.train_step(x, y)   # the full batch on every rank; the loss on every rank
    trainer.train_step(x, y, accumulate=2, max_norm=1.0)  # 2 batches of B/2 per step, clipped by the global norm
    trainer.train_step(x, y, scaler=recipe.LossScaler(group))  # float16 under autocast: loss scaling, skip agreed

Sharded: stage s's parameters, gradients and optimizer state on rank s; the batch cut into M
micro-batches (inputs read by stage 0, targets by stage S−1); ``scale_grads=True`` divides the
summed micro-batch gradients by M. The trainer steps the optimizer itself: torch's ``clip_grad_norm_``
inside that optimizer (a step pre-hook, a subclass's ``step``) would clip each stage by its own norm,
so it is refused at the step (``recipe.sealed_step``: LocalClipError; the first step's update undone).
Collectives: none; send/recv of the message forward and its gradient back across each boundary
the rank touches: M·((s < S−1) + (s > 0)) messages of (B/M, …)·b on stage s, and one broadcast of
the loss from the last stage (b).
Papers: GPipe, Huang et al. 2019 (arXiv:1811.06965); 1F1B, Narayanan et al. 2021 (arXiv:2104.04473).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from torch_impl.parallel import recipe
from torch_impl.parallel.ep import refuse_split_experts

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
CLIP_FIX = ("clip with trainer.train_step(x, y, max_norm=...) (the stages' squares summed over the pipeline), "
            "not torch.nn.utils.clip_grad_norm_ inside the optimizer's step")


class StageError(ValueError):
    """A model or stage split that the pipeline cannot compute exactly."""


def _owner(name: str, stage_of: dict[str, int]) -> int | None:
    return next((s for path, s in stage_of.items() if name == path or name.startswith(path + ".")), None)


def check_stages(model: nn.Module, stages: Sequence[Sequence[str]], world_size: int) -> list[list[nn.Module]]:
    """The stage split's static checks (no process group needed); returns each stage's modules."""
    if len(stages) != world_size:
        raise StageError(f"pp: {len(stages)} stages for a group of {world_size} ranks: give one module list per rank")
    mods = dict(model.named_modules())
    listed = [p for stage in stages for p in stage]
    for p in listed:
        if p not in mods or not p:
            raise StageError(f"pp: {p!r} is not a submodule path of {type(model).__name__} "
                             f"(some: {', '.join(q for q in mods if q)[:200]}); fix the stage list")
        if listed.count(p) > 1:
            raise StageError(f"pp: {p!r} is listed twice; each module runs in one stage")
    stage_of = {p: s for s, stage in enumerate(stages) for p in stage}
    holders: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if _owner(name, stage_of) is None:
            raise StageError(f"pp: parameter {name!r} is in no stage (every parameter must be in one: a bare "
                             "parameter on the root cannot be pipelined; move it into a submodule listed in a stage)")
        holders.setdefault(id(p), []).append(name)
    for names in holders.values():
        if len({_owner(n, stage_of) for n in names}) > 1:
            raise StageError(f"pp: one parameter is held by {', '.join(map(repr, names))} in different stages "
                             "(tied); put its users in one stage or untie it")
    return [[mods[p] for p in stage] for stage in stages]


@torch.no_grad()
def check_chain(model: nn.Module, stages: list[list[nn.Module]], x: torch.Tensor, dtypes: bool = False):
    """Run the chain on ``x`` (one micro-batch); refuse if it is not model(x) or the messages differ.
    Returns every stage's output shape (``dtypes``: and the list of their dtypes: under autocast the
    compute dtype's)."""
    h, shapes = x, []
    for modules in stages:
        for m in modules:
            h = m(h)
        shapes.append((h.shape, h.dtype))
    if len(set(shapes[:-1])) > 1:
        raise StageError(f"pp: the stage boundaries carry different activations {shapes[:-1]}: a pipeline sends one "
                         "message shape; move the modules that change it into the first or the last stage")
    whole = model(x)
    if not isinstance(whole, torch.Tensor) or whole.shape != h.shape or not torch.equal(whole, h):
        raise StageError("pp: the chain of the stages' modules does not give model(x) (the model's forward does "
                         "more than call them in this order): list every module its forward calls, in order")
    return ([s for s, _ in shapes], [d for _, d in shapes]) if dtypes else [s for s, _ in shapes]


class Trainer:
    """``pipeline``'s result: ``train_step(x, y, accumulate=1, max_norm=None)`` -> the mean loss (every
    rank), ``named_parameters()`` (this rank's stage, the model's names), ``optimizer`` (a torch
    optimizer over this stage's trainable parameters: lr schedulers drive it), ``comm_theory()``.
    The optimizer callable gets the stage's parameters, the model's own tensors: build param groups
    by identity with masks computed on the whole model (``decay = {id(p) for n, p in
    model.named_parameters() if ...}``) or by ``p.dim()``."""

    def __init__(self, model, stages, loss, optimizer, group, microbatches, schedule):
        self.model, self.paths, self.loss, self.group, self.m = model, stages, loss, group, microbatches
        self.n, self.rank, self.kind = dist.get_world_size(group), dist.get_rank(group), schedule
        self.modules = check_stages(model, stages, self.n)
        self.mine = nn.Sequential(*self.modules[self.rank])
        self.optimizer = optimizer([p for p in self.mine.parameters() if p.requires_grad])
        self.schedule, self.message = None, None  # built at the first step, from the checked chain
        self.clipped = False  # the last step clipped: one more all-reduce in comm_theory
        self.scaled, self._scale = False, 1.0  # the last step's loss scaler (its flag: one more all-reduce)
        self.steps = 0  # optimizer steps taken (the first one's update is undone when it is refused)

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {f"{path}.{k}": p for path in self.paths[self.rank]
                for k, p in self.model.get_submodule(path).named_parameters()}

    def _split(self, a: torch.Tensor) -> torch.Tensor:
        if a.shape[0] % self.m:
            raise StageError(f"pp: batch dim 0 = {a.shape[0]} is not divisible by microbatches={self.m}")
        return a[: a.shape[0] // self.m]  # (B/M, …): the first micro-batch

    def _build(self, x: torch.Tensor, y: torch.Tensor) -> None:
        first = self._split(x)
        self._split(y)
        shapes, dts = check_chain(self.model, self.modules, first, dtypes=True)
        dt = dts[0]
        meta = lambda shape, d: torch.empty(shape, dtype=d, device=x.device, requires_grad=True)
        s, last = self.rank, self.n - 1
        stage = PipelineStage(self.mine, s, self.n, x.device, group=self.group,
                              input_args=first if s == 0 else meta(shapes[s - 1], dts[s - 1]),
                              output_args=meta(shapes[s], dts[s]))
        if self.kind == "1f1b" and self.m < self.n:
            raise StageError(f"pp: 1f1b needs microbatches >= stages ({self.m} < {self.n}); use gpipe")
        scaled = lambda out, y: self.loss(out, y) * self._scale  # noqa: E731  (a loss scaler's; else · 1.0)
        self.schedule = SCHEDULES[self.kind](stage, self.m, loss_fn=scaled, scale_grads=True)
        self.message = (shapes[0], dt) if self.n > 1 else None
        self._last = dist.get_global_rank(self.group, last)

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One schedule over x's M micro-batches: the gradients of their mean; the mean loss (last stage)."""
        s, last = self.rank, self.n - 1
        args, losses = ((x,) if s == 0 else ()), []
        if s == last:
            self.schedule.step(*args, target=y, losses=losses)  # M micro-batch means
            return torch.stack(losses).mean().detach()
        self.schedule.step(*args)
        return torch.zeros((), dtype=self._dtype(), device=x.device)

    def _dtype(self) -> torch.dtype:
        """The parameters' (and the loss's, its broadcast's, the norm's) dtype."""
        return next(self.mine.parameters()).dtype

    def train_step(self, x: torch.Tensor, y: torch.Tensor, accumulate: int = 1,
                   max_norm: float | None = None, scaler: recipe.LossScaler | None = None) -> float:
        """One optimizer step on the batch (x, y). ``accumulate`` K: the batch is cut into K equal
        parts along dim 0, each run through the schedule (M micro-batches each) and the K gradients
        averaged (the full batch's mean; the K runs' messages are K× one run's). ``max_norm``: clip
        by the global norm (the stages' squares summed over the group: one scalar all-reduce).
        ``scaler`` (float16 under autocast): the loss scaled, this stage's gradients unscaled before
        clipping, the step skipped on every stage when any stage overflowed (``scaler.update()`` done
        here; ``scaler.skipped`` says whether to step an LR schedule)."""
        if accumulate < 1 or x.shape[0] % accumulate or y.shape[0] % accumulate:
            raise StageError(f"pp: accumulate={accumulate} must be >= 1 and divide the batch dim 0 ({x.shape[0]})")
        xs, ys = x.chunk(accumulate), y.chunk(accumulate)
        if self.schedule is None:
            self._build(xs[0], ys[0])
            self._rows = xs[0].shape[0]
        if xs[0].shape[0] != self._rows:
            raise StageError(f"pp: the stages were built for parts of {self._rows} rows (batch / accumulate); this "
                             f"step's are {xs[0].shape[0]}: keep batch / accumulate fixed across steps")
        self.optimizer.zero_grad(set_to_none=True)
        self.scaled, self._scale = scaler is not None, 1.0 if scaler is None else scaler.get_scale()
        params = [p for p in self.mine.parameters() if p.requires_grad]
        sums, values = [None] * len(params), []
        for xi, yi in zip(xs, ys):
            values.append(self._run(xi, yi))
            if accumulate > 1:  # the schedule scales every p.grad by 1/M: keep each run's apart
                for i, p in enumerate(params):
                    if p.grad is not None:
                        sums[i] = p.grad if sums[i] is None else sums[i].add_(p.grad)
                    p.grad = None
        if accumulate > 1:
            for p, g in zip(params, sums):
                p.grad = None if g is None else g.div_(accumulate)
                recipe.refresh([p.grad])
        value = torch.stack(values).mean() / self._scale
        if self.n > 1:
            dist.broadcast(value, self._last, group=self.group)
        if scaler is not None and scaler.unscale_(self.optimizer, [p.grad for p in params]):
            scaler.update()  # an inf / NaN on some stage: every stage skips (no clip, no step)
            return float(value)
        self.clipped = max_norm is not None
        if self.clipped:
            self.norm = recipe.clip_([p.grad for p in params], [], max_norm, self.group, self._dtype())
        if self.n > 1:  # a clip inside the user's optimizer (its own norm per stage): refused
            recipe.sealed_step(self.optimizer, params, "pp.pipeline", CLIP_FIX, undo=not self.steps)
        else:
            self.optimizer.step()
        self.steps += 1
        if scaler is not None:
            scaler.update()
        return float(value)

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """This rank's messages: M per boundary it touches, each way; the loss's broadcast."""
        if self.message is None:
            return {}
        shape, dt = self.message
        b = shape.numel() * dt.itemsize
        k = self.m * ((self.rank < self.n - 1) + (self.rank > 0))
        out = {"send": (k, k * b), "recv": (k, k * b), "broadcast": (1, self._dtype().itemsize)}
        out = out | (recipe.clip_comm(self._dtype().itemsize) if self.clipped else {})
        return recipe.add_comm(out, recipe.scaler_comm(self.scaled))  # the found-inf flag: one more all-reduce


def pipeline(model: nn.Module, stages: Sequence[Sequence[str]], loss: Callable, optimizer: Callable, group=None,
             microbatches: int = 4, schedule: str = "gpipe") -> Trainer:
    """GPipe (or 1F1B) over ``group``'s ranks for a model whose forward is the chain ``stages`` lists.
    ``optimizer(params)`` builds the optimizer over this rank's stage's trainable parameters."""
    if schedule not in SCHEDULES:
        raise StageError(f"pp: unknown schedule {schedule!r}; choose from {tuple(SCHEDULES)}")
    if not dist.is_initialized():
        raise StageError("pp: no process group: run under torch_impl.launch.launch or torchrun")
    refuse_split_experts(model.named_parameters(), "pipeline")
    return Trainer(model, [list(s) for s in stages], loss, optimizer, group or dist.group.WORLD, microbatches,
                   schedule)
