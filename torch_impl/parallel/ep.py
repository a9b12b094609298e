"""Expert parallelism's pieces for a mixture-of-experts layer (GShard, Lepikhin et al. 2020,
arXiv:2006.16668; Megatron-Core's MoEAlltoAllTokenDispatcher): rank r owns experts
[r·E/N, (r+1)·E/N) whole; tokens travel to their experts' owners by all-to-all and back.

    d = Dispatcher(E, local_experts, group, ALL_TO_ALL["explicit"])
    moe.global_counts, moe.dispatch = d.global_counts, d     # an MoE layer's two seams

Your own MoE layer (router + an experts module of stacked (E, …) weights called as experts(rows, counts),
rows sorted by expert; torchtitan's GroupedExperts call): ``expert_parallel`` splits the module in place
and routes that same call through a Dispatcher; ``finish_gradients`` after backward (EP inside DP).

    ep.expert_parallel(model.moe.experts, group)        # rank r keeps experts [r·E/N, (r+1)·E/N)
    loss(model(x_local), y_local).backward(); ep.finish_gradients(model, group); opt.step()
    ep.clip_grad_norm_(model, max_norm, group)          # between the two: the global norm (experts summed)

Per layer: ONE all-gather of the (E,) int64 per-expert counts (-> the uneven splits and the global
counts of the balancing loss), the dispatch all-to-all of the k·n assignment rows (sorted by expert),
the local experts, the combine all-to-all back; each all-to-all's backward is the reverse one.
Dropless: no capacity, nothing padded. Bytes: shared.theory.ep_comm_torch. The runner torch_impl/ep.py
plugs these into the project's MoE transformer and has the details (builtin vs explicit all-to-all).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from torch_impl.parallel import recipe

# --- the all-to-alls --------------------------------------------------------------------------------


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """(Σ send, D) -> (Σ recv, D): send[j] rows to rank j, recv[j] rows from rank j, in rank order."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Uneven all-to-all whose backward is the reverse one (Megatron-Core's ``_AllToAll``)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.splits, ctx.group = (send, recv), group
        return all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return all_to_all_rows(grad, recv, send, ctx.group), None, None, None


def explicit_all_to_all(x, send, recv, group):
    return AllToAll.apply(x, send, recv, group)


# torchtitan's name; in torch 2.13 an alias of all_to_all_single, whose op has the autograd built in
_FUNCTIONAL_A2A = getattr(funcol, "all_to_all_single_autograd", funcol.all_to_all_single)


def builtin_all_to_all(x, send, recv, group):
    return _FUNCTIONAL_A2A(x.contiguous(), recv, send, group)  # (output_split_sizes, input_split_sizes)


ALL_TO_ALL = {"explicit": explicit_all_to_all, "builtin": builtin_all_to_all}  # what tells the styles apart


# --- the dispatcher: MoE.global_counts and MoE.dispatch of one layer ----------------------------------


