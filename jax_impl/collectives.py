"""The collectives in JAX: inside ``jax.shard_map`` (explicit), and as reshardings under ``jax.jit``.

Same function names as torch_impl/collectives.py; each runs INSIDE a shard_map body on one
device's block ``x`` and returns that device's result. ``axis`` is the mesh axis name (torch's
``group``); a device's index on it, ``lax.axis_index(axis)``, is torch's rank.

JAX is SPMD: every device runs the same program and every collective is symmetric, so there is
no root-based primitive (no broadcast, reduce, gather, scatter) and no send/recv pair. The rooted
collectives are built from symmetric ones plus a mask on ``axis_index`` (see each function);
point-to-point is ``lax.ppermute`` (a collective-permute: every device sends and receives at
once). Bytes per call (nccl-tests size S, as jax_impl.ledger reads them from the compiled HLO)
match torch's, except the barrier's stand-in psum (4 bytes). Sources: the Ultrascale Playbook's
collectives appendix, CS336 lecture 8, the shard_map docs ("collective primitives").
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.devices import where
from jax_impl.ledger import comm_of
from jax_impl.parallel.tree import fetch
from shared.collectives import (
    BENCH_OPS,
    BENCH_SIZES,
    NAMES,
    WITH_ROOT,
    bench_elements,
    expected,
    expected_bytes,
    max_abs_err,
    rank_input,
    root_rank,
)
from shared.theory import busbw
from shared.tolerances import COLLECTIVES

# --- one-to-all and all-to-one, rebuilt from symmetric collectives ----------------------------


def broadcast(x, axis, root=0):
    """No broadcast primitive: a psum in which every device but the root contributes zeros.
    It costs an all-reduce (wire 2(N−1)/N·n per device instead of ≈ n for a pipelined broadcast);
    XLA lowers a jit resharding "root's block → replicated" the same way (see spmd_reshardings)."""
    mine = jnp.where(lax.axis_index(axis) == root, x, jnp.zeros_like(x))  # (n,): zeros off-root
    return lax.psum(mine, axis)


def reduce(x, axis, root=0):
    """No reduce primitive: psum (every device gets the sum), then only the root keeps it."""
    total = lax.psum(x, axis)
    return jnp.where(lax.axis_index(axis) == root, total, jnp.zeros_like(total))


def gather(x, axis, root=0):
    """No gather primitive: all_gather gives every device the concatenation; the root keeps it
    (the other devices' copies are the price: wire (N−1)/N·S on every device, not just into the root)."""
    return lax.all_gather(x, axis, tiled=True)  # (N·c,)


def scatter(x, axis, root=0):
    """No scatter primitive: an all_to_all sends chunk j of every device's buffer to device j;
    device r keeps what came from the root (block ``root`` of the result) and drops the rest.
    (Alternative: broadcast the root's buffer, then each device dynamic_slices chunk r — an
    all-reduce of the whole buffer instead of an all-to-all.)"""
    n = lax.axis_size(axis)
    assert x.shape[0] % n == 0, (x.shape, n)
    c = x.shape[0] // n
    received = lax.all_to_all(x, axis, 0, 0, tiled=True)  # (N·c,): block s came from device s
    return received[root * c:(root + 1) * c]  # (c,)


# --- symmetric collectives: JAX has these directly --------------------------------------------


def all_reduce_sum(x, axis):
    return lax.psum(x, axis)


def all_reduce_avg(x, axis):
    """pmean = psum, then divide by N: exact on small integers (see shared.collectives)."""
    return lax.pmean(x, axis)


def all_reduce_max(x, axis):
    return lax.pmax(x, axis)


def all_gather(x, axis):
    return lax.all_gather(x, axis, tiled=True)  # (N·c,); tiled: concatenate, don't stack


def reduce_scatter(x, axis):
    """Device r gets chunk r of the sum."""
    return lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)  # (c,)


def all_to_all(x, axis):
    """Chunk j of device i's x goes to device j, landing at position i."""
    return lax.all_to_all(x, axis, 0, 0, tiled=True)  # (N·c,)


def barrier(x, axis):
    """SPMD has no barrier: the devices run one program in lock-step, and any collective already
    waits for every device. The stand-in: a psum of one int32 that x's result depends on (so it
    cannot be dropped); the host then waits with block_until_ready."""
    arrived = lax.psum(jnp.ones((), jnp.int32), axis)  # () == N once everyone is here
    return jnp.where(arrived == lax.axis_size(axis), x, jnp.full_like(x, jnp.nan))


# --- point-to-point, and the all-reduce built from it -----------------------------------------


