"""Context parallelism (CP) with torch.distributed, the runner: the sequence is split over the cp
ranks for the whole model.

Sharded: tokens, targets and their positions (``shared.theory.cp_positions``: T/N consecutive
ones; ring_zigzag: chunks r and 2N−1−r of 2N). Every weight is replicated. Only attention needs
other ranks' keys and values, through the ``Attention.core`` seam (cores: torch_impl/parallel/cp.py).
a = B·(T/N)·D·b, one rank's share of K (or Q, V, the residual stream).

    explicit/ring         K|V (one message) hop to r+1 each of N−1 hops, merged by an online softmax;
                          backward: K|V rotate again and dK|dV travel home: per layer 3N−2 sends of 2a
    explicit/ring_zigzag  the same ring over the load-balanced layout: causal work even per rank
    explicit/ulysses      3 all-to-alls sequence -> heads, attention over the whole sequence for H/N
                          heads, 1 back; each one's backward the reverse: 8 all-to-alls of a per layer
    builtin/context_parallel  torch's experimental context_parallel (CUDA and float32 only:
                          ``BUILTIN_REFUSAL``)

The replicated weights' gradients: one all-reduce of Φ·b (BucketedDDP, one bucket).
Mixed precision (--precision mixed): float32 weights and AdamW state, the step under autocast; K|V and
the all-to-alls move bf16, the ring's dK|dV and the gradient all-reduce float32 (cp_comm(autocast=True)).
float16: the same with dynamic loss scaling (torch_impl/recipe.loss_scaler), + one 4-byte all-reduce.
Bytes per step per rank (shared.theory.cp_comm): ring L·(3N−2)·2a + Φ·b; ulysses 8L·a + Φ·b.
Papers: ring attention, Liu et al. 2023 (arXiv:2310.01889); striped/zigzag, Brandon et al. 2023;
DeepSpeed-Ulysses, Jacobs et al. 2023 (arXiv:2309.14509).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import cp_comm_bytes, cp_positions
from torch_impl import recipe
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import build_model, inputs, loss_fn, make_optimizer, targets, to_fixture
from torch_impl.parallel.cp import RingCore, UlyssesCore
from torch_impl.parallel.dp import BucketedDDP

VARIANTS = (("explicit", "ring"), ("explicit", "ring_zigzag"), ("explicit", "ulysses"),
            ("builtin", "context_parallel"))

# Measured on torch 2.13 CPU/gloo (docs/cp.md). context_parallel wraps q, k, v in DTensors
# (Shard(2)) and handles only the CUDA SDPA kernels (flash, efficient, cudnn) with its ring.
BUILTIN_REFUSAL = (
    "cp: builtin/context_parallel needs CUDA (NCCL) and float32/bfloat16. On CPU SDPA dispatches to "
    "aten._scaled_dot_product_flash_attention_for_cpu, which has neither a CP ring handler nor a DTensor "
    "sharding strategy (NotImplementedError: '... does not have a sharding strategy registered'); forcing "
    "the math backend fails too (its causal mask is a plain tensor: 'aten.add.Tensor got mixed torch.Tensor "
    "and DTensor'). On CUDA, flash / efficient / cudnn attention have no float64 kernel, so float64 takes "
    "that same math path.")


def builtin_available(cfg: Config) -> bool:
    """context_parallel runs where SDPA dispatches to a CUDA kernel it handles: NCCL ranks, no float64."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend()) and cfg.dtype != "float64"


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    return VARIANTS if builtin_available(cfg) else VARIANTS[:3]

# --- training ---------------------------------------------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    if (style, variant) not in VARIANTS:
        raise ValueError(f"cp: unknown style/variant {style}/{variant}; choose from {VARIANTS}")
    cfg.check("cp", "torch")
    if style == "builtin" and not builtin_available(cfg):
        raise ValueError(BUILTIN_REFUSAL + f" (here: backend {dist.get_backend() if dist.is_initialized() else None},"
                         f" {cfg.dtype})")
    n, r, group, b, t = ctx.world_size, ctx.rank, ctx.group, cfg.batch, cfg.seq
    model = build_model(cfg, problem, ctx.device)
    tokens, y = inputs(cfg, problem, ctx.device), targets(cfg, problem, ctx.device)  # (B, T) each
    seen: dict = {}
    if style == "explicit":
        pos = torch.tensor(cp_positions(t, n, r, variant), device=ctx.device)  # (T/N,) global positions
        tokens, y = tokens[:, pos], y[:, pos]  # (B, T/N): this rank's tokens, in local order
        core = UlyssesCore(t, group) if variant == "ulysses" else RingCore(t, variant, group)
        for block in model.blocks:
            block.attn.core = core
        sharded = contextlib.nullcontext
    else:
        mesh, core = init_device_mesh(ctx.device.type, (n,), mesh_dim_names=("cp",)), None
        pos = torch.arange(t, device=ctx.device)  # (T,)
        # shards (and head-tail reorders) the buffers in place for the block, restores them after
        sharded = lambda: context_parallel(mesh, buffers=[tokens, y, pos], buffer_seq_dims=[1, 1, 0])
    recipe.freeze_(model, cfg)  # the recipe (torch_impl/recipe.py): before the wrapper, as dp
    net = BucketedDDP(model, cfg.bucket_mb, group)  # one bucket: one all-reduce of Φ·b per step
    opt = make_optimizer(recipe.param_groups(model.named_parameters(), cfg), cfg)
    scaler = recipe.loss_scaler(cfg, group, share=n)  # float16: the skip agreed over cp; local means averaged
    names, params = [name for name, _ in model.named_parameters()], list(model.parameters())

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with sharded():
            assert tokens.shape == y.shape == (b, t // n) and pos.shape == (t // n,), (tokens.shape, pos.shape)
            seen.setdefault("positions", pos.tolist())
            # mean CE over this rank's B·T/N tokens; --accumulate K: K groups of B/K sequences, reduced once
            loss = recipe.accumulate(cfg, tokens, y, lambda ts, ys: loss_fn(net(ts, pos), ys), net.no_sync,
                                     scaler)
        net.finish_gradient_synchronization()  # replicated weights' gradients averaged over cp
        return loss

    trained = train_loop(cfg, ctx, Setup(
        forward_backward=forward_backward, grads=lambda: [p.grad for p in params],
        update=recipe.stepper(opt, cfg, net.clip_grad_norm_, scaler=scaler),  # the averaged gradient: a local norm
        fixture=lambda ts: [to_fixture(model, name, x) for name, x in zip(names, ts, strict=True)],
        params=params, optimizer=opt, loss_reduction="mean", group=group,
        comm_theory=cp_comm_bytes(cfg, variant, autocast=True) + recipe.scaler_bytes(cfg)
        if style == "explicit" and not cfg.freeze else None,
        extra={"backend": ctx.backend}, scaler=scaler))
    every = [None] * n  # bookkeeping after training, outside the ledger
    dist.all_gather_object(every, (seen["positions"], core.scores if core else None), group=group)
    trained.extra["positions"] = [p for p, _ in every]
    if core is not None:
        trained.extra["attention_scores"] = [s for _, s in every]  # per rank, per layer, forward
    return trained
