"""Context parallelism for any ``nn.Module`` that offers the attention seam, and its cores (ring,
zigzag ring, Ulysses): the twin of jax_impl/parallel/cp.py; torch_impl/cp.py plugs the same cores
into the project's transformer.

The seam: (1) attention through ``attention(q, k, v)`` — SDPA's signature, CAUSAL, no mask, dropout
or other scale (refused); transformers models: ``register()``, then
``attn_implementation="parallel_twins_cp"``; (2) the GLOBAL positions handed to the model's position
encoding (``loss(model, *batch, positions)``); (3) a loss that is a mean over its tokens.

    trainer = context_parallel(model, loss, lambda ps: torch.optim.AdamW(ps), group, "ring")
    loss_value = trainer.train_step(tokens, targets)   # (B, T) each, the same on every rank

Sharded: every batch array along the sequence (T/N per rank; ring_zigzag: chunks r and 2N−1−r of
2N); every parameter replicated. a = one rank's K, B·H·(T/N)·dh·b.
Collectives per seam call: ring 3N−2 sends of K|V (2a; forward N−1, backward 2N−1 with dK|dV,
``RingAttention``); ulysses 8 all-to-alls of a (``UlyssesCore``). After backward ONE flat all-reduce
of the gradients with the loss and a refusal flag: (Φ + 2)·b. ``comm_theory()`` counts them.
A model that never calls the seam is refused at the first step; one that routes only some attention
layers through it cannot be detected: route every attention through it.
Papers: ring attention, Liu et al. 2023 (arXiv:2310.01889); DeepSpeed-Ulysses, Jacobs et al. 2023
(arXiv:2309.14509).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shared.theory import cp_chunks, cp_positions
from torch_impl.parallel import recipe
from torch_impl.parallel.ep import refuse_split_experts
from torch_impl.parallel.tp_ops import Transposed

VARIANTS = ("ring", "ring_zigzag", "ulysses")
NAME = "parallel_twins_cp"  # the transformers attention implementation ``register`` adds
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("cp_seam", default=None)  # (core, positions, calls, refused)


class SeamError(ValueError):
    """A call of the attention seam, or a model, that context parallelism cannot compute exactly."""


def causal(q, k, v):
    """Causal attention (B, H, T, dh) -> (B, H, T, dh), written out in the inputs' dtype (the same
    math as the ring's blocks; CPU float64 SDPA agrees to ~1e-16 but its kernel is not ours to pin)."""
    t = q.shape[2]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, T, T)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=True, scale=None, **_):
    """F.scaled_dot_product_attention's place: causal attention, over the group inside a cp step."""
    if attn_mask is not None or not is_causal:
        raise SeamError("cp.attention is causal attention over the global positions; it takes no attn_mask "
                        "(the ring masks by position): call it without attn_mask=, is_causal=True")
    if dropout_p:
        raise SeamError("cp.attention has no attention dropout: call it with dropout_p=0")
    if scale is not None and scale != query.shape[-1] ** -0.5:
        raise SeamError(f"cp.attention scales by dh**-0.5 = {query.shape[-1] ** -0.5}, not {scale}")
    active = _ACTIVE.get()
    if active is None:
        return causal(query, key, value)
    core, n = active.core, dist.get_world_size(active.core.group)
    if isinstance(core, UlyssesCore) and query.shape[1] % n:
        raise SeamError(f"ulysses splits heads: {query.shape[1]} heads over cp={n}; use ring or H % N == 0")
    active.calls.append((key.numel(), key.element_size()))
    return core(query, key, value)  # (B, H, T/N, dh)


