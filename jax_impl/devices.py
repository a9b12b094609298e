"""Devices and meshes. Meshes are built here explicitly and passed to every function.

CPU: N simulated devices (``shared.env.simulate_host_devices`` before JAX starts).
GPU: the local GPUs. ``init_distributed()`` joins several JAX processes (multi-controller: Slurm,
or coordinator address / process count / process id, e.g. jax_impl/launch.py's children or
compare.py under a multi-node launch) so that ``jax.devices()`` spans every process's devices,
process 0's first; results come back through ``jax_impl.model.to_numpy`` (process_allgather).
Under several processes a run takes either every device (one SPMD program across processes) or
only this process's own (the single-device reference: each process computes its own copy).
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

FALLBACK: str | None = None  # the line saying why --device auto took the CPU though a GPU was there
_SAID: set[str] = set()


def gpu_unavailable_reason() -> str:
    """Why JAX has no GPU backend, in one line: the CUDA plugin's own initialisation error (e.g. a
    CUDA/cuDNN library mismatch, jax-ml/jax#18032) when it tried and failed, else a missing plugin."""
    from jax._src import xla_bridge  # the backends' initialisation errors live only here

    errors = getattr(xla_bridge, "_backend_errors", {}) or {}
    for name in ("cuda", "rocm", "gpu"):
        if name in errors:
            return f"JAX's {name} backend failed to initialize: {' '.join(str(errors[name]).split())}"
    chosen = os.environ.get("JAX_PLATFORMS", "")
    if chosen and not {"cuda", "gpu", "rocm"} & set(chosen.split(",")):
        return f"JAX_PLATFORMS={chosen} leaves the GPU out"
    return "JAX sees no GPU (no CUDA plugin: pip install '.[gpu]', i.e. jax[cuda13])"


def _gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def platform(device: str = "auto", n: int = 1) -> str:
    """'auto' | 'cpu' | 'gpu' -> the JAX platform to run on ('cpu' or 'gpu'). 'auto' takes the GPUs
    only when there are at least ``n`` of them (as torch_impl.launch does), else the CPU devices;
    when it does not take GPUs it could see (or whose backend failed), it says so once on stderr and
    keeps the line in ``FALLBACK`` for the rows. 'gpu' never falls back: ValueError, one line why."""
    global FALLBACK
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, got {device!r}")
    if device == "cpu":
        return "cpu"
    n_gpu = _gpu_count()
    if device == "gpu" and n_gpu == 0:
        raise ValueError(f"--device gpu: {gpu_unavailable_reason()}")
    if n_gpu >= (1 if device == "gpu" else n):
        return "gpu"
    from jax._src import xla_bridge

    failed = any(k in (getattr(xla_bridge, "_backend_errors", {}) or {}) for k in ("cuda", "rocm", "gpu"))
    if n_gpu or failed:
        FALLBACK = (f"jax: {n_gpu} GPU(s) for {n} devices, so the CPU" if n_gpu
                    else f"jax: the CPU, {gpu_unavailable_reason()}")
        if FALLBACK not in _SAID:
            _SAID.add(FALLBACK)
            print(f"note: --device auto fell back: {FALLBACK}", file=sys.stderr)
    return "cpu"


def xla_platform(mesh) -> str:
    """"cpu" | "cuda" | …: the platform a mesh's programs compile for (the XLA choices recorded per
    platform, jax_impl.cp.seq_sharded_comm and jax_impl.ep.gshard_comm, are looked up by it)."""
    return where(mesh.devices.flat)["platform"]


def wire_config(cfg, mesh):
    """The Config whose element sizes a step on ``mesh`` puts on the wire, for its shared.theory bytes.
    Mixed precision on the CPU: XLA:CPU runs bf16 collectives in float32 (jax_impl/ledger.py; measured:
    a bf16 ppermute / psum compiles to an f32 collective-permute / all-reduce), so the activations that
    the program sends in bf16 (theory: cfg.compute_bytes) move 4 bytes per element there, as the float32
    master gradients do: the float32 run's theory. Elsewhere (GPU keeps bf16 on the wire): ``cfg``.
    float16 stays float16 on XLA:CPU's wire (measured: cp's ring and ulysses, 2 bytes per element): ``cfg``."""
    if getattr(cfg, "precision", "pure") == "mixed" and cfg.dtype == "bfloat16" and xla_platform(mesh) == "cpu":
        return cfg.replace(dtype=cfg.param_dtype, precision="pure")
    return cfg


def where(devs) -> dict:
    """Where a program runs, for Trained.where: {"platform": "cpu" | "cuda", "backend": None ("XLA -O0" on the
    CPU at -O0: compare.py's compile-bound sizes, the tests), "devices": ["cuda:0", …], "fallback": the auto
    fallback line when it ran on the CPU}."""
    devs = list(devs)
    kinds = {d.platform for d in devs}
    plat = "/".join(sorted("cuda" if k == "gpu" else k for k in kinds))  # JAX calls CUDA devices "gpu"
    names = [f"{'cuda' if d.platform == 'gpu' else d.platform}:{d.id}" for d in devs]
    fast = plat == "cpu" and "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
    return {"platform": plat, "backend": "XLA -O0" if fast else None, "devices": names,  # fast: preflight.py
            "fallback": FALLBACK if plat == "cpu" else None}


def devices(n: int, device: str = "auto") -> list:
    if jax.process_count() > 1:
        return _multiprocess_devices(n, device)
    devs = jax.devices(platform(device, n))
    if len(devs) < n:
        raise ValueError(
            f"world_size={n} needs {n} JAX devices, found {len(devs)} {devs[0].platform} devices "
            f"(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts)"
        )
    return devs[:n]


def make_mesh(shape: int | tuple[int, ...], axis_names: str | tuple[str, ...], device: str = "auto") -> Mesh:
    """A mesh over the first prod(shape) devices with Auto axes (shardings are hints XLA may
    propagate, not asserted types), e.g. ``make_mesh(4, "dp")`` or ``make_mesh((2, 2), ("dp", "tp"))``."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    devs = np.array(devices(int(np.prod(shape)), device)).reshape(shape)
    return Mesh(devs, names, axis_types=(AxisType.Auto,) * len(names))


def _multiprocess_devices(n: int, device: str) -> list:
    """Every device (process-major: jax.devices() lists process 0's first) or this process's first n."""
    kind = "cpu" if device == "cpu" else jax.default_backend()
    if device == "gpu" and kind != "gpu":
        raise ValueError(f"--device gpu: {gpu_unavailable_reason()}")
    everything, mine = jax.devices(kind), jax.local_devices(backend=kind)
    if n == len(everything):
        return everything
    if n <= len(mine):
        return mine[:n]
    raise ValueError(f"world_size={n}: under {jax.process_count()} JAX processes a run takes all "
                     f"{len(everything)} devices or at most this process's {len(mine)}")


def multiprocess_env() -> tuple[str, int, int] | None:
    """(coordinator address, process count, process id) from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID when all three are set (jax.distributed reads only the first
    itself), else None. Reads the environment only: safe before JAX starts."""
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    if not all(os.environ.get(k) for k in names):
        return None
    return os.environ[names[0]], int(os.environ[names[1]]), int(os.environ[names[2]])


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """Join a multi-controller JAX launch, before any JAX computation: explicit arguments, else
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else what JAX detects itself
    (Slurm, Open MPI, k8s, Cloud TPU). CPU collectives across processes go over gloo."""
    env = multiprocess_env()
    if env is not None and coordinator is num_processes is process_id is None:
        coordinator, num_processes, process_id = env
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
