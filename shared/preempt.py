"""Stopping by signal (issues 38, 47): SIGTERM (a scheduler's preemption, ``kill``, GNU ``timeout``,
torchrun's agent) and SIGINT (Ctrl-C), to the parent, to a rank, or to the whole process group.

- **graceful** (a checkpoint plan is active): the handler only records the first signal (and passes
  it on through ``forwarders``: the torch launcher sends SIGTERM to its ranks); the training loops
  (torch_impl/harness.py, jax_impl/harness.py) finish the step they are in, agree across ranks,
  save it, and raise ``Preempted`` naming the step and the folder saved; a run that had not begun
  its first step stops before it (``Preempted(None)``: nothing saved). A second Ctrl-C stops at once
  (KeyboardInterrupt), as torchrun's and most trainers' do.
- **at once** (no checkpoint plan: nothing to save): the first signal raises ``Stopped`` (a
  KeyboardInterrupt: compare.py keeps the rows that finished, writes --json, says so in one line);
  later ones are only recorded, so the results are written whole.

compare.py then exits 128 + the signal's number (143 SIGTERM, 130 SIGINT). ``quiet()`` turns the
handler into a recorder once the runs are over. Stdlib only.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STATUS = 128 + signal.SIGTERM  # 143; SIGINT: 130 (exit_status)
_state: dict = {"signal": None, "mode": None, "previous": {}, "raised": False}
forwarders: list[Callable[[], None]] = []  # run by the handler: the torch launcher passes SIGTERM on to its ranks


class Preempted(Exception):
    """A run stopped by a signal after ``step`` steps (None: before its first step), ``saved`` the
    checkpoint folder it wrote at that step (None: nothing saved). Its text is one line, the path last:
    ``preempted (SIGTERM): stopped after step 2; saved to ck/run/step_000002``."""

    def __init__(self, step: int | None, saved: str | None = None, signame: str | None = None):
        signame = signame or signal_name() or "SIGTERM"
        what = f"stopped after step {step}" if step is not None else "stopped before its first step"
        super().__init__(f"preempted ({signame}): {what}; " + (f"saved to {saved}" if saved else "nothing saved"))
        self.step, self.saved, self.signame = step, saved, signame


class Stopped(KeyboardInterrupt):
    """The first SIGTERM or SIGINT without a checkpoint plan: the run is abandoned at once."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


def _handler(signum, frame) -> None:
    name = signal.Signals(signum).name
    first = _state["signal"] is None
    if first:
        _state["signal"] = name
    for forward in list(forwarders):
        forward()
    if _state["mode"] == "at once" and not _state["raised"]:
        _state["raised"] = True
        raise Stopped(name)
    if _state["mode"] == "graceful" and not first and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save


def install(graceful: bool = True) -> bool:
    """Handle SIGTERM and SIGINT (see the module's docstring); main thread only (False elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _state["mode"] = "graceful" if graceful else "at once"
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if current is not _handler:
            _state["previous"][sig] = current
        signal.signal(sig, _handler)
    return True


def quiet() -> None:
    """From now on a signal is only recorded (the results being written must not be cut)."""
    if _state["mode"] is not None:
        _state["mode"] = "record"


@contextlib.contextmanager
def deferred():
    """A block a stop must not cut in two (the torch launcher starting its ranks: a rank half started
    is one the launcher cannot end): a signal inside is recorded, and an "at once" stop is raised
    when the block ends."""
    mode = _state["mode"]
    if mode != "at once" or threading.current_thread() is not threading.main_thread():
        yield  # (a handler raises only in the main thread: a block elsewhere is never cut)
        return
    _state["mode"] = "record"
    try:
        yield
    finally:
        _state["mode"] = mode
    if _state["signal"] is not None and not _state["raised"]:
        _state["raised"] = True
        raise Stopped(_state["signal"])


def installed() -> bool:
    """Whether this process's SIGTERM handler is the one ``install`` set."""
    return signal.getsignal(signal.SIGTERM) is _handler


def requested() -> bool:
    return _state["signal"] is not None


def signal_name() -> str | None:
    """The first signal received ("SIGTERM" / "SIGINT"), or None."""
    return _state["signal"]


def is_stop(error) -> bool:
    """Whether ``error`` (an exception, or a line of compare.py's errors) is a run stopped by a signal
    (``Preempted``, or its line inside a launch's error): the frameworks after it are not run."""
    return isinstance(error, Preempted) or "Preempted: preempted (SIG" in str(error) or \
        str(error).startswith("preempted (SIG")


def exit_status(signame: str | None) -> int:
    return 128 + int(getattr(signal, signame or "SIGTERM"))


def reset() -> None:
    """Forget a request and restore the handlers there were before ``install`` (tests; a process that
    goes on). Never installed: SIGTERM's default."""
    _state["signal"], _state["mode"], _state["raised"] = None, None, False
    if threading.current_thread() is threading.main_thread():
        previous = _state["previous"]
        for sig in SIGNALS:
            if signal.getsignal(sig) is _handler:
                signal.signal(sig, previous.get(sig, signal.SIG_DFL if sig == signal.SIGTERM
                                                else signal.default_int_handler))
        previous.clear()