def hf_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function signature over ``attention``: (B, H, T, dh) in, (B, T, H, dh) out."""
    if attention_mask is not None:
        _refuse(f"{NAME} takes no attention_mask (padding or packing): causal attention only")
    active = _ACTIVE.get()
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise SeamError(f"{NAME} is full causal attention: {unsupported}={kwargs[unsupported]} is not supported")
    ids = kwargs.get("position_ids")  # (1 or B, T/N)
    if active is not None and ids is not None and bool((ids != active.positions).any()):
        _refuse(f"{NAME}: the model's position_ids are not the ranks' global positions (e.g. the local arange "
                "transformers makes when given none): pass position_ids=positions[None]")
    groups = getattr(module, "num_key_value_groups", 1)  # grouped-query attention: K|V per query head
    key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    causal_ = kwargs.get("is_causal", getattr(module, "is_causal", True))  # an encoder's attention: refused
    out = attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=causal_)  # (B, H, T, dh)
    return out.transpose(1, 2).contiguous(), None


def hf_mask(*_, attention_mask=None, **__):
    """transformers' mask function for NAME: no mask (the seam is causal); refuses padding."""
    if attention_mask is not None and not bool(attention_mask.all()):
        _refuse(f"{NAME} is causal attention only: a padding attention_mask would be ignored; "
                "give unpadded sequences (or pad and mask the loss's targets instead)")
    return None


def _refuse(message: str) -> None:
    """Outside a cp step: raise. Inside: rank 0 may see nothing wrong (its local arange IS its global
    positions), so a raise here alone would leave the others in the ring; the refusal rides in the
    step's all-reduce instead and every rank raises there, before the update."""
    active = _ACTIVE.get()
    if active is None:
        raise SeamError(message)
    active.refused = active.refused or message


def register(name: str = NAME) -> str:
    """Add ``hf_attention`` (and ``hf_mask``) to transformers' attention (and mask) registries."""
    from transformers import AttentionInterface, AttentionMaskInterface  # optional: transformers models only

    AttentionInterface.register(name, hf_attention)
    AttentionMaskInterface.register(name, hf_mask)
    return name


@contextlib.contextmanager
def _active(seen: SimpleNamespace):
    token = _ACTIVE.set(seen)
    try:
        yield seen
    finally:
        _ACTIVE.reset(token)


def step(core, positions: torch.Tensor):
    """The seam's context for one training step of a composition (parallel/compose.py) that does its
    own gradient reduction: yields the record of the step (``calls``: the seam calls seen; ``refused``:
    a refusal the caller must make every rank raise, before its update)."""
    return _active(SimpleNamespace(core=core, positions=positions, calls=[], refused=None))


