"""Context parallelism (CP) with torch.distributed: the sequence is split over the cp ranks for
the whole model.

Sharded: tokens, targets and their positions. Rank r holds the B full sequences' tokens at
``shared.theory.cp_positions(T, N, r, variant)`` (ring / ulysses: T/N consecutive ones;
ring_zigzag: chunks r and 2N−1−r of 2N), (B, T/N), and reads wpe at those positions. Every weight
is replicated. Everything but attention is per token, hence local; attention needs every earlier
key/value, which is what the variants do differently, through the ``Attention.core`` seam
(q, k, v local (B, H, T/N, dh)). a = B·(T/N)·D·b: one rank's share of the residual stream, of Q,
of K and of V.

    explicit/ring         Ring attention (Liu et al. 2023, arXiv:2310.01889), ``RingAttention``.
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
averaged over cp by torch_impl.dp.BucketedDDP: one bucket, one all-reduce of Φ·b.
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
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import cp_chunks, cp_comm_bytes, cp_positions
from torch_impl.dp import BucketedDDP
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import build_model, inputs, loss_fn, make_optimizer, targets, to_fixture
from torch_impl.tp import Transposed

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


# --- ring attention ---------------------------------------------------------------------------------


def ring_exchange(t: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Start sending ``t`` to r+1 and receiving its successor from r−1 (ONE message each way).
    Returns (receive buffer, works to wait on)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    nxt = torch.empty_like(t)
    to, frm = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    return nxt, dist.batch_isend_irecv([dist.P2POp(dist.isend, t, to, group), dist.P2POp(dist.irecv, nxt, frm, group)])


def wait(works: list) -> None:
    for w in works:
        w.wait()


def scores(q: torch.Tensor, k: torch.Tensor, diag: bool) -> torch.Tensor:
    """Scaled q·kᵀ of one chunk pair (B, H, c, c); on the diagonal the future is −inf."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, c, c)
    if diag:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class RingCore:
    """``Attention.core`` for ring / ring_zigzag; ``scores``: entries computed in the last forward."""

    def __init__(self, cfg: Config, variant: str, group):
        self.group, self.variant, self.scores = group, variant, 0
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_seq = cfg.seq // self.n

    def __call__(self, q, k, v):
        assert q.shape[2] == k.shape[2] == v.shape[2] == self.local_seq, q.shape  # (B, H, T/N, dh)
        return RingAttention.apply(q, k, v, self)


def pairs(core: RingCore, src: int):
    """(local q chunk index, kv chunk index within the block of rank ``src``, diagonal?) of every chunk
    pair this rank computes at the hop holding ``src``'s K|V (kv chunk ≤ q chunk)."""
    mine, theirs = cp_chunks(core.n, core.rank, core.variant), cp_chunks(core.n, src, core.variant)
    return [(a, b, qc == kc) for a, qc in enumerate(mine) for b, kc in enumerate(theirs) if kc <= qc]


