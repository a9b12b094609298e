"""compose's expert axis ("ep"): a user's MoE layers' stacked experts split over mesh["ep"], the rest
of the model data-parallel over it. What compose.py's Trainer runs when the mesh names "ep". The twin:
jax_impl/parallel/compose_ep.py (the same semantics).

    parallelize(model, mesh, experts=["layers.*.moe.experts"], ...)   # mesh dims from dp, fsdp, ep, tp

Sharded:
  data      "ep" is a DATA axis: the batch rows split over every data axis (dp, fsdp, ep), the data
            index row-major over them in mesh order; dense parameters replicated over ep (FSDP shards
            them over fsdp only, as without ep), their gradients averaged over every data rank.
  experts   every module an ``experts=`` glob names (its parameters all stacked (E, …)) is split on
            dim 0 over ep by ``ep.expert_parallel(module, mesh["ep"]'s group, style)``: ep rank r keeps
            experts [r·E/ep, (r+1)·E/ep), replicated over dp × fsdp × tp (never tp-split, never
            fsdp-sharded: FSDP2's / the FSDP wrapper's ``ignored_params``). Under tp the MoE layer runs
            identically on every tp rank (its input is replicated over tp); each tp rank's all-to-alls
            stay inside its ep group.
  balance   a layer holding a ``global_counts`` attribute (the project's MoE seam: None = its own
            counts) gets ``ExpertAxis.global_counts``: its (E,) counts summed over EVERY data rank, so
            a balancing loss computed from them equals one device's on the whole batch.

Collectives per step (forward / backward), per MoE layer on ep: ONE all-gather of the (ep·E,) int64
counts (the Dispatcher's splits), the dispatch and combine all-to-alls (uneven, dropless) forward and
their reverses backward; on the data group one all-reduce of the (E,) counts (layers with
``global_counts``). After backward: the dense gradients averaged over dp × ep (× fsdp's own
reductions: folded into the dp all-reduce without fsdp, into HSDP's replica all-reduce under the
explicit FSDP; FSDP2 keeps its dp all-reduce and ONE more flat all-reduce over ep follows), the
experts' gradients (each owner's sum over its ep group's rows) averaged over dp × fsdp by ONE flat
all-reduce, then / ep: together the mean-loss gradient of one device.
Bytes per step per rank (b the parameters' item size; routing-dependent, as shared.theory.ep_comm_torch):
    ep     Σ_l [ ep·E·8 + 2·(k·n_l + received_l)·D·b ]          (all-gather; 4 all-to-alls)
    data   Σ_l E·8 (balance) + Φ_dense·b (no fsdp: one all-reduce over dp × ep)
    dp×fsdp  Φ_experts/ep·b                                       (the experts' all-reduce)
``ExpertAxis.comm_theory`` adds these to the Trainer's per-axis theory from the last step's routing.

Refused before anything changes (ComposeError, one line: what, which axes, the fix): ep beside pp or
cp, ep > 1 without ``experts=``, an ``experts=`` glob naming no module, a named module whose
parameters are not all stacked (E, …) (or hold buffers), E not divisible by ep, a tp plan entry or an
FSDP unit glob naming an expert module (or a module inside one), compile=True with ep. ``experts=``
without ep > 1 splits nothing (the experts train as dense parameters); its layers' ``global_counts`` still
sum over every data (× cp) rank, so the balancing loss stays one device's under dp / fsdp / cp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torch_impl.parallel import ep as lib
from torch_impl.parallel import recipe
from torch_impl.parallel.compose_axes import ComposeError, group_over
from torch_impl.parallel.tp import matches
from torch_impl.parallel.zero import average_flat

DATA_AXES = ("dp", "fsdp", "ep")  # the batch rows split over these, row-major in mesh order


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def check_ep(model: nn.Module, layout: dict[str, int], experts, plan: dict | None, units, compile=False) -> list[str]:
    """The ep refusals (no process group needed, nothing changed). Returns the expert modules' paths."""
    n = layout.get("ep", 1)
    if n > 1:
        beside = [f"{a}={layout[a]}" for a in ("pp", "cp") if layout.get(a, 1) > 1]
        if beside:
            raise ComposeError(f"compose: ep={n} beside {', '.join(beside)} is not composed (pp would stage the "
                               "MoE layers' all-to-alls, cp would route T/cp tokens per rank with the balancing "
                               "loss's means over them); fix: ep with dp / fsdp / tp only")
        if not experts:
            raise ComposeError(f"compose: ep={n} needs experts=[module path globs] naming each MoE layer's stacked "
                               "experts module (e.g. experts=['layers.*.moe.experts']); fix: name them, or drop ep")
        if compile:
            raise ComposeError("compose: compile=True with ep > 1: the experts' uneven all-to-alls take their "
                               "splits from the routing (data-dependent shapes, graph breaks); fix: compile=False")
    if not experts:
        return []
    names = [p for p, _ in model.named_modules() if p]
    paths = []
    for glob in experts:
        hit = [p for p in names if matches(p, glob)]
        if not hit:
            raise ComposeError(f"compose: experts glob {glob!r} names no module of {type(model).__name__}; fix: a "
                               "module path glob ('*' one segment) of the module holding the stacked (E, …) weights")
        paths += [p for p in hit if p not in paths]
    for path in paths:
        try:
            lib.check_experts(model.get_submodule(path), n)
        except lib.ExpertError as e:
            raise ComposeError(f"compose: experts {path!r}: {e}; fix: name the module holding only the stacked "
                               f"(E, …) expert weights, with E divisible by ep={n}") from None
    for what, globs in (("tp plan entry", list(plan or {})), ("FSDP unit glob", list(units or ()))):
        for glob in globs:
            hit = next((p for p in names if matches(p, glob) and any(_inside(p, e) for e in paths)), None)
            if hit and n > 1:
                raise ComposeError(f"compose: {what} {glob!r} names {hit!r}, inside the experts that ep={n} splits "
                                   "whole by expert (never tp-split or fsdp-sharded); fix: leave the experts out of it")
    return paths


