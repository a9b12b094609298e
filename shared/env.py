"""Environment set-up that must happen before JAX starts (stdlib only; JAX is not imported).

JAX on CPU simulates N devices with ``--xla_force_host_platform_device_count=N``, read once when
its backend initialises. compare.py and tests/conftest.py call ``simulate_host_devices`` first.
"""

from __future__ import annotations

import os
import re

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
