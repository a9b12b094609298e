"""``python compare.py doctor``: the one command for whoever first has a GPU node.

Prints what the node has and what a GPU run would use, then runs the smallest real checks, and
says what to send back. Order matters: JAX's GPU backend starts in its own process, before any
torch import there, and torch's checks run in another (each framework loads its CUDA libraries
alone: jax-ml/jax#18032). Exit 0 when every check passed, 1 when one failed.

    versions (python, torch, jax, jaxlib, the CUDA plugin), CUDA majors (torch's build, JAX's plugin,
    the nvidia-* wheels installed), the devices torch and JAX see, the NCCL version, float32 / TF32
    settings in force; then compare.py at world size 1 and N (every GPU) on NCCL, and JAX on the GPUs: every
    collective and dp and tp on the tiny MLP (SMALL; the whole table: python compare.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

from parallel_twins.args import prog

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding parallel_twins, jax_impl

_TORCH_PROBE = r"""
import json, torch
out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    out["capability"] = [".".join(map(str, torch.cuda.get_device_capability(i)))
                         for i in range(torch.cuda.device_count())]
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:
        out["nccl"] = f"unavailable: {e}"
    out["cudnn"] = torch.backends.cudnn.version()
from torch_impl.launch import set_float32_ieee
set_float32_ieee()
out["matmul_fp32_precision"] = torch.backends.cuda.matmul.fp32_precision
out["cudnn_allow_tf32_readable"] = str(torch.backends.cudnn.allow_tf32)
print("DOCTOR" + json.dumps(out))
"""

_JAX_PROBE = r"""
import json, os
os.environ.pop("JAX_PLATFORMS", None)
import jax
out = {"jax": jax.__version__, "default_backend": jax.default_backend(),
       "devices": [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}" for d in jax.devices()]}
from jax._src import xla_bridge
errors = getattr(xla_bridge, "_backend_errors", {})
out["backend_errors"] = {k: " ".join(str(v).split())[:300] for k, v in errors.items() if k in ("cuda", "rocm")}
import jax_impl  # noqa: F401 - the project's float32 settings, as a run has them
out["default_matmul_precision"] = str(jax.config.jax_default_matmul_precision)
try:
    out["platform_version"] = jax.devices()[0].client.platform_version
except Exception:
    pass
print("DOCTOR" + json.dumps(out))
"""


def _probe(code: str, timeout: float = 300) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("DOCTOR"):
            return json.loads(line[len("DOCTOR"):])
    return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}


def cuda_packages() -> dict[str, str]:
    """The installed CUDA wheels (nvidia-*, cuda-*, jax-cuda*): name -> version."""
    out = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("nvidia-", "cuda-", "jax-cuda")):
            out[name] = dist.version
    return dict(sorted(out.items()))


def _majors(pkgs: dict[str, str]) -> list[str]:
    import re

    found = set()
    for name, version in pkgs.items():
        if m := re.search(r"(?:-cu|jax-cuda)(\d+)", name):
            found.add(m.group(1))
        elif name in ("cuda-toolkit", "nvidia-cuda-runtime"):
            found.add(version.split(".")[0])
    return sorted(found)


def _run(title: str, argv: list[str], timeout: float = 900) -> bool:
    print(f"\n== {title}: python compare.py {' '.join(argv)}", flush=True)
    out = subprocess.run([sys.executable, "-m", "parallel_twins.cli", *argv], cwd=HERE, text=True, timeout=timeout,
                         capture_output=True)
    tail = (out.stdout + out.stderr).strip().splitlines()[-6:]
    print("\n".join("   " + line for line in tail))
    print(f"   -> exit {out.returncode}")
    return out.returncode == 0


SMALL = ["--size", "tiny", "--model", "mlp", "--patterns", "collectives,dp,tp"]  # doctor's runs


def doctor_main(argv: list[str]) -> int:
    from parallel_twins.args import ArgumentError, Parser

    p = Parser(prog=f"{prog()} doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--probe-only", action="store_true", help="print versions and devices, run nothing")
    try:
        args = p.parse_args(argv)
    except ArgumentError as exc:  # one line, exit 2, as every other subcommand
        print(f"{prog()} doctor: error: {exc}", file=sys.stderr)
        return 2
    print(f"python {sys.version.split()[0]} on {sys.platform}")
    jx = _probe(_JAX_PROBE)  # JAX first, alone: its GPU backend starts before any torch import
    th = _probe(_TORCH_PROBE)
    pkgs = cuda_packages()
    print("jax:", json.dumps(jx, indent=1))
    print("torch:", json.dumps(th, indent=1))
    print("CUDA wheels:", ", ".join(f"{k} {v}" for k, v in pkgs.items()) or "none")
    majors = _majors(pkgs)
    print("CUDA majors among the wheels:", ", ".join(majors) or "none",
          "(one expected)" if len(majors) <= 1 else "(MIXED: two CUDA stacks, see docs/gpu.md)")
    n = len(th.get("devices", []))
    ok = True
    if not args.probe_only:
        if n == 0:
            print("\nno GPU visible to torch: the GPU runs are skipped")
        else:
            # the smallest real checks (issue 46: doctor <= 30 s on a GPU node): every collective, and dp and tp
            # on the tiny MLP — a handful of programs to compile, not compare.py's 125 runs at GPU sizes
            common = ["--steps", "3", "--quiet", *SMALL]
            ok &= _run("torch, world size 1, NCCL", ["--device", "gpu", "--frameworks", "torch", "--world-size", "1",
                                                     "--dtype", "float32", *common])
            if n > 1:
                ok &= _run(f"torch, world size {n}, NCCL", ["--device", "gpu", "--frameworks", "torch",
                                                           "--world-size", str(n), "--dtype", "float32", *common])
        if not any(d.startswith("gpu") for d in jx.get("devices", [])):
            print("\nJAX sees no GPU:", jx.get("backend_errors") or jx.get("error") or "no CUDA plugin")
            ok = False if n else ok
        else:
            k = sum(d.startswith("gpu") for d in jx["devices"])
            ok &= _run(f"JAX on {k} GPU(s)", ["--device", "gpu", "--frameworks", "jax", "--world-size", str(k),
                                              "--dtype", "float32", "--steps", "3", "--quiet", *SMALL])
    if n >= 1:  # what this node achieves, as the table compare.py plan --profile reads (docs/plan.md; one GPU:
        #         its GEMMs, FlashAttention and copy, the links its preset cites)
        print(f"\nfor the planner: python compare.py bench --frameworks torch --device gpu --world-size {n} "
              "--profile profile.json, then python compare.py plan --profile profile.json ...")
    print("\nsend back: everything above (or python compare.py doctor > doctor.txt 2>&1), plus "
          "`nvidia-smi` and `pip list | grep -i -e nvidia -e cuda -e jax -e torch`")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(doctor_main(sys.argv[1:]))
