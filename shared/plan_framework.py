"""What a training framework sends and waits for beyond the bytes this repository's runs send
(``compare.py plan --framework``): the planner's step model per framework, each difference cited to the
framework's source. shared/theory counts what the repository's torch runs send (the ledgers); a published
run was trained by another framework, whose collectives differ in three places the planner models:

  torchtitan  (the default) what the repository's DTensor runs do: sequence parallelism's all-gather is
              autograd's, its gathered output kept for the backward; pipeline sends posted together with
              the receives (torch.distributed.pipelining's batched P2P ops), a stage's receive not on its
              critical path.
  megatron    Megatron-LM's sequence parallelism keeps the *sharded* input of each column-parallel linear
              and all-gathers it again in the backward for the weight gradient (megatron/core/
              tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication.backward: an async
              all-gather into a global buffer, "scheduled before the input gradient computation" and waited
              on before the weight gradient): two more all-gathers of the block's input per block and
              micro-batch (before W_qkv and the MLP's first matrix). Megatron overlaps it with the input
              gradient's GEMM, as it does its backward tp all-reduce; the planner credits neither (tp traffic
              on the critical path, ``tp_overlap`` off), and so reproduces Table 4's layer times (docs/plan.md).
              Korthikanti et al. 2022 (arXiv:2205.05198) measure sp's gain on one 22B layer at 3 % (their
              Table 4: 19.6 → 19.0 ms); without the re-gather the planner put it at 10 %.
  deepspeed   DeepSpeed's pipeline engine (deepspeed/runtime/pipe/): TrainSchedule.steps() issues a
              stage's SendGrad then RecvActivation before a forward and RecvGrad then SendActivation
              before a backward, each a blocking p2p.send / p2p.recv (one after the other, never batched):
              a stage's receives wait on its critical path as its sends do (a discrete-event run of that
              schedule with blocking pairs costs ≈ 4 transfers per micro-batch, the planner's default 2).
              With tensor parallelism its sends are partitioned (the pipeline config's defaults
              pipe_partitioned = grad_partitioned = True, deepspeed/runtime/config.py: 1/t of the
              activation per rank, all-gathered over tp on arrival: the planner's ``pp_scatter``), and a
              stage keeps only its 1/t of the output it sent, all-gathering it again before that
              micro-batch's backward (PipelineEngine._exec_backward_pass: "Reconstruct if we previously
              partitioned the output"): one more tp all-gather of A per micro-batch on every stage but the last.
              Under bf16 its BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py, added with bf16 + pipeline
              parallelism in DeepSpeed PR #1801, 2022) accumulates fp32 gradients and the engine all-reduces
              them whole after the pipeline flush (PipelineEngine._exec_reduce_grads → _bf16_reduce_grads →
              buffered_allreduce_fallback over the fp32 flat buffers; ZeRO-1 then shards only the update):
              an all-reduce of 4 bytes per gradient element where ZeRO-1's reduce-scatter sends half as much;
              the tied embedding's gradient all-reduced between the first and last stage is the fp32 one too
              (_exec_reduce_tied_grads: weight._hp_grad). And after every micro-batch's backward on every stage
              but the last, the bf16 gradients are added into the fp32 ones (PipelineEngine._exec_backward_pass
              → BF16_Optimizer.update_hp_grads: hp_grad.add_(lp.grad.to(float32)) per parameter, two
              memory-bound kernels: 2 + 4 bytes for the cast, 4 + 4 + 4 for the add = 18 bytes per element).
"""

from __future__ import annotations

from shared.theory.layout import Layout, Model
from shared.theory.mesh import stage_params

FRAMEWORKS = ("torchtitan", "megatron", "deepspeed")


def check(framework: str) -> str:
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
    return framework


def framework_view(view: dict, model: Model, layout: Layout, stage: int, batch: int, b: int, framework: str,
                   precision: str) -> dict:
    """``view`` (plan.comm of ``stage``) with what ``framework`` sends beyond it (see the module's docstring)."""
    out = {label: dict(ops) for label, ops in view.items()}
    if framework == "megatron" and layout.sp and "tp" in out:
        M = layout.microbatches
        act = batch // (layout.dp * M) * (model.seq // layout.cp) * model.dim * b
        extra = 2 * stage_params(model, layout, stage)["per"] * M
        cnt, nb = out["tp"].get("all_gather", (0, 0))
        out["tp"]["all_gather"] = (cnt + extra, nb + extra * act)
    if framework == "deepspeed" and layout.pp_scatter and layout.tp > 1 and stage < layout.pp - 1 and "tp" in out:
        M = layout.microbatches
        act = batch // (layout.dp * M) * (model.seq // layout.cp) * model.dim * b
        cnt, nb = out["tp"].get("all_gather", (0, 0))
        out["tp"]["all_gather"] = (cnt + M, nb + M * act)
    if framework == "deepspeed" and precision == "mixed-fp32-grads":
        label = layout.grad_label or layout.data_axis
        ops = out.get(label, {})
        if "all_reduce" in out.get("pp", {}):  # the tied embedding's fp32 gradient
            cnt, nb = out["pp"]["all_reduce"]
            out["pp"]["all_reduce"] = (cnt, 2 * nb)
        if layout.zero == 1 and "reduce_scatter" in ops:  # the fp32 gradients all-reduced whole (2 × 2 bytes
            cnt, nb = ops.pop("reduce_scatter")  # of bf16 the ledgers count: plan.fp32_grads doubles it)
            ops["all_reduce"] = (cnt, nb)
    return out


def critical_recv(framework: str, label: str) -> bool:
    """Whether a receive on axis ``label`` waits on the critical path (DeepSpeed's blocking pipeline recv)."""
    return framework == "deepspeed" and label == "pp"


ACCUMULATE_BYTES = 18  # DeepSpeed's update_hp_grads per element: cast (read 2, write 4), add (read 4 + 4, write 4)


def accumulate_seconds(model: Model, layout: Layout, stage: int, framework: str, precision: str,
                       hbm: float) -> float:
    """Seconds per micro-batch that ``framework`` spends outside the model on ``stage``: DeepSpeed's bf16
    pipeline adds each micro-batch's bf16 gradients into fp32 ones on every stage but the last
    (ACCUMULATE_BYTES per element of the stage's parameters on one rank, at ``hbm`` bytes/s)."""
    if framework != "deepspeed" or precision != "mixed-fp32-grads" or stage == layout.pp - 1:
        return 0.0
    sp = stage_params(model, layout, stage)
    return ACCUMULATE_BYTES * (sp["units"] + sp["vectors"]) / hbm
