"""Pipeline schedules by hand in JAX: one shard_map body, per-micro-batch jax.vjp (1F1B, ZB-H1, interleaved).

Library level (jax_impl/parallel/): the runner jax_impl/pp.py and the seam parallel/pp.py (its 1F1B,
``programs=``: one program per stage) both run it. Its torch counterpart is a runner module,
torch_impl/pp_schedules.py (send/recv by hand for the project's model), and the torch seam takes
torch.distributed.pipelining's schedules, so there is no torch_impl/parallel/pp_schedules.py twin.

jax_impl/pp.py's variants ("shard_map", "1f1b" | "zb" | "interleaved") run these schedules on
pp.py's parameter layout (blocks (S, L/S, …) and the embedding / head slots, over "pp"); pp.py
builds the stage function, this module the schedule. The circular pipeline's backward is jax.grad
of the whole unrolled schedule: GPipe order, all M micro-batches' activations alive at once. Here
the gradient is computed INSIDE the schedule, as torch_impl/pp.py's explicit schedules do:

  order   shared.schedule.order(schedule, S, M, v): 1F1B (warm-up F(0 … w−1), w = min(S−s−1, M);
          steady F(w+i), B(i); cool-down B), ZB-H1 (1F1B's F/B with B = the input gradient only
          and the weight gradients W deferred), interleaved (device s runs v model chunks, chunk c
          = virtual stage c·S + s; Megatron's order).
  ticks   the simulator's unit-cost timeline (``shared.schedule.simulate``, f = b = 1, w = 1 under
          zb, else 0): every op at an integer tick, each after the op whose message it needs (sent
          the tick before); 1F1B takes 2·(M+S−1) ticks (``plan``).
  F(mb)   y, vjp = jax.vjp(stage_fn, params, x): the vjp function is a ``jax.tree_util.Partial``
          pytree; its leaves (the residuals) go into a stash slot, except leaves that ARE the
          chunk's weights (same for every micro-batch: not copied). Stage S−1's (the last virtual
          stage's) F includes the head and the micro-batch's loss / M, stage 0's the embedding.
  B(mb)   unflattens the slot's leaves with the treedef of a probe trace and pulls back the
          incoming gradient: 1F1B, interleaved: adds dW to the accumulator, sends dx to the
          previous virtual stage, frees the slot. ZB-H1: keeps dx only (the dW half of the pull-back
          is dead code in the branch, which XLA removes: B is the critical path), stores the
          incoming gradient beside the slot and keeps the slot.
  W(mb)   ZB-H1: the same pull-back from the slot and the stored gradient, keeping dW only (dx is
          dead code); then the slot is free. Like torch's second autograd pass, W walks the chunk's
          backward chain again: the per-layer gradients B computed are not kept.
  switch  at each tick a device looks its op up in static (ticks, S) tables indexed by
          lax.axis_index("pp") and runs it under lax.switch over that tick's (kind, chunk)s: idle
          devices compute nothing.
  permute after each tick ONE lax.ppermute with that tick's static source → target pairs (an F's y
          to the next virtual stage's device, a B's dx to the previous one's; W sends nothing),
          received into an "inbox" of slots; ticks where nobody sends have no permute. Should two
          messages meet at one device in one tick, the tick has two (forward, backward): never
          under 1F1B, at S ≥ 3 under zb and interleaved; shared.theory.pp_ticks_permute_count
          counts them.

Every parameter is pp-sharded (a device's chunks and slots are its own), so the vjp's dW on a device
is its gradient: nothing is replicated, check_vma inserts no psum, nothing is double counted. The
loss leaves the body by one scalar psum (real on stage S−1 only).

Activations: stage s holds at most the simulator's peak in flight (``plan`` asserts it): 1F1B
min(S−s, M) micro-batches (torch's), ZB-H1 min(S, M) on every stage (held until W), interleaved
min(2·(S−s−1) + (v−1)·S + 1, v·M) (micro-batch, chunk)s of 1/v the layers. SPMD caveat: one
program for all devices, so every device allocates the largest stage's stash slots (and the
inbox's), where torch's stage s allocates only what it uses; and every device's F runs the
embedding and the head on its (zero, unless stage 0 / S−1) slots, whose residuals are stashed too.
``run(..., programs=)``: stages that are different programs (jax_impl/parallel/pp.py's seam), each op a
branch per (kind, chunk, stage), differentiated with respect to the stage's weights as read from the
device's parameters (left out of the stash) and pulled back through that read.

Communication per step, every device: collective-permutes of one micro-batch's activation
((B/M, D) MLP, (B/M, T, D) transformer), one per tick with a sender:
shared.theory.pp_ticks_permute_count (1F1B: pp_1f1b_permute_count, 2·(M+S−1) − 1 for S ≥ 3,
M ≥ 2), + the loss's all-reduce.

Papers: Narayanan et al. 2021 (PipeDream-Flush / 1F1B and interleaved 1F1B, arXiv:2104.04473);
Qi et al. 2024 (ZB-H1, arXiv:2401.10241); MaxText's pipeline is the circular one (its issue: 1F1B
needs per-micro-batch control, i.e. MPMD or this unrolled form).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shared.schedule import Op, simulate

IDLE, FWD, BWD, WGT = 0, 1, 2, 3
KINDS = {"F": FWD, "B": BWD, "W": WGT}


def message(stages: int, virtual: int, s: int, op: Op) -> tuple[int, tuple[int, str, int, int]] | None:
    """Where ``op`` on device ``s`` sends its result: (device, the op it feeds there (device, kind,
    mb, chunk)), or None: the last virtual stage's F feeds its own loss, virtual stage 0's B and W
    nobody. F on virtual stage k feeds k+1 (device S−1's chunk c: device 0's chunk c+1), B feeds k−1."""
    k, last = op.chunk * stages + s, stages * virtual - 1
    if op.kind == "W" or (op.kind == "F" and k == last) or (op.kind == "B" and k == 0):
        return None
    k += 1 if op.kind == "F" else -1
    return k % stages, (k % stages, op.kind, op.mb, k // stages)


@dataclass(frozen=True)
class Plan:
    """The static schedule. Tables (ticks, S) of ints: ``kind`` IDLE/FWD/BWD/WGT, ``chunk``, ``mb``,
    ``stash`` (the slot F fills and B — zb: W — empties), ``read`` (inbox slot holding F's input or
    B's incoming gradient, −1: none: virtual stage 0's F, the last one's B, W). Per tick, per permute:
    its (source, target) ``pairs`` and ``write`` (S,) (the inbox slot it fills, −1: none)."""

    grid: list[list[Op | None]]  # [tick][stage]
    kind: np.ndarray
    chunk: np.ndarray
    mb: np.ndarray
    stash: np.ndarray
    read: np.ndarray
    pairs: list[list[list[tuple[int, int]]]]  # [tick][permute]
    write: list[list[np.ndarray]]  # [tick][permute]: (S,)
    peak_in_flight: list[int]  # per stage: most (micro-batch, chunk)s stashed at once
    inbox_slots: int

    def executed(self) -> list[list[tuple[str, int, int]]]:
        """Per stage, the ops (kind, mb, chunk) in the order the ticks run them."""
        return [[(op.kind, op.mb, op.chunk) for op in (row[s] for row in self.grid) if op]
                for s in range(len(self.grid[0]))]


@functools.cache
def plan(stages: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1) -> Plan:
    """The schedule's ops at their ticks in the simulator's unit-cost timeline; then stash slots
    (lowest free) and inbox slots are assigned and each tick's messages grouped into permutes."""
    S, M, v = stages, microbatches, virtual
    sim = simulate(schedule, S, M, v, f=1.0, b=1.0, w=1.0 if schedule == "zb" else 0.0)
    grid: list[list[Op | None]] = [[None] * S for _ in range(round(sim.span))]
    for e in sim.events:
        assert e.start == int(e.start) and e.end == e.start + 1, e  # unit costs: integer ticks
        grid[int(e.start)][e.rank] = e.op
    T, free_at = len(grid), "W" if schedule == "zb" else "B"
    kind, chunk, mbs, stash, read = (np.full((T, S), fill, np.int32) for fill in (IDLE, 0, 0, 0, -1))
    stashed, inbox, pending = [{} for _ in range(S)], [set() for _ in range(S)], {}  # pending[op key] = slot
    peak, pairs, write = [0] * S, [], []
    for t, row in enumerate(grid):
        sends = []
        for s, op in enumerate(row):
            if op is None:
                continue
            kind[t, s], chunk[t, s], mbs[t, s] = KINDS[op.kind], op.chunk, op.mb
            key = (op.mb, op.chunk)
            if op.kind == "F":
                stash[t, s] = stashed[s][key] = min(set(range(v * M)) - set(stashed[s].values()))
                peak[s] = max(peak[s], len(stashed[s]))
            else:
                stash[t, s] = stashed[s].pop(key) if op.kind == free_at else stashed[s][key]
            if (s, op.kind, op.mb, op.chunk) in pending:
                read[t, s] = pending.pop((s, op.kind, op.mb, op.chunk))
                inbox[s].discard(int(read[t, s]))
            if (msg := message(S, v, s, op)) is not None:
                sends.append((s, *msg))
        # one permute if no device receives twice this tick, else one per direction (F, B)
        groups = [sends] if len({to for _, to, _ in sends}) == len(sends) else \
            [[m for m in sends if m[2][1] == k] for k in "FB"]
        pairs.append([]), write.append([])
        for group in (g for g in groups if g):
            assert len({to for _, to, _ in group}) == len(group), (t, group)  # one message per receiver
            slots = np.full(S, -1, np.int32)
            for _, to, fed in group:  # filled after this tick's reads: a slot read at t can be refilled at t
                slots[to] = pending[fed] = min(set(range(2 * v * M + 2)) - inbox[to])
                inbox[to].add(int(slots[to]))
            pairs[-1].append([(src, to) for src, to, _ in group])
            write[-1].append(slots)
    assert not pending and all(not d for d in stashed)
    assert peak == sim.peak_in_flight, (peak, sim.peak_in_flight)  # the simulator's peak in flight
    used = max((int(w.max()) for ws in write for w in ws), default=-1)
    return Plan(grid, kind, chunk, mbs, stash, read, pairs, write, peak, used + 1 if used >= 0 else 1)


def run(stage_fn, params: list[dict], message_type: jax.ShapeDtypeStruct, stages: int, microbatches: int,
        schedule: str = "1f1b", virtual: int = 1, info: dict | None = None, grad_dtype=None, programs=None):
    """``schedule`` inside a shard_map over "pp". ``stage_fn(params, x, mb, chunk) -> (y, loss)``:
    model chunk ``chunk`` (static) of this device run forward on micro-batch ``mb`` (a traced index)
    from ``x``, the activation received from the previous virtual stage (zeros on virtual stage 0,
    which embeds instead); ``y`` the activation for the next (shaped ``message_type``), ``loss``
    this micro-batch's share of the loss (0 off the last virtual stage). ``params``: this device's
    chunks, one tree each. Returns (this device's summed loss, its gradients, one tree per chunk).
    ``info``, if given, receives the stash's sizes when this is traced (bytes per micro-batch, device).
    ``grad_dtype``: what the gradients are summed over the micro-batches in (mixed precision: the float32
    master dtype, ``params`` the bf16 copies; default: the params' own dtype).
    ``programs``: stages that are different programs (jax_impl/parallel/pp.py's seam), one ``(fn, view)``
    per device: device s runs ``fn(view(params[c]), x, mb, chunk)``, differentiated with respect to what
    ``view`` returns (its leaves, the stage's weights, are then left out of the stash) and pulled back
    through ``view`` into ``params``; each op a branch of its own, so a stash slot holds one stage's
    residuals, not every stage's. None: ``stage_fn`` on every device, ``params`` as they are."""
    p, v, zb = plan(stages, microbatches, schedule, virtual), virtual, schedule == "zb"
    assert len(params) == v, (len(params), v)
    assert programs is None or len(programs) == stages, (len(programs), stages)
    progs = list(programs) if programs is not None else [(stage_fn, None)]
    program_of = np.arange(stages) if programs is not None else np.zeros(stages, np.int64)  # device -> program
    s = lax.axis_index("pp")
    varying = lambda a: lax.pcast(a, "pp", to="varying")
    mine = lambda a: jnp.asarray(a)[s]  # this device's entry of an (S,) table row

    def forward(c, g, params, x, mb):
        """F: -> (y, loss, the vjp's leaves that are not weights), {leaf index: weight index}."""
        fn, view = progs[g]
        q = params if view is None else view(params)
        (y, loss), vjp = jax.vjp(lambda q, a: fn(q, a, mb, c), q, x)
        leaves, treedef = jax.tree.flatten(vjp)
        ids = {id(w): i for i, w in enumerate(jax.tree.leaves(q))}
        shared = {j: ids[id(leaf)] for j, leaf in enumerate(leaves) if id(leaf) in ids}
        return (y, loss, [a for j, a in enumerate(leaves) if j not in shared]), (treedef, shared)

    zeros = jnp.zeros(message_type.shape, message_type.dtype)  # (B/M, D) / (B/M, T, D)
    probes = {}  # per (chunk, program): the residuals' structure, from a trace that computes nothing (eval_shape)
    for c in range(v):
        for g in range(len(progs)):
            probe = {}

            def probed(params, x, mb, c=c, g=g, probe=probe):
                out, probe["meta"] = forward(c, g, params, x, mb)
                return out

            # typed as in the branches (device-varying x and mb), or the vjp would transpose a pcast into a psum
            _, loss_type, res = jax.eval_shape(probed, params[c], varying(zeros), mine(np.zeros(stages, np.int32)))
            probes[c, g] = (res, *probe["meta"])
    # the stash: per dtype one (slots, n) buffer, a micro-batch's residuals raveled into one row
    # (two buffers, not one per leaf: the unrolled ticks would copy every leaf's buffer around);
    # n the largest chunk's (chunk 0 adds the embedding's residuals, chunk v−1 the head's)
    dtypes = sorted({r.dtype.name for res, *_ in probes.values() for r in res})
    width = {d: max(sum(r.size for r in res if r.dtype.name == d) for res, *_ in probes.values()) for d in dtypes}
    slots = max(p.peak_in_flight)  # the busiest stage's, allocated on every device (SPMD)
    per_mb = max(sum(r.size * r.dtype.itemsize for r in res) for res, *_ in probes.values())  # weights left out
    msg_bytes = message_type.size * message_type.dtype.itemsize
    if info is not None:  # zb also keeps each stashed micro-batch's incoming gradient until W
        info |= {"stash_bytes_per_microbatch": per_mb + zb * msg_bytes, "stash_slots": slots,
                 "stash_bytes": slots * (per_mb + zb * msg_bytes), "inbox_bytes": (p.inbox_slots + 1) * msg_bytes}
    state = {"stash": {d: varying(jnp.zeros((slots, width[d]), d)) for d in dtypes},
             "inbox": varying(jnp.zeros((p.inbox_slots + 1,) + zeros.shape, zeros.dtype)),  # (K + 1, B/M, …)
             "grads": jax.tree.map(lambda a: varying(jnp.zeros(a.shape, grad_dtype or a.dtype)), params),
             "loss": varying(jnp.zeros((), loss_type.dtype))}
    if zb:  # B's incoming gradient, by stash slot, for W
        state["cotangents"] = varying(jnp.zeros((slots,) + zeros.shape, zeros.dtype))  # (slots, B/M, …)

    def pack(leaves):  # residual leaves -> {dtype: (n,)}, zero-padded to the widest chunk's
        rows = {d: [a.ravel() for a in leaves if a.dtype.name == d] for d in dtypes}
        rows = {d: jnp.concatenate(r) if r else jnp.zeros((0,), d) for d, r in rows.items()}
        return {d: jnp.pad(r, (0, width[d] - r.size)) for d, r in rows.items()}

    def take(state, slot):  # the inbox message at a table slot; zeros where the table says −1
        return jnp.where(slot >= 0, lax.dynamic_index_in_dim(state["inbox"], slot, keepdims=False), 0)

    def pull(c, g, state, params, slot, cotangent):
        """Rebuild chunk c's vjp from stash slot ``slot`` and pull ``cotangent`` back: (dparams, dx)."""
        view = progs[g][1]
        q, through = (params, None) if view is None else jax.vjp(view, params)
        res, treedef, shared = probes[c, g]
        rows = {d: lax.dynamic_index_in_dim(b, slot, keepdims=False) for d, b in state["stash"].items()}
        offset, kept = dict.fromkeys(dtypes, 0), []
        for r in res:
            d = r.dtype.name
            kept.append(lax.dynamic_slice_in_dim(rows[d], offset[d], r.size).reshape(r.shape))
            offset[d] += r.size
        kept, weights = iter(kept), jax.tree.leaves(q)
        leaves = [weights[shared[j]] if j in shared else next(kept) for j in range(treedef.num_leaves)]
        dloss = varying(jnp.ones((), loss_type.dtype))  # d(loss)/d(loss): the last stage's seed
        dq, dx = jax.tree.unflatten(treedef, leaves)((cotangent, dloss))
        return (dq if through is None else through(dq)[0]), dx

    def accumulate(state, c, dparams):
        grads = list(state["grads"])
        grads[c] = jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads[c], dparams)
        return state | {"grads": grads}

    def idle(c, g, state, params, mb, slot, read):
        return state, varying(zeros)

    def fwd(c, g, state, params, mb, slot, read):
        (y, loss, leaves), (_, again) = forward(c, g, params[c], take(state, read), mb)
        assert again == probes[c, g][2], (again, probes[c, g][2])  # the weights sit where the probe found them
        stash = {d: lax.dynamic_update_index_in_dim(state["stash"][d], row, slot, 0) for d, row in pack(leaves).items()}
        return state | {"stash": stash, "loss": state["loss"] + loss}, y

    def bwd(c, g, state, params, mb, slot, read):
        dy = take(state, read)
        dparams, dx = pull(c, g, state, params[c], slot, dy)
        if zb:  # B: dx only (dparams unused: XLA drops that half); W needs dy later
            return state | {"cotangents": lax.dynamic_update_index_in_dim(state["cotangents"], dy, slot, 0)}, dx
        return accumulate(state, c, dparams), dx

    def wgt(c, g, state, params, mb, slot, read):  # zb's W: dW only (dx unused), nothing sent
        dy = lax.dynamic_index_in_dim(state["cotangents"], slot, keepdims=False)  # what B(mb) received
        dparams, _ = pull(c, g, state, params[c], slot, dy)
        return accumulate(state, c, dparams), varying(zeros)

    run_op = {IDLE: idle, FWD: fwd, BWD: bwd, WGT: wgt}
    for t in range(len(p.grid)):  # Python loop: every permute is in the HLO, each tick's tables static
        keys = [(int(k), int(c), int(g)) if k != IDLE else (IDLE, 0, 0)
                for k, c, g in zip(p.kind[t], p.chunk[t], program_of)]  # per device: (kind, chunk, program)
        ops = sorted(set(keys))
        branches = [functools.partial(run_op[k], c, g) for k, c, g in ops]  # only what some device runs at t
        index = mine(np.array([ops.index(key) for key in keys], np.int32))
        state, out = lax.switch(index, branches, state, params, mine(p.mb[t]), mine(p.stash[t]), mine(p.read[t]))
        assert out.shape == zeros.shape, (out.shape, zeros.shape)  # y on or dx back: one activation
        for pairs, slots in zip(p.pairs[t], p.write[t]):  # non-receivers get zeros, written to the spare slot K
            got = lax.ppermute(out, "pp", pairs)
            slot = mine(np.where(slots >= 0, slots, p.inbox_slots))
            state["inbox"] = lax.dynamic_update_index_in_dim(state["inbox"], got, slot, 0)
    return state["loss"], state["grads"]
