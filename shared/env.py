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


CACHE_ENV = "PARALLEL_TWINS_CACHE"  # a folder for JAX's compiled programs; "off": none
CACHE_MAX_BYTES = 1 << 30  # past this, trim_compile_cache deletes the oldest programs at a run's start


def compile_cache_dir() -> str | None:
    """Where compare.py keeps JAX's compiled programs between runs: $PARALLEL_TWINS_CACHE, else
    $XDG_CACHE_HOME/parallel-twins/jax, else ~/.cache/parallel-twins/jax; None when PARALLEL_TWINS_CACHE=off."""
    given = os.environ.get(CACHE_ENV)
    if given is not None:
        return None if given.strip().lower() in ("off", "0", "none", "") else os.path.expanduser(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "parallel-twins", "jax")


def use_compile_cache() -> str | None:
    """Before JAX starts: JAX's persistent compilation cache in compile_cache_dir(), every program kept (a
    second compare.py run loads the steps it compiled instead of compiling them again), at most
    CACHE_MAX_BYTES. A cache the user configured (JAX_COMPILATION_CACHE_DIR) is left as it is. Returns the
    folder in use, or None.

    JAX's own size limit (jax_compilation_cache_max_size) is left off: with it, every program written
    lists and stats the whole folder under a file lock, and with a few thousand small programs (the test
    suite writes ~6,500) that made a cold module 4x slower (cp's seam: 38 s -> 162 s) and the default
    tier 22 min instead of 6. The folder is trimmed once here instead."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    folder = compile_cache_dir()
    if folder is None:
        return None
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")  # no per-write scan (see above)
    trim_compile_cache(folder, CACHE_MAX_BYTES)
    return folder


def trim_compile_cache(folder: str, max_bytes: int) -> int:
    """Delete the oldest (by modification time) files of JAX's cache ``folder`` until it holds at most 3/4
    of ``max_bytes``, if it holds more than ``max_bytes``; returns the files deleted. One listing per
    process; another process deleting or writing at the same moment is harmless (a missing file is
    skipped, and a program deleted under a reader is compiled again). Only regular files directly in the
    folder are considered, never a link or a subfolder."""
    try:
        entries = [e for e in os.scandir(folder) if e.is_file(follow_symlinks=False)]
    except OSError:
        return 0
    stats = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        stats.append((st.st_mtime, st.st_size, entry.path))
    total = sum(size for _, size, _ in stats)
    if total <= max_bytes:
        return 0
    deleted = 0
    for _, size, path in sorted(stats):
        if total <= max_bytes * 3 // 4:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        total -= size
        deleted += 1
    return deleted


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
