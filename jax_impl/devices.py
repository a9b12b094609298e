"""Devices and meshes. Meshes are built here explicitly and passed to every function.

CPU: N simulated devices (``shared.env.simulate_host_devices`` before JAX starts).
GPU: the local GPUs. ``init_distributed()`` joins several JAX processes (Slurm, or explicit
coordinator address / process count / process id) so that ``jax.devices()`` spans every node; the
pattern modules here read results back with ``jax.device_get``, which needs every shard addressable
from this process, so compare.py's JAX side runs on one node.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def platform(device: str = "auto", n: int = 1) -> str:
    """'auto' | 'cpu' | 'gpu' -> the JAX platform to run on ('cpu' or 'gpu'). 'auto' takes the GPUs
    only when there are at least ``n`` of them (as torch_impl.launch does), else the CPU devices."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, got {device!r}")
    if device == "cpu":
        return "cpu"
    try:
        n_gpu = len(jax.devices("gpu"))
    except RuntimeError:
        n_gpu = 0
    if device == "gpu" and n_gpu == 0:
        raise ValueError("--device gpu: JAX sees no GPU (install the 'gpu' extra: jax[cuda12])")
    return "gpu" if n_gpu >= (1 if device == "gpu" else n) else "cpu"


def devices(n: int, device: str = "auto") -> list:
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


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """Multi-node JAX: one process per node. With no arguments JAX reads Slurm / cloud env."""
    jax.distributed.initialize(coordinator, num_processes, process_id)