class ExpertAxis:
    """One Trainer's ep: the split experts, their gradients' reduction, the balancing loss's counts,
    the whole experts (``full``) and ep's part of ``comm_theory``."""

    def __init__(self, module: nn.Module, paths: list[str], mesh: DeviceMesh, layout: dict[str, int], style: str,
                 unfolded: bool = False):
        self.n = layout.get("ep", 1)  # 1: no split; only the balancing counts' seam (dp / fsdp / cp)
        self.group, self.unfolded = mesh["ep"].get_group() if self.n > 1 else None, unfolded and self.n > 1
        data = [a for a in layout if a in DATA_AXES + ("cp",) and layout[a] > 1]  # mesh order; cp only without ep
        other = [a for a in data if a != "ep"] if self.n > 1 else []
        self.data_label, self.other_label = "+".join(data), "+".join(other)
        self.data_group = group_over(mesh, data)[1]
        self.other_group = group_over(mesh, other)[1]
        self.dispatchers, self.ids = [], set()
        for path in paths:
            experts = module.get_submodule(path)
            if self.n > 1:
                self.dispatchers.append(lib.expert_parallel(experts, self.group, style))
                self.ids |= {id(p) for p in experts.parameters()}
            parent = module.get_submodule(path.rpartition(".")[0])
            if hasattr(parent, "global_counts"):  # the balancing loss's seam
                parent.global_counts = self.global_counts
        self.calls, self.count_bytes, self.noted = 0, 0, []

    def params(self, params) -> list[nn.Parameter]:
        return [p for p in params if id(p) in self.ids]

    def dense(self, params) -> list[torch.Tensor]:
        """The (local) gradients of the parameters every data rank holds alike."""
        grads = [p.grad for p in params if id(p) not in self.ids and p.grad is not None]
        return [g.to_local() if isinstance(g, DTensor) else g for g in grads]

    def begin_step(self) -> None:
        self.calls, self.count_bytes, self.noted = 0, 0, []

    def note(self) -> None:
        """After each forward of the step (an accumulation's part): its routing's collectives, kept."""
        self.noted.append([d.comm_theory() for d in self.dispatchers])

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(E,) this rank's counts -> summed over every data rank (ONE all-reduce over dp × fsdp × ep, or
        × cp without ep)."""
        total = counts.detach().clone()
        dist.all_reduce(total, group=self.data_group)
        self.calls, self.count_bytes = self.calls + 1, self.count_bytes + total.numel() * total.element_size()
        return total

    def finish(self, params) -> None:
        """After the Trainer's reduction: ``unfolded`` (FSDP2, which reduced over dp × fsdp only) the dense
        shards averaged over ep (ONE flat all-reduce); each owner's expert gradient (Σ over its ep group's
        rows of their local mean losses) averaged over dp × fsdp (ONE flat all-reduce), then / ep: the
        gradient of the mean over all d data ranks' losses (d = dp·fsdp·ep), as one device's."""
        if self.n == 1:
            return
        if self.unfolded:
            average_flat(self.dense(params), self.group)
        grads = [p.grad for p in self.params(params) if p.grad is not None]
        if self.other_group is not None:
            average_flat(grads, self.other_group)
        for g in grads:
            g.div_(self.n)
        recipe.refresh(grads)

    def full(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's (E/ep, …) experts -> (E, …) (ep rank order = expert order; call on every rank)."""
        out = p.new_empty((self.n * p.shape[0], *p.shape[1:]))
        dist.all_gather_single(out, p.detach().contiguous(), group=self.group)
        return out

    def labels(self) -> dict:
        return {g: label for g, label in ((self.data_group, self.data_label), (self.other_group, self.other_label))
                if g is not None}

    def comm_theory(self, add, params, b: int) -> None:
        """ep's collectives of the last step (the Dispatchers' routing), the counts' all-reduces, the experts'
        gradient all-reduce over dp × fsdp; ``add(label, op, count, bytes)``."""
        for part in self.noted:  # every forward of the last step (accumulation: one per part)
            for ops in part:
                for op, (k, nbytes) in ops.items():
                    add("ep", op, k, nbytes)
        if self.calls:
            add(self.data_label, "all_reduce", self.calls, self.count_bytes)
        if self.unfolded:
            add("ep", "all_reduce", 1, sum(g.numel() for g in self.dense(params)) * b)
        if self.other_group is not None:
            add(self.other_label, "all_reduce", 1, sum(p.grad.numel() for p in self.params(params)
                                                       if p.grad is not None) * b)
