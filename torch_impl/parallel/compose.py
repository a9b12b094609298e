"""N-D composition for ANY nn.Module on ONE DeviceMesh, torchtitan's way (parallelize_llama +
pipeline_llama): dp | fsdp × pp × cp × tp, each axis a named sub-mesh (``mesh["tp"]``, ...).
The twin: jax_impl/parallel/compose.py. What a model offers: a tp plan (module path -> style,
parallel/tp.py), a stage builder ``stage(model, s, S) -> nn.Module`` (stage 0 takes the tokens, the
last returns the logits; one module per stage: parallel/llama.py's ``Stage``), FSDP units (module
path globs) and, under cp, its attention through the cp seam (parallel/cp.py) and a ``positions``
attribute on the stage module that its position encoding reads.

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("fsdp", "pp", "tp"))
    trainer = parallelize(model, mesh, plan=TP_PLAN, stage=Stage, units=["model.layers.*"],
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), microbatches=2)
    loss = trainer.train_step(tokens, targets)   # (B, T) each, the whole batch on every rank

Order (torchtitan's): this rank's pp stage is built, then ``apply_tp`` on mesh["tp"], then
``apply_fsdp`` on the data mesh (fsdp, flattened with cp when both: torchtitan's dp_shard_cp),
then ``apply_pp`` on mesh["pp"]'s group; cp is a context around each step (RingCore on mesh["cp"]).
Sharded: rows [i·B/d, (i+1)·B/d) on data index i; tokens cp_positions(T, c, j, "ring") on cp index
j; layers by stage; weights by the plan over tp (and by FSDP over fsdp(+cp)). Loss: the mean CE,
each rank's local mean over its tokens; the global mean is their mean over data × cp (equal counts).

builtin   DTensor TP (apply_dtensor_plan = parallelize_module, loss under loss_parallel), FSDP2
          ``fully_shard`` per unit + root, PipelineStage + ScheduleGPipe/1F1B (scale_grads), dp
          as ONE flat all-reduce of the (tp-local) gradients over data × cp after backward: what
          DDP does, which cannot take DTensor weights. cp: the project's seam (torch's own
          context_parallel is CUDA-only).
explicit  the project's wrappers on the same sub-meshes' groups: apply_plan + the vocabulary-parallel
          CE, the FSDP wrapper (no pp: refused), the same pipeline, cp seam and dp all-reduce.
          explicit fsdp × pp: the wrapper's shard gradients arrive after the schedule (which would
          scale them by 1/M too early), so the composition divides by M after they arrive.
Refused before anything changes (ComposeError, one line: what, which axes, the fix): both dp and
fsdp > 1 (HSDP), an axis not in AXES, explicit tp with a loss other than ``cross_entropy``, builtin
tp of a vocabulary not divisible by tp (DTensor's uneven shards; explicit pads it), cp
without a ``positions`` attribute, a parameter in two stages or in none, a cp variant other than
ring; a plan tp cannot carry out (tp.PlanError); indivisible rows / sequence / micro-batches (at
the first step, before any collective). Inside a step, a cp seam refusal (e.g. local position ids)
raises on every rank before the update (parallel/cp.py).
Collectives per step: tp's 2 all-reduces per layer forward and 2 backward (+ the loss's);
fsdp's all-gathers and reduce-scatters per unit per micro-batch; pp's one message (m, T/c, D) per
micro-batch and boundary each way; cp's ring (3c−2 K|V messages per attention call); dp's one flat
all-reduce; and one world all-reduce of (loss, refusal flag) per step (bookkeeping: the loss).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from shared.theory import cp_positions
from torch_impl.parallel import cp as seam
from torch_impl.parallel.fsdp import FSDP, average_flat
from torch_impl.parallel.tp import apply_dtensor_plan, apply_plan, check_plan, matches, unshard
from torch_impl.parallel.tp_ops import VocabParallelCrossEntropy

AXES = ("dp", "fsdp", "pp", "cp", "tp")
STYLES = ("builtin", "explicit")
# gathering fsdp × tp weights whole (full_tensor, bookkeeping) takes two all-gathers: harmless, said once per call
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


NOT_DERIVED = "fsdp × pp: the all-gathers and reduce-scatters per micro-batch are not derived (comm_theory omits them)"


class ComposeError(ValueError):
    """A layout, style or model that the composition cannot train exactly (raised before any change)."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean CE over every token: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sizes(mesh: DeviceMesh) -> dict[str, int]:
    return dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True))


