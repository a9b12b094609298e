"""1F1B in JAX by hand: one shard_map body, per-micro-batch jax.vjp, interleaved as torch does.

jax_impl/pp.py's variant ("shard_map", "1f1b") runs this schedule on pp.py's parameter layout
(blocks (S, L/S, …) and the embedding / head slots, over "pp"); pp.py builds the stage function,
this module the schedule. The circular pipeline's backward is jax.grad of the whole unrolled
schedule: GPipe order, all M micro-batches' activations alive at once. Here the gradient is
computed INSIDE the schedule, as torch_impl/pp.py's explicit 1F1B does:

  order   stage s: warm-up F(0 … w−1), w = min(S−s−1, M); steady F(w+i), B(i); cool-down B (``order``).
  ticks   the orders placed on a lock-step clock: each tick every device runs one op or idles, an op
          starts once its input has arrived (sent the tick before) — 2·(M+S−1) ticks (``plan``).
  F(mb)   y, vjp = jax.vjp(stage_fn, params, x): the vjp function is a ``jax.tree_util.Partial``
          pytree; its leaves (the residuals) go into a stash slot, except leaves that ARE the
          stage's weights (same for every micro-batch: not copied). B(mb) unflattens the slot's
          leaves with the treedef of a probe trace, pulls back the incoming gradient, adds dW to
          this device's accumulator and sends dx to s−1; the slot is free again. Stage S−1's F
          includes the head and the micro-batch's loss / M, stage 0's the embedding.
  switch  at each tick a device looks its op up in static (ticks, S) tables indexed by
          lax.axis_index("pp") and runs it under lax.switch: idle devices compute nothing.
  permute after each tick ONE lax.ppermute with that tick's static source → target pairs: a device
          that ran F sends y up (s → s+1), one that ran B sends dx down (s → s−1). A device never runs
          both, and no two senders aim at one device (asserted), so activations and gradients share
          the permute and a receive "inbox" of slots; ticks where nobody sends have no permute.

Every parameter is pp-sharded (one stage per device), so the vjp's dW on a device is its stage's
gradient: nothing is replicated, check_vma inserts no psum, nothing is double counted. The loss
leaves the body by one scalar psum (real on stage S−1 only).

Activations: stage s holds at most min(S−s, M) micro-batches' residuals at once (``plan`` asserts
it; torch's 1F1B stashes as many). SPMD caveat: one program for all devices, so every device
allocates the largest stage's min(S, M) stash slots (and the inbox's), where torch's stage s
allocates only what it uses; and every device's F runs the embedding and the head on its (zero,
unless stage 0 / S−1) slots, whose residuals are stashed too.

Communication per step, every device: collective-permutes of one micro-batch's activation
((B/M, D) MLP, (B/M, T, D) transformer), one per tick with a sender:
shared.theory.pp_1f1b_permute_count (2·(M+S−1) − 1 for S ≥ 3, M ≥ 2), + the loss's all-reduce.

Paper: Narayanan et al. 2021 (PipeDream-Flush / 1F1B, arXiv:2104.04473); MaxText's pipeline is
the circular one (its issue: 1F1B needs per-micro-batch control, i.e. MPMD or this unrolled form).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

IDLE, FWD, BWD = 0, 1, 2


def order(stages: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """torch_impl/pp.py explicit_step's 1F1B order, per stage: [(kind, mb)]."""
    out = []
    for s in range(stages):
        w = min(stages - s - 1, microbatches)
        ops = [("F", i) for i in range(w)]
        for i in range(microbatches - w):
            ops += [("F", w + i), ("B", i)]
        out.append(ops + [("B", i) for i in range(microbatches - w, microbatches)])
    return out


@dataclass(frozen=True)
class Plan:
    """The static schedule. Tables (ticks, S) of ints: ``kind`` IDLE/FWD/BWD, ``mb``, ``stash`` (the
    slot F fills / B empties), ``read`` (inbox slot holding F's input or B's incoming gradient,
    −1: none: stage 0's F, stage S−1's B), ``write`` (inbox slot the tick's permute fills, −1: none)."""

    grid: list[list[tuple[str, int] | None]]  # [tick][stage]
    kind: np.ndarray
    mb: np.ndarray
    stash: np.ndarray
    read: np.ndarray
    write: np.ndarray
    pairs: list[list[tuple[int, int]]]  # [tick]: the permute's (source, target) pairs
    peak_in_flight: list[int]  # per stage: most micro-batches stashed at once
    inbox_slots: int

    def executed(self) -> list[list[tuple[str, int]]]:
        """Per stage, the ops in the order the ticks run them."""
        return [[row[s] for row in self.grid if row[s]] for s in range(len(self.grid[0]))]