class Dispatcher:
    """One MoE layer's seams on one ep rank: ``global_counts`` exchanges the counts (and keeps C for
    the splits), ``__call__`` moves the rows to their experts' owners and back. ``experts``: this
    rank's E/N experts, a module with ``first`` / ``num`` (its expert ids) called as
    ``experts(rows grouped by expert, rows per expert)`` (torch_impl.transformer.GroupedExperts)."""

    def __init__(self, num_experts: int, experts, group, all_to_all):
        self.n, self.rank, self.group = dist.get_world_size(group), dist.get_rank(group), group
        self.experts, self.all_to_all, self.num_experts = experts, all_to_all, num_experts
        per = num_experts // self.n  # rank r owns experts [r·E/N, (r+1)·E/N) (shared.theory.ep_experts_of)
        self.owned = [range(dst * per, (dst + 1) * per) for dst in range(self.n)]
        self.mine = self.owned[self.rank]
        assert (experts.first, experts.num) == (self.mine.start, len(self.mine)), (experts.first, experts.num)
        self.c: list[list[int]] = []

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        gathered = counts.new_empty(self.n * self.num_experts)  # (N·E,) int64
        dist.all_gather_single(gathered, counts.contiguous(), group=self.group)
        c = gathered.view(self.n, self.num_experts)  # (N, E): C[src][e]
        self.c = c.tolist()
        return c.sum(0)  # (E,): the global counts

    def __call__(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        c, n, mine = self.c, self.n, self.mine
        kind = rows.device.type
        if torch.is_autocast_enabled(kind):  # mixed precision: the rows travel in the compute dtype (bf16), cast
            rows = rows.to(torch.get_autocast_dtype(kind))  # as the experts' first matmul would cast them anyway
        assert counts == c[self.rank] and rows.shape[0] == sum(counts), (counts, c[self.rank], rows.shape)
        send = [sum(c[self.rank][e] for e in self.owned[dst]) for dst in range(n)]
        recv = [sum(c[src][e] for e in mine) for src in range(n)]
        got = self.all_to_all(rows, send, recv, self.group)  # (received, D): by source, then expert
        assert got.shape == (sum(recv), rows.shape[1]), got.shape
        blocks = got.split([c[src][e] for src in range(n) for e in mine])  # block (src, i) at src·E/N + i
        per = len(mine)
        grouped = torch.cat([blocks[src * per + i] for i in range(per) for src in range(n)])  # by expert
        y = self.experts(grouped, [sum(c[src][e] for src in range(n)) for e in mine])  # (received, D)
        out = y.split([c[src][e] for e in mine for src in range(n)])  # block (i, src) at i·N + src
        back = torch.cat([out[i * n + src] for src in range(n) for i in range(per)])  # by source again
        combined = self.all_to_all(back, recv, send, self.group)  # (k·n, D): my rows, sorted order
        assert combined.shape == rows.shape, (combined.shape, rows.shape)
        self.row_bytes = rows.shape[1] * rows.element_size()
        return combined

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """The last call's collectives on this rank, with its backward: the counts' all-gather ((N·E,)
        int64), the dispatch and combine all-to-alls and their reverses, each moving the rows this rank
        sends plus those it receives (its k·n rows and the rows for its experts)."""
        return {"all_gather": (1, self.n * self.num_experts * 8), "all_to_all": (4, 2 * self.rows() * self.row_bytes)}

    def rows(self) -> int:
        """The rows the last counts exchange routes through this rank: its own k·n sent plus those it receives."""
        return sum(self.c[self.rank]) + sum(self.c[src][e] for src in range(self.n) for e in self.mine)


# --- a user's MoE layer: expert_parallel on the module holding the stacked experts ----------------------

EXPERT_MARK = "_ep_experts"  # set on each parameter expert_parallel split: (E, rank's first expert, group size)


class ExpertError(ValueError):
    """A module that expert_parallel cannot split exactly."""


def check_experts(experts: nn.Module, world_size: int) -> int:
    """The static checks of ``expert_parallel`` (no process group needed): every parameter of ``experts``
    stacked (E, …) with one E divisible by ``world_size``, no buffer, nothing split before. Returns E."""
    named = list(experts.named_parameters())
    if not named:
        raise ExpertError(f"ep: {type(experts).__name__} holds no parameter: give the module that holds the "
                          "stacked expert weights (E, …)")
    if list(experts.named_buffers()):
        raise ExpertError(f"ep: {type(experts).__name__} holds buffers {[n for n, _ in experts.named_buffers()]}: "
                          "expert_parallel splits parameters only; make them parameters or move them out")
    lead = {name: (p.shape[0] if p.dim() else None) for name, p in named}
    if len(set(lead.values())) != 1 or None in lead.values():
        raise ExpertError(f"ep: the experts' parameters must all be stacked (E, …) on dim 0; leading dims {lead}. "
                          "Fix: keep the router and any shared weights outside the experts module")
    if any(hasattr(p, EXPERT_MARK) for _, p in named):
        raise ExpertError(f"ep: {type(experts).__name__} is expert-parallel already")
    e = next(iter(lead.values()))
    if e % world_size:
        raise ExpertError(f"ep: {e} experts are not divisible by the group's {world_size} ranks "
                          "(every rank owns E/N whole experts)")
    return e


class _Local:
    """The Dispatcher's view of the user's module: experts ``first`` … ``first+num−1``, called on rows
    grouped by local expert with the counts in the type the layer passed (list or tensor)."""

    def __init__(self, forward, first: int, num: int):
        self.forward, self.first, self.num, self.as_tensor = forward, first, num, None

    def __call__(self, rows, counts: list[int]):
        return self.forward(rows, self.as_tensor(counts) if self.as_tensor else counts)


def expert_parallel(experts: nn.Module, group=None, style: str = "explicit") -> Dispatcher:
    """Expert parallelism for YOUR mixture-of-experts layer, in place. ``experts``: the module holding the
    stacked expert weights (every parameter (E, …)), called by your layer as ``experts(rows, counts)`` —
    rows (Σ counts, D) grouped by expert (your router's top-k, sorted), counts (E,) rows per expert (a
    list or an int tensor) — returning one row per row, and looping over its own dim 0 (so that E/N
    experts take E/N counts). Afterwards rank r keeps experts [r·E/N, (r+1)·E/N) and the same call
    exchanges the counts (one all-gather), sends every row to its expert's owner, runs the local
    experts and brings the rows back (all-to-all each way, backward the reverse): the output equals
    the unsplit module's on the same rows. Returns the Dispatcher: ``.global_counts(counts)`` gives the
    (E,) counts over every rank (a balancing loss equal to one device's), ``.comm_theory()`` the last
    call's collectives. After backward, call
    ``finish_gradients(model, group)``; the wrappers (BucketedDDP, Zero1/2, FSDP) refuse the split
    parameters (averaging them would mix different experts)."""
    group = group if group is not None else dist.group.WORLD
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    e = check_experts(experts, n)
    per = e // n
    for owner in experts.modules():
        for attr, p in list(owner._parameters.items()):
            if p is not None and not hasattr(p, EXPERT_MARK):
                part = nn.Parameter(p.detach()[rank * per:(rank + 1) * per].clone(), requires_grad=p.requires_grad)
                setattr(part, EXPERT_MARK, (e, rank * per, n))
                owner._parameters[attr] = part
    local = _Local(experts.forward, rank * per, per)
    d = Dispatcher(e, local, group, ALL_TO_ALL[style])

    def forward(rows: torch.Tensor, counts, *args, **kwargs):
        if args or kwargs:
            raise ExpertError("ep: the experts are called as experts(rows, counts); extra arguments are not sent")
        c = torch.as_tensor(counts, dtype=torch.int64, device=rows.device)
        if c.shape != (e,):
            raise ExpertError(f"ep: counts must be ({e},) rows per expert, got shape {tuple(c.shape)}")
        local.as_tensor = (lambda cs: torch.tensor(cs, dtype=counts.dtype, device=counts.device)) \
            if isinstance(counts, torch.Tensor) else None
        d.global_counts(c)
        return d(rows, c.tolist())
    experts.forward = forward  # an instance attribute: nn.Module.__call__ (and its hooks) call it
    return d


def finish_gradients(model: nn.Module, group=None) -> None:
    """EP inside DP, after backward (each rank's loss the mean over its rows): every other gradient averaged
    over the group (ONE flat all-reduce, / N); an expert's gradient — the sum over every rank's rows that
    reached it — divided by N."""
    group = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        if hasattr(p, EXPERT_MARK):
            p.grad.div_(n)
    rest = [p.grad for p in params if not hasattr(p, EXPERT_MARK)]
    if rest:
        flat = torch.cat([g.reshape(-1) for g in rest])
        dist.all_reduce(flat, group=group)
        flat.div_(n)
        for g, chunk in zip(rest, flat.split([g.numel() for g in rest])):
            g.copy_(chunk.view_as(g))
    # torch's clip_grad_norm_ over what this rank holds sees ITS experts only: a local norm, a different
    # clip on every rank (silently wrong, the replicated weights drifting apart): refused at the step
    recipe.seal([p.grad for p in params if hasattr(p, EXPERT_MARK)], "ep.finish_gradients",
                "clip with ep.clip_grad_norm_(model, max_norm, group): the experts' squares summed over the group")


def clip_grad_norm_(model: nn.Module, max_norm: float, group=None) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` of the whole (unsplit) model, after ``finish_gradients``: the experts'
    gradients (this rank's E/N) summed over the group by ONE scalar all-reduce, every other gradient (equal
    on every rank after the average) counted once. Returns the global norm, equal on every rank."""
    group = group if group is not None else dist.group.WORLD
    params = [p for p in model.parameters() if p.requires_grad]  # gradients None skipped, the all-reduce still run
    if not params:
        return torch.zeros(())
    split = [p.grad for p in params if hasattr(p, EXPERT_MARK)]
    whole = [p.grad for p in params if not hasattr(p, EXPERT_MARK)]
    return recipe.clip_(split, whole, max_norm, group, params[0].dtype)


def refuse_split_experts(named, who: str) -> None:
    """For the data-parallel wrappers: no parameter ``expert_parallel`` split (one line, the fix)."""
    for name, p in named:
        if hasattr(p, EXPERT_MARK):
            raise ExpertError(f"{who}: parameter {name!r} holds this rank's experts only (ep.expert_parallel); "
                              f"{who} would take it for the whole parameter (averaged, sharded or staged over the "
                              "ranks: different experts mixed). ep composes with data parallelism only: train the "
                              "model unwrapped and call ep.finish_gradients(model, group) after backward")
