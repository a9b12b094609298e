"""Helpers of the tests that stop compare.py from outside (issue 47): its processes, read from Linux's /proc."""

from __future__ import annotations

import os


def children(pid: int) -> list[int]:
    """``pid``'s children, spawned by any of its threads (compare.py starts the torch launch in a thread, side by
    side with JAX; /proc/PID/task/PID/children lists the main thread's only). [] once ``pid`` has ended."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def grandchildren(pid: int) -> list[int]:
    """The children of ``pid``'s children: compare.py's torch ranks, children of its forkserver."""
    return [g for c in children(pid) for g in children(c)]
