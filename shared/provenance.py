"""What produced a result file: the provenance block every ``--json`` (and ``--markdown``) output carries.

    block = provenance(argv=sys.argv, world_size=4, layout={"frameworks": ["torch", "jax"], ...})
    data = stamp({"config": ..., "runs": ...}, block)     # {"schema_version": 1, "provenance": block, ...}
    text = provenance_markdown(block)                     # the same block as a Markdown list

Read without importing a framework (stdlib only): package versions from ``importlib.metadata`` (torch's
CUDA and cuDNN from its own ``torch/version.py`` text, never ``import torch``), the CPU model from
/proc/cpuinfo, GPUs and driver from ``nvidia-smi`` when it is on PATH, CUDA / NCCL / cuDNN from the
``nvidia-*`` wheels, the project's commit and dirty flag from ``git`` (None outside a checkout), with
short timeouts so that a hung tool never holds a run back. docs/results-schema.json describes it.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata

SCHEMA_VERSION = 1  # docs/results-schema.json's "version"; raise it when a field changes meaning or goes
PACKAGES = ("torch", "jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project's checkout


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _run(argv: list[str], timeout: float = 3.0) -> str | None:
    """stdout of a short command, stripped; None when it is missing, fails or hangs."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str | None:
    """/proc/cpuinfo's "model name" (Linux), else platform.processor() (None when empty)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def gpus() -> dict | None:
    """{"names": [...], "driver": "550.54"} from nvidia-smi, or None without one (CPU machines)."""
    if not shutil.which("nvidia-smi"):
        return None
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], timeout=10.0)
    if not out:
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    return {"names": [r[0] for r in rows], "driver": rows[0][1] if len(rows[0]) > 1 else None}


def _torch_build() -> dict:
    """torch's CUDA and cuDNN build versions, read from torch/version.py's text (no ``import torch``)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {}
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for key in ("cuda", "hip"):
        m = re.search(rf"^{key}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        out[f"torch_{key}"] = m.group(1) if m else None
    return out


def cuda_stack() -> dict:
    """CUDA, NCCL and cuDNN as installed wheels say (None where absent), and torch's CUDA build."""
    wheels = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("nvidia-", "jax-cuda")):
            wheels[name] = dist.version
    pick = lambda prefix: next((v for k, v in sorted(wheels.items()) if k.startswith(prefix)), None)
    return {"cuda_runtime": pick("nvidia-cuda-runtime"), "nccl": pick("nvidia-nccl"),
            "cudnn": pick("nvidia-cudnn"), "jax_cuda_plugin": pick("jax-cuda"), **_torch_build()}


def git_state() -> dict:
    """{"commit": sha, "dirty": bool} of the project's checkout; both None outside one (or without git)."""
    sha = _run(["git", "-C", ROOT, "rev-parse", "HEAD"]) if shutil.which("git") else None
    if not sha:
        return {"commit": None, "dirty": None}
    status = _run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"])
    return {"commit": sha, "dirty": None if status is None else bool(status)}


def provenance(argv: list[str] | None = None, world_size: int | None = None, layout: dict | None = None) -> dict:
    """The block: versions, platform and devices, the project's commit, the date (UTC, ISO 8601), the
    command line (``argv``, default sys.argv), the world size and the process layout (``layout``: e.g.
    {"frameworks": [...], "torch": "4 processes (gloo)", "jax": "1 process, 4 simulated devices"}),
    and the environment variables that change what XLA or NCCL do (XLA_FLAGS, NCCL_*)."""
    argv = list(sys.argv if argv is None else argv)
    return {
        "schema_version": SCHEMA_VERSION,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": argv,
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in PACKAGES},
        "platform": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                     "cpu": cpu_model(), "cpu_count": os.cpu_count()},
        "gpu": gpus(),
        "cuda": cuda_stack(),
        "git": git_state(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k == "XLA_FLAGS" or k.startswith("NCCL_")},
        "world_size": world_size,
        "layout": layout or {},
    }


def process_layout(frameworks, world_size: int, device: str, meshes=()) -> dict:
    """How the run's processes were laid out, from the launch environment: torch's ranks (spawned here,
    or torchrun's: RANK / LOCAL_WORLD_SIZE), JAX's processes (JAX_NUM_PROCESSES; 1: one controller
    driving every device), the --device asked for and the N-D layouts (e.g. ["dp=2,tp=2"])."""
    env = os.environ
    torchrun = "RANK" in env
    layout = {"frameworks": list(frameworks), "device": device, "meshes": list(meshes)}
    if "torch" in frameworks:
        layout["torch"] = {"processes": world_size, "launch": "torchrun" if torchrun else "spawn",
                           "per_node": int(env.get("LOCAL_WORLD_SIZE", world_size))}
    if "jax" in frameworks:
        procs = int(env.get("JAX_NUM_PROCESSES", "1"))
        layout["jax"] = {"processes": procs, "devices_per_process": world_size // max(procs, 1)}
    return layout


def stamp(data: dict, block: dict) -> dict:
    """A result file's dict with the schema version and the provenance block first."""
    return {"schema_version": SCHEMA_VERSION, "provenance": block, **data}


def flat(block: dict, prefix: str = "") -> dict[str, object]:
    """The block as {"packages.torch": "2.13.0", "gpu.names": "H100, H100", ...}: one line per field
    (what the diff header and the Markdown list show)."""
    out: dict[str, object] = {}
    for key, value in (block or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{name}."))
        elif isinstance(value, list):
            out[name] = " ".join(map(str, value)) if key == "command" else ", ".join(map(str, value))
        else:
            out[name] = None if isinstance(value, dict) else value
    return out


def provenance_markdown(block: dict) -> str:
    """The block as a Markdown list, for the top of a ``--markdown`` file."""
    lines = ["**provenance**", ""]
    lines += [f"- `{k}`: {'-' if v is None else v}" for k, v in flat(block).items()]
    return "\n".join(lines) + "\n\n"