class RingAttention(torch.autograd.Function):
    """Causal attention of the local q over every rank's K|V, passed around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, core: RingCore):
        n, r, nc = core.n, core.rank, len(cp_chunks(core.n, core.rank, core.variant))
        qs = q.chunk(nc, dim=2)  # nc × (B, H, c, dh)
        out = [torch.zeros_like(x) for x in qs]  # running outputs, normalised
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device) for x in qs]  # (B, H, c)
        kv, core.scores = torch.stack([k, v]), 0  # (2, B, H, T/N, dh): K|V, one message
        for i in range(n):
            nxt, works = ring_exchange(kv, core.group) if i < n - 1 else (None, [])  # before the compute
            ks, vs = kv[0].chunk(nc, dim=2), kv[1].chunk(nc, dim=2)
            for a, b, diag in pairs(core, (r - i) % n):
                s = scores(qs[a], ks[b], diag)  # (B, H, c, c)
                core.scores += s.numel()
                blk_lse = torch.logsumexp(s, dim=-1)  # (B, H, c)
                blk_out = torch.exp(s - blk_lse.unsqueeze(-1)) @ vs[b]  # (B, H, c, dh)
                new = torch.logaddexp(lse[a], blk_lse)
                old_w, blk_w = torch.exp(lse[a] - new).unsqueeze(-1), torch.exp(blk_lse - new).unsqueeze(-1)
                out[a], lse[a] = old_w * out[a] + blk_w * blk_out, new  # (B, H, c, dh), (B, H, c)
            wait(works)
            kv = nxt
        bsz, h, tl, dh = q.shape
        lse = torch.cat(lse, dim=2)  # (B, H, T/N)
        # (B, H, T/N, dh) laid out (B, T/N, H, dh) as SDPA's output, so W_o's input is a view of it
        out = q.new_empty(bsz, tl, h, dh).transpose(1, 2).copy_(torch.cat(out, dim=2))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.core = core
        return out

    @staticmethod
    def backward(ctx, dout):  # (B, H, T/N, dh)
        q, k, v, out, lse = ctx.saved_tensors
        core = ctx.core
        n, r, nc, scale = core.n, core.rank, len(cp_chunks(core.n, core.rank, core.variant)), q.shape[-1] ** -0.5
        dq = torch.zeros_like(q)
        qs, dqs, douts = q.chunk(nc, dim=2), dq.chunk(nc, dim=2), dout.chunk(nc, dim=2)
        lses = lse.chunk(nc, dim=2)
        deltas = (dout * out).sum(-1).chunk(nc, dim=2)  # D = rowsum(dout·out): nc × (B, H, c)
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)  # (2, B, H, T/N, dh)
        for i in range(n):
            nxt, works = ring_exchange(kv, core.group) if i < n - 1 else (None, [])
            ks, vs = kv[0].chunk(nc, dim=2), kv[1].chunk(nc, dim=2)
            dks, dvs = dkv[0].chunk(nc, dim=2), dkv[1].chunk(nc, dim=2)  # views: accumulate in place
            for a, b, diag in pairs(core, (r - i) % n):
                p = torch.exp(scores(qs[a], ks[b], diag) - lses[a].unsqueeze(-1))  # (B, H, c, c) softmax
                dvs[b].add_(p.transpose(-1, -2) @ douts[a])
                ds = p * (douts[a] @ vs[b].transpose(-1, -2) - deltas[a].unsqueeze(-1))  # (B, H, c, c)
                dqs[a].add_(ds @ ks[b] * scale)
                dks[b].add_(ds.transpose(-1, -2) @ qs[a] * scale)
            # dK|dV travel with their block: N hops (one rank: already home)
            dkv, dworks = ring_exchange(dkv, core.group) if n > 1 else (dkv, [])
            wait(works + dworks)
            kv = nxt
        return dq, dkv[0], dkv[1], None  # the last hop brought my block's dK|dV home


# --- ulysses ----------------------------------------------------------------------------------------


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, T/N, dh) -> (B, H/N, T, dh): head group j goes to rank j, sequence chunks arrive in rank order."""
    n = dist.get_world_size(group)
    b, h, t, d = x.shape
    send = x.reshape(b, n, h // n, t, d).transpose(0, 1).contiguous()  # (N, B, H/N, T/N, dh)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's sequence chunk of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """(B, H/N, T, dh) -> (B, H, T/N, dh): the inverse of ``seq_to_heads``."""
    n = dist.get_world_size(group)
    b, hn, t, d = y.shape
    send = y.reshape(b, hn, n, t // n, d).permute(2, 0, 1, 3, 4).contiguous()  # (N, B, H/N, T/N, dh)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: head group j of my sequence chunk
    return recv.permute(1, 3, 0, 2, 4).reshape(b, t // n, n * hn, d).transpose(1, 2)  # laid out (B, T/N, H, dh)


class UlyssesCore:
    """``Attention.core`` for ulysses: 3 all-to-alls in, causal SDPA on H/N heads, 1 back."""

    def __init__(self, cfg: Config, group):
        self.group, self.scores, self.local_seq = group, 0, cfg.seq // dist.get_world_size(group)

    def __call__(self, q, k, v):
        assert q.shape[2] == self.local_seq and q.shape[1] % dist.get_world_size(self.group) == 0, q.shape
        # each all-to-all's backward is the reverse one (tp.Transposed)
        q, k, v = (Transposed.apply(x, self.group, seq_to_heads, heads_to_seq) for x in (q, k, v))  # (B, H/N, T, dh)
        self.scores = q.shape[0] * q.shape[1] * q.shape[2] ** 2  # the whole T×T, masked half included
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H/N, T, dh)
        return Transposed.apply(y, self.group, heads_to_seq, seq_to_heads)  # (B, H, T/N, dh)


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
        core = UlyssesCore(cfg, group) if variant == "ulysses" else RingCore(cfg, variant, group)
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
