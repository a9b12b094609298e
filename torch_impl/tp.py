"""Tensor parallelism (TP) with torch.distributed, the runner: every weight matrix split over the tp
ranks; every rank sees the full batch.

A TP layout is a PLAN (module path -> style) applied by torch_impl/parallel/tp.py: ``apply_plan``
(explicit: shards + Megatron's f/g as hooks, parallel/tp_ops.py) or ``apply_dtensor_plan`` (builtin:
``parallelize_module``). This runner picks the project's plans (TRANSFORMER_PLAN, SP_PLAN, ``mlp_plan``).

Sharded (transformer): attention by whole heads (W_qkv colwise_heads, W_o rowwise), W_up colwise,
W_down rowwise, the embedding and head by vocabulary rows; norms and wpe replicated.
Collectives: f (identity fwd, all-reduce bwd) before each column-parallel matmul, g (all-reduce fwd,
identity bwd) after each row-parallel one and the embedding; the vocab-parallel loss all-reduces a
MAX of (B, T) and a SUM of (2, B, T) (DTensor's loss_parallel: 3 of (B, T)); its backward is local.
Bytes per step per rank: (4L+2)·B·T·D·b + 3·B·T·b (shared.theory.tp_transformer_comm).
MLP (CS336 lecture 8): allgather (every layer colwise + all-gather; MLP only) or megatron
(colwise/rowwise pairs) (shared.theory.tp_comm_bytes).

Sequence parallelism (megatron_sp / dtensor_sp; transformer only): between the matmuls the stream is
(B, T/tp, D); f becomes an all-gather of the sequence (bwd reduce-scatter), g a reduce-scatter (bwd
all-gather): (4L+2) of each of B·T·D·b (Megatron's wire bytes), the loss's, and one all-reduce of
the SP parameters' partial gradients (shared.theory.tp_sp_comm). Norm activations saved /tp.
builtin/dtensor issues the same collectives. docs/tp.md has the styles, the refusals and the plans.
compiled/dtensor(_sp), compiled/megatron(_sp): the same plans with each block compiled (torch_impl/compiled.py).
Mixed precision (--precision mixed): float32 shards and AdamW state, the step under autocast; the g's
after W_o / W_down move their bf16 outputs (2 bytes), the rest float32 (tp_comm_bytes(autocast=True)).
float16: the same with dynamic loss scaling (torch_impl/recipe.loss_scaler), + one 4-byte all-reduce.
The recipe (--clip, --accumulate, --schedule, --decay-mask, --freeze; torch_impl/recipe.py): frozen
parameters before the plan; tp.clip_grad_norm_ (explicit: one scalar all-reduce; DTensor: torch's norm,
one b-byte norm per parameter all-reduced); K parts of the whole batch's rows (no reduction to skip).
Papers: Megatron-LM, Shoeybi et al. 2019 (arXiv:1909.08053 §3); sequence parallelism, Korthikanti
et al. 2022 (arXiv:2205.05198 §4.2.2).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import loss_parallel

from shared.config import Config
from shared.problem import Problem, param_names
from shared.results import Trained
from shared.theory import tp_comm_bytes
from torch_impl import compiled, recipe
from torch_impl.harness import Setup, train_loop
from torch_impl.launch import RankContext
from torch_impl.model import build_model, inputs, is_transposed, loss_fn, mlp_plan, targets, to_fixture
from torch_impl.parallel.tp import SEQUENCE_STYLES, SHARD_DIM, apply_dtensor_plan, apply_plan, clip_grad_norm_, unshard
from torch_impl.parallel.tp_ops import VocabParallelCrossEntropy, check_replicated, heads_perm, reduce_sequence_grads
from torch_impl.transformer import SP_PLAN, TRANSFORMER_PLAN

VARIANTS = (("explicit", "allgather"), ("explicit", "megatron"), ("builtin", "dtensor"),
            ("explicit", "megatron_sp"), ("builtin", "dtensor_sp"))
SP_VARIANTS = ("megatron_sp", "dtensor_sp")  # sequence parallel: the transformer only
# The compiled style (torch_impl/compiled.py): the DTensor plans and the hand-written Megatron steps with each
# block compiled (their tp collectives become functional collectives inside the compiled programs).
COMPILED = (("compiled", "dtensor"), ("compiled", "dtensor_sp"), ("compiled", "megatron"), ("compiled", "megatron_sp"))


def variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    """allgather is MLP-only (see the module docstring); sequence parallelism transformer-only."""
    drop = SP_VARIANTS if cfg.model == "mlp" else ("allgather",)
    return tuple(v for v in VARIANTS if v[1] not in drop)


def compiled_variants(cfg: Config) -> tuple[tuple[str, str], ...]:
    return tuple(v for v in COMPILED if cfg.model == "transformer" or v[1] not in SP_VARIANTS)


def plan_for(cfg: Config, variant: str) -> dict[str, str]:
    if cfg.model == "mlp":
        return mlp_plan(cfg.layers, variant)
    return SP_PLAN if variant in SP_VARIANTS else TRANSFORMER_PLAN


def comm_theory(cfg: Config, style: str, variant: str) -> int | None:
    """shared.theory's bytes per step per rank (mixed: autocast's bf16 g's) + float16's flag + the norm's
    all-reduce (explicit: one scalar; DTensor: below). --accumulate K: the same bytes (each
    micro-batch's f / g / loss reductions move B/K of the rows). --freeze: None (a frozen stretch of the
    model drops the f's that no trainable gradient needs). DTensor: torch's clip_grad_norm_ over the
    DTensors all-reduces every parameter's norm once (b bytes each; in 3 all-reduces under dtensor, 8 under
    dtensor_sp at L=2 on 2 ranks, 3 and 12 at L=4 on 4: DTensor groups the placements; measured)."""
    if cfg.freeze:
        return None
    base = tp_comm_bytes(cfg, variant, autocast=True) + recipe.scaler_bytes(cfg)
    return base + recipe.clip_bytes(cfg, groups=len(param_names(cfg)) if style == "builtin" else 1)


# --- training ------------------------------------------------------------------------------------


def train(cfg: Config, problem: Problem, style: str, variant: str, ctx: RankContext) -> Trained:
    every = variants(cfg) + compiled_variants(cfg)
    if (style, variant) not in every:
        raise ValueError(f"tp: unknown variant {style}/{variant} for the {cfg.model}; choose from {every}")
    cfg.check("tp", "torch")
    n, group, transformer, sp = ctx.world_size, ctx.group, cfg.model == "transformer", variant in SP_VARIANTS
    plan = plan_for(cfg, variant)
    if style == "compiled":
        compiled.begin(ctx.device.type)
    model = build_model(cfg, problem, ctx.device)
    x, y = inputs(cfg, problem, ctx.device), targets(cfg, problem, ctx.device)  # full batch on every rank
    recipe.freeze_(model, cfg)  # before the plan: the shards / DTensors keep requires_grad=False
    kind = "explicit" if variant.startswith(("megatron", "allgather")) else "builtin"  # compiled: either plan
    if kind == "explicit":
        styles = apply_plan(model, plan, group, sp)
        loss_of = (lambda out, ys: VocabParallelCrossEntropy.apply(out, ys, group)) if transformer else loss_fn
        parallel_loss = contextlib.nullcontext
        full = lambda t, name: unshard(t, styles[name], group) if name in split else t
    else:
        # compiled: the unplanned parameters stay plain tensors (replicate_rest's hooks swap a module's parameters
        # on every call, a guard that fails on every later step)
        styles = apply_dtensor_plan(model, plan, init_device_mesh(ctx.device.type, (n,), mesh_dim_names=("tp",)), sp,
                                    replicate_rest=style != "compiled")
        loss_of = loss_fn
        parallel_loss = loss_parallel if transformer else contextlib.nullcontext  # CE over Shard(-1) logits

        def full(t, name):  # DTensor -> all-gather; un-permute W_qkv's rows
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            return t[torch.argsort(heads_perm(t.shape[0], n, t.device))] if styles.get(name) == "colwise_heads" else t

    units = compiled.compile_units(model, compiled.units(cfg)) if style == "compiled" else None  # after the plan
    split = {k: s for k, s in styles.items() if s not in SEQUENCE_STYLES}  # the rest: replicated
    names = [name for name, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    partial = [p for name, p in zip(names, params, strict=True) if styles.get(name) in SEQUENCE_STYLES]
    for name, p in zip(names, params, strict=True):  # rank code: local shapes
        expect = list(problem.params[name].shape[::-1] if is_transposed(model, name) else problem.params[name].shape)
        if name in split:
            expect[SHARD_DIM[styles[name]]] //= n  # e.g. attn.qkv (3D/tp, D), mlp.down (D, 4D/tp), wte (V/tp, D)
        assert list((p.to_local() if hasattr(p, "to_local") else p).shape) == expect, (name, p.shape, expect)
    opt = recipe.optimizer(model.named_parameters(), cfg)  # --decay-mask: shards / DTensors keep their dims
    scaler = recipe.loss_scaler(cfg, group)  # float16: loss scaling, the skip agreed over tp (4 bytes)

    def forward_backward():
        opt.zero_grad(set_to_none=True)
        with parallel_loss():  # logits (B, T, V/tp) stay split; MLP: the full (B, D) output
            # --accumulate K: K parts of the whole batch's rows, loss / K each (tp reduces no gradient to skip)
            loss = recipe.accumulate(cfg, x, y, lambda xs, ys: loss_of(model(xs), ys), scaler=scaler)
        if partial and kind == "explicit":
            reduce_sequence_grads(partial, group)
        elif partial:  # DTensor leaves their .grad Partial(sum): reduce once (else every AdamW op that
            for p in partial:  # reads it all-reduces it again: 3 times per parameter per step)
                if p.grad is not None:  # --freeze: a frozen SP gain has none
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
        forward_backward=forward_backward, grads=lambda: [p.grad for p in params],
        # float16: unscale, skip; --clip: the global norm (explicit: split squares summed over tp, one scalar
        # all-reduce; DTensor: torch's norm over the DTensors); AdamW; the schedule
        update=recipe.stepper(opt, cfg, lambda c: clip_grad_norm_(model, c, group), scaler=scaler),
        fixture=fixture, params=params, optimizer=opt, loss_reduction="same", group=group,
        comm_theory=comm_theory(cfg, kind, variant),
        extra={"plan": plan, "backend": ctx.backend}, scaler=scaler, compiled=units))
