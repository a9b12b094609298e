"""Expert parallelism (EP) with torch.distributed, the runner: the MoE transformer's experts are
sharded over the ep ranks; tokens travel to their experts by all-to-all.

Sharded: rank r owns experts [r·E/N, (r+1)·E/N) of every MoE layer, whole, and sequences
[r·B/N, (r+1)·B/N) of the batch (EP inside DP): n = B·T/N tokens. Embeddings, attention, norms,
routers and the head are replicated.

Per MoE layer (the ``MoE.global_counts`` / ``MoE.dispatch`` seams; the pieces: torch_impl/parallel/ep.py):
  1. ONE all-gather of the (E,) int64 counts: the uneven splits and the balancing loss's global f;
  2. dispatch: the k·n assignment rows, sorted by expert, by ``all_to_all_single`` with uneven splits;
  3. the local experts; 4. combine: the reverse all-to-all brings every row home.
Backward: each all-to-all's backward is the reverse all-to-all. Dropless: no capacity, no padding.
The replicated gradients: ONE flat all-reduce; an expert's gradient stays on its owner.

    explicit/dropless  ``AllToAll``, a hand-written autograd Function around dist.all_to_all_single
    builtin/dropless   the autograd-aware functional all-to-all (core torch has no EP building
                       block; docs/ep.md says why this is the closest builtin)

Bytes per step per rank (shared.theory.ep_comm_torch, on the step's own routing counts):
    Σ_l [ N·E·8 + 2·(k·n + received_l)·D·b ] + ep_replicated_params·b
Papers: GShard, Lepikhin et al. 2020 (arXiv:2006.16668); Switch Transformer, Fedus et al. 2021
(arXiv:2101.03961); DeepSpeed-MoE, Rajbhandari et al. 2022 (arXiv:2201.05596); Megatron-Core's dispatcher.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from shared.config import Config
from shared.problem import Problem, is_expert_param
from shared.results import Trained
from shared.theory import ep_comm_bytes_torch, ep_comm_torch, ep_experts_of
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import aux_loss, build_model, expert_load, inputs, loss_fn, make_optimizer, targets, to_fixture
from torch_impl.parallel.dp import local_batch
from torch_impl.parallel.ep import ALL_TO_ALL, Dispatcher
from torch_impl.parallel.fsdp import average_flat

VARIANTS = (("explicit", "dropless"), ("builtin", "dropless"))


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    return VARIANTS


# --- training ---------------------------------------------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    if (style, variant) not in VARIANTS:
        raise ValueError(f"ep: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    cfg.check("ep")
    n, r, group = ctx.world_size, ctx.rank, ctx.group
    model = build_model(cfg, problem, ctx.device)
    mine = ep_experts_of(cfg, r)
    for block in model.blocks:  # keep my E/N experts; swap in the all-to-all seams
        block.mlp.experts = block.mlp.experts.shard(mine.start, len(mine))
        d = Dispatcher(cfg.experts, block.mlp.experts, group, ALL_TO_ALL[style])
        block.mlp.global_counts, block.mlp.dispatch = d.global_counts, d
    x = local_batch(inputs(cfg, problem, ctx.device), r, n)  # (B/N, T)
    y = local_batch(targets(cfg, problem, ctx.device), r, n)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    replicated = [p for name, p in named if not is_expert_param(name)]
    experts = [p for name, p in named if is_expert_param(name)]
    assert all(p.shape[0] == len(mine) for p in experts), [p.shape for p in experts]
    opt = make_optimizer(params, cfg)
    loads = []  # per step: (L, B/N, E) routing of my sequences

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y) + aux_loss(model)  # local mean CE + Σ_l aux_l (global f, local P)
        loss.backward()
        average_flat([p.grad for p in replicated], group)  # ONE all-reduce, / N
        for p in experts:
            p.grad.div_(n)  # the owner holds Σ_ranks d(loss_r)/dW_e; the loss is their mean
        loads.append(expert_load(model))
        return loss

    def fixture(tensors: list[torch.Tensor]) -> list:
        full = []
        for (name, _), t in zip(named, tensors, strict=True):
            if is_expert_param(name):  # (E/N, …) slices, in rank order = expert order -> (E, …)
                whole = t.new_empty((n * t.shape[0], *t.shape[1:]))
                dist.all_gather_single(whole, t.detach().contiguous(), group=group)
                t = whole
            full.append(to_fixture(model, name, t))
        return full

    trained = train_loop(cfg, ctx, Setup(
        forward_backward=forward_backward, update=opt.step, grads=lambda: [p.grad for p in params],
        fixture=fixture, params=params, optimizer=opt, loss_reduction="mean", group=group,
        extra={"backend": ctx.backend}))
    # bookkeeping after training, outside the ledger: every rank's routing, ledger and activations
    every: list = [None] * n
    dist.all_gather_object(every, (loads, trained.comm, trained.extra["activation_bytes"]), group=group)
    load = np.concatenate([np.stack(rank_loads) for rank_loads, _, _ in every], axis=2)  # ranks' sequences in order
    trained.extra["expert_load"] = load  # (steps, L, B, E) int64
    trained.extra["comm_per_rank"] = [comm for _, comm, _ in every]
    trained.extra["activation_bytes_per_rank"] = [a for _, _, a in every]
    theory = [ep_comm_torch(cfg, style, load[-1], rank) for rank in range(n)]
    trained.extra["comm_theory_per_rank"] = [{op: {"count": c, "bytes": b} for op, (c, b) in t.items()}
                                             for t in theory]
    trained.comm_theory = ep_comm_bytes_torch(cfg, style, load[-1], r)
    return trained