class Trainer:
    """``context_parallel``'s result: ``train_step(*batch)`` (B, T) tensors -> the global mean loss,
    ``shard_batch``, ``positions``, ``comm_theory()``; ``model`` trains in place."""

    def __init__(self, model: nn.Module, loss: Callable, optimizer: Callable, group, variant: str):
        self.model, self.loss, self.group, self.variant = model, loss, group, variant
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = [p for p in model.parameters() if p.requires_grad]  # a tied one once
        self.optimizer = optimizer(self.params)
        self.calls: list[tuple[int, int]] | None = None  # per seam call of the last step: (K elements, itemsize)

    def positions(self, t: int, device=None) -> torch.Tensor:
        """This rank's global positions (T/N,), in its local order."""
        chunks = 2 * self.n if self.variant == "ring_zigzag" else self.n
        if t % chunks:
            raise SeamError(f"cp {self.variant}: sequence length {t} is not divisible by {chunks} "
                            f"({'2·' if self.variant == 'ring_zigzag' else ''}cp): pad the sequence or change cp")
        return torch.tensor(cp_positions(t, self.n, self.rank, self.variant), device=device)

    def shard_batch(self, *arrays) -> tuple:
        """(B, T, …) tensors -> this rank's (B, T/N, …) in the variant's order, + positions (T/N,)."""
        pos = self.positions(arrays[0].shape[1], arrays[0].device)
        return (*(a[:, pos] for a in arrays), pos)

    def _core(self, t: int):
        return UlyssesCore(t, self.group) if self.variant == "ulysses" else RingCore(t, self.variant, self.group)

    def train_step(self, *batch, accumulate: int = 1, max_norm: float | None = None,
                   scaler: recipe.LossScaler | None = None) -> float:
        """One optimizer step on the (B, T) batch. ``accumulate`` K: K backward passes over B/K rows
        each (losses scaled by 1/K), ONE gradient all-reduce after the last. ``max_norm``: clip by
        the global norm — after the all-reduce every rank holds the whole mean gradient, so it is
        the local norm (no communication). ``scaler`` (float16 under autocast): the loss scaled, the
        gradients unscaled after the all-reduce, the step skipped on every rank when the flag (all-reduced
        over the group) says some rank saw an inf / NaN; ``scaler.update()`` done here."""
        b = batch[0].shape[0]
        if accumulate < 1 or b % accumulate:
            raise SeamError(f"cp: accumulate={accumulate} must be >= 1 and divide the batch dim 0 ({b})")
        *local, pos = self.shard_batch(*batch)
        self.optimizer.zero_grad(set_to_none=True)
        seen = SimpleNamespace(core=self._core(batch[0].shape[1]), positions=pos, calls=[], refused=None)
        value = 0.0
        for k in range(accumulate):
            part = [a[k * b // accumulate:(k + 1) * b // accumulate] for a in local]  # (B/K, T/N, …)
            with _active(seen):
                part_loss = self.loss(self.model, *part, pos) / accumulate  # mean over B/K·T/N tokens, / K
            if not seen.calls:
                raise SeamError("the model never called cp.attention (torch_impl.parallel.cp): each rank would "
                                "attend within its own T/N tokens. Route its attention through it (transformers: "
                                f"attn_implementation={NAME!r} after cp.register())")
            (part_loss if scaler is None else scaler.scale(part_loss)).backward()
            value = value + part_loss.detach()
        self.calls = seen.calls  # every part's seam calls: comm_theory counts the step's
        grads = [p.grad for p in self.params]
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(self.params, grads)]
                         + [torch.stack([value.detach(), value.new_tensor(float(seen.refused is not None))])
                            .to(self.params[0].dtype)])  # (Φ + 2,): the gradients, the loss, the flag
        dist.all_reduce(flat, group=self.group)  # the one collective outside attention
        if flat[-1] > 0:
            raise SeamError(seen.refused or "cp: another rank's seam call was refused (its error says why); "
                            "nothing was updated")
        flat /= self.n  # equal token counts: the mean of local means is the global mean
        at = 0
        for p, g in zip(self.params, grads):
            if g is not None:
                g.copy_(flat[at:at + p.numel()].view_as(g))
            at += p.numel()
        self.scaled = scaler is not None
        if scaler is not None and scaler.unscale_(self.optimizer, grads):
            scaler.update()  # an inf / NaN on some rank: every rank skips (no clip, no step)
            return float(flat[-2])
        if max_norm is not None:
            self.norm = recipe.clip_([], grads, max_norm, self.group, self.params[0].dtype, reduce=False)
        self.optimizer.step()
        if scaler is not None:
            scaler.update()
        return float(flat[-2])

    def comm_theory(self) -> dict[str, tuple[int, int]]:
        """op -> (count, bytes) per step per rank from the seam calls the last step saw, and (Φ + 2)·b."""
        b = self.params[0].element_size()
        out = {"all_reduce": (1, (sum(p.numel() for p in self.params) + 2) * b)}
        out = recipe.add_comm(out, recipe.scaler_comm(getattr(self, "scaled", False)))  # the found-inf flag
        if not self.calls or self.n == 1:
            return out
        a = sum(size * item for size, item in self.calls)  # Σ over calls of one rank's K bytes
        if self.variant == "ulysses":
            return out | {"all_to_all": (8 * len(self.calls), 8 * a)}
        k = (3 * self.n - 2) * len(self.calls)
        return out | {"send": (k, (3 * self.n - 2) * 2 * a), "recv": (k, (3 * self.n - 2) * 2 * a)}


