"""A check of the planner's GEMM size table on a GPU: the bfloat16 GEMMs that published runs' models really
issue (each in its three places: Y = X·W, dX = dY·Wᵀ, dW = Xᵀ·dY), timed as ``compare.py bench`` times its
grid (a CUDA graph of 10 products between two events), against the grid's prediction for their smallest
side. scripts/gpu_check.sh runs it after bench; docs/gpu/h100_real_shapes.txt is its output on an H100.

    python scripts/gpu_shapes.py [OUT_DIR]      # prints the table; OUT_DIR/real_shapes.json (default $OUT, .)
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from parallel_twins.bench import _graph_seconds  # noqa: E402

# (m tokens, n out, k in) of one rank: Llama 3 405B at tp = 8 (D 16 384, 8 K/V heads of 128, SwiGLU 53 248)
# and T = 8192; Megatron's GPT 530B at tp = 8 (D 20 480, MLP 4·D) and T = 2048; Llama 3 70B at tp = 4
SHAPES = {"llama405b tp8 qkv": (8192, 2304, 16384), "llama405b tp8 o": (8192, 16384, 2048),
          "llama405b tp8 w13": (8192, 13312, 16384), "llama405b tp8 w2": (8192, 16384, 6656),
          "gpt530b tp8 qkv": (2048, 7680, 20480), "gpt530b tp8 o": (2048, 20480, 2560),
          "gpt530b tp8 fc1": (2048, 10240, 20480), "gpt530b tp8 fc2": (2048, 20480, 10240),
          "llama70b tp4 w13": (8192, 14336, 8192)}


def places(m: int, n: int, k: int, device) -> dict[str, float]:
    """FLOP/s of the forward and both backward products of a (m×k)·(k×n) layer."""
    out = {}
    for tag, (a, b, c) in (("fwd", (m, n, k)), ("dX", (m, k, n)), ("dW", (k, n, m))):
        x = torch.randn(a, c, dtype=torch.bfloat16, device=device)
        w = torch.randn(c, b, dtype=torch.bfloat16, device=device)
        out[tag] = 2 * a * b * c / _graph_seconds(lambda x=x, w=w: x @ w, 10, device)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_shapes.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    device, res = torch.device("cuda"), {}
    for name, (m, n, k) in SHAPES.items():
        r = res[name] = places(m, n, k, device)
        step = 3 * 2 * m * n * k / sum(2 * m * n * k / x for x in r.values())  # the three in sequence
        print(f"{name:20s} {m}x{n}x{k}: " + " ".join(f"{t} {v / 1e12:.0f}" for t, v in r.items()) +
              f"  step-mean {step / 1e12:.0f} TFLOP/s")
    out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    with open(os.path.join(out, "real_shapes.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