def ring_shift(x, axis):
    """Every device sends x to its right neighbour and receives its left neighbour's: one
    collective-permute (torch: an isend + irecv pair per rank)."""
    n = lax.axis_size(axis)
    return lax.ppermute(x, axis, perm=[(i, (i + 1) % n) for i in range(n)])


def ring_all_reduce(x, axis):
    """All-reduce by hand on a ring of N devices, x split into N chunks of n/N (same schedule as
    torch_impl.collectives.ring_all_reduce). Reduce-scatter phase, N−1 steps: at step s device r
    sends chunk (r−s) and adds the chunk (r−s−1) it receives. All-gather phase, N−1 steps: it
    sends chunk (r+1−s), a finished sum, and overwrites chunk (r−s). A Python loop, not
    fori_loop, so the HLO (and the ledger) shows all 2(N−1) collective-permutes."""
    n, r = lax.axis_size(axis), lax.axis_index(axis)
    assert x.shape[0] % n == 0, (x.shape, n)
    chunks = x.reshape(n, -1)  # (N, n/N)
    for s in range(n - 1):  # reduce-scatter
        chunks = chunks.at[(r - s - 1) % n].add(ring_shift(chunks[(r - s) % n], axis))
    for s in range(n - 1):  # all-gather
        chunks = chunks.at[(r - s) % n].set(ring_shift(chunks[(r + 1 - s) % n], axis))
    return chunks.reshape(-1)  # (n,)


def rs_then_ag(x, axis):
    """all_reduce == reduce_scatter + all_gather: the identity behind ZeRO and FSDP."""
    return all_gather(reduce_scatter(x, axis), axis)


FUNCTIONS = {
    "broadcast": broadcast, "reduce": reduce, "all_reduce_sum": all_reduce_sum,
    "all_reduce_avg": all_reduce_avg, "all_reduce_max": all_reduce_max, "gather": gather,
    "all_gather": all_gather, "scatter": scatter, "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all, "ring_shift": ring_shift, "barrier": barrier,
    "ring_all_reduce": ring_all_reduce, "rs_then_ag": rs_then_ag,
}


def _per_device(mesh, fn):
    """jit(shard_map(fn)) over a 1-D mesh: device r's block of the global input is its x."""
    axis = mesh.axis_names[0]
    return jax.jit(jax.shard_map(partial(fn, axis=axis), mesh=mesh, in_specs=P(axis),
                                 out_specs=P(axis), check_vma=True))


def check_all(mesh) -> list[dict]:
    """Run every collective on a 1-D mesh; one row per collective with every device's output
    (``outputs[r]``), the worst error over devices, and the HLO ledger of the compiled call."""
    axis = mesh.axis_names[0]
    n = mesh.shape[axis]
    sharded = NamedSharding(mesh, P(axis))
    library = _per_device(mesh, all_reduce_sum)
    rows = []
    for name in NAMES:
        kwargs = {"root": root_rank(n)} if name in WITH_ROOT else {}
        step = _per_device(mesh, partial(FUNCTIONS[name], **kwargs))
        x = jax.device_put(np.concatenate([rank_input(name, r, n) for r in range(n)]), sharded)  # (N·n_in,)
        out = np.split(fetch(step(x)), n)  # N × this device's result (fetch: from any JAX process)
        wants = [expected(name, r, n) for r in range(n)]
        err = max(max_abs_err(o, w) for o, w in zip(out, wants, strict=True))
        extra_bytes = 4 if name == "barrier" else 0  # the psum of one int32
        row = {"variant": name, "ok": err <= COLLECTIVES, "max_abs_err": err, "comm": comm_of(step, x),
               "expected_bytes": expected_bytes(name, n, x.dtype.itemsize) + extra_bytes,
               "outputs": [None if w is None else o.tolist() for o, w in zip(out, wants, strict=True)],
               "where": where(mesh.devices.flat)}  # platform / devices, for RunResult's fields
        if name in ("ring_all_reduce", "rs_then_ag"):  # equal to the library all-reduce?
            lib = np.split(fetch(library(x)), n)
            row["vs_library_max_abs_err"] = max(max_abs_err(o, l) for o, l in zip(out, lib, strict=True))
            row["ok"] = row["ok"] and row["vs_library_max_abs_err"] <= COLLECTIVES
        rows.append(row)
    return rows


# --- the SPMD view: no collective written, XLA picks one to reshard ---------------------------


