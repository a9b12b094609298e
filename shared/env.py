"""Environment set-up that must happen before JAX starts (stdlib only; JAX is not imported).

JAX on CPU simulates N devices with ``--xla_force_host_platform_device_count=N``, read once when
its backend initialises. compare.py and tests/conftest.py call ``simulate_host_devices`` first.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys

FLAG = "--xla_force_host_platform_device_count"


def simulate_host_devices(n: int) -> None:
    """Make XLA's CPU backend expose at least ``n`` devices (no effect on GPU devices)."""
    # Never let JAX grab 75% of GPU memory up front: torch ranks may share the node.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    flags = os.environ.get("XLA_FLAGS", "")
    match = re.search(rf"{FLAG}=(\d+)", flags)
    if match and int(match.group(1)) >= n:
        return
    flags = re.sub(rf"{FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}={n}".strip()


def die_with_parent() -> None:
    """In a launched rank or process: the kernel SIGKILLs it when its parent dies (Linux
    PR_SET_PDEATHSIG), so a killed launcher leaves no orphans (torch_impl / jax_impl launch.py)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def die_with_process(pid: int) -> None:
    """In a rank forked from a forkserver (its parent is the forkserver, not the launcher): end this
    process within a moment of process ``pid`` (the launcher) ending, whatever its way out — a
    SIGKILLed compare.py otherwise left a rank computing on, at 50 % of a core for an hour (found by
    the held-out audit: --steps 1e20, then SIGKILL). A pidfd (Linux >= 5.3) becomes readable when the
    process exits, with no pid-reuse race; where there is none, nothing is watched."""
    import select
    import threading

    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here, or the launcher is already gone
        if not _alive(pid):
            os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)  # as PR_SET_PDEATHSIG would: no handler, no clean-up
    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def local_gpu_count() -> int:
    """CUDA devices this process may use (CUDA_VISIBLE_DEVICES respected), asked of the driver itself
    (libcuda's cuDeviceGetCount): no framework is imported, so neither torch's CUDA runtime nor JAX's
    plugin is loaded before the other (jax-ml/jax#18032). 0 without a driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value
