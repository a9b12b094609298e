"""Tensor parallelism (TP, Megatron-LM: Shoeybi et al. 2019, arXiv:1909.08053, §3): every weight
matrix is split over the tp ranks; every rank sees the full batch.

A TP layout is a PLAN: a small table from module path (``*`` = one path segment, as in
``parallelize_module`` and torchtitan's ``parallelize_llama``) to a parallel style, applied to any
model by one function of torch_impl/parallel/tp.py: ``apply_plan`` (explicit: sharded weights +
Megatron's f/g as module hooks, parallel/tp_ops.py) or ``apply_dtensor_plan`` (builtin:
``parallelize_module`` with ``DTENSOR_STYLES``). This runner builds the project's models, picks
their plan (TRANSFORMER_PLAN / SP_PLAN beside the transformer, ``mlp_plan`` beside the MLP) and
runs the step.
Styles (weights as nn.Linear stores them, (out, in)):

    colwise        rows of weight (output features) split; f before (identity fwd, all-reduce bwd)
    colwise_heads  colwise over whole heads: rows [q_r; k_r; v_r] of W_qkv (heads_perm reorders)
    rowwise        columns (input features) split; g after (all-reduce fwd, identity bwd)
    vocab_embed    embedding rows [r·V/tp, (r+1)·V/tp); other tokens give zero rows; g after
    colwise_vocab  the LM head: colwise, logits stay split (B, T, V/tp) for vocab_parallel_ce
    colwise_out    colwise + all-gather of the output (MLP, odd L: the last layer; bwd a slice)
    colwise_gather colwise + all-gather, no f (MLP allgather scheme: bwd reduce-scatter)
    sequence       (SP) weight replicated, runs on this rank's T/tp tokens; gradient partial
    positions      (SP) wpe: as sequence, its input (the positions) cut to this rank's T/tp first

Any model (parallel/tp.py; docs/tp.md, "Bring your own model"): ``check_plan`` refuses, before anything changes,
what ``apply_plan`` cannot do exactly (a key matching nothing, a style on a module it cannot split,
sizes not divisible by tp, part of a head on a rank, tied parameters split unlike, SP leaving a
replicated parameter unplanned) with one ``PlanError`` (what, module path, fix). Biases: colwise
splits them, rowwise adds them once after g. Vocabularies: any V (rows padded to ⌈V/tp⌉, the
head's padded logits −inf). Sibling projections reading the same input share one f (SharedEnter).

Transformer (TRANSFORMER_PLAN; norms and wpe replicated): per block 2 all-reduces of B·T·D
forward (g after attn.o, mlp.down) and 2 backward (f before attn.qkv, mlp.up); plus the embedding's
g (fwd) and the head's f (bwd), and the vocab-parallel loss's all-reduces: MAX of the row max
(B, T), SUM of (2, B, T) (target logit, Σexp; DTensor's loss_parallel: 3 of (B, T)); its backward
is local (softmax − onehot on the own vocab slice). Per step per rank: (4L+2)·B·T·D·b + 3·B·T·b
(shared.theory.tp_transformer_comm). The norm gains and wpe see
identical inputs and gradients on every rank (f/g keep the residual stream replicated): no
collective for them, and ``fixture`` asserts the ranks agree. The full logits never exist.

MLP (the CS336 lecture-8 model, ``mlp_plan``): allgather — every layer colwise_gather: L all-gathers
fwd + L−1 reduce-scatters bwd of S = B·D·b (the last gather's bwd is a slice: the loss is computed
from the same full output everywhere); megatron — colwise/rowwise pairs, ⌊L/2⌋ all-reduces fwd +
⌈L/2⌉−1 bwd (layer 0's f has nothing to reduce), odd L: colwise_out (+1 all-gather). allgather is
MLP-only: in a residual network the gradient of the gathered stream is part partial (the next
matmul) and part replicated (the residual path), which is Megatron's f, not a reduce-scatter.

builtin/dtensor: the same plan through ``parallelize_module`` (Colwise/RowwiseParallel; the head
ColwiseParallel(output_layouts=Shard(-1)) and the loss under ``loss_parallel()``); W_qkv's rows are
permuted at load time (heads_perm) so DTensor's contiguous Shard(0) gives each rank [q_r; k_r; v_r],
and un-permuted in ``fixture``. DTensor issues the same collectives, one for one.
Memory per rank: split weights /tp, replicated norms and wpe whole (tp_state_bytes).

Sequence parallelism (megatron_sp / dtensor_sp, Korthikanti et al. 2022, arXiv:2205.05198 §4.2.2;
transformer only; SP_PLAN = the same splits + "sequence" norms and "positions" wpe): between the
matmuls (embedding output, norms, residual adds) the activations are (B, T/tp, D). f becomes g =
all-gather of the sequence before each column-parallel matmul (bwd reduce-scatter), g becomes ḡ =
reduce-scatter after each row-parallel matmul and the embedding (bwd all-gather); the head's input
is gathered, the logits stay (B, T, V/tp). Per step per rank (A = B·T·D·b): (4L+2) all-gathers and
(4L+2) reduce-scatters of A (= Megatron's wire bytes), the loss's all-reduces, and one all-reduce
of the SP parameters' partial gradients ((2L+1)·D + T·D)·b (shared.theory.tp_sp_comm). Saved
activations: each norm's input, rsqrt and output /tp (theory.tp_sp_activation_saving). builtin:
torchtitan's plan (SequenceParallel norms, Colwise(input_layouts=Shard(1)), Rowwise(output_layouts=
Shard(1)), the embedding Rowwise(output_layouts=Shard(1))); wpe = SequenceParallel(sequence_dim=0)
after local_positions. DTensor leaves the SP gradients Partial: ``train`` redistributes them once.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import loss_parallel

from shared.config import Config
from shared.problem import Problem
from shared.results import Trained
from shared.theory import tp_comm_bytes
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import build_model, inputs, is_transposed, loss_fn, make_optimizer, mlp_plan, targets, to_fixture
from torch_impl.parallel.tp import SEQUENCE_STYLES, SHARD_DIM, apply_dtensor_plan, apply_plan, unshard
from torch_impl.parallel.tp_ops import VocabParallelCrossEntropy, check_replicated, heads_perm, reduce_sequence_grads
from torch_impl.transformer import SP_PLAN, TRANSFORMER_PLAN

VARIANTS = (("explicit", "allgather"), ("explicit", "megatron"), ("builtin", "dtensor"),
            ("explicit", "megatron_sp"), ("builtin", "dtensor_sp"))
SP_VARIANTS = ("megatron_sp", "dtensor_sp")  # sequence parallel: the transformer only


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    """allgather is MLP-only (see the module docstring); sequence parallelism transformer-only."""
    drop = SP_VARIANTS if cfg.model == "mlp" else ("allgather",)
    return tuple(v for v in VARIANTS if v[1] not in drop)


def plan_for(cfg: Config, variant: str) -> dict[str, str]:
    if cfg.model == "mlp":
        return mlp_plan(cfg.layers, variant)
    return SP_PLAN if variant in SP_VARIANTS else TRANSFORMER_PLAN


# --- training ------------------------------------------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    if (style, variant) not in variants(cfg):
        raise ValueError(f"tp: unknown variant {style}/{variant} for the {cfg.model}; choose from {variants(cfg)}")
    cfg.check("tp")
    n, group, transformer, sp = ctx.world_size, ctx.group, cfg.model == "transformer", variant in SP_VARIANTS
    plan = plan_for(cfg, variant)
    model = build_model(cfg, problem, ctx.device)
    x, y = inputs(cfg, problem, ctx.device), targets(cfg, problem, ctx.device)  # full batch on every rank
    if style == "explicit":
        styles = apply_plan(model, plan, group, sp)
        loss_of = (lambda out: VocabParallelCrossEntropy.apply(out, y, group)) if transformer else loss_fn
        parallel_loss = contextlib.nullcontext
        full = lambda t, name: unshard(t, styles[name], group) if name in split else t
    else:
        styles = apply_dtensor_plan(model, plan, init_device_mesh(ctx.device.type, (n,), mesh_dim_names=("tp",)), sp)
        loss_of = lambda out: loss_fn(out, y)
        parallel_loss = loss_parallel if transformer else contextlib.nullcontext  # CE over Shard(-1) logits

        def full(t, name):  # DTensor -> all-gather; un-permute W_qkv's rows
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            return t[torch.argsort(heads_perm(t.shape[0], n, t.device))] if styles.get(name) == "colwise_heads" else t

    split = {k: s for k, s in styles.items() if s not in SEQUENCE_STYLES}  # the rest: replicated
    names = [name for name, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    partial = [p for name, p in zip(names, params, strict=True) if styles.get(name) in SEQUENCE_STYLES]
    for name, p in zip(names, params, strict=True):  # rank code: local shapes
        expect = list(problem.params[name].shape[::-1] if is_transposed(model, name) else problem.params[name].shape)
        if name in split:
            expect[SHARD_DIM[styles[name]]] //= n  # e.g. attn.qkv (3D/tp, D), mlp.down (D, 4D/tp), wte (V/tp, D)
        assert list((p.to_local() if hasattr(p, "to_local") else p).shape) == expect, (name, p.shape, expect)
    opt = make_optimizer(params, cfg)

    def forward_backward():
        opt.zero_grad(set_to_none=True)
        with parallel_loss():
            loss = loss_of(model(x))  # logits (B, T, V/tp) stay split; MLP: the full (B, D) output
            loss.backward()
        if partial and style == "explicit":
            reduce_sequence_grads(partial, group)
        elif partial:  # DTensor leaves their .grad Partial(sum): reduce once (else every AdamW op that
            for p in partial:  # reads it all-reduces it again: 3 times per parameter per step)
                p.grad = p.grad.redistribute(placements=[Replicate()])
        return loss.to_local() if hasattr(loss, "to_local") else loss  # replicated on every rank

    def fixture(tensors):
        out = []
        for name, t in zip(names, tensors, strict=True):
            if name not in split:
                check_replicated(t.to_local() if hasattr(t, "to_local") else t, name, group)
            out.append(to_fixture(model, name, full(t, name)))
        return out

    return train_loop(cfg, ctx, Setup(
        forward_backward=forward_backward, update=opt.step, grads=lambda: [p.grad for p in params],
        fixture=fixture, params=params, optimizer=opt, loss_reduction="same", group=group,
        comm_theory=tp_comm_bytes(cfg, variant),
        extra={"plan": plan, "backend": ctx.backend}))
