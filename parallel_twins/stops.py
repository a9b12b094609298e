"""compare.py stopped by a signal (issue 47): SIGTERM or SIGINT to it, to a rank, or to the whole
process group (``kill -TERM -PGID``, GNU ``timeout``, a batch scheduler, Ctrl-C).

    watch(plan)                  # before the runs: shared/preempt.py's handler, graceful with a plan
    quiet()                      # after them: a later signal cannot cut the results being written
    how = stopped(plan, errors)  # None, or (signal name, what is on disk): the line and the exit status

With a checkpoint plan every run in flight finishes its step, saves it and stops; the line says the
step saved and where, checked on disk (its manifest there), or that none was. Without one the runs
are abandoned at once and the line says nothing was saved. Either way --json holds the rows that
finished, and the exit status is 128 + the signal (143 SIGTERM, 130 SIGINT).
"""

from __future__ import annotations

import os
import re

from parallel_twins.args import prog
from shared import preempt

# the one line a stopped run raises (shared.preempt.Preempted), inside its framework's error line
_PREEMPTED = re.compile(r"preempted \((SIG[A-Z]+)\): stopped (?:after step (\d+)|before its first step); "
                        r"(?:saved to (.+)|nothing saved)$")


def watch(plan, launched: bool) -> None:
    """Install the handler for the runs: graceful with a plan (finish the step, save it), at once
    without (nothing to save). ``launched``: this process is one rank of torchrun's (whose agent
    stops its workers itself): without a plan, the default (the process ends) is kept."""
    if plan is not None:
        preempt.install(graceful=True)
    elif not launched:
        preempt.install(graceful=False)


def quiet() -> None:
    preempt.quiet()


def preempted_in(errors) -> list[tuple[str, int | None, str | None]]:
    """(signal, step, saved path) of each ``Preempted`` line in ``errors``."""
    out = []
    for e in errors:
        m = _PREEMPTED.search(e)
        if m:
            out.append((m.group(1), int(m.group(2)) if m.group(2) else None, m.group(3)))
    return out


def stopped(errors) -> str | None:
    """The signal that stopped the runs (this process's, else a rank's ``Preempted``), or None."""
    found = preempted_in(errors)
    return preempt.signal_name() or (found[0][0] if found else None)


def on_disk(plan, errors) -> str:
    """What the stop left on disk, in words, checked there: the step saved and its folder, or none."""
    if plan is None:
        return "nothing saved (no --checkpoint-dir)"
    saved = [(step, path) for _, step, path in preempted_in(errors) if path]
    kept = [(step, path) for step, path in saved if os.path.isfile(os.path.join(path, "manifest.json"))]
    if kept:
        return "; ".join(f"step {step} saved to {path}" for step, path in kept) + "; continue with --resume"
    if saved:
        return (f"the save of step {saved[0][0]} is not on disk ({saved[0][1]} has no manifest); the earlier "
                f"checkpoints under {plan.dir} are kept; continue with --resume")
    import glob

    earlier = glob.glob(os.path.join(glob.escape(plan.dir), "*", "step_*", "manifest.json"))
    return "no step was saved at the stop; " + (f"the checkpoints already under {plan.dir} are kept; continue with "
                                                 "--resume" if earlier else f"there is no checkpoint under {plan.dir}")


def line(signame: str | None, plan, errors, during: str | None, rows: int, written: list[str]) -> str:
    """compare.py's one line for runs stopped by ``signame`` (None: a KeyboardInterrupt, Ctrl-C)."""
    how = "stopped by SIGTERM" if signame == "SIGTERM" else "interrupted (Ctrl-C)" if signame in (None, "SIGINT") \
        else f"stopped by {signame}"
    during = during or next((e.split(":", 1)[0] for e in errors if _PREEMPTED.search(e)), None)
    where = f" during the {during} runs" if during else ""
    kept = f"{rows} finished rows" + (f" written to {', '.join(written)}" if written else " (none saved: no --json)")
    return f"{prog()}: {how}{where}; {kept}; {on_disk(plan, errors)}"
