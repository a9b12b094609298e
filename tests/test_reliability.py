"""Issue 38's launcher, up-front and library checks: each a fault or a hostile input, answered in
one line before anything trains (docs/reliability.md). All in-process or one tiny launch."""

import os
import signal
import time

import pytest

from parallel_twins import cli as compare

# --- the JAX launcher watches every process -----------------------------------------------------

_DIE_ON_1 = """
import os, signal, time
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"pid{os.environ['JAX_PROCESS_ID']}"), "w") as f:
    f.write(str(os.getpid()))
if os.environ["JAX_PROCESS_ID"] == "1":
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)  # process 0: a peer blocked in a collective that will never complete
"""


def test_jax_launch_ends_every_process_when_process_1_dies(tmp_path, capsys):
    """Process 1 is SIGKILLed while process 0 runs on: the launch used to poll process 0 first and
    noticed 94 s later. Now it ends process 0 within seconds, exits 128 + 9, and says so in one line."""
    from jax_impl.launch import run_command

    script = tmp_path / "job.py"
    script.write_text(_DIE_ON_1)
    t0 = time.monotonic()
    rc = run_command([str(script)], 2, 1, timeout_s=60)
    elapsed = time.monotonic() - t0
    assert rc == 128 + signal.SIGKILL
    assert elapsed < 30, elapsed  # the children's start (JAX imported twice) plus the 2 s grace, not the 60 s timeout
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "jax_impl.launch: process 1 of 2 ended with signal SIGKILL; stopped processes [0]", err
    pid0 = int((tmp_path / "pid0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)