@functools.cache
def plan(stages: int, microbatches: int) -> Plan:
    """``order`` on a lock-step clock: at each tick every stage runs its next op if the op it
    depends on (F on s−1, B on s+1, the last stage's own F) ran at an earlier tick — the
    simulator's unit-cost timeline. Then stash slots (lowest free) and inbox slots are assigned."""
    S, M, ops = stages, microbatches, order(stages, microbatches)
    done, nxt, grid = {}, [0] * S, []  # done[(kind, stage, mb)] = tick
    while any(n < len(o) for n, o in zip(nxt, ops)):
        t, row = len(grid), [None] * S
        for s in range(S):
            if nxt[s] < len(ops[s]):
                k, mb = ops[s][nxt[s]]
                dep = (("F", s - 1, mb) if s > 0 else None) if k == "F" else \
                    (("B", s + 1, mb) if s < S - 1 else ("F", s, mb))
                row[s] = (k, mb) if dep is None or done.get(dep, t) < t else None
        for s, op in enumerate(row):
            if op:
                done[(op[0], s, op[1])], nxt[s] = t, nxt[s] + 1
        grid.append(row)
    T = len(grid)
    kind, mbs, stash, read, write = (np.full((T, S), fill, np.int32) for fill in (IDLE, 0, 0, -1, -1))
    stashed, inbox, pending = [{} for _ in range(S)], [set() for _ in range(S)], {}  # pending[(s, kind, mb)] = slot
    peak, pairs = [0] * S, []
    for t, row in enumerate(grid):
        sends = []
        for s, op in enumerate(row):
            if op is None:
                continue
            k, mb = op
            kind[t, s], mbs[t, s] = (FWD if k == "F" else BWD), mb
            if k == "F":
                stash[t, s] = stashed[s][mb] = min(set(range(M)) - set(stashed[s].values()))
                peak[s] = max(peak[s], len(stashed[s]))
            else:
                stash[t, s] = stashed[s].pop(mb)
            if (s, k, mb) in pending:
                read[t, s] = pending.pop((s, k, mb))
                inbox[s].discard(int(read[t, s]))
            to = s + 1 if k == "F" else s - 1
            if 0 <= to < S:
                sends.append((s, to, k, mb))
        assert len({to for _, to, _, _ in sends}) == len(sends), (t, sends)  # one message per receiver
        for _, to, k, mb in sends:  # filled after this tick's reads: a slot read at t can be refilled at t
            slot = min(set(range(2 * M)) - inbox[to])
            inbox[to].add(slot)
            write[t, to] = pending[(to, k, mb)] = slot
        pairs.append([(s, to) for s, to, _, _ in sends])
    assert not pending and all(not d for d in stashed)
    assert peak == [min(S - s, M) for s in range(S)], peak  # torch's 1F1B: min(S − s, M) on stage s
    return Plan(grid, kind, mbs, stash, read, write, pairs, peak, int(write.max()) + 1 if write.max() >= 0 else 1)


