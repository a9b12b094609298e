"""Preemption by SIGTERM (issue 38), as torchrun's SIGTERM grace and Orbax's save-on-preemption do
it: the handler only records the request; the training loops (torch_impl/harness.py,
jax_impl/harness.py) finish the step they are in, agree across ranks, save it when a checkpoint
plan is active, and raise ``Preempted``; compare.py then exits 143 (128 + SIGTERM). Installed only
with --checkpoint-dir: without one there is nothing to save and SIGTERM ends the run at once, as
before. Stdlib only.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

EXIT_STATUS = 128 + signal.SIGTERM  # 143
_state = {"requested": False}
forwarders: list[Callable[[], None]] = []  # run by the handler: the torch launcher passes SIGTERM on to its ranks


class Preempted(Exception):
    """SIGTERM: the run stopped after ``step`` steps (saved when a checkpoint plan is active)."""

    def __init__(self, step: int):
        super().__init__(f"preempted (SIGTERM): stopped after step {step}, saved")
        self.step = step


def _handler(signum, frame) -> None:
    _state["requested"] = True
    for forward in list(forwarders):
        forward()


def install() -> bool:
    """SIGTERM records a request instead of ending the process (main thread only: False elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _handler)
    return True


def installed() -> bool:
    """Whether this process's SIGTERM handler is the one ``install`` set."""
    return signal.getsignal(signal.SIGTERM) is _handler


def requested() -> bool:
    return _state["requested"]


def reset() -> None:
    """Forget a request and restore the default handler (tests; a process that goes on)."""
    _state["requested"] = False
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