def context_parallel(model: nn.Module, loss: Callable, optimizer: Callable, group=None,
                     variant: str = "ring") -> Trainer:
    """Context parallelism over ``group`` (default: the world) for a model with the seam (module docstring).
    ``optimizer(params)`` builds the optimizer over the trainable parameters."""
    if variant not in VARIANTS:
        raise SeamError(f"cp: unknown variant {variant!r}; choose from {VARIANTS}")
    if not dist.is_initialized():
        raise SeamError("cp: no process group: run under torch_impl.launch.launch or torchrun")
    refuse_split_experts(model.named_parameters(), "context_parallel")
    group = group or dist.group.WORLD
    n = dist.get_world_size(group)
    if any(isinstance(m, nn.Dropout) and m.p and m.training for m in model.modules()):
        raise SeamError(f"{type(model).__name__} has active dropout: its masks would differ from one process's; "
                        "call model.eval() or build it with p=0")
    if not any(p.requires_grad for p in model.parameters()):
        raise SeamError(f"{type(model).__name__} has no trainable parameter")
    with torch.no_grad():  # every rank starts from rank 0's weights
        for p in model.parameters() if n > 1 else ():
            dist.broadcast(p, dist.get_global_rank(group, 0), group=group)
    return Trainer(model, loss, optimizer, group, variant)


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

    def __init__(self, seq: int, variant: str, group):
        self.group, self.variant, self.scores = group, variant, 0
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_seq = seq // self.n  # seq: the global sequence length T

    def __call__(self, q, k, v):
        assert q.shape[2] == k.shape[2] == v.shape[2] == self.local_seq, q.shape  # (B, H, T/N, dh)
        return RingAttention.apply(q, k, v, self)


def pairs(core: RingCore, src: int):
    """(local q chunk index, kv chunk index within the block of rank ``src``, diagonal?) of every chunk
    pair this rank computes at the hop holding ``src``'s K|V (kv chunk ≤ q chunk)."""
    mine, theirs = cp_chunks(core.n, core.rank, core.variant), cp_chunks(core.n, src, core.variant)
    return [(a, b, qc == kc) for a, qc in enumerate(mine) for b, kc in enumerate(theirs) if kc <= qc]


def _rounding(low: torch.dtype, acc: torch.dtype):
    """Rounds a float32 probability (or its gradient) to the inputs' dtype and back: what a flash
    kernel does before multiplying it with V (or K, Q) in low precision. The identity when acc is low."""
    return (lambda t: t) if acc == low else (lambda t: t.to(low).to(acc))


