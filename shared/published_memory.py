"""Published memory readings against the planner's memory per GPU (``plan.predict``'s fullest stage): the
other half of "layouts that published runs used are predicted to fit". Every reading is the paper's.

torchtitan (Liang et al. 2024, arXiv:2410.06511; the repository's docs/performance.md at commit 9dec370,
2024-12-26): Llama 3.1 on H100s, "Memory(GiB)" the maximum over all GPUs of a stable reading (torch's
peak reserved), full activation checkpointing, FSDP2 (reduce in fp32: mixed-fp32-grads), torch.compile and
Float8 linears (not modelled: the planner counts bf16 activations and weights); Table 2 (8B, 8 GPUs,
local batch 1), Table 4 (70B, FSDP 32 × TP 8, local batch 16), Table 5 (405B, FSDP 8 × TP 8 × PP 8, 1F1B,
local batch 32) and Table 6 (405B, TP 8 × PP 8, local batch 8, 1F1B). PP micro-batches are not published:
torchtitan's default then, one per stage (M = 8); 126 layers on 8 stages: one fewer on the first and the
last (trim = 1, as Llama 3). Left out: "FSDP 1, CP 8" (FSDP sharded over the cp ranks alone: the
planner's ZeRO-3 needs a data axis), the interleaved rows (v not published).

The planner's memory is a lower bound of these readings: they include the loss' transient copies of the
logits (bf16 head output, its fp32 upcast and the fp32 log-softmax: 10 bytes per logit at the forward's
peak, where the planner keeps 6: the head's output and the fp32 softmax), FSDP2's unsharded gradients
under PP, Float8's casts, and what the allocator reserves beyond what is live.
"""

from __future__ import annotations

from dataclasses import replace

from shared.published import PRESETS

_8B, _70B, _405B = PRESETS["llama3-8b"], PRESETS["llama3-70b"], PRESETS["llama3-405b"]

# (name, model, layout axes, GPUs, global batch, micro-batches, reported GiB)
TORCHTITAN_MEMORY = (
    ("torchtitan 8B fsdp=8 T=32768 8 H100", replace(_8B, seq=32768), {"dp": 8}, 8, 8, 1, 83.9),
    ("torchtitan 8B fsdp=4 cp=2 T=65536 8 H100", replace(_8B, seq=65536), {"dp": 4, "cp": 2}, 8, 4, 1, 84.2),
    ("torchtitan 8B fsdp=2 cp=4 T=131072 8 H100", replace(_8B, seq=131072), {"dp": 2, "cp": 4}, 8, 2, 1, 84.0),
    ("torchtitan 70B fsdp=32 tp=8 256 H100", _70B, {"dp": 32, "tp": 8, "sp": True}, 256, 512, 1, 71.9),
    ("torchtitan 405B fsdp=8 tp=8 pp=8 512 H100", _405B, {"dp": 8, "tp": 8, "pp": 8, "sp": True, "trim": 1}, 512,
     256, 8, 82.5),
    ("torchtitan 405B fsdp=8 tp=8 pp=8 T=32768 512 H100", replace(_405B, seq=32768),
     {"dp": 8, "tp": 8, "pp": 8, "sp": True, "trim": 1}, 512, 64, 8, 75.3),
    ("torchtitan 405B fsdp=4 cp=2 tp=8 pp=8 T=65536 512 H100", replace(_405B, seq=65536),
     {"dp": 4, "cp": 2, "tp": 8, "pp": 8, "sp": True, "trim": 1}, 512, 32, 8, 75.9),
    ("torchtitan 405B fsdp=2 cp=4 tp=8 pp=8 T=131072 512 H100", replace(_405B, seq=131072),
     {"dp": 2, "cp": 4, "tp": 8, "pp": 8, "sp": True, "trim": 1}, 512, 16, 8, 77.1),
)


def memory_rows() -> list[dict]:
    """TORCHTITAN_MEMORY predicted: {name, reported GiB, predicted GiB, ratio, memory (by part)}."""
    from shared import plan

    rows = []
    for name, model, axes, gpus, batch, micro, reported in TORCHTITAN_MEMORY:
        lay = plan.Layout(**axes, zero=3, recompute="full", microbatches=micro)
        why = plan.invalid(model, lay, batch)
        if why:
            raise ValueError(f"{name}: {why}")
        pred = plan.predict(model, lay, plan.Cluster.preset("h100", gpus), batch, precision="mixed-fp32-grads",
                            time_if_over=False)
        got = pred.memory["total"] / 2 ** 30
        rows.append({"name": name, "reported": reported, "predicted": got, "ratio": got / reported,
                     "memory": pred.memory})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| run | reported GiB | predicted GiB | predicted / reported | params / grads / optimizer / activations "
             "/ gathered weights GiB |", "|---|---|---|---|---|"]
    for r in rows:
        parts = " / ".join(f"{r['memory'][k] / 2 ** 30:.1f}" for k in ("params", "grads", "optimizer",
                                                                       "activations", "buffers"))
        lines.append(f"| {r['name']} | {r['reported']:.1f} | {r['predicted']:.1f} | {r['ratio']:.2f} | {parts} |")
    return "\n".join(lines)
