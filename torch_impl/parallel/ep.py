"""Expert parallelism's pieces for a mixture-of-experts layer (GShard, Lepikhin et al. 2020,
arXiv:2006.16668; Megatron-Core's MoEAlltoAllTokenDispatcher): rank r owns experts
[r·E/N, (r+1)·E/N) whole; tokens travel to their experts' owners by all-to-all and back.

    d = Dispatcher(E, local_experts, group, ALL_TO_ALL["explicit"])
    moe.global_counts, moe.dispatch = d.global_counts, d     # an MoE layer's two seams

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
        return combined
