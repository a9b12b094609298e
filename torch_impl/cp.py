"""Context parallelism (CP) with torch.distributed: the sequence is split over the cp ranks for
the whole model.

Sharded: tokens, targets and their positions. Rank r holds the B full sequences' tokens at
``shared.theory.cp_positions(T, N, r, variant)`` (ring / ulysses: T/N consecutive ones;
ring_zigzag: chunks r and 2N−1−r of 2N), (B, T/N), and reads wpe at those positions. Every weight
is replicated. Everything but attention is per token, hence local; attention needs every earlier
key/value, which is what the variants do differently, through the ``Attention.core`` seam
(q, k, v local (B, H, T/N, dh)). a = B·(T/N)·D·b: one rank's share of the residual stream, of Q,
of K and of V.

    explicit/ring         Ring attention (Liu et al. 2023, arXiv:2310.01889), ``RingAttention``
                          (the cores: torch_impl/parallel/cp.py, beside the seam).
                          Forward, hop i = 0…N−1: the K|V block (ONE message) goes to r+1 and the
                          next comes from r−1 (batch_isend_irecv, started BEFORE this hop's
                          compute); the visible chunk pairs (kv chunk ≤ q chunk; equal: causal mask
                          inside; wholly in the future: skipped) are merged with an online softmax
                          (running out + log-sum-exp: exact). Only q, k, v, out, lse are saved.
                          Backward: K|V rotate again (N−1 hops) and the dK|dV accumulator (ONE
                          message) travels with its block, N hops, the last bringing it home.
                          Per layer 3N−2 sends of 2a (forward N−1, backward 2N−1).
    explicit/ring_zigzag  The same ring over the load-balanced layout (Brandon et al. 2023,
                          striped attention; zigzag as in ring-flash-attention): every hop ≥ 1
                          computes exactly 2 of the 4 chunk pairs on every rank, so causal work is
                          even (shared.theory.cp_attention_scores; ``extra["attention_scores"]``).
    explicit/ulysses      DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): q, k, v
                          (B, H, T/N, dh) -> 3 all-to-alls -> (B, H/N, T, dh), causal SDPA over the
                          whole sequence for H/N heads, 1 all-to-all back; each all-to-all's
                          backward is the reverse one: 8 all-to-alls of a per layer and step.
    builtin/context_parallel  torch.distributed.tensor.experimental.context_parallel: buffers
                          (tokens, targets, positions) sharded by its head-tail load balancer (the
                          zigzag layout when 2N | T), SDPA monkey-patched into its ring (K|V
                          rotated by an all-gather, its default). CUDA (NCCL) and float32 only:
                          see ``BUILTIN_REFUSAL``.

Loss: mean cross-entropy over this rank's B·T/N tokens; the ranks' token counts are equal, so the
mean over ranks is the global mean (loss_reduction "mean"). The replicated weights' gradients are
averaged over cp by torch_impl.parallel.dp.BucketedDDP: one bucket, one all-reduce of Φ·b.
Bytes per step per rank: shared.theory.cp_comm — ring L·(3N−2)·2a + Φ·b; ulysses 8L·a + Φ·b.
Activation memory per rank (bytes saved for backward, S on one device): every activation is per
token and the ring saves q, k, v, out, lse of its tokens as SDPA does of all, so ring holds
(S − b)/N + b (b: the loss's 0-d weight); ulysses also keeps the all-to-all's output that W_o
saves, + L·a (tests/test_cp.py measures both).
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
    cfg.check("cp")
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
    net = BucketedDDP(model, cfg.bucket_mb, group)  # one bucket: one all-reduce of Φ·b per step
    opt = make_optimizer(net.parameters(), cfg)
    names, params = [name for name, _ in model.named_parameters()], list(model.parameters())

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with sharded():
            assert tokens.shape == y.shape == (b, t // n) and pos.shape == (t // n,), (tokens.shape, pos.shape)
            seen.setdefault("positions", pos.tolist())
            loss = loss_fn(net(tokens, pos), y)  # mean CE over this rank's B·T/N tokens
            loss.backward()
        net.finish_gradient_synchronization()  # replicated weights' gradients averaged over cp
        return loss

    trained = train_loop(cfg, ctx, Setup(
        forward_backward=forward_backward, update=opt.step, grads=lambda: [p.grad for p in params],
        fixture=lambda ts: [to_fixture(model, name, x) for name, x in zip(names, ts, strict=True)],
        params=params, optimizer=opt, loss_reduction="mean", group=group,
        comm_theory=cp_comm_bytes(cfg, variant) if style == "explicit" else None,
        extra={"backend": ctx.backend}))
    every = [None] * n  # bookkeeping after training, outside the ledger
    dist.all_gather_object(every, (seen["positions"], core.scores if core else None), group=group)
    trained.extra["positions"] = [p for p, _ in every]
    if core is not None:
        trained.extra["attention_scores"] = [s for _, s in every]  # per rank, per layer, forward
    return trained