def check(layout: dict[str, int], style: str, loss: Callable, plan: dict | None) -> None:
    """The refusals that need no process group (one line each)."""
    if style not in STYLES:
        raise ComposeError(f"compose: unknown style {style!r}; choose from {STYLES}")
    bad = [a for a in layout if a not in AXES]
    if bad:
        raise ComposeError(f"compose: unknown mesh axes {bad}; name the DeviceMesh's dims from {AXES}")
    if layout.get("dp", 1) > 1 and layout.get("fsdp", 1) > 1:
        raise ComposeError("compose: dp and fsdp both > 1 (HSDP) is not composed here; fix: one data axis "
                           "(dp=N or fsdp=N)")
    if style == "explicit" and layout.get("tp", 1) > 1 and plan and loss is not cross_entropy:
        raise ComposeError("compose explicit: tp splits the head's vocabulary, so the loss must be the "
                           "vocabulary-parallel CE; fix: loss=compose.cross_entropy (or style='builtin')")


def check_stages(model: nn.Module, stage: Callable, stages: int) -> None:
    """Every trainable parameter in exactly one stage (a tie across stages would train two copies apart)."""
    if stages == 1:
        return
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(repr(n))
    held: dict[int, int] = {}
    for s in range(stages):
        for p in stage(model, s, stages).parameters():
            if held.setdefault(id(p), s) != s:
                tied = " = ".join(names.get(id(p), ["?"]))
                raise ComposeError(f"compose pp: parameter {tied} is held by stages {held[id(p)]} and {s} "
                                   "(tied): pp would train two copies apart; fix: untie it or put its holders in "
                                   "one stage")
    lost = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if lost:
        raise ComposeError(f"compose pp: {lost[:3]} in no stage (would never train); fix: the stage builder must "
                           "hold every module the model's forward uses")


def check_vocab(model: nn.Module, plan: dict[str, str], tp: int, style: str) -> None:
    """builtin tp: DTensor shards a vocabulary V % tp != 0 unevenly, which the pipeline's fixed
    message shapes and the loss's re-wrapping of local logits do not describe: refused."""
    if style != "builtin" or tp == 1:
        return
    for path, m in model.named_modules():
        style_of = next((st for k, st in plan.items() if path and matches(path, k)), None)
        if style_of in ("vocab_embed", "colwise_vocab") and m.weight.shape[0] % tp:
            raise ComposeError(f"compose builtin: {path!r} ({style_of}) has {m.weight.shape[0]} rows, not divisible "
                               f"by tp={tp}; fix: style='explicit' (pads the vocabulary) or V divisible by tp")


def apply_tp(module: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh, style: str) -> dict[str, str]:
    """The plan's entries that name a module of ``module`` (a stage holds some), on mesh["tp"]."""
    paths = [p for p, _ in module.named_modules()]
    plan = {k: v for k, v in plan.items() if any(matches(p, k) for p in paths)}
    if style == "builtin":
        return apply_dtensor_plan(module, plan, tp_mesh)
    return apply_plan(module, plan, tp_mesh.get_group(), missing_ok=True)


