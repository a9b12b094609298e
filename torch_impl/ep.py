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

The recipe (docs/recipe.md, ### Under ep): --accumulate K runs the reference's micro-batches (B/K whole
sequences, split over the ranks: ``ep_batch``), each with its own counts all-gather and balancing loss;
--clip ep.clip_grad_norm_ (the experts' squares summed over the ranks); decay mask, frozen globs (after the
split) and the schedule as dp. Mixed precision: the step under autocast, the rows dispatched in bf16.
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
from torch_impl import recipe
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import aux_loss, build_model, expert_load, inputs, loss_fn, targets, to_fixture
from torch_impl.parallel.dp import local_batch
from torch_impl.parallel.ep import ALL_TO_ALL, EXPERT_MARK, Dispatcher, clip_grad_norm_, finish_gradients

VARIANTS = (("explicit", "dropless"), ("builtin", "dropless"))


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    return VARIANTS


# --- training ---------------------------------------------------------------------------------------


def ep_batch(a: torch.Tensor, rank: int, n: int, k: int) -> torch.Tensor:
    """This rank's rows: of each of the k micro-batches (B/k whole sequences, in order, the reference's),
    the rank's B/(k·n) of them (rank order), the k pieces stacked in order: (B/n, …). k = 1: local_batch."""
    return torch.cat([local_batch(part, rank, n) for part in a.chunk(k)])


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    if (style, variant) not in VARIANTS:
        raise ValueError(f"ep: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    cfg.check("ep", "torch")
    n, r, group, k = ctx.world_size, ctx.rank, ctx.group, cfg.accumulate
    model = build_model(cfg, problem, ctx.device)
    mine = ep_experts_of(cfg, r)
    for block in model.blocks:  # keep my E/N experts; swap in the all-to-all seams
        block.mlp.experts = block.mlp.experts.shard(mine.start, len(mine))
        for p in block.mlp.experts.parameters():  # what ep.finish_gradients / ep.clip_grad_norm_ read
            setattr(p, EXPERT_MARK, (cfg.experts, mine.start, n))
        d = Dispatcher(cfg.experts, block.mlp.experts, group, ALL_TO_ALL[style])
        block.mlp.global_counts, block.mlp.dispatch = d.global_counts, d
    recipe.freeze_(model, cfg)  # --freeze: fixture names (the shards keep them), after the shards are made
    x = ep_batch(inputs(cfg, problem, ctx.device), r, n, k)  # (B/N, T): k micro-batches' rows of this rank
    y = ep_batch(targets(cfg, problem, ctx.device), r, n, k)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    assert all(p.shape[0] == len(mine) for name, p in named if is_expert_param(name)), [p.shape for p in params]
    opt = recipe.optimizer(named, cfg)  # AdamW; --decay-mask: matrices (the experts' (E/N, …) too) / vectors
    # --clip: the global norm, experts' squares summed over the ranks (one scalar all-reduce), the rest once
    clip = lambda max_norm: clip_grad_norm_(model, max_norm, group)  # noqa: E731
    loads = []  # per step: (L, k, B/(k·N), E) routing of my sequences

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        parts = []

        def loss_of(xs, ys):  # one micro-batch: local mean CE + Σ_l aux_l (its global f, local P)
            loss = loss_fn(model(xs), ys) + aux_loss(model)
            parts.append(expert_load(model))
            return loss
        loss = recipe.accumulate(cfg, x, y, loss_of)  # --accumulate K: loss / K each, gradients summed
        # ONE all-reduce of the replicated gradients (/ N); an expert's (its owner's Σ over the ranks' rows) / N
        finish_gradients(model, group)
        loads.append(np.stack(parts, axis=1))
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
        forward_backward=forward_backward, update=recipe.stepper(opt, cfg, clip),  # clip, AdamW, the schedule
        grads=lambda: [p.grad for p in params], fixture=fixture, params=params, optimizer=opt,
        loss_reduction="mean", group=group, extra={"backend": ctx.backend}))
    # bookkeeping after training, outside the ledger: every rank's routing, ledger and activations
    del loads[len(trained.step_times):]  # the run's steps' routing (bench --overhead steps more after it)
    every: list = [None] * n
    dist.all_gather_object(every, (loads, trained.comm, trained.extra["activation_bytes"]), group=group)
    by_rank = np.stack([np.stack(rank_loads) for rank_loads, _, _ in every], axis=3)  # (steps, L, K, N, b, E)
    load = by_rank.reshape(*by_rank.shape[:2], -1, by_rank.shape[-1])  # (steps, L, B, E): the batch's order
    trained.extra["expert_load"] = load
    trained.extra["comm_per_rank"] = [comm for _, comm, _ in every]
    trained.extra["activation_bytes_per_rank"] = [a for _, _, a in every]
    theory = [ep_comm_torch(cfg, style, load[-1], rank) for rank in range(n)]
    trained.extra["comm_theory_per_rank"] = [{op: {"count": c, "bytes": b} for op, (c, b) in t.items()}
                                             for t in theory]
    trained.comm_theory = ep_comm_bytes_torch(cfg, style, load[-1], r)
    return trained