def run(stage_fn, params: dict, message: jax.ShapeDtypeStruct, stages: int, microbatches: int,
        info: dict | None = None):
    """1F1B inside a shard_map over "pp". ``stage_fn(params, x, mb) -> (y, loss)``: this stage's
    forward of micro-batch ``mb`` (a traced index) from ``x``, the activation received from s−1
    (zeros on stage 0, which embeds instead); ``y`` the activation for s+1 (shaped ``message``),
    ``loss`` this micro-batch's share of the loss (0 off the last stage). ``params``: this device's
    stage. Returns (this device's summed loss, its gradient, shaped like ``params``). ``info``, if
    given, receives the stash's sizes when this is traced (bytes per micro-batch and per device)."""
    p = plan(stages, microbatches)
    s = lax.axis_index("pp")
    varying = lambda a: lax.pcast(a, "pp", to="varying")
    mine = lambda a: jnp.asarray(a)[s]  # this device's entry of an (S,) table row

    def forward(params, x, mb):
        """F: -> (y, loss, the vjp's leaves that are not weights), {leaf index: weight index}."""
        (y, loss), vjp = jax.vjp(lambda q, v: stage_fn(q, v, mb), params, x)
        leaves, treedef = jax.tree.flatten(vjp)
        ids = {id(w): i for i, w in enumerate(jax.tree.leaves(params))}
        shared = {j: ids[id(leaf)] for j, leaf in enumerate(leaves) if id(leaf) in ids}
        return (y, loss, [a for j, a in enumerate(leaves) if j not in shared]), (treedef, shared)

    probe = {}  # the residuals' structure, from a trace that computes nothing (eval_shape)

    def probed(params, x, mb):
        out, probe["meta"] = forward(params, x, mb)
        return out

    zeros = jnp.zeros(message.shape, message.dtype)  # (B/M, D) / (B/M, T, D)
    # typed as in the branches (device-varying x and mb), or the vjp would transpose a pcast into a psum
    _, loss_type, res = jax.eval_shape(probed, params, varying(zeros), mine(np.zeros(stages, np.int32)))
    treedef, shared = probe["meta"]
    # the stash: per dtype one (slots, n) buffer, a micro-batch's residuals raveled into one row
    # (two buffers, not one per leaf: the unrolled ticks would copy every leaf's buffer around)
    dtypes = sorted({r.dtype.name for r in res})
    width = {d: sum(r.size for r in res if r.dtype.name == d) for d in dtypes}
    slots = max(p.peak_in_flight)  # min(S, M): stage 0's peak, allocated on every device (SPMD)
    per_mb = sum(r.size * r.dtype.itemsize for r in res)  # the vjp's residuals, the weights left out
    if info is not None:
        info |= {"stash_bytes_per_microbatch": per_mb, "stash_slots": slots, "stash_bytes": slots * per_mb,
                 "inbox_bytes": (p.inbox_slots + 1) * message.size * message.dtype.itemsize}
    state = {"stash": {d: varying(jnp.zeros((slots, width[d]), d)) for d in dtypes},
             "inbox": varying(jnp.zeros((p.inbox_slots + 1,) + message.shape, message.dtype)),  # (K + 1, B/M, …)
             "grads": jax.tree.map(lambda a: varying(jnp.zeros(a.shape, a.dtype)), params),
             "loss": varying(jnp.zeros((), loss_type.dtype))}

    def pack(leaves):  # residual leaves -> {dtype: (n,)}
        return {d: jnp.concatenate([a.ravel() for a in leaves if a.dtype.name == d]) for d in dtypes}

    def unpack(rows):  # {dtype: (n,)} -> residual leaves
        offset, out = dict.fromkeys(dtypes, 0), []
        for r in res:
            d = r.dtype.name
            out.append(lax.dynamic_slice_in_dim(rows[d], offset[d], r.size).reshape(r.shape))
            offset[d] += r.size
        return out

    def take(state, slot):  # the inbox message at a table slot; zeros where the table says −1
        return jnp.where(slot >= 0, lax.dynamic_index_in_dim(state["inbox"], slot, keepdims=False), 0)

    def idle(state, params, mb, slot, read):
        return state, varying(zeros)

    def fwd(state, params, mb, slot, read):
        (y, loss, leaves), (_, again) = forward(params, take(state, read), mb)
        assert again == shared, (again, shared)  # the weights sit where the probe found them
        stash = {d: lax.dynamic_update_index_in_dim(state["stash"][d], row, slot, 0) for d, row in pack(leaves).items()}
        return state | {"stash": stash, "loss": state["loss"] + loss}, y

    def bwd(state, params, mb, slot, read):
        kept = iter(unpack({d: lax.dynamic_index_in_dim(b, slot, keepdims=False) for d, b in state["stash"].items()}))
        weights = jax.tree.leaves(params)
        leaves = [weights[shared[j]] if j in shared else next(kept) for j in range(treedef.num_leaves)]
        dloss = varying(jnp.ones((), loss_type.dtype))  # d(loss)/d(loss): the last stage's seed
        dparams, dx = jax.tree.unflatten(treedef, leaves)((take(state, read), dloss))
        return state | {"grads": jax.tree.map(jnp.add, state["grads"], dparams)}, dx

    for t in range(len(p.grid)):  # Python loop: every permute is in the HLO, each tick's tables static
        kinds = sorted({int(k) for k in p.kind[t]})  # only the branches some device runs at tick t
        branches = [{IDLE: idle, FWD: fwd, BWD: bwd}[k] for k in kinds]
        index = mine(np.searchsorted(kinds, p.kind[t]).astype(np.int32))
        state, out = lax.switch(index, branches, state, params, mine(p.mb[t]), mine(p.stash[t]), mine(p.read[t]))
        assert out.shape == message.shape, (out.shape, message.shape)  # y up or dx down: one activation
        if p.pairs[t]:  # non-receivers get zeros, written to the spare slot K
            got = lax.ppermute(out, "pp", p.pairs[t])
            slot = mine(np.where(p.write[t] >= 0, p.write[t], p.inbox_slots))
            state["inbox"] = lax.dynamic_update_index_in_dim(state["inbox"], got, slot, 0)
    return state["loss"], state["grads"]