class RingAttention(torch.autograd.Function):
    """Causal attention of the local q over every rank's K|V, passed around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, core: RingCore):
        # autocast (mixed precision): q|k|v come in bf16 and travel so; scores, softmax statistics and the
        # running output in float32, the probabilities rounded to bf16 before their matmul with V (as
        # SDPA's flash kernels do: the reference's rounding), the output rounded to bf16 once
        acc = torch.float32 if torch.is_autocast_enabled(q.device.type) else q.dtype
        with torch.autocast(q.device.type, enabled=False):
            out, lse = RingAttention._forward(q, k, v, core, acc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.core, ctx.acc = core, acc
        return out

    @staticmethod
    def _forward(q, k, v, core: RingCore, acc: torch.dtype):
        n, r, nc = core.n, core.rank, len(cp_chunks(core.n, core.rank, core.variant))
        low = _rounding(q.dtype, acc)
        qs = q.to(acc).chunk(nc, dim=2)  # nc × (B, H, c, dh)
        out = [torch.zeros_like(x) for x in qs]  # running outputs, normalised
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device) for x in qs]  # (B, H, c)
        kv, core.scores = torch.stack([k, v]), 0  # (2, B, H, T/N, dh): K|V, one message
        for i in range(n):
            nxt, works = ring_exchange(kv, core.group) if i < n - 1 else (None, [])  # before the compute
            ks, vs = kv[0].to(acc).chunk(nc, dim=2), kv[1].to(acc).chunk(nc, dim=2)
            for a, b, diag in pairs(core, (r - i) % n):
                s = scores(qs[a], ks[b], diag)  # (B, H, c, c)
                core.scores += s.numel()
                blk_lse = torch.logsumexp(s, dim=-1)  # (B, H, c)
                blk_out = low(torch.exp(s - blk_lse.unsqueeze(-1))) @ vs[b]  # (B, H, c, dh)
                new = torch.logaddexp(lse[a], blk_lse)
                old_w, blk_w = torch.exp(lse[a] - new).unsqueeze(-1), torch.exp(blk_lse - new).unsqueeze(-1)
                out[a], lse[a] = old_w * out[a] + blk_w * blk_out, new  # (B, H, c, dh), (B, H, c)
            wait(works)
            kv = nxt
        bsz, h, tl, dh = q.shape
        # (B, H, T/N, dh) laid out (B, T/N, H, dh) as SDPA's output, so W_o's input is a view of it
        out = q.new_empty(bsz, tl, h, dh).transpose(1, 2).copy_(torch.cat(out, dim=2))
        return out, torch.cat(lse, dim=2)  # (B, H, T/N, dh) in q's dtype, (B, H, T/N) in acc

    @staticmethod
    def backward(ctx, dout):  # (B, H, T/N, dh)
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):  # acc: float32 under autocast (forward's)
            dq, dkv = RingAttention._backward(q, k, v, out, lse, dout, ctx.core, ctx.acc)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None

    @staticmethod
    def _backward(q, k, v, out, lse, dout, core: RingCore, acc: torch.dtype):
        n, r, nc, scale = core.n, core.rank, len(cp_chunks(core.n, core.rank, core.variant)), q.shape[-1] ** -0.5
        low = _rounding(q.dtype, acc)
        q, out, dout = q.to(acc), out.to(acc), dout.to(acc)
        dq = torch.zeros_like(q)
        qs, dqs, douts = q.chunk(nc, dim=2), dq.chunk(nc, dim=2), dout.chunk(nc, dim=2)
        lses = lse.chunk(nc, dim=2)
        deltas = (dout * out).sum(-1).chunk(nc, dim=2)  # D = rowsum(dout·out): nc × (B, H, c)
        # K|V travel in their own dtype, the dK|dV accumulators in acc (autocast: float32, 4 bytes)
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=acc, device=k.device)  # (2, B, H, T/N, dh)
        for i in range(n):
            nxt, works = ring_exchange(kv, core.group) if i < n - 1 else (None, [])
            ks, vs = kv[0].to(acc).chunk(nc, dim=2), kv[1].to(acc).chunk(nc, dim=2)
            dks, dvs = dkv[0].chunk(nc, dim=2), dkv[1].chunk(nc, dim=2)  # views: accumulate in place
            for a, b, diag in pairs(core, (r - i) % n):
                p = torch.exp(scores(qs[a], ks[b], diag) - lses[a].unsqueeze(-1))  # (B, H, c, c) softmax
                dvs[b].add_(low(p).transpose(-1, -2) @ douts[a])
                ds = low(p * (douts[a] @ vs[b].transpose(-1, -2) - deltas[a].unsqueeze(-1)))  # (B, H, c, c)
                dqs[a].add_(ds @ ks[b] * scale)
                dks[b].add_(ds.transpose(-1, -2) @ qs[a] * scale)
            # dK|dV travel with their block: N hops (one rank: already home)
            dkv, dworks = ring_exchange(dkv, core.group) if n > 1 else (dkv, [])
            wait(works + dworks)
            kv = nxt
        return dq, dkv  # the last hop brought my block's dK|dV home


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

    def __init__(self, seq: int, group):
        self.group, self.scores, self.local_seq = group, 0, seq // dist.get_world_size(group)

    def __call__(self, q, k, v):
        assert q.shape[2] == self.local_seq and q.shape[1] % dist.get_world_size(self.group) == 0, q.shape
        # each all-to-all's backward is the reverse one (tp_ops.Transposed)
        q, k, v = (Transposed.apply(x, self.group, seq_to_heads, heads_to_seq) for x in (q, k, v))  # (B, H/N, T, dh)
        self.scores = q.shape[0] * q.shape[1] * q.shape[2] ** 2  # the whole T×T, masked half included
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H/N, T, dh)
        return Transposed.apply(y, self.group, heads_to_seq, seq_to_heads)  # (B, H, T/N, dh)
