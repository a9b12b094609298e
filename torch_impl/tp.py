"""Tensor parallelism (TP): every weight is split across the tp ranks; every rank sees the full batch.

From Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, §3) and the CS336 lecture-8 code, which
stops at the forward pass and gives each rank a random shard. Here rank r's shard is a SLICE of
the fixture weight W_l, and we train: forward, backward, AdamW (each rank steps its own shard, so
the shards of one W_l stay slices of one consistent weight). S = B·D·b below.

- explicit/allgather (the CS336 scheme): every layer column-parallel, rank r holds
  W_l[:, r·D/tp:(r+1)·D/tp] (D, D/tp). fwd: y = gelu(x @ W_l,r) (B, D/tp) -- GELU is elementwise,
  so it runs on the shard BEFORE the gather (1/tp of the work) -- then all-gather -> (B, D).
  bwd: the next layer reads only its own columns, so rank r holds a *partial* dL/dx; the backward
  of the all-gather is a reduce-scatter (sum the partials, keep my columns). The last gather feeds
  the loss, which every rank computes from the same full output: that gradient is already complete
  and identical on every rank, so its backward is a local slice, no collective.
  Per step per rank: L all-gathers + (L-1) reduce-scatters, S each; wire (2L-1)·S·(tp-1)/tp.
- explicit/megatron: layers in pairs, column-parallel (D, D/tp) then row-parallel (D/tp, D), GELU
  local in between; Megatron's f (identity fwd, all-reduce bwd) before each pair and g (all-reduce
  fwd, identity bwd) after it. Odd L: the last layer is column-parallel + all-gather (as above).
  Per step per rank: floor(L/2) all-reduces fwd (g) + ceil(L/2)-1 bwd (f; the first f has nothing
  to reduce: x needs no gradient) + (L mod 2) all-gathers, S each.
- builtin/dtensor: the same Megatron plan by ``parallelize_module`` with ColwiseParallel /
  RowwiseParallel; DTensor issues functional collectives (``_c10d_functional.*``, seen by the ledger).

Loss: every rank holds the full output, so the loss needs no collective.
Memory per rank: params, grads, AdamW moments all 1/tp: Φ·b/tp, Φ·b/tp, 2·Φ·b/tp.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import tp_comm_bytes
from torch_impl.launch import RankContext
from torch_impl.model import (
    build_model,
    inputs,
    loss_fn,
    make_optimizer,
    optimizer_state_bytes,
    tensor_bytes,
    to_numpy,
    torch_dtype,
)

VARIANTS = (("explicit", "allgather"), ("explicit", "megatron"), ("builtin", "dtensor"))


def layer_kinds(layers: int, variant: str) -> list[str]:
    """Per layer: "col" (rank holds W_l[:, shard], (D, D/tp)) or "row" (W_l[shard, :], (D/tp, D))."""
    if variant == "allgather":
        return ["col"] * layers
    return ["col", "row"] * (layers // 2) + ["col"] * (layers % 2)  # odd L: last col + all-gather


def shard_of(w: np.ndarray, kind: str, rank: int, n: int) -> np.ndarray:
    k = w.shape[0] // n
    return w[:, rank * k:(rank + 1) * k] if kind == "col" else w[rank * k:(rank + 1) * k, :]


# --- the collectives as autograd Functions (plain dist.* calls have no autograd) --------------


class GatherColumns(torch.autograd.Function):
    """fwd: all-gather the (B, D/tp) shards along the feature dim -> (B, D).
    bwd: grad_is_partial -> reduce-scatter (sum every rank's partial dL/dx, keep my columns);
    else the grad is already full and identical everywhere -> keep my columns, no collective."""

    @staticmethod
    def forward(ctx, y, group, grad_is_partial: bool):
        n, b, k = dist.get_world_size(group), y.shape[0], y.shape[1]
        ctx.group, ctx.partial, ctx.rank = group, grad_is_partial, dist.get_rank(group)
        out = y.new_empty(n * b, k)  # (tp·B, D/tp): all_gather_single concatenates along dim 0
        dist.all_gather_single(out, y.contiguous(), group=group)
        return out.view(n, b, k).permute(1, 0, 2).reshape(b, n * k)  # (B, D)

    @staticmethod
    def backward(ctx, grad):  # grad: (B, D)
        n = dist.get_world_size(ctx.group)
        b, k = grad.shape[0], grad.shape[1] // n
        if not ctx.partial:
            return grad[:, ctx.rank * k:(ctx.rank + 1) * k], None, None  # (B, D/tp)
        chunks = grad.reshape(b, n, k).permute(1, 0, 2).reshape(n * b, k)  # (tp·B, D/tp)
        out = grad.new_empty(b, k)  # (B, D/tp)
        dist.reduce_scatter_single(out, chunks, group=ctx.group)
        return out, None, None


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward (each rank's dL/dx is partial)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # (B, D)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # (B, D)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum the row-parallel partial products), identity backward."""

    @staticmethod
    def forward(ctx, z, group):
        z = z.clone()  # (B, D), partial sum on each rank
        dist.all_reduce(z, group=group)
        return z

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --- the two explicit forwards (rank code: local shapes asserted) ------------------------------


def forward_allgather(shards: list[torch.Tensor], x: torch.Tensor, group) -> torch.Tensor:
    b, d = x.shape
    n = dist.get_world_size(group)
    for l, w in enumerate(shards):
        assert w.shape == (d, d // n), w.shape
        y = F.gelu(x @ w, approximate="none")  # (B, D/tp): GELU before the gather
        x = GatherColumns.apply(y, group, l < len(shards) - 1)  # (B, D)
    return x


def forward_megatron(shards: list[torch.Tensor], x: torch.Tensor, group) -> torch.Tensor:
    b, d = x.shape
    n = dist.get_world_size(group)
    for wa, wb in zip(shards[0::2], shards[1::2], strict=False):  # (col, row) pairs; odd L: last one left
        assert wa.shape == (d, d // n) and wb.shape == (d // n, d), (wa.shape, wb.shape)
        h = F.gelu(CopyToTP.apply(x, group) @ wa, approximate="none")  # f; (B, D/tp)
        x = F.gelu(ReduceFromTP.apply(h @ wb, group), approximate="none")  # g; (B, D)
    if len(shards) % 2:  # odd L: a lone column-parallel layer, gathered for the loss
        w = shards[-1]
        assert w.shape == (d, d // n), w.shape
        y = F.gelu(CopyToTP.apply(x, group) @ w, approximate="none")  # (B, D/tp)
        x = GatherColumns.apply(y, group, False)  # (B, D)
    return x


def gather_full(shard: torch.Tensor, kind: str, group) -> torch.Tensor:
    """The full (D, D) weight (fixture orientation) from every rank's shard."""
    rows = shard.detach().T if kind == "col" else shard.detach()  # (D/tp, D)
    full = rows.new_empty(dist.get_world_size(group) * rows.shape[0], rows.shape[1])  # (D, D)
    dist.all_gather_single(full, rows.contiguous(), group=group)
    return full.T if kind == "col" else full


# --- builtin: DTensor ----------------------------------------------------------------------------


def parallelize_megatron(model: torch.nn.Module, mesh, kinds: list[str]) -> torch.nn.Module:
    """Colwise shards linear.weight's rows (= W_l's columns), Rowwise its columns (= W_l's rows).
    Colwise keeps its output Shard(-1) (GELU local), Rowwise all-reduces to Replicate; an odd last
    layer is Colwise with a Replicate output (all-gather; DTensor applies GELU after the gather)."""
    plan = {}
    for l, kind in enumerate(kinds):
        if kind == "row":
            plan[f"layers.{l}.linear"] = RowwiseParallel()
        elif l == len(kinds) - 1:
            plan[f"layers.{l}.linear"] = ColwiseParallel(output_layouts=Replicate())
        else:
            plan[f"layers.{l}.linear"] = ColwiseParallel()
    return parallelize_module(model, mesh, plan)


# --- training ------------------------------------------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    if (style, variant) not in VARIANTS:
        raise ValueError(f"tp: unknown variant {style}/{variant}")
    cfg.check("tp")
    n, d = ctx.world_size, cfg.dim
    kinds = layer_kinds(cfg.layers, "allgather" if variant == "allgather" else "megatron")
    x = inputs(cfg, problem, ctx.device)  # (B, D): every rank sees the full batch
    if style == "explicit":
        params = [torch.tensor(shard_of(w, k, ctx.rank, n), dtype=torch_dtype(cfg), device=ctx.device,
                               requires_grad=True) for w, k in zip(problem.weights, kinds, strict=True)]
        forward = forward_allgather if variant == "allgather" else forward_megatron
        run = lambda: forward(params, x, ctx.group)  # (B, D)
        full = lambda ts: [gather_full(t, k, ctx.group) for t, k in zip(ts, kinds, strict=True)]
    else:
        mesh = init_device_mesh(ctx.device.type, (n,), mesh_dim_names=("tp",))
        model = parallelize_megatron(build_model(cfg, problem, ctx.device), mesh, kinds)
        params = [block.linear.weight for block in model.layers]  # DTensors, weight == W_l.T
        for p, kind in zip(params, kinds, strict=True):  # Colwise: (D/tp, D) local rows; Rowwise: (D, D/tp)
            assert p.to_local().shape == ((d // n, d) if kind == "col" else (d, d // n)), p.to_local().shape
        run = lambda: model(x)  # (B, D), a plain (replicated) tensor
        full = lambda ts: [t.full_tensor().T for t in ts]  # all-gather, back to fixture orientation
    opt = make_optimizer(params, cfg)

    losses, step_times, grads0 = [], [], None
    for step in range(cfg.steps):
        last = step == cfg.steps - 1  # the ledger records one steady-state step: the last
        with ctx.ledger.recording() if last else contextlib.nullcontext():
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(run())  # full output on every rank: no collective for the loss
            loss.backward()
            opt.step()
            losses.append(loss.item())  # .item() syncs
            step_times.append(time.perf_counter() - t0)
        if step == 0:
            grads0 = [to_numpy(g) for g in full([p.grad for p in params])]
    comm = ctx.ledger.summary()
    final = [to_numpy(w) for w in full(params)]
    return Trained(
        losses=losses,
        grads0=grads0,
        params=final,
        step_times=step_times,
        comm=comm,
        comm_theory=tp_comm_bytes(cfg, "allgather" if variant == "allgather" else "megatron"),
        state_bytes={"params": tensor_bytes(params), "grads": tensor_bytes([p.grad for p in params]),
                     "optimizer": optimizer_state_bytes(opt)},  # local shards of DTensors
        extra={"layer_kinds": kinds, "backend": ctx.backend},
    )
