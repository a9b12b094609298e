"""N-D composition for ANY nn.Module on ONE DeviceMesh, torchtitan's way (parallelize_llama +
pipeline_llama): dp | fsdp × pp × cp × tp, each axis a named sub-mesh (``mesh["tp"]``, ...), and an expert
axis "ep" beside dp / fsdp / tp for a MoE model's stacked experts (``experts=`` globs: compose_ep.py has
what it shards, its collectives forward and backward, its bytes per step and its refusals).
The twin: jax_impl/parallel/compose.py. What a model offers: a tp plan (module path -> style,
parallel/tp.py), a stage builder ``stage(model, s, S) -> nn.Module`` (stage 0 takes the tokens, the
last returns the logits; one module per stage: parallel/llama.py's ``Stage``), FSDP units (module
path globs) and, under cp, its attention through the cp seam (parallel/cp.py) and a ``positions``
attribute on the stage module that its position encoding reads. The steps per axis and the refusals:
compose_axes.py (torch_impl/mesh.py, the project's own ``--mesh`` runs, calls the same steps).

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("fsdp", "pp", "tp"))
    trainer = parallelize(model, mesh, plan=TP_PLAN, stage=Stage, units=["model.layers.*"],
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), microbatches=2)
    loss = trainer.train_step(tokens, targets)   # (B, T) each, the whole batch on every rank

Order (torchtitan's): this rank's pp stage is built, then ``apply_tp`` on mesh["tp"], then (compile=True)
each unit ``torch.compile``d, then ``apply_fsdp`` on the data mesh (fsdp, flattened with cp when both:
torchtitan's dp_shard_cp), then ``apply_pp`` on mesh["pp"]'s group; cp is a context around each step
(RingCore on mesh["cp"]).
Sharded: rows [i·B/d, (i+1)·B/d) on data index i (row-major over dp, fsdp, ep in mesh order); tokens
cp_positions(T, c, j, "ring") on cp index j; layers by stage; weights by the plan over tp (and by FSDP over
fsdp(+cp)); ep's experts by expert. Loss: the mean CE,
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
HSDP (dp and fsdp both > 1: torchtitan's dp_replicate × dp_shard): the data index is row-major over
(dp, fsdp) in mesh order; builtin FSDP2 on the 2-D (dp, fsdp[_cp]) mesh (reduce-scatter over the
shard group, then an all-reduce of each shard over dp); explicit the FSDP wrapper over fsdp(+cp), then
ONE flat all-reduce of its shards' and vectors' gradients over dp.
Refused before anything changes (ComposeError, one line: what, which axes, the fix): an axis not in
AXES, explicit tp with a loss other than ``cross_entropy``, builtin tp of a vocabulary not divisible
by tp (DTensor's uneven shards; explicit pads it), cp without a ``positions`` attribute, a parameter
in two stages or in none, a cp variant other than ring; a plan tp cannot carry out (tp.PlanError);
indivisible rows / sequence / micro-batches (at the first step, before any collective). Inside a
step, a cp seam refusal (e.g. local position ids) raises on every rank before the update
(parallel/cp.py); torch's clip_grad_norm_ inside the optimizer where a rank holds pieces (pp, tp,
explicit fsdp) at the step (recipe.sealed_step: LocalClipError).
Collectives per step: tp's 2 all-reduces per layer forward and 2 backward (+ the loss's);
fsdp's all-gathers and reduce-scatters per unit per micro-batch; pp's one message (m, T/c, D) per
micro-batch and boundary each way; cp's ring (3c−2 K|V messages per attention call); dp's one flat
all-reduce; ep's (compose_ep.py: per MoE layer a counts all-gather and 4 all-to-alls, the balancing
counts' all-reduce, the dense gradients over ep folded in or one more all-reduce, the experts' over dp ×
fsdp); and one world all-reduce of (loss, refusal flag) per step (bookkeeping: the loss).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shared.theory import cp_positions
from torch_impl.parallel import compiled, recipe
from torch_impl.parallel import cp as seam
from torch_impl.parallel.compose_axes import (  # noqa: F401  (ComposeError, check*: this module's API too)
    AXES,
    STYLES,
    ComposeError,
    apply_fsdp,
    apply_pp,
    apply_tp,
    check,
    check_stages,
    check_vocab,
    cross_entropy,
    global_clip_,
    group_over,
    local_logits,
    micro_major_rows,
    sizes,
    stage_loss,
    transformers_plan,
)
from torch_impl.parallel.compose_ep import DATA_AXES, ExpertAxis, check_ep
from torch_impl.parallel.ep import refuse_split_experts
from torch_impl.parallel.fsdp import FSDP, average_flat
from torch_impl.parallel.tp import check_plan, matches, unshard

CLIP_FIX = ("clip with trainer.train_step(tokens, targets, max_norm=...) (the global norm), not "
            "torch.nn.utils.clip_grad_norm_ inside the optimizer's step")


class Trainer:
    """``parallelize``'s result: ``train_step(tokens, targets)`` -> the global mean loss;
    ``full_state_dict()`` -> every parameter whole (the model's names), on every rank."""

    def __init__(self, model, mesh, plan, stage, units, loss, optimizer, microbatches, style, cp_variant,
                 schedule, compile=False, experts=(), aux=None):
        self.layout, self.mesh, self.style, self.loss, self.plan = sizes(mesh), mesh, style, loss, plan
        check(self.layout, style, loss, plan)
        expert_paths = check_ep(model, self.layout, experts, plan, units, compile)  # ComposeError, nothing changed
        ax = lambda a: self.layout.get(a, 1)
        # M: the pipeline's micro-batches (default 2), or without pp the accumulation's parts (default 1)
        self.S, self.t, self.c = ax("pp"), ax("tp"), ax("cp")
        self.M = microbatches or (2 if self.S > 1 else 1)
        if aux is not None and self.S > 1:
            raise ComposeError("compose: aux= with pp > 1: the pipeline calls the loss per micro-batch on the last "
                               "stage, which does not hold the earlier stages' terms; fix: aux=None under pp")
        coord = lambda a: mesh[a].get_local_rank() if ax(a) > 1 else 0
        self.data = "fsdp" if ax("fsdp") > 1 else "dp"  # the axis the gradient group shards (fsdp) or reduces over
        self.hsdp = ax("dp") > 1 and ax("fsdp") > 1  # replicate over dp × shard over fsdp (+cp)
        self.ep = ax("ep")  # a data axis too (compose_ep.py): its experts split, the rest replicated
        self.d, self.i, self.j, self.s = ax("dp") * ax("fsdp") * self.ep, 0, coord("cp"), coord("pp")
        for a in (a for a in self.layout if a in DATA_AXES):  # the data index: row-major, mesh order
            self.i = self.i * ax(a) + coord(a)
        if self.t > 1 and plan:
            check_plan(model, plan, self.t)  # PlanError (e.g. GQA heads that tp does not divide), nothing changed
            check_vocab(model, plan, self.t, style)
        check_stages(model, stage, self.S)
        self.module = stage(model, self.s, self.S) if stage else model
        if self.c > 1 and not hasattr(self.module, "positions"):
            raise ComposeError(f"compose: cp={self.c} needs the stage module to read a `positions` attribute "
                               "(its tokens' global positions); fix: give the module one (parallel/llama.py Stage)")
        self.styles = apply_tp(self.module, plan, mesh["tp"], style) if self.t > 1 and plan else {}
        # the model's own length along each split dim (explicit pads a vocabulary tp does not divide)
        self._sizes = {n: p.tp_size for n, p in self.module.named_parameters(remove_duplicate=False)
                       if hasattr(p, "tp_size")}
        # compile=True: each unit compiled after tp, before FSDP (torchtitan's order); parallel/compiled.py
        self.compiled = compiled.compile_units(self.module, units if compile is True else compile) if compile \
            else None
        self._steps = 0
        grad_axes = [a for a in (self.data, "cp") if ax(a) > 1]
        if self.ep > 1 and self.data == "dp":  # ep folded into dp's all-reduce of the dense gradients
            grad_axes = [a for a in self.layout if a in ("dp", "ep") and ax(a) > 1]
        self.grad_label = "+".join(grad_axes)
        self.grad_mesh, self.grad_group = group_over(mesh, grad_axes)
        # the shards' replicas: HSDP's dp, and ep's (the explicit FSDP folds ep into this all-reduce; FSDP2
        # reduces over dp itself, then ep_group's all-reduce follows)
        rep = [a for a in self.layout if a in ("dp", "ep") and ax(a) > 1 and (a == "dp" or style == "explicit")]
        self.rep_label, self.rep_group = "+".join(rep), group_over(mesh, rep if self.data == "fsdp" else [])[1]
        unfolded = self.data == "fsdp" and style == "builtin"  # FSDP2 reduces the dense ones over dp × fsdp only
        self.experts = ExpertAxis(self.module, expert_paths, mesh, self.layout, style, unfolded) \
            if expert_paths and (self.ep > 1 or self.d * self.c > 1) else None  # ep = 1: the counts' seam only
        ignored = set(self.experts.params(self.module.parameters())) if self.experts else None  # not FSDP's
        held = lambda: {(id(o), a): p for o in self.module.modules() for a, p in o._parameters.items() if p is not None}
        tp_split = {k for k, p in held().items() if hasattr(p, "tp_size")}  # explicit tp's pieces, before FSDP
        self.fsdp, self.fsdp2 = None, []
        if self.data == "fsdp" and self.d > 1:
            if style == "builtin":  # HSDP: FSDP2 on the 2-D (dp, fsdp[_cp]) mesh (torchtitan's dp_replicate)
                data_mesh = mesh["dp", self.grad_mesh.mesh_dim_names[0]] if self.hsdp else self.grad_mesh
                self.fsdp2 = apply_fsdp(self.module, data_mesh, units, ignored)
            else:
                self.fsdp = FSDP(self.module, group=self.grad_group, ignored_params=ignored)
        self.run = self.fsdp or self.module
        self._tp_split = {id(p) for k, p in held().items() if k in tp_split}  # the wrapper's shards of those too
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = optimizer(self.params)
        self.cp_group, self.cp_variant = (mesh["cp"].get_group() if self.c > 1 else None), cp_variant
        if self.S > 1 and self.t > 1 and style == "builtin" and self.s == self.S - 1:
            local_logits(self.module)  # the pipeline passes plain tensors; self._loss wraps them again
        self._loss = stage_loss(loss, self.styles, mesh["tp"] if self.t > 1 else None, style)
        if aux is not None:  # a term of each rank's loss read after its forward (e.g. MoE balancing losses)
            base = self._loss
            self._loss = lambda out, y: base(out, y) + aux()
        self.schedule_name = schedule
        self.clipped = False  # did the last step clip (comm_theory counts the norm's scalar all-reduce)
        self.steps = 0  # optimizer steps taken (a refused first step's update is undone)
        self.schedule = apply_pp(self.run, self.s, self.S, mesh["pp"], self._loss, self.M, schedule,
                                 scale_grads=self.fsdp is None) if self.S > 1 else None

    def local_batch(self, tokens: torch.Tensor, targets: torch.Tensor):
        """(B, T) each -> this rank's (B/d, T/c) each and their global positions (T/c,)."""
        (rows, seq), d, c = tokens.shape, self.d, self.c
        if rows % (d * self.M) or seq % c:
            raise ComposeError(f"compose: batch ({rows}, {seq}) does not split into data={d} × microbatches="
                               f"{self.M} rows and cp={c} sequence chunks; fix: rows divisible by {d * self.M}, "
                               f"T by {c}")
        pos = torch.tensor(cp_positions(seq, c, self.j, "ring"), device=tokens.device)
        r = rows // d
        if self.S == 1 and self.M > 1 and self.experts is not None:  # accumulation with routed experts: part k
            pick = micro_major_rows(rows, self.M, d, self.i, tokens.device)  # (B/d,)
            return tokens[pick][:, pos], targets[pick][:, pos], pos
        return tokens[self.i * r:(self.i + 1) * r][:, pos], targets[self.i * r:(self.i + 1) * r][:, pos], pos

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, max_norm: float | None = None) -> float:
        """One optimizer step on the whole (B, T) batch; ``max_norm``: clip by the global norm first
        (``clip_grad_norm_``; the norm in ``self.norm``). Returns the global mean loss."""
        x, y, pos = self.local_batch(tokens, targets)
        if self.c > 1:
            self.module.positions = pos
        self.optimizer.zero_grad(set_to_none=True)
        if self.experts is not None:
            self.experts.begin_step()
        core = seam.RingCore(tokens.shape[1], self.cp_variant, self.cp_group) if self.c > 1 else None
        seen = seam.step(core, pos) if core else contextlib.nullcontext(None)
        parallel = loss_parallel() if self.t > 1 and self.style == "builtin" else contextlib.nullcontext()
        watch = (compiled.Watch() if self._steps == 0 else compiled.steady()) if self.compiled else \
            contextlib.nullcontext()  # compiled: the first step compiles, later ones must not recompile
        with watch, seen as calls, parallel:
            if self.schedule is None:  # M parts (accumulation), each loss / M; FSDP2 reduces in the last only
                value = 0
                for k, (xs, ys) in enumerate(zip(x.chunk(self.M), y.chunk(self.M), strict=True)):
                    with self._quiet(k == self.M - 1):
                        part = self._loss(self.run(xs), ys) / self.M
                        part.backward()
                    if self.experts is not None:
                        self.experts.note()  # this part's routing (comm_theory sums the parts)
                    torch.clear_autocast_cache()  # FSDP2 re-gathers into the same tensors: no stale bf16 cast
                    value = value + part.detach()
            elif self.s == self.S - 1:
                losses = []
                self.schedule.step(*(() if self.s else (x,)), target=y, losses=losses)
                value = torch.stack(losses).mean()
            else:
                self.schedule.step(*(() if self.s else (x,)))
                value = None
        if self.compiled and self._steps == 0:
            compiled.require_compiled(watch, f"compose compile=True ({', '.join(self.compiled)})")
        self._steps += 1
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
        self.clipped = max_norm is not None
        if self.clipped:
            self.norm = self.clip_grad_norm_(max_norm)
        if self.S > 1 or self.t > 1 or self.fsdp is not None or self.ep > 1:  # pieces: a local clip is wrong
            recipe.sealed_step(self.optimizer, self.params, "compose", CLIP_FIX, undo=not self.steps)
        else:  # whole averaged gradients (dp, cp) or FSDP2's DTensors: torch's own clip is the model's
            self.optimizer.step()
        self.steps += 1
        return float(out[0]) / (self.d * self.c)

    def _quiet(self, last: bool):
        """Accumulation under FSDP2: reduce-scatter and reshard after the last part's backward only (as the
        pipeline does); the other wrappers reduce once in ``_sync`` (the explicit FSDP's reduce-scatters add)."""
        if self.fsdp2 and self.M > 1:  # the root is an FSDPModule: both recurse into every unit
            self.module.set_requires_gradient_sync(last)
            self.module.set_reshard_after_backward(last)
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` of the whole model, on every rank, after the step's reductions
        (``compose_axes.global_clip_``: ONE world all-reduce of one scalar)."""
        return global_clip_(self.params, max_norm, self.S, self._tp_split, self.t, self.fsdp,
                            self.experts.ids if self.experts else frozenset(), self.ep)

    def _dense(self) -> list:
        """The parameters every data rank holds alike (all but ep's experts)."""
        return [p for p in self.params if not (self.experts and id(p) in self.experts.ids)]

    def _sync(self) -> None:
        """The data × cp gradient reduction FSDP2 does not do: the explicit FSDP's, or dp's all-reduce;
        ep's (compose_ep.ExpertAxis.finish: the experts', FSDP2's dense shards over ep)."""
        local = lambda g: g.to_local() if isinstance(g, DTensor) else g
        if self.fsdp is not None:
            self.fsdp.finish_gradient_synchronization()  # the shards' gradients arrive here, summed over M
            for p in self.params if self.schedule is not None else ():
                if p.grad is not None:
                    p.grad.div_(self.M)  # the schedule's scale_grads would have scaled them before they came
                    recipe.refresh([p.grad])
            if self.rep_group is not None:  # HSDP: the shards (and the vectors) averaged over dp (× ep), ONE all-reduce
                grads = [p.grad for p in self._dense() if p.grad is not None]
                average_flat(grads, self.rep_group)
        elif self.grad_group is not None and not (self.data == "fsdp" and self.style == "builtin"):
            grads = [local(p.grad) for p in self._dense() if p.grad is not None]
            average_flat(grads, self.grad_group)  # ONE all-reduce over data × cp, / (d·c)
        if self.experts is not None:
            self.experts.finish(self.params)

    def labels(self) -> dict:
        """{process group: axis label} for CommLedger.label_groups: each axis by name, the gradient
        group by its axes ("dp+cp"); the loss's all-reduce runs on the world ("world")."""
        out = {self.mesh[a].get_group(): a for a in self.layout if self.layout[a] > 1}
        out |= self.experts.labels() if self.experts else {}
        if self.rep_group is not None:
            out[self.rep_group] = self.rep_label
        if self.grad_group is not None:
            out[self.grad_group] = self.grad_label
        return out

    def comm_theory(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Per axis label (``labels``): op -> (count, bytes) per step per rank, from the module wrapped
        and the last step's shapes (A = m·(T/c)·D·b, D the rowwise modules' output width). Derived:
        tp (explicit: per micro-batch one g per rowwise module and the embedding, one f per input of
        colwise modules and the head, the vocabulary CE's MAX + SUM; builtin: one f per colwise
        module, loss_parallel's 3), pp (M messages of A per boundary each way), cp (the ring: 3c−2
        K|V messages per seam call), dp (one flat all-reduce), fsdp (explicit: the FSDP wrapper's own
        theory, its gathers and reduce-scatters M times under pp; builtin: FSDP2 gathers each unit in
        every micro-batch's forward and once in backward — the pipeline keeps it unsharded from the
        first backward to the last, under GPipe and 1F1B alike, where a backward lands between
        forwards — so M + 1 times, the root once, and reduce-scatters each once, dim 0 padded to the
        group size) and the world's (loss, flag; the global norm's scalar when the step clipped)."""
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
        if self.fsdp is not None:  # under pp every micro-batch gathers, re-gathers and reduce-scatters (they add)
            for op, (n, nbytes) in self.fsdp.comm_theory().items():
                k = M if op in ("all_gather", "reduce_scatter") else 1  # the vectors' all-reduce: once, at the end
                add(self.grad_label, op, k * n, k * nbytes)
            if self.rep_group is not None:  # the shards and vectors averaged over dp (× ep): one flat all-reduce
                add(self.rep_label, "all_reduce", 1,
                    sum(p.grad.numel() for p in self._dense() if p.grad is not None) * b)
        elif self.fsdp2:  # a unit: gathered in each micro-batch's forward and once in backward; the root once
            n = self.grad_mesh.size()
            for path, nbytes, trainable in self.fsdp2:
                k = 1 if path == "" else M + 1
                add(self.grad_label, "all_gather", k, k * nbytes)
                if trainable:
                    add(self.grad_label, "reduce_scatter", 1, nbytes)
                    if self.hsdp:  # HSDP: each group's reduce-scattered shard all-reduced over dp
                        add("dp", "all_reduce", 1, nbytes // n)
        elif self.grad_group is not None and not (self.data == "fsdp" and self.style == "builtin"):
            add(self.grad_label, "all_reduce", 1, sum(p.grad.to_local().numel() if isinstance(p.grad, DTensor)
                                                      else p.grad.numel() for p in self._dense()
                                                      if p.grad is not None) * b)
        if self.experts is not None:
            self.experts.comm_theory(add, self.params, b)
        world = dist.group.WORLD.group_name  # a sub-mesh spanning every rank runs on the world's group
        label = next((a for g, a in self.labels().items() if g.group_name == world), "world")
        add(label, "all_reduce", 1, 2 * b)
        if self.clipped:  # the global norm's scalar (float64, else float32)
            add(label, "all_reduce", 1, 8 if self.params[0].dtype == torch.float64 else 4)
        return out

    def _planned(self) -> dict[str, str]:
        """{module path of this stage: tp style} of the plan's entries."""
        return {p: st for p, _ in self.module.named_modules() for k, st in (self.plan or {}).items()
                if p and matches(p, k)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters whole, by the model's names and in its shapes (a padded vocabulary's
        rows dropped; a tied weight under each of its names), so ``model.load_state_dict(...)`` takes it
        (all_gather_object: bookkeeping)."""
        mine, done = {}, {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in done:  # tied: one gather, every name
                mine[name] = done[id(p)]
                continue
            w = self.fsdp.full_tensor(name, p) if self.fsdp is not None else p
            w = w.full_tensor() if isinstance(w, DTensor) else w.detach()
            if self.experts and id(p) in self.experts.ids:
                w = self.experts.full(w)  # (E/ep, …) -> (E, …)
            if name in self.styles and self.style == "explicit":
                w = unshard(w, self.styles[name], self.mesh["tp"].get_group(), self._sizes.get(name))
            mine[name] = done[id(p)] = w.detach().clone()
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.s, mine))
        return {k: v for s in range(self.S) for st, d in every if st == s for k, v in d.items()}


def parallelize(model: nn.Module, mesh: DeviceMesh, *, plan: dict[str, str] | str | None = None,
                stage: Callable | None = None, units: list[str] = (), loss: Callable = cross_entropy,
                optimizer: Callable, microbatches: int | None = None, style: str = "builtin", cp: str = "ring",
                schedule: str = "gpipe", compile: bool | list[str] = False, experts: list[str] = (),
                aux: Callable | None = None) -> Trainer:
    """dp|fsdp × pp × cp × tp on ``mesh`` (dims named from AXES) for ``model``: the module docstring.
    ``optimizer(params)`` builds the optimizer over this rank's (sharded) trainable parameters.
    ``plan="auto"``: a transformers model's own tp plan (``transformers_plan``).
    ``compile``: True compiles each of ``units`` on this stage, a list of globs those modules instead
    (parallel/compiled.py); the first step compiles (a step that compiles nothing is refused), a later step that
    would recompile raises. ``experts``: module path globs of the MoE layers' stacked experts, split over a
    mesh axis "ep" (compose_ep.py); ``aux()``: a term added to each rank's loss after its forward (e.g. the
    MoE layers' balancing losses, which compose_ep's ``global_counts`` makes one device's).
    ``microbatches``: under pp the schedule's micro-batches (default 2); without pp K parts of each rank's
    rows accumulated in one step (loss / K each, one reduction; default 1; with experts part j is this rank's
    share of rows [j·B/K, (j+1)·B/K), each part its own routing and balancing loss)."""
    if plan == "auto":
        plan = transformers_plan(model)
    check(sizes(mesh), style, loss, plan)
    check_ep(model, sizes(mesh), experts, plan, units, compile)
    refuse_split_experts(model.named_parameters(), "compose")
    if sizes(mesh).get("pp", 1) > 1 and stage is None:
        raise ComposeError("compose: pp > 1 needs stage=(model, s, S) -> nn.Module (e.g. parallel/llama.py Stage)")
    if cp != "ring":
        raise ComposeError(f"compose: cp variant {cp!r} is not composed (its sequence order differs); fix: cp='ring'")
    if compile and sizes(mesh).get("cp", 1) > 1:
        raise ComposeError("compose: compile=True with cp > 1: the cp seam's ring passes K|V with "
                           "dist.batch_isend_irecv inside an autograd Function, which dynamo cannot trace (torch 2.13 "
                           "has no functional send/recv); fix: compile=False under cp")
    if compile and not units:
        raise ComposeError("compose: compile=True compiles the units; fix: name them, e.g. units=['model.layers.*']")
    if compile:
        compiled.prepare(mesh.device_type)
        compiled.reset()
    return Trainer(model, mesh, plan, stage, list(units), loss, optimizer, microbatches, style, cp, schedule,
                   compile, list(experts), aux)