def spmd_reshardings(mesh) -> list[dict]:
    """The same data movement as a plain jnp program under jax.jit with input/output shardings:
    no collective is written; ``chosen`` is what XLA put in the compiled HLO, ``expected`` the
    HLO op one would write by hand (``matches``: it is there). c = 2 elements per device."""
    axis = mesh.axis_names[0]
    n, c = mesh.shape[axis], 2
    vec = np.arange(n * c, dtype=np.float32)  # (N·c,)
    mat = np.arange((n * c) ** 2, dtype=np.float32).reshape(n * c, n * c)  # (N·c, N·c)
    top = root_rank(n)
    cases = [  # (label, collective, HLO op expected, function, input, in spec, out spec, result)
        ("P('x')->P()", "all_gather", "all_gather", lambda v: v, vec, P(axis), P(), vec),
        ("P('x',None)->P(None,'x')", "all_to_all", "all_to_all", lambda m: m, mat, P(axis, None),
         P(None, axis), mat),
        ("sum(P('x',None), 0)->P()", "all_reduce_sum", "all_reduce", lambda m: m.sum(0), mat,
         P(axis, None), P(), mat.sum(0)),
        ("max(P('x',None), 0)->P()", "all_reduce_max", "all_reduce", lambda m: m.max(0), mat,
         P(axis, None), P(), mat.max(0)),
        # XLA:CPU emits all-reduce + dynamic-slice here; the GPU pipeline's ReduceScatterCreator
        # pass rewrites that pair into a reduce-scatter.
        ("sum(P('x',None), 0)->P('x')", "reduce_scatter", "reduce_scatter", lambda m: m.sum(0), mat,
         P(axis, None), P(axis), mat.sum(0)),
        ("roll(P('x'), c)->P('x')", "ring_shift", "collective_permute", lambda v: jnp.roll(v, c), vec,
         P(axis), P(axis), np.roll(vec, c)),
        # XLA moves the root's block to device 0 (collective-permute), then psums it with zeros
        # from everyone else: the masked psum of ``broadcast`` above.
        ("P('x')[root]->P()", "broadcast", "all_reduce", lambda v: v.reshape(n, c)[top], vec, P(axis), P(),
         vec.reshape(n, c)[top]),
        # Replicated -> sharded needs no communication: each device slices its own block.
        ("P()->P('x')", "scatter", "none", lambda v: v, vec, P(), P(axis), vec),
    ]
    rows = []
    for label, collective, want, fn, value, in_spec, out_spec, result in cases:
        step = jax.jit(fn, out_shardings=NamedSharding(mesh, out_spec))
        x = jax.device_put(value, NamedSharding(mesh, in_spec))
        got, chosen = fetch(step(x)), comm_of(step, x)
        rows.append({"variant": label.replace("'x'", repr(axis)), "collective": collective, "expected": want,
                     "chosen": chosen, "matches": (not chosen) if want == "none" else want in chosen,
                     "ok": got.shape == result.shape and bool(np.all(got == result))})
    return rows


# --- bandwidth sweep in the style of nccl-tests -----------------------------------------------

_BENCH_FNS = {"all_reduce": all_reduce_sum, "all_gather": all_gather,
              "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}


def bench(mesh, ops=BENCH_OPS, sizes_bytes=BENCH_SIZES, iters=10, warmup=2, dtype=jnp.float32) -> list[dict]:
    """Per op and size S: jit a shard_map of the one collective, compile it outside the clock, run
    ``warmup`` calls, then time ``iters`` calls dispatched back to back between two blocks (as torch's
    bench on CUDA and nccl-tests: a block per call would time the dispatch and the wait), divided by
    ``iters``. algbw = S / t, busbw = algbw · factor(N) as in nccl-tests."""
    axis = mesh.axis_names[0]
    n = mesh.shape[axis]
    itemsize = jnp.dtype(dtype).itemsize
    rows = []
    for op in ops:
        if op not in _BENCH_FNS:
            raise ValueError(f"unknown bench op {op!r}; choose from {', '.join(BENCH_OPS)}")
        for size in sizes_bytes:
            elems, s_bytes = bench_elements(op, size, n, itemsize)
            x = jax.device_put(jnp.zeros(n * elems, dtype), NamedSharding(mesh, P(axis)))  # (N·elems,)
            step = _per_device(mesh, _BENCH_FNS[op]).lower(x).compile()
            jax.block_until_ready([step(x) for _ in range(warmup)] + [x])
            t0 = time.perf_counter()
            outs = [step(x) for _ in range(iters)]  # every output waited for: the calls are independent
            jax.block_until_ready(outs)
            t = (time.perf_counter() - t0) / iters
            algbw, bus = busbw(op, s_bytes, t, n)
            rows.append({"op": op, "size_bytes": s_bytes, "time_s": t, "algbw": algbw, "busbw": bus})
    return rows
