"""What each page of docs/side_by_side/ shows (scripts/side_by_side.py renders them): per pattern, per
idea, the excerpts of every style with a sentence each, and the formula's bytes from ``shared.theory`` at
the small configuration the page states. When the code moves (a file split, a renamed method), the paths
and qualified names here are what changes.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from side_by_side_cut import Page, Row, kib, ops  # noqa: E402  (scripts/, put on the path above)
from side_by_side_cut import ex as _ex  # noqa: E402

from shared.collectives import expected_bytes  # noqa: E402
from shared.config import Config  # noqa: E402
from shared.theory import (  # noqa: E402
    cp_comm,
    dp_comm_bytes,
    ep_comm_jax,
    ep_comm_torch,
    fsdp_comm,
    mesh_comm_jax,
    mesh_comm_torch,
    pp_bubble_fraction,
    pp_circular_permute_bytes,
    pp_circular_permute_count,
    pp_p2p_bytes_per_rank,
    pp_p2p_count_per_rank,
    pp_ticks_permute_bytes,
    pp_ticks_permute_count,
    tp_comm,
    zero1_comm_bytes,
)


def collectives_page() -> Page:
    n, b = 4, 4  # shared.collectives' inputs: float32, 4 ranks
    eb = lambda name: kib(expected_bytes(name, n, b))
    T, J = "torch_impl/collectives.py", "jax_impl/collectives.py"
    rows = (
        Row("all-reduce: every rank gets the sum", f"S = n = {eb('all_reduce_sum')} (4 float32)", (
            _ex("explicit", T, "all_reduce_sum", "In place on a clone: `dist.all_reduce` with `SUM`."),
            _ex("shard_map", J, "all_reduce_sum", "`lax.psum` over the mesh axis: the same all-reduce, as a value."),
        )),
        Row("all-gather and reduce-scatter: the halves of an all-reduce",
            f"all-gather S = N·n_in = {eb('all_gather')}; reduce-scatter S = the input = {eb('reduce_scatter')}", (
                _ex("explicit", T, "all_gather", "`all_gather_single` into one (N·c,) buffer, rank order."),
                _ex("explicit", T, "reduce_scatter", "`reduce_scatter_single`: rank r keeps chunk r of the sum."),
                _ex("shard_map", J, "all_gather", "`lax.all_gather(tiled=True)`: concatenated, not stacked."),
                _ex("shard_map", J, "reduce_scatter", "`lax.psum_scatter(tiled=True)`: device r keeps chunk r."),
            )),
        Row("all-to-all: a transpose across ranks", f"S = the input = {eb('all_to_all')}", (
            _ex("explicit", T, "all_to_all", "`all_to_all_single`: chunk j of rank i lands on rank j at slot i."),
            _ex("shard_map", J, "all_to_all", "`lax.all_to_all(x, axis, 0, 0, tiled=True)`: the same transpose."),
        )),
        Row("a rooted collective: broadcast", f"S = n = {eb('broadcast')}", (
            _ex("explicit", T, "broadcast", "`dist.broadcast` from a root rank (torch has every rooted collective)."),
            _ex("shard_map", J, "broadcast", "SPMD has no root: a `psum` where every device but the root adds "
                "zeros (an all-reduce's cost)."),
        )),
        Row("point to point: one step of a ring", f"S = the message = {eb('ring_shift')}", (
            _ex("explicit", T, "ring_shift", "`isend` right and `irecv` left posted together (`batch_isend_irecv`): "
                "no deadlock.", key='dist.P2POp(dist.isend'),
            _ex("shard_map", J, "ring_shift", "One `lax.ppermute` (a collective-permute): every device sends and "
                "receives at once."),
        )),
        Row("an all-reduce by hand on a ring", f"2(N−1) messages of n/N = {eb('ring_all_reduce')} "
            f"(the all-reduce's bus bytes)", (
                _ex("explicit", T, "ring_all_reduce", "Reduce-scatter phase then all-gather phase, N−1 `ring_shift`s "
                    "each (send/recv).", start="chunks = list(", end="return torch.cat",
                    key='chunks[(r - s - 1) % n] +='),
                _ex("shard_map", J, "ring_all_reduce", "The same schedule with `ppermute`; Python-unrolled, so the "
                    "HLO shows all 2(N−1) permutes.", start="chunks = x.reshape", end="return chunks.reshape",
                    key='chunks = chunks.at[(r - s - 1) % n].add'),
            )),
        Row("no collective written: a resharding under jit", "what XLA picks, read from the HLO "
            "(docs/collectives.md)", (
            _ex("jit", J, "spmd_reshardings", "Each case is a plain program with an input and an output sharding; "
                "XLA inserts the collective (all-gather, all-to-all, all-reduce, collective-permute).",
                start='("P(\'x\')->P()"', end='P(axis), P(axis), np.roll(vec, c)),', key='("P(\'x\')->P()"'),
        )),
    )
    return Page("collectives", "The collectives",
                "Every collective as one small function per framework, checked against NumPy "
                "(`compare.py --patterns collectives`). torch has rooted collectives and send/recv; JAX's SPMD "
                "has symmetric ones and `ppermute`, and builds the rest from them. torch has no builtin style "
                "here, JAX no typed one. The whole page: [docs/collectives.md](../collectives.md).",
                "4 ranks, float32, the fixtures of `shared/collectives.py`", rows,
                "Bytes per call and rank (nccl-tests' size S) from `shared.collectives.expected_bytes`")


def dp_page() -> Page:
    cfg = Config(model="mlp", layers=4, dim=16, batch=16, world_size=4, dtype="float64")
    P, F, TY = "torch_impl/parallel/dp.py", "jax_impl/parallel/fsdp.py", "jax_impl/parallel/typed.py"
    Z = "jax_impl/parallel/zero.py"
    rows = (
        Row("DP: average the gradients", f"all-reduce Φ·b = {kib(dp_comm_bytes(cfg))} (`dp_comm_bytes`)", (
            _ex("explicit", P, "allreduce_gradients", "CS336's: after backward, one blocking `all_reduce` per "
                "gradient, then /N.", start="for p in module.parameters()", end="p.grad.div_(n)"),
            _ex("explicit", P, "BucketedDDP._grad_hook", "DDP's, by hand: a hook puts each gradient/N in its "
                "bucket; a full bucket starts an async `all_reduce`.", start='bucket["ready"] += 1',
                end="self.next_bucket += 1"),
            _ex("builtin", "torch_impl/dp.py", "make_setup", "`DistributedDataParallel`: the same in C++.",
                start="net = DistributedDataParallel(", end="bucket_cap_mb=cfg.bucket_mb)"),
            _ex("compiled", "torch_impl/dp.py", "make_setup", "`torch.compile` over DDP: DDPOptimizer splits the "
                "graph at DDP's buckets; the reducer still all-reduces eagerly.", start='if style == "compiled":',
                end="net = torch.compile(net)", key="net = torch.compile(net)"),
            _ex("shard_map", Z, "ZeroSteps._local", "The local gradients: of copies cast to varying over 'dp' …",
                start="mine = {k:", end="for k, a in params.items()}"),
            _ex("shard_map", Z, "ZeroSteps._dp_step", "… averaged by one `lax.pmean`: an all-reduce.",
                start="grads = lax.pmean", end="grads = lax.pmean"),
            _ex("jit", F, "Trainer._jit_step", "The global loss of a batch in `P('dp')`: XLA inserts the "
                "all-reduce (typed: the same step, its layouts as types).",
                start="(_, loss), grads = jax.value_and_grad", end="has_aux=True)(params)", key="jax.value_and_grad"),
        )),
        Row("ZeRO-1: split the optimizer state", f"reduce-scatter + all-gather 2·Φ·b = "
            f"{kib(zero1_comm_bytes(cfg))} (`zero1_comm_bytes`)", (
                _ex("explicit", P, "Zero1Optimizer.reduce_gradients", "The flat gradients reduce-scattered: this "
                    "rank's 1/N of their mean …", start="dist.reduce_scatter_single", end="mine.grad.div_("),
                _ex("explicit", P, "Zero1Optimizer.update", "… AdamW on it, then an all-gather writes the new "
                    "weights into the model.", start="self.local.step()", end="dist.all_gather_single"),
                _ex("shard_map", Z, "ZeroSteps._zero1_step", "`psum_scatter` of the flat gradient; optax on this "
                    "device's slice …", start="g = lax.psum_scatter", end="w = lax.dynamic_slice_in_dim"),
                _ex("shard_map", Z, "ZeroSteps._zero1_step", "… then `all_gather` of the update.",
                    start="flat = lax.all_gather", end="flat = lax.all_gather"),
                _ex("typed", TY, "TypedTrainer._step", "Gradients and weights stated in the moments' rows "
                    "`P('dp')` (a slice) …", start="g = {k: self.stated.reshard", end="w = {k: self.stated.reshard"),
                _ex("typed", TY, "TypedTrainer._step", "… the update back to `P()`: XLA's all-gather.",
                    start="new = {k: self.stated.reshard", end="new = {k: self.stated.reshard"),
            )),
    )
    return Page("dp", "Data parallelism and ZeRO-1",
                "The batch is split, weights replicated, gradients averaged; ZeRO-1 also splits AdamW's state. "
                "The whole page: [docs/dp.md](../dp.md).",
                "the MLP, L = 4, D = 16, N = 4, float64: Φ = 1,024, b = 8", rows)


def fsdp_page() -> Page:
    cfg = Config(model="mlp", layers=4, dim=32, world_size=4, dtype="float64")
    T, F, TY = "torch_impl/parallel/fsdp.py", "jax_impl/parallel/fsdp.py", "jax_impl/parallel/typed.py"
    Z2 = "torch_impl/parallel/zero.py"  # Zero2 and the Units
    Z = "jax_impl/parallel/zero.py"
    rows = (
        Row("ZeRO-3: gather each weight before use, reduce-scatter its gradient",
            f"{ops(fsdp_comm(cfg, 'zero3'))} (`fsdp_comm`: 3·Φ·b less layer 0's backward gather)", (
                _ex("explicit", T, "FSDP._start", "A unit's row blocks, cast to the compute dtype, all-gathered "
                    "asynchronously (`all_gather_single`): started one unit ahead (prefetch).",
                    start="src = unit.shard.detach()", end="self._inflight[unit] ="),
                _ex("explicit", T, "_Gathered", "Forward hands the layer the gathered weight; backward "
                    "reduce-scatters its gradient.", key='ctx.fsdp._reduce_scatter'),
                _ex("explicit", T, "FSDP._unpack", "Backward: autograd's saved weight is a handle, gathered again "
                    "at first use.", start="if unit not in self._regathered", end="self._bwd_pos =",
                    key='self._wait(unit)'),
                _ex("explicit", T, "FSDP._reduce_scatter", "The gradient's async `reduce_scatter_single` into this "
                    "rank's rows.", start="out = torch.empty_like(unit.shard)", end="self._pending.append"),
                _ex("shard_map", Z, "_Gathering.__call__", "Each unit's rows `all_gather`ed at its call inside "
                    "`jax.checkpoint` (so backward gathers again); autodiff transposes each gather into the "
                    "gradient's `psum_scatter`.", start="gdef, state = nnx.split", end="return jax.checkpoint"),
            )),
        Row("ZeRO-2: gradients and state split, weights whole", f"{ops(fsdp_comm(cfg, 'zero2'))} (`fsdp_comm`)", (
            _ex("explicit", Z2, "Zero2._reduce_scatter", "Each full gradient reduce-scattered as it completes; the "
                "full one is dropped.", start="out = torch.empty_like(unit.shard)", end="p.grad = None"),
            _ex("explicit", Z2, "Zero2.all_gather_params", "After the step: every updated row block all-gathered "
                "into the full weight.", start="for unit in self.units.values()", end="unit.full.copy_("),
            _ex("shard_map", Z, "ZeroSteps._zero_step", "Every row-split gradient `psum_scatter`ed …",
                start="grads |= {k: lax.psum_scatter", end="grads |= {k: lax.psum_scatter"),
            _ex("shard_map", Z, "ZeroSteps._zero_step", "… and after optax, every updated row block `all_gather`ed.",
                start="mine |= {k: lax.all_gather", end="mine |= {k: lax.all_gather"),
        )),
        Row("The builtin, the compiler, the types", f"FSDP2: {ops(fsdp_comm(cfg, 'fsdp2'))} (`fsdp_comm`: it "
            "gathers layer 0 again)", (
                _ex("builtin", "torch_impl/fsdp.py", "fsdp2_model", "FSDP2: `fully_shard` per block and on the root; "
                    "per block one all-gather forward, one backward, one reduce-scatter.",
                    start="for block in", end="fully_shard(model, mesh=mesh"),
                _ex("compiled", "torch_impl/fsdp.py", "fsdp2_model", "torchtitan's per-block compile: each block's "
                    "compute compiled; FSDP2's gathers and reduce-scatters stay in its eager hooks.",
                    start="if compile:", end="compiled.compile_units(block", key="compiled.compile_units(block"),
                _ex("jit", F, "Trainer.__init__", "zero3 under jit is a layout: row-split params `P('dp')`; XLA "
                    "(CPU) gathers each weight once, keeps it, and all-reduces the gradient.",
                    start="self.param_specs = {k: P(axis)", end="self.param_specs = {k: P(axis)",
                    key='self.param_specs'),
                _ex("typed", TY, "TypedTrainer._batch_loss", "zero3 in types: each row-split param's gather is a "
                    "stated `reshard(w, P())`; XLA makes each an all-gather.",
                    start="full = {k: self.stated.reshard", end="full = {k: self.stated.reshard"),
            )),
    )
    return Page("fsdp", "ZeRO-2, ZeRO-3 (FSDP) and FSDP2",
                "Parameters (ZeRO-3), gradients and AdamW state split in row blocks over the ranks. The whole "
                "page: [docs/fsdp.md](../fsdp.md); what XLA chose instead: "
                "[docs/sharding_modes.md](../sharding_modes.md).",
                "the MLP, L = 4, D = 32, N = 4, float64: each weight D²·b = 8 KiB", rows)


def tp_page() -> Page:
    cfg = Config(model="mlp", layers=4, dim=32, world_size=4, dtype="float64")
    tcfg = Config(model="transformer", layers=2, dim=16, heads=2, seq=8, vocab=32, batch=8, world_size=4,
                  dtype="float64")
    O, TP, JR, JP = ("torch_impl/parallel/tp_ops.py", "torch_impl/parallel/tp.py", "jax_impl/tp.py",
                     "jax_impl/parallel/tp.py")
    TD = "torch_impl/parallel/tp_dtensor.py"
    rows = (
        Row("Megatron's f and g", f"MLP: {ops(tp_comm(cfg, 'megatron'))} (`tp_comm`; each S = B·D·b)", (
            _ex("explicit", O, "CopyToTP", "f, before a column-parallel matmul: identity forward, `all_reduce` of "
                "the partial input gradient backward."),
            _ex("explicit", O, "ReduceFromTP", "g, after a row-parallel matmul: `all_reduce` of the partial "
                "products forward, identity backward."),
            _ex("shard_map", JR, "copy_to_tp", "f: a cast to varying over 'tp'; its transpose is a `psum`."),
            _ex("shard_map", JR, "reduce_from_tp", "g: a `psum`; its transpose is the identity."),
            _ex("shard_map", JR, "mlp_forward_megatron", "Column- then row-parallel pairs: one all-reduce each way.",
                start="for wa, wb in zip(", end="x = gelu(reduce_from_tp(", key='reduce_from_tp(h @ wb)'),
        )),
        Row("A plan on any model", "the same f/g pairs, hooked into the planned modules", (
            _ex("explicit", TP, "apply_plan", "f and g (or SP's gather and scatter) as module hooks …",
                start="enter = SharedEnter(", end="leave = sp_scatter if", key='enter = SharedEnter('),
            _ex("explicit", TP, "apply_plan", "… f before every column-parallel module, g after every row-parallel "
                "one.", start="if style in ENTER_STYLES:", end="module.register_forward_hook(lambda m, args, out: "
                "leave(out, group))", key='leave(out, group))'),
            _ex("shard_map", JP, "_Split.__call__", "A planned module's stand-in: row-parallel ends in a `psum` (g), "
                "column-parallel starts with f (`_Trace.enter`).", start='if self._style == "rowwise":',
                end="y = m(tr.enter(x)"),
        )),
        Row("Sequence parallelism: the sequence split between the matmuls",
            f"transformer: {ops(tp_comm(tcfg, 'megatron_sp'))} (`tp_comm`)", (
            _ex("explicit", O, "sp_gather", "g: `all_gather` of the sequence forward, `reduce_scatter` backward.",
                key='return Transposed.apply'),
            _ex("explicit", O, "scatter_sequence", "ḡ's forward: the partial products reduce-scattered to this "
                "rank's tokens.", start="rows = z.movedim(1, 0)", end="return out.movedim(0, 1)"),
            _ex("shard_map", JR, "gather_sequence", "g: `all_gather` along T; its transpose is `psum_scatter`."),
            _ex("shard_map", JR, "scatter_sequence", "ḡ: `psum_scatter` along T; its transpose is `all_gather`."),
        )),
        Row("The loss over a vocabulary split over tp", f"transformer: all-reduce MAX of (B, T) and SUM of (2, B, T), "
            f"3·B·T·b = {kib(3 * tcfg.batch * tcfg.seq * tcfg.bytes_per_element)} (in `tp_comm` above)", (
                _ex("explicit", O, "VocabParallelCrossEntropy.forward", "All-reduce MAX of the row max, then one SUM "
                    "of the target logit and Σexp; backward is local.", start="m = logits.amax(",
                    end="picked, sumexp = sums"),
                _ex("shard_map", JR, "vocab_parallel_ce", "`pmax` of the row max, one `psum` of both sums.",
                    start="m = lax.pmax(", end="picked, sumexp = lax.psum("),
            )),
        Row("The builtin, the compiler, the types", f"DTensor, transformer: {ops(tp_comm(tcfg, 'dtensor'))} "
            "(`tp_comm`: `loss_parallel` takes one all-reduce more)", (
                _ex("builtin", TD, "DTENSOR_STYLES", "The same plan's styles as DTensor's parallel styles …",
                    key='"rowwise": lambda'),
                _ex("builtin", TD, "apply_dtensor_plan", "… applied by `parallelize_module`: DTensor issues the "
                    "all-reduces.", start="parallelize_module(model, mesh", end="parallelize_module(model, mesh"),
                _ex("compiled", "torch_impl/tp.py", "train", "Either plan with each block compiled after it: "
                    "dynamo turns the tp all-reduces into functional collectives inside the compiled programs.",
                    start="units = compiled.compile_units(", end="units = compiled.compile_units(",
                    key="units = compiled.compile_units("),
                _ex("jit", JR, "jit_ops", "The same places as sharding constraints (f's input and g's output "
                    "replicated, split activations on their last dim); XLA derives the all-reduces.",
                    start="at = lambda *spec", end="rows = at("),
                _ex("typed", "jax_impl/tp_typed.py", "TypedOps.row", "Row-parallel in types: the einsum's output "
                    "stated `unreduced={'tp'}`, then `reduce` …", start="z = jnp.einsum(eq, h, w, out_sharding",
                    end="return self.reduce(", key='unreduced={"tp"}'),
                _ex("typed", "jax_impl/tp_typed.py", "TypedOps.reduce", "… reshards it to reduced: Megatron's g, "
                    "which XLA makes an all-reduce."),
            )),
    )
    return Page("tp", "Tensor parallelism (Megatron) and sequence parallelism",
                "Each weight split over 'tp' (column-parallel, then row-parallel), every rank on the whole batch. "
                "The whole page: [docs/tp.md](../tp.md).",
                "the MLP, L = 4, D = 32, B = 32, N = 4, float64; the transformer L = 2, D = 16, T = 8, V = 32, "
                "B = 8", rows)


def pp_page() -> Page:
    cfg = Config(model="mlp", layers=4, dim=32, batch=32, microbatches=4, world_size=4, dtype="float64")
    T, J = "torch_impl/pp.py", "jax_impl/pp.py"
    rows = (
        Row("The message between stages", f"torch, a middle stage: {pp_p2p_count_per_rank(cfg, 1)} sends, "
            f"{kib(pp_p2p_bytes_per_rank(cfg, 1))} (`pp_p2p_bytes_per_rank`: M activations of (B/M)·D·b on, M "
            f"gradients back); JAX circular: {pp_circular_permute_count(cfg)}× "
            f"{kib(pp_circular_permute_bytes(cfg))} collective-permutes (`pp_circular_permute_bytes`); bubble "
            f"(S−1)/(M+S−1) = {pp_bubble_fraction(cfg.world_size, cfg.microbatches):.2f}", (
                _ex("explicit", T, "exchange", "One batched exchange with the neighbours: activations to s+1, "
                    "gradients to s−1 (`isend`/`irecv` in `batch_isend_irecv`).", start="ops = []",
                    end="work.wait()"),
                _ex("shard_map", J, "circular", "The circular schedule: every stage runs each tick, a `ppermute` "
                    "shifts activations to s+1; backward is autodiff's reverse shift.", start="shift = [(i",
                    end="return jnp.stack(outs)"),
            )),
        Row("1F1B by hand", f"JAX: {pp_ticks_permute_count(cfg, '1f1b')} collective-permutes, "
            f"{kib(pp_ticks_permute_bytes(cfg, '1f1b'))} (`pp_ticks_permute_bytes`)", (
                _ex("explicit", T, "explicit_step", "Warm-up forwards, then one forward and one backward per "
                    "micro-batch, each a send/recv pair with a neighbour.", start="else:  # 1f1b",
                    end="weights(mb)", key='_, dy = exchange(pipe, send_fwd=forward(warmup + i'),
                _ex("shard_map", "jax_impl/parallel/pp_schedules.py", "run", "Per tick, after every device's op: one "
                    "`ppermute` per static set of source → target pairs.", start="for pairs, slots in zip(",
                    end='state["inbox"] ='),
            )),
        Row("The builtin, the compiler, the types", "torch.distributed.pipelining: the same messages", (
            _ex("builtin", T, "make_builtin", "`PipelineStage` per chunk and torch's schedule (`Schedule1F1B`, …): "
                "its own send/recv.", start="stages = [PipelineStage(", end="return cls(stages[0]"),
            _ex("compiled", T, "train", "Each stage compiled whole under the same schedule; the send/recv stay "
                "eager (torch has no functional send/recv).", start='if style == "compiled":  # each stage',
                end="units = [f", key="compiled.compile_units(chunk"),
            _ex("jit", J, "jit_circular", "The same schedule on whole (S, …) arrays: a `jnp.roll` over the stage "
                "axis pinned to `P('pp')`; XLA makes it a collective-permute.", start="for t in range(M + S - 1):",
                end="state = pin(jnp.roll(", key='jnp.roll'),
            _ex("typed", J, "TYPED_REFUSAL", "Refused: the shift cannot be written in types.", key='TYPED_REFUSAL'),
        )),
    )
    return Page("pp", "Pipeline parallelism",
                "Layers split in stages, one per rank; micro-batches flow through them. The whole page: "
                "[docs/pp.md](../pp.md).",
                "the MLP, L = 4, D = 32, B = 32, S = 4 stages, M = 4 micro-batches, float64", rows)


def cp_page() -> Page:
    cfg = Config(model="transformer", layers=2, dim=16, heads=2, seq=8, vocab=32, batch=8, world_size=4,
                 dtype="float64")
    P, J = "torch_impl/parallel/cp.py", "jax_impl/parallel/cp.py"
    rows = (
        Row("Ring attention: K|V around the ring", f"{ops(cp_comm(cfg, 'ring'))} (`cp_comm`: L·(3N−2) sends of "
            "K|V and dK|dV, then the gradient all-reduce)", (
                _ex("explicit", P, "ring_exchange", "Send K|V to r+1, receive from r−1: one `batch_isend_irecv`.",
                    start="n, r = dist", end="return nxt"),
                _ex("explicit", P, "RingAttention._forward", "Each hop: start the next block's transfer, attend to "
                    "the block held, merge by log-sum-exp.", start="kv, core.scores = torch.stack",
                    end="kv = nxt", key='ring_exchange(kv'),
                _ex("shard_map", J, "ring_core", "The ring: one `ppermute` to r+1 …", start="ring = [(j",
                    end="send = lambda"),
                _ex("shard_map", J, "ring_core.core_fwd", "… per hop, before the compute; backward sends dK|dV "
                    "the same way.", start="kv = jnp.stack", end="kv = incoming", key='send(kv)'),
            )),
        Row("Ulysses: from sequence shards to head shards and back",
            f"{ops(cp_comm(cfg, 'ulysses'))} (`cp_comm`: 8 all-to-alls per layer)", (
            _ex("explicit", P, "seq_to_heads", "`all_to_all_single`: head group j to rank j, sequence chunks back "
                "in rank order.", start="send = x.reshape", end="return recv"),
            _ex("explicit", P, "UlyssesCore.__call__", "q, k, v to heads, SDPA on H/N heads, the output back; each "
                "all-to-all's backward is the reverse one.", start="q, k, v = (Transposed", end="return Transposed",
                key='Transposed.apply(x'),
            _ex("shard_map", J, "attention", "`lax.all_to_all` to heads, causal attention, and back.",
                start='if variant == "ulysses"', end="return lax.all_to_all(out"),
        )),
        Row("The builtin, the compiler, the types", "what XLA picks (measured in docs/cp.md)", (
            _ex("builtin", "torch_impl/cp.py", "train", "torch's experimental `context_parallel` shards the buffers "
                "in place and swaps SDPA for its own context-parallel attention (CUDA only: refused on CPU).",
                start="mesh, core = init_device_mesh", end="sharded = lambda: context_parallel"),
            _ex("jit", "jax_impl/cp.py", "seq_sharded_loss", "The single-device loss, the stream pinned to "
                "`P(None, 'cp', None)`: XLA gathers K and V.", start="pin = lambda", end="return output_loss"),
            _ex("typed", "jax_impl/cp_typed.py", "attention.attn", "In types: K and V stated resharded to the whole "
                "sequence, `P()` (XLA: all-gathers).", start="k, v = (stated.reshard", end="causal = stated.reshard"),
        )),
    )
    return Page("cp", "Context parallelism",
                "The sequence split over the ranks; attention needs every earlier token. The whole page: "
                "[docs/cp.md](../cp.md).",
                "the transformer, L = 2, D = 16, H = 2, T = 8, V = 32, B = 8, N = 4, float64", rows)


def ep_page() -> Page:
    cfg = Config(model="transformer", layers=2, dim=16, heads=2, seq=8, vocab=32, batch=8, world_size=4,
                 dtype="float64", experts=8, topk=2)
    per = cfg.seq * cfg.topk // cfg.experts  # a balanced routing: every expert T·k/E of each sequence
    load = [[[per] * cfg.experts for _ in range(cfg.batch)] for _ in range(cfg.layers)]
    P, J = "torch_impl/parallel/ep.py", "jax_impl/parallel/ep.py"
    rows = (
        Row("Tokens to their experts and back", f"torch (dropless, a balanced routing): "
            f"{ops(ep_comm_torch(cfg, 'explicit', load, 0))}; JAX (capacity-padded): "
            f"{ops(ep_comm_jax(cfg, 'shard_map'))} (`ep_comm_torch`, `ep_comm_jax`)", (
                _ex("explicit", P, "all_to_all_rows", "An uneven `all_to_all_single`: send[j] rows to rank j.",
                    start="out = x.new_empty", end="return out"),
                _ex("explicit", P, "AllToAll", "Its backward is the reverse all-to-all.",
                    key='return all_to_all_rows(grad'),
                _ex("explicit", P, "Dispatcher.__call__", "The splits from the exchanged counts; dispatch, the "
                    "local experts, combine.", start="send = [sum(", end="combined = self.all_to_all(",
                    key='got = self.all_to_all('),
                _ex("shard_map", J, "dispatch", "A capacity-padded (E, C, D) buffer: one `lax.all_to_all` to the "
                    "experts' devices, one back.", start="buf = jnp.zeros((e, c, d)", end="y = lax.all_to_all(y"),
            )),
        Row("The counts", "torch: all-gather of the (N, E) int64 counts; JAX: a psum of (E,)", (
            _ex("explicit", P, "Dispatcher.global_counts", "`all_gather_single` of every rank's counts: the split "
                "sizes and the global load.", start="gathered =", end="return c.sum(0)"),
            _ex("shard_map", J, "global_counts", "One `psum` (the splits are static: capacity)."),
        )),
        Row("The builtin, the compiler, the types", "what XLA picks (measured in docs/ep.md)", (
            _ex("builtin", P, "builtin_all_to_all", "torch's functional all-to-all, autograd built in.",
                key='_FUNCTIONAL_A2A('),
            _ex("jit", "jax_impl/ep.py", "gshard_dispatch.dispatch", "GShard's einsums on global arrays, the expert "
                "axis pinned to 'ep': XLA picks the all-to-alls.", start="x = pin(jnp.einsum",
                end="return pin(out, AXIS)", key='x = pin(jnp.einsum'),
            _ex("typed", "jax_impl/ep_typed.py", "dispatch_in_types.dispatch", "The same einsums in types: each "
                "all-to-all a stated reshard between (E@ep, G) and (E, G@ep).", start="x = stated.reshard",
                end="y = stated.reshard"),
        )),
    )
    return Page("ep", "Expert parallelism (mixture of experts)",
                "Experts split over 'ep'; each token's rows travel to its experts' ranks and back. The whole page: "
                "[docs/ep.md](../ep.md).",
                "the MoE transformer, L = 2, D = 16, T = 8, B = 8, E = 8 experts, top-2, N = 4, float64", rows)


def mesh_page() -> Page:
    cfg = Config(model="transformer", layers=4, dim=16, heads=2, seq=8, vocab=32, batch=8, world_size=8,
                 dtype="float64", mesh=(("dp", 2), ("tp", 2), ("pp", 2)), microbatches=2)
    per_axis = lambda comm: "; ".join(f"{axis}: {ops(c)}" for axis, c in comm.items() if c)
    C, L = "torch_impl/parallel/compose.py", "jax_impl/parallel/compose_losses.py"
    rows = (
        Row("One mesh, one step per axis", f"torch, rank 0: {per_axis(mesh_comm_torch(cfg, 'explicit', 0))} "
            f"(`mesh_comm_torch`)", (
                _ex("explicit", C, "Trainer.__init__", "In torchtitan's order: tp on `mesh['tp']` …",
                    start="self.styles = apply_tp(", end="self.styles = apply_tp(", key='apply_tp('),
                _ex("explicit", C, "Trainer.__init__", "… FSDP on the data mesh (builtin: FSDP2, below) …",
                    start='if self.data == "fsdp" and self.d > 1:', end="self.fsdp = FSDP(", key='FSDP(self.module'),
                _ex("explicit", C, "Trainer.__init__", "… the pipeline on `mesh['pp']`'s group.",
                    start="self.schedule = apply_pp(", end="scale_grads=self.fsdp is None)", key='apply_pp('),
                _ex("explicit", C, "Trainer._sync", "dp: ONE flat all-reduce of the (tp-local) gradients over "
                    "data × cp.", start="elif self.grad_group", end="average_flat(grads", key='average_flat('),
                _ex("shard_map", L, "shard_map_loss.body", "One body over the whole mesh: fsdp's gathers, "
                    "then every array cast to varying once over the axes it meets (its transpose sums the "
                    "gradient over dp/cp).", start="blocks = {k: gather(", end="for k, a in rest.items()}",
                    key='gather(a[0]'),
                _ex("shard_map", L, "forward_loss", "pp inside the same body: a `ppermute` over 'pp' per "
                    "tick.", start="for t in range(M + S - 1):", end='return lax.psum('),
            )),
        Row("The builtin, the compiler, the types", f"JAX jit: {per_axis(mesh_comm_jax(cfg, 'jit'))} "
            "(`mesh_comm_jax`: XLA's choice, as measured)", (
                _ex("builtin", "torch_impl/parallel/compose_axes.py", "apply_fsdp", "FSDP2 per unit and on the root.",
                    start="for u in paths:", end="fully_shard(module, mesh=mesh,"),
                _ex("builtin", "torch_impl/parallel/compose_axes.py", "apply_pp", "`PipelineStage` on the pp group, "
                    "torch's schedule.", start="stage = PipelineStage(", end="return SCHEDULES"),
                _ex("compiled", C, "Trainer.__init__", "`compile=True`: each unit compiled after tp, before FSDP "
                    "(torchtitan's order).", start="self.compiled = compiled.compile_units(",
                    end="self.compiled = compiled.compile_units(", key="compiled.compile_units("),
                _ex("jit", "jax_impl/mesh.py", "jit_loss", "One set of constraints names every axis (the stream, the "
                    "vocabulary, the tp splits); XLA picks each axis's collectives.", start="at = lambda *spec",
                    end="ops = SimpleNamespace("),
                _ex("typed", "jax_impl/mesh_typed.py", "loss_for.gather", "fsdp in types: each parameter's gather "
                    "stated, down to its tp shard."),
            )),
    )
    return Page("mesh", "N-D parallelism on one mesh",
                "dp or fsdp × tp × pp (× cp) composed on one DeviceMesh / jax Mesh; every collective names its "
                "axis. The whole page: [docs/mesh.md](../mesh.md).",
                "the transformer, L = 4, D = 16, T = 8, V = 32, B = 8 on dp = 2 × tp = 2 × pp = 2, M = 2, float64",
                rows)


PAGES = (collectives_page, dp_page, fsdp_page, tp_page, pp_page, cp_page, ep_page, mesh_page)
