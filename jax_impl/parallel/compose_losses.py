"""The composed step's loss, three ways: the forward the shard_map body runs (fsdp's gathers, each array
cast varying once, tp's stand-ins, GPipe's ``ppermute`` over "pp"), the forward jit runs with pp (every
stage at once under vmap, rolled one stage on per iteration), and the plain forward (jit, no pp). The
``Composed`` trainer (jax_impl/parallel/compose.py, whose docstring counts the collectives) calls them with
itself as ``c``; they read its mesh, split, plan and trace and change nothing else. No torch twin: torch's
composed step is the user's module's own forward under its wrappers (torch_impl/parallel/compose.py).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.parallel import cp as cp_seam
from jax_impl.parallel import ep as ep_seam
from jax_impl.parallel.compose_axes import ComposeError, one, stand_ins, varying
from jax_impl.parallel.tp import local_shapes_refusal


def merge(parts, flat: dict):
    gdef, treedef, keys, _ = parts
    return nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, [flat[k] for k in keys]))


def forward_loss(c, params, tokens, targets, positions, manual: bool):
    """Mean loss over the tokens given: this device's (manual, in shard_map) or all (jit)."""
    sp, S, M = c.split, c.S, c.M
    rows, T = tokens.shape
    parts = {}
    for p in sp.first + sp.last:
        flat = {k[len(p) + 1:]: v for k, v in params["rest"].items() if k.startswith(p + ".")}
        parts[p] = merge(c.parts[p], flat)
    blocks = params["blocks"]
    layers = [merge(c.block_parts, {k: a[l] for k, a in blocks.items()})
              for l in range(next(iter(blocks.values())).shape[0])]
    if manual and c.tp > 1:
        f_cache = {}  # one f per input array (q|k|v, gate|up): one backward psum, Megatron's
        layers = [stand_ins(layer, c.rel_plan, f_cache) for layer in layers]

    block_calls = []

    def stage(h):
        for layer in layers:
            h = sp.block(c.root, layer, h, positions)
            block_calls.append(1)
        return h

    h0 = sp.embed(c.root, parts, tokens, positions)  # (rows, T, D): stage 0's input
    if manual and c._trace is not None:  # one micro-batch's stream: comm_theory's A
        c._trace["stream"] = ((rows // M,) + h0.shape[1:], h0.dtype.itemsize)
    if manual and c.tp > 1 and c._trace is not None:  # f casts per block call: comm_theory
        c._trace["f"] = lambda: (len(f_cache), sum(x.shape[-1] for x, _ in f_cache.values()), len(block_calls))
    m = rows // M
    if S == 1 and M > 1:  # accumulation: M row chunks, their mean losses averaged (one gradient of it)
        if manual and c._trace is not None:
            c._trace["stream"] = ((m,) + h0.shape[1:], h0.dtype.itemsize)
        total = 0
        for k in range(M):  # with aux= (compose_ep.py): each chunk's own balancing losses, read after its forward
            total = total + c.loss(sp.head(c.root, head_parts(c, parts), stage(h0[k * m:(k + 1) * m])),
                                   targets[k * m:(k + 1) * m])
            if c.experts.aux is not None:
                total = total + c.experts.aux_value(c.root, parts, sp.blocks, layers)
        return total / M
    if S == 1:
        loss = c.loss(sp.head(c.root, head_parts(c, parts), stage(h0)), targets)
        # aux= (compose_ep.py): the layers' balancing losses of this forward, read after it (refused with pp)
        return loss if c.experts.aux is None else loss + c.experts.aux_value(c.root, parts, sp.blocks, layers)
    h0 = h0.reshape((M, m) + h0.shape[1:])
    if manual and "pp" not in varying(h0):  # varying over pp once: its cotangent summed once
        h0 = lax.pcast(h0, "pp", to="varying")
    idx, state, outs = lax.axis_index("pp"), jnp.zeros_like(h0[0]), []
    for t in range(M + S - 1):  # stage s runs micro-batch t − s (GPipe); bubbles run on zeros, unused
        out = stage(jnp.where(idx == 0, h0[min(t, M - 1)], state))
        if t >= S - 1:
            outs.append(out)
        state = lax.ppermute(out, "pp", [(s, s + 1) for s in range(S - 1)])
    logits = sp.head(c.root, head_parts(c, parts), jnp.concatenate(outs))
    loss = c.loss(logits, targets)  # micro-batch k = rows [k·m, (k+1)·m)
    return lax.psum(jnp.where(idx == S - 1, loss, 0), "pp")


def jit_pipeline_loss(c, params, tokens, targets, positions):
    """jit with pp (global arrays): GPipe over the stacked blocks (S, L/S, …), every stage at once under
    vmap (spmd_axis_name "pp"), the stream rolled one stage on per iteration (jax_impl/pp.py's jit
    pipeline's circular shift), pinned to P("pp", data, cp); micro-batch k = global rows [k·m, (k+1)·m)
    (the mean over equal micro-batches is the batch's). XLA places the collectives."""
    sp, S, M = c.split, c.S, c.M
    m = tokens.shape[0] // M
    parts = {p: merge(c.parts[p], {k[len(p) + 1:]: v for k, v in params["rest"].items()
                                             if k.startswith(p + ".")}) for p in sp.first + sp.last}

    def stage(blocks, h):  # one stage's L/S layers on (m, T, D)
        for l in range(next(iter(blocks.values())).shape[0]):
            h = sp.block(c.root, merge(c.block_parts, {k: a[l] for k, a in blocks.items()}), h,
                         positions)
        return h

    every = jax.vmap(stage, spmd_axis_name="pp")
    h0 = sp.embed(c.root, parts, tokens, positions)
    h0 = h0.reshape((M, m) + h0.shape[1:])  # (M, m, T, D)
    spec = P("pp", one(c.data), c.seq, *([None] * (h0.ndim - 3)))
    pin = lambda a: lax.with_sharding_constraint(a, NamedSharding(c.mesh, spec))  # noqa: E731
    first = (np.arange(S) == 0).reshape((S,) + (1,) * (h0.ndim - 1))
    state, outs = jnp.zeros((S,) + h0.shape[1:], h0.dtype), []
    for t in range(M + S - 1):  # stage s runs micro-batch t − s; bubbles compute on zeros, unused
        y = every(params["blocks"], pin(jnp.where(first, h0[min(t, M - 1)][None], state)))  # (S, m, T, D)
        if t >= S - 1:
            outs.append(y[S - 1])
        state = pin(jnp.roll(y, 1, axis=0))  # stage s's output is stage s+1's input
    return c.loss(sp.head(c.root, head_parts(c, parts), jnp.concatenate(outs)), targets)


def head_parts(c, parts: dict) -> dict:
    """The modules the head gets (the first's too: a tied head reads the embedding), the first ones it
    reads recorded for comm_theory (their gradient meets the last stage's pp-varying stream)."""
    trace, first = c._trace, set(c.split.first)

    class Reads(dict):
        def __getitem__(self, key):
            if trace is not None and key in first:
                trace.setdefault("tied", set()).add(key)
            return super().__getitem__(key)

    return Reads(parts)


def shard_map_loss(c):
    specs, data, seq = c.specs, one(c.data), c.seq

    def gather(a, spec, lead: int, axis: int):  # fsdp: dim 0 of the Param's own dims gathered over "fsdp"
        first = spec[lead] if len(spec) > lead else None
        has = first == "fsdp" or (isinstance(first, tuple) and "fsdp" in first)
        return lax.all_gather(a, "fsdp", axis=axis, tiled=True) if has else a

    def vary(a, axes):
        missing = tuple(x for x in c.layout if x in axes and x not in varying(a))
        return lax.pcast(a, missing, to="varying") if missing else a

    data_axes, stage = c.data, {"pp"} if "pp" in c.layout else set()

    def body(params, tokens, targets, positions):  # blocks (1, L/S, …) -> (L/S, …)
        blocks = {k: gather(a[0], specs["blocks"][k], 2, 1) for k, a in params["blocks"].items()}
        rest = {k: gather(a, specs["rest"][k], 0, 0) for k, a in params["rest"].items()}
        # every array varying ONCE over the axes its inputs vary on (data, cp; pp after the first modules):
        # the cast's transpose sums its gradient once per step, not once per use (per layer and iteration)
        sees = set(data_axes + ((seq,) if seq else ()))
        blocks = {k: vary(a, sees | stage) for k, a in blocks.items()}
        rest = {k: vary(a, sees | (set() if any(k.startswith(p + ".") for p in c.split.first) else stage))
                for k, a in rest.items()}
        c._trace = {"seam": [], "stream": ((), 0), "loss": 0, "ep": []}
        ctx = cp_seam._active(c.cp_variant, c.c, c._record) if c.c > 1 else contextlib.nullcontext()
        # the ep seam (compose_ep.py): tokens move over "ep" (when split), counts sum over the data (× cp) axes
        counts = tuple(a for a in data_axes + ((seq,) if seq else ()) if c.layout[a] > 1)
        moe = ep_seam._active("ep" if c.experts.n > 1 else None, counts, c._record_ep) if c.experts.globs else \
            contextlib.nullcontext()
        with ctx, moe:
            try:
                loss = forward_loss(c, {"blocks": blocks, "rest": rest}, tokens, targets, positions, True)
            except TypeError as e:  # JAX's shape errors on tp-local shards (a head count read from config)
                if c.tp == 1:
                    raise
                raise ComposeError("compose " + local_shapes_refusal(e)) from None
        c._trace["loss"] = loss.dtype.itemsize
        if "f" in c._trace:  # (f casts, Σ widths) per block call (the cache is dropped with the trace)
            n, widths, calls = c._trace["f"]()
            c._trace["f"] = (n // calls, widths // calls)
        return loss[None]

    return jax.shard_map(body, mesh=c.mesh, in_specs=(specs, P(data, seq), P(data, seq), P(seq)),
                         out_specs=P(one(c.data + ((seq,) if seq else ()))), check_vma=True)