def apply_fsdp(module: nn.Module, mesh: DeviceMesh, units: list[str]) -> list[tuple[str, int, bool]]:
    """FSDP2: ``fully_shard`` every module matching a unit glob, then the root (torchtitan's order).
    Returns each group's (path, bytes all-gathered, trainable?), the root last: its (tp-local)
    parameters with dim 0 padded to a multiple of the mesh size, as FSDP2 shards them."""
    n = mesh.size()
    paths = [path for path, _ in module.named_modules() if path and any(matches(path, u) for u in units)]
    owner = lambda name: next((u for u in paths if name.startswith(u + ".")), "")  # "" = the root's
    groups: dict[str, list] = {u: [] for u in [*paths, ""]}
    for name, p in module.named_parameters():  # each parameter once, before any is sharded
        groups[owner(name)].append(p)

    def nbytes(ps) -> int:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in ps]
        return sum(-(-t.shape[0] // n) * n * t[0].numel() * t.element_size() if t.dim() else t.element_size()
                   for t in local)

    out = [(u, nbytes(ps), any(p.requires_grad for p in ps)) for u, ps in groups.items()]
    for u in paths:
        fully_shard(module.get_submodule(u), mesh=mesh)
    fully_shard(module, mesh=mesh)
    return out


def apply_pp(module: nn.Module, s: int, S: int, pp_mesh: DeviceMesh, loss: Callable, microbatches: int,
             schedule: str = "gpipe", scale_grads: bool = True):
    """This stage in ``torch.distributed.pipelining`` (shapes inferred at the first step). scale_grads:
    the schedule divides the summed micro-batch gradients by M (False: the caller does, after a
    reduction that fills them later — the explicit FSDP's shards)."""
    stage = PipelineStage(module, s, S, torch.device("cpu"), group=pp_mesh.get_group())
    return SCHEDULES[schedule](stage, microbatches, loss_fn=loss, scale_grads=scale_grads)


def _group(mesh: DeviceMesh, axes: list[str]):
    """(sub-mesh, group) over ``axes`` together (flattened when several), or (None, None)."""
    if not axes:
        return None, None
    sub = mesh[axes[0]] if len(axes) == 1 else mesh[tuple(axes)]._flatten("_".join(axes))
    return sub, sub.get_group()


class Trainer:
    """``parallelize``'s result: ``train_step(tokens, targets)`` -> the global mean loss;
    ``full_state_dict()`` -> every parameter whole (the model's names), on every rank."""

    def __init__(self, model, mesh, plan, stage, units, loss, optimizer, microbatches, style, cp_variant,
                 schedule):
        self.layout, self.mesh, self.style, self.loss, self.plan = sizes(mesh), mesh, style, loss, plan
        check(self.layout, style, loss, plan)
        ax = lambda a: self.layout.get(a, 1)
        self.S, self.t, self.c, self.M = ax("pp"), ax("tp"), ax("cp"), microbatches if ax("pp") > 1 else 1
        coord = lambda a: mesh[a].get_local_rank() if ax(a) > 1 else 0
        self.data = "fsdp" if ax("fsdp") > 1 else "dp"
        self.d, self.i, self.j, self.s = ax(self.data), coord(self.data), coord("cp"), coord("pp")
        if self.t > 1 and plan:
            check_plan(model, plan, self.t)  # PlanError (e.g. GQA heads that tp does not divide), nothing changed
            check_vocab(model, plan, self.t, style)
        check_stages(model, stage, self.S)
        self.module = stage(model, self.s, self.S) if stage else model
        if self.c > 1 and not hasattr(self.module, "positions"):
            raise ComposeError(f"compose: cp={self.c} needs the stage module to read a `positions` attribute "
                               "(its tokens' global positions); fix: give the module one (parallel/llama.py Stage)")
        self.styles = apply_tp(self.module, plan, mesh["tp"], style) if self.t > 1 and plan else {}
        grad_axes = [a for a in (self.data, "cp") if ax(a) > 1]
        self.grad_mesh, self.grad_group = _group(mesh, grad_axes)
        self.fsdp, self.fsdp2 = None, []
        if self.data == "fsdp" and self.d > 1:
            if style == "builtin":
                self.fsdp2 = apply_fsdp(self.module, self.grad_mesh, units)
            else:
                self.fsdp = FSDP(self.module, group=self.grad_group)
        self.run = self.fsdp or self.module
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = optimizer(self.params)
        self.cp_group, self.cp_variant = (mesh["cp"].get_group() if self.c > 1 else None), cp_variant
        if self.S > 1 and self.t > 1 and style == "builtin" and self.s == self.S - 1:
            # the pipeline passes plain tensors: local logits (m, T/c, V/t) out, DTensor again in the loss
            self.module.register_forward_hook(lambda m, a, out: out.to_local() if isinstance(out, DTensor) else out)
        self.schedule = apply_pp(self.run, self.s, self.S, mesh["pp"], self._loss, self.M, schedule,
                                 scale_grads=self.fsdp is None) if self.S > 1 else None

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.t > 1 and self.style == "explicit" and "colwise_vocab" in self.styles.values():
            return VocabParallelCrossEntropy.apply(out, y, self.mesh["tp"].get_group())  # (m, T/c, V/t) logits
        if self.t > 1 and self.style == "builtin" and "colwise_vocab" in self.styles.values() \
                and not isinstance(out, DTensor):  # the pipeline's plain local logits
            out = DTensor.from_local(out, self.mesh["tp"], [Shard(-1)])
        value = self.loss(out, y)
        return value.to_local() if isinstance(value, DTensor) else value

    def local_batch(self, tokens: torch.Tensor, targets: torch.Tensor):
        """(B, T) each -> this rank's (B/d, T/c) each and their global positions (T/c,)."""
        (rows, seq), d, c = tokens.shape, self.d, self.c
        if rows % (d * self.M) or seq % c:
            raise ComposeError(f"compose: batch ({rows}, {seq}) does not split into data={d} × microbatches="
                               f"{self.M} rows and cp={c} sequence chunks; fix: rows divisible by {d * self.M}, "
                               f"T by {c}")
        pos = torch.tensor(cp_positions(seq, c, self.j, "ring"), device=tokens.device)
        r = rows // d
        return tokens[self.i * r:(self.i + 1) * r][:, pos], targets[self.i * r:(self.i + 1) * r][:, pos], pos

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        x, y, pos = self.local_batch(tokens, targets)
        if self.c > 1:
            self.module.positions = pos
        self.optimizer.zero_grad(set_to_none=True)
        core = seam.RingCore(tokens.shape[1], self.cp_variant, self.cp_group) if self.c > 1 else None
        seen = seam.step(core, pos) if core else contextlib.nullcontext(None)
        parallel = loss_parallel() if self.t > 1 and self.style == "builtin" else contextlib.nullcontext()
        with seen as calls, parallel:
            if self.schedule is None:
                value = self._loss(self.run(x), y)
                value.backward()
            elif self.s == self.S - 1:
                losses = []
                self.schedule.step(*(() if self.s else (x,)), target=y, losses=losses)
                value = torch.stack(losses).mean()
            else:
                self.schedule.step(*(() if self.s else (x,)))
                value = None
        self.last = {"m": x.shape[0] // self.M, "tc": x.shape[1], "b": self.params[0].element_size(),
                     "kv": [c for c in calls.calls] if calls is not None else []}  # for comm_theory
        if calls is not None and not calls.calls:
            raise ComposeError("compose: cp > 1 but the model never called the cp seam (parallel/cp.py): each "
                               "rank would attend within its own tokens; route its attention through it")
        self._sync()
        # the world mean of (loss on last-stage, tp-rank-0 ranks) · S·t, and the seam's refusal flag
        holds = value is not None and (self.t == 1 or self.mesh["tp"].get_local_rank() == 0)
        dt = self.params[0].dtype
        out = torch.stack([value.detach().to(dt) if holds else torch.zeros((), dtype=dt),
                           torch.tensor(float(calls is not None and calls.refused is not None), dtype=dt)])
        dist.all_reduce(out)
        if out[1] > 0:
            raise seam.SeamError((calls and calls.refused) or "cp: another rank's seam call was refused; "
                                 "nothing was updated")
        self.optimizer.step()
        return float(out[0]) / (self.d * self.c)

    def _sync(self) -> None:
        """The data × cp gradient reduction FSDP2 does not do: the explicit FSDP's, or dp's all-reduce."""
        if self.fsdp is not None:
            self.fsdp.finish_gradient_synchronization()  # the shards' gradients arrive here, summed over M
            for p in self.params if self.schedule is not None else ():
                if p.grad is not None:
                    p.grad.div_(self.M)  # the schedule's scale_grads would have scaled them before they came
        elif self.grad_group is not None and not (self.data == "fsdp" and self.style == "builtin"):
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.params
                     if p.grad is not None]
            average_flat(grads, self.grad_group)  # ONE all-reduce over data × cp, / (d·c)

    def labels(self) -> dict:
        """{process group: axis label} for CommLedger.label_groups: each axis by name, the gradient
        group by its axes ("dp+cp"); the loss's all-reduce runs on the world ("world")."""
        out = {self.mesh[a].get_group(): a for a in self.layout if self.layout[a] > 1}
        if self.grad_group is not None:
            out[self.grad_group] = self.grad_label
        return out

    @property
    def grad_label(self) -> str:
        return "+".join(a for a in (self.data, "cp") if self.layout.get(a, 1) > 1)

    def comm_theory(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Per axis label (``labels``): op -> (count, bytes) per step per rank, from the module wrapped
        and the last step's shapes (A = m·(T/c)·D·b, D the rowwise modules' output width). Derived:
        tp (explicit: per micro-batch one g per rowwise module and the embedding, one f per input of
        colwise modules and the head, the vocabulary CE's MAX + SUM; builtin: one f per colwise
        module, loss_parallel's 3), pp (M messages of A per boundary each way), cp (the ring: 3c−2
        K|V messages per seam call), dp (one flat all-reduce), fsdp without pp (explicit: the FSDP
        wrapper's own theory; builtin: FSDP2 gathers each unit in forward and again in backward, the
        root once, and reduce-scatters each once, dim 0 padded to the group size) and the world's
        (loss, flag). Not derived: fsdp under pp (gathers per micro-batch as the schedule and FSDP's
        resharding decide): absent from the result, NOT_DERIVED says so."""
        out: dict[str, dict[str, tuple[int, int]]] = {}

        def add(label, op, n, nbytes):
            c, b = out.setdefault(label, {}).get(op, (0, 0))
            out[label][op] = (c + n, b + nbytes)

        m, tc, b, M = self.last["m"], self.last["tc"], self.last["b"], self.M
        mods = dict(self.module.named_modules())
        row = [p for p, st in self._planned().items() if st == "rowwise"]
        D = mods[row[0]].out_features if row else 0
        A = m * tc * D * b
        if self.t > 1:
            st = self._planned()
            col = [p for p, x in st.items() if x == "colwise"]
            fs = len({p.rsplit(".", 1)[0] for p in col}) if self.style == "explicit" else len(col)
            g = len(row) + sum(x == "vocab_embed" for x in st.values())
            f = fs + sum(x == "colwise_vocab" for x in st.values())
            add("tp", "all_reduce", M * (g + f), M * (g + f) * A)
            if self.s == self.S - 1:
                n_ce, ce_bytes = (2, 3 * m * tc * b) if self.style == "explicit" else (3, 3 * m * tc * b)
                add("tp", "all_reduce", M * n_ce, M * ce_bytes)
        if self.S > 1:
            k = M * ((self.s < self.S - 1) + (self.s > 0))
            add("pp", "send", k, k * A)
            add("pp", "recv", k, k * A)
        if self.c > 1 and self.last["kv"]:
            a, k = sum(n * item for n, item in self.last["kv"]), (3 * self.c - 2) * len(self.last["kv"])
            add("cp", "send", k, (3 * self.c - 2) * 2 * a)
            add("cp", "recv", k, (3 * self.c - 2) * 2 * a)
        if self.data == "fsdp" and self.d > 1 and self.S > 1:
            pass  # NOT_DERIVED
        elif self.fsdp is not None:
            for op, (n, nbytes) in self.fsdp.comm_theory().items():
                add(self.grad_label, op, n, nbytes)
        elif self.fsdp2:  # a unit: gathered in forward and again in backward; the root once
            for path, nbytes, trainable in self.fsdp2:
                k = 1 if path == "" else 2
                add(self.grad_label, "all_gather", k, k * nbytes)
                if trainable:
                    add(self.grad_label, "reduce_scatter", 1, nbytes)
        elif self.grad_group is not None and not (self.data == "fsdp" and self.style == "builtin"):
            add(self.grad_label, "all_reduce", 1, sum(p.grad.to_local().numel() if isinstance(p.grad, DTensor)
                                                      else p.grad.numel() for p in self.params
                                                      if p.grad is not None) * b)
        world = dist.group.WORLD.group_name  # a sub-mesh spanning every rank runs on the world's group
        add(next((a for g, a in self.labels().items() if g.group_name == world), "world"), "all_reduce", 1, 2 * b)
        return out

    def _planned(self) -> dict[str, str]:
        """{module path of this stage: tp style} of the plan's entries."""
        return {p: st for p, _ in self.module.named_modules() for k, st in (self.plan or {}).items()
                if p and matches(p, k)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters whole, by the model's names (all_gather_object: bookkeeping)."""
        mine = {}
        for name, p in self.module.named_parameters():
            w = self.fsdp.full_tensor(name, p) if self.fsdp is not None else p
            w = w.full_tensor() if isinstance(w, DTensor) else w.detach()
            if name in self.styles and self.style == "explicit":
                w = unshard(w, self.styles[name], self.mesh["tp"].get_group())
            mine[name] = w.detach().clone()
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.s, mine))
        return {k: v for s in range(self.S) for st, d in every if st == s for k, v in d.items()}


def parallelize(model: nn.Module, mesh: DeviceMesh, *, plan: dict[str, str] | None = None,
                stage: Callable | None = None, units: list[str] = (), loss: Callable = cross_entropy,
                optimizer: Callable, microbatches: int = 2, style: str = "builtin", cp: str = "ring",
                schedule: str = "gpipe") -> Trainer:
    """dp|fsdp × pp × cp × tp on ``mesh`` (dims named from AXES) for ``model``: the module docstring.
    ``optimizer(params)`` builds the optimizer over this rank's (sharded) trainable parameters."""
    check(sizes(mesh), style, loss, plan)
    if sizes(mesh).get("pp", 1) > 1 and stage is None:
        raise ComposeError("compose: pp > 1 needs stage=(model, s, S) -> nn.Module (e.g. parallel/llama.py Stage)")
    if cp != "ring":
        raise ComposeError(f"compose: cp variant {cp!r} is not composed (its sequence order differs); fix: cp='ring'")
    return Trainer(model, mesh, plan, stage, list(units), loss, optimizer, microbatches, style, cp, schedule)
