"""The planner's step time against a measured one on this GPU: the repository's own Transformer (torch,
bfloat16 parameters, SDPA's causal attention, AdamW fused; one device, no collective) trained for a few
steps at sizes where the GPU is busy, each step timed between CUDA events, beside ``compare.py plan``'s
prediction for the same model on the preset this GPU belongs to (shared/plan.py predict: its measured
GEMM table, FlashAttention's measured rate, the memory-bound ops at the measured copy bandwidth, the
optimizer). scripts/gpu_check.sh runs it; its output lands in docs/gpu/.

    python scripts/gpu_step_check.py [OUT_DIR]      # prints the table; OUT_DIR/step_check.json
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shared import efficiency, plan  # noqa: E402
from torch_impl.transformer import Transformer  # noqa: E402

# (layers, dim, heads, vocab, seq, batch of sequences): small GEMMs to large ones, short to long sequences
CONFIGS = ((8, 2048, 16, 32000, 2048, 8), (8, 4096, 32, 32000, 4096, 2), (4, 8192, 64, 32000, 8192, 1))
STEPS, WARMUP = 8, 3


def measure(layers, dim, heads, vocab, seq, batch, device) -> float:
    """Seconds per training step (forward, fp32 cross-entropy, backward, AdamW), the median of STEPS (each
    between two device synchronizations: a step is hundreds of ms, the host's launches run ahead of it)."""
    torch.manual_seed(0)
    model = Transformer(layers, dim, heads, vocab, seq, dtype=torch.bfloat16, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    times = []
    for i in range(WARMUP + STEPS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def plan_step(layers, dim, heads, vocab, seq, batch, preset: str) -> dict:
    """compare.py plan's step for this run on one GPU of ``preset``: {"step", "compute_matmul", …} seconds."""
    model = plan.Model(layers, dim, heads, vocab, seq)
    cluster = plan.Cluster.preset(preset, 1)
    return plan.predict(model, plan.Layout(microbatches=1), cluster, batch, 2, "pure", "builtin", "flash").time


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_step_check.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    preset = efficiency.preset_of(name)
    if preset is None:
        print(f"gpu_step_check.py: {name!r} matches no GPU preset", file=sys.stderr)
        return 2
    rows = []
    print(f"{name} (preset {preset}): one training step, bfloat16, AdamW; measured median of {STEPS} vs plan")
    print(f"{'L':>3} {'D':>5} {'H':>3} {'T':>5} {'B':>2}  {'measured ms':>11} {'planned ms':>10} {'plan/meas':>9}"
          "   planned: matmul / attention / elementwise / head / optimizer ms")
    for layers, dim, heads, vocab, seq, batch in CONFIGS:
        got = measure(layers, dim, heads, vocab, seq, batch, device)
        t = plan_step(layers, dim, heads, vocab, seq, batch, preset)
        parts = [t.get(k, 0.0) * 1e3 for k in ("compute_matmul", "compute_attention", "compute_elementwise",
                                                "compute_head", "optimizer")]
        rows.append({"layers": layers, "dim": dim, "heads": heads, "vocab": vocab, "seq": seq, "batch": batch,
                     "measured_s": got, "planned_s": t["step"], "planned": t})
        print(f"{layers:>3} {dim:>5} {heads:>3} {seq:>5} {batch:>2}  {got * 1e3:11.1f} {t['step'] * 1e3:10.1f} "
              f"{t['step'] / got:9.2f}   " + " / ".join(f"{x:.1f}" for x in parts))
    out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    with open(os.path.join(out, "step_check.json"), "w") as f:
        json.dump({"device": name, "preset": preset, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
