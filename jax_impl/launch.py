"""Run a function under multi-controller JAX: N processes, each owning a slice of the devices.

    out = launch(fn, 2, 2, *args)        # 2 processes × 2 devices; process 0's return value
    python -m jax_impl.launch -n 2 -d 4 compare.py --frameworks jax --mesh dp=2,tp=2,pp=2

The JAX mirror of torch_impl/launch.py, and the path a multi-node user takes: every process runs
the same program (SPMD across controllers: the same jitted computations in the same order, the
single-device reference included), ``jax.devices()`` spans all N·k devices and
``jax.local_devices()`` this process's k. ``fn(*args)`` runs in every process after
``jax.distributed.initialize``; it must be a module-level function and its arguments picklable.

The recipe (JAX 0.10.2, CPU; each line is one environment variable / call in a child):

- ``XLA_FLAGS=--xla_force_host_platform_device_count=k`` (this process's devices) and
  ``JAX_PLATFORMS=cpu``, set before JAX starts: each child is a fresh interpreter (subprocess).
- ``jax.config.update("jax_cpu_collectives_implementation", "gloo")`` before the backend starts
  (gloo is JAX 0.10.2's default, set explicitly to make the choice visible; "mpi" is the other):
  XLA:CPU's cross-process all-reduce, all-gather, all-to-all, collective-permute go over gloo.
- Inputs: ``jax.device_put(host_array, NamedSharding(global_mesh, spec))`` with the same host
  array on every process works as is (each process places its own shards).
- ``jax.distributed.initialize("127.0.0.1:PORT", N, i)``: process 0 also hosts the coordinator
  service on PORT. JAX itself reads only ``JAX_COORDINATOR_ADDRESS`` from the environment (plus
  Slurm / Open MPI / k8s / TPU auto-detection); ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` are this
  project's convention, read by ``jax_impl.devices.init_distributed`` and compare.py.
- Devices: process i's are ``jax.devices()[i·k:(i+1)·k]`` (ids 2048·i + j on CPU), so a mesh built
  by reshaping ``jax.devices()`` row-major puts its innermost axis inside one process ("node").
- Read-back: ``jax.device_get`` refuses an array with shards on other processes;
  ``jax_impl.model.to_numpy`` uses ``multihost_utils.process_allgather`` (a collective: every
  process calls it) or, for a replicated array, this process's own copy.

The coordinator port: the parent binds port 0, reads the port the OS gave and closes the socket
(JAX's coordinator binds it itself; the window in between is the only race). A process that
raises writes its traceback, one that dies is seen by its exit code: either way the others are
killed at once and ``LaunchError`` carries the traceback. Children get SIGKILL when the parent
dies (PR_SET_PDEATHSIG), so nothing is orphaned; the whole launch ends after ``timeout_s``. The
command form passes SIGTERM on to every process and waits for them to save (preemption:
``run_command``).
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from shared.env import die_with_parent

DEFAULT_TIMEOUT_S = 300.0
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COUNT_FLAG = "--xla_force_host_platform_device_count"
TERM = 128 + signal.SIGTERM  # 143: a process that stopped on SIGTERM (shared/preempt.py)


class LaunchError(RuntimeError):
    """A process raised, died or timed out; the message holds its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_device_flags(k: int, flags: str) -> str:
    """XLA_FLAGS with exactly ``k`` simulated CPU devices (shared.env only ever raises the count)."""
    flags = re.sub(rf"{_COUNT_FLAG}=\d+", "", flags).strip()
    return f"{flags} {_COUNT_FLAG}={k}".strip()


def child_env(process_id: int, processes: int, devices_per_process: int, coordinator: str) -> dict[str, str]:
    """The environment of process ``process_id``: its own device count (replacing any inherited
    one, e.g. the test suite's 8), CPU platform, and where the coordinator is."""
    env = dict(os.environ)
    env.update(XLA_FLAGS=host_device_flags(devices_per_process, env.get("XLA_FLAGS", "")), JAX_PLATFORMS="cpu",
               JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(processes),
               JAX_PROCESS_ID=str(process_id), PARALLEL_TWINS_LAUNCH_PARENT=str(os.getpid()),
               PYTHONPATH=os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p))
    return env


def launch(fn: Callable[..., Any], processes: int, devices_per_process: int, *args: Any,
           timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    if processes < 1 or devices_per_process < 1:
        raise ValueError(f"need processes >= 1 and devices_per_process >= 1, got {processes}, {devices_per_process}")
    with tempfile.TemporaryDirectory(prefix="jax_launch_") as work:
        with open(os.path.join(work, "job.pkl"), "wb") as f:
            pickle.dump(sys.path, f)  # first: where fn's module is found (as mp's spawn does)
            pickle.dump((fn, args), f)
        coordinator = f"127.0.0.1:{free_port()}"
        procs = []
        try:
            for i in range(processes):
                log = open(os.path.join(work, f"log{i}.txt"), "wb")  # gloo's chatter, crashes' last words
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", f"from jax_impl.launch import _child_main; _child_main({work!r}, {i})"],
                    env=child_env(i, processes, devices_per_process, coordinator), cwd=_ROOT,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
                log.close()
            _wait(procs, work, timeout_s)
        finally:
            _stop(procs)
        with open(os.path.join(work, "result0.pkl"), "rb") as f:
            return pickle.load(f)


def _wait(procs, work: str, timeout_s: float) -> None:
    """Until every process exited 0; the first failure (raised, died) or the deadline ends the launch."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return
        for i, code in enumerate(codes):
            if code not in (None, 0):
                raise LaunchError(_why(procs, work, i))
        if time.monotonic() > deadline:
            running = [i for i, c in enumerate(codes) if c is None]
            raise LaunchError(f"launch timed out after {timeout_s:.0f}s; still running: processes {running}")
        time.sleep(0.05)


def _why(procs, work: str, first: int) -> str:
    """The failure's story: a process that raised (its traceback) is named before one that only
    reacted to it; a process that died without a traceback: its exit and the tail of its output."""
    time.sleep(0.2)  # a peer's traceback may be on its way
    raised = [i for i in range(len(procs)) if os.path.exists(os.path.join(work, f"error{i}.txt"))]
    if raised:
        i = raised[0]
        with open(os.path.join(work, f"error{i}.txt")) as f:
            return f"process {i} raised:\n{f.read()}"
    code = procs[first].returncode
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    with open(os.path.join(work, f"log{first}.txt"), errors="replace") as f:
        tail = f.read()[-2000:]
    return f"process {first} died with {how}; its last output:\n{tail}"


def _stop(procs, grace_s: float = 0.0) -> None:
    """End every process still running: SIGTERM and ``grace_s`` to go (a script's own handlers
    run), then SIGKILL (a process blocked in a gloo collective ignores nothing else quickly)."""
    if grace_s > 0:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=10)


_RUN_SCRIPT = ("import os, runpy, sys; from jax_impl.launch import _die_with_parent; _die_with_parent(); "
               "sys.argv = sys.argv[1:]; sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])); "
               "runpy.run_path(sys.argv[0], run_name='__main__')")


def run_command(argv: list[str], processes: int, devices_per_process: int, timeout_s: float,
                grace_s: float = 2.0, term_grace_s: float = 60.0) -> int:
    """``python -m jax_impl.launch -n N -d K script.py ARGS…``: N copies of a Python script on this
    machine, each with K CPU devices and the environment a multi-node launch gives one process per
    node. Process 0's output is this command's; the others' stdout is dropped (their stderr shows).

    Every process is watched (each poll reads every exit status, not process 0's first): when one
    ends non-zero, the others get SIGTERM, then SIGKILL ``grace_s`` later, and one line on stderr
    names the process and its status. Exit status: that process's (128 + signal for a signal), else
    0; 124 on timeout.

    SIGTERM to this launcher (preemption, as torchrun's agent does it), or a process that exits 143
    (it got one), is passed on to every process; they then have ``term_grace_s`` to finish their
    step, save and exit (compare.py with --checkpoint-dir: 143) before SIGKILL. The launch exits
    143; a process failing otherwise meanwhile ends the others as above."""
    coordinator, procs, termed = f"127.0.0.1:{free_port()}", [], {}

    def forward(signum, frame) -> None:  # recorded here, passed on by the loop below (to every process)
        termed.setdefault("at", time.monotonic())

    previous = signal.signal(signal.SIGTERM, forward) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        for i in range(processes):
            procs.append(subprocess.Popen([sys.executable, "-c", _RUN_SCRIPT, *argv], stdin=subprocess.DEVNULL,
                                          stdout=None if i == 0 else subprocess.DEVNULL,
                                          env=child_env(i, processes, devices_per_process, coordinator)))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]  # every one, every time
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None and _status(codes[failed]) == TERM:  # one process preempted: all are
                termed.setdefault("at", time.monotonic())
            if termed:  # preempted: every process finishes its step, saves and exits; wait for all of them
                if not termed.get("sent"):
                    termed["sent"] = True
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(signal.SIGTERM)
                failed = next((i for i, c in enumerate(codes) if c is not None and _status(c) not in (0, TERM)),
                              None)  # a failure other than the stop itself ends the others as below
                if failed is None:
                    if all(c is not None for c in codes) or time.monotonic() > termed["at"] + term_grace_s:
                        return _after_sigterm(procs, codes, processes)
                    time.sleep(0.05)
                    continue
            if failed is not None:
                code = codes[failed]
                others = [i for i, c in enumerate(codes) if c is None]
                _stop(procs, grace_s)
                print(f"jax_impl.launch: process {failed} of {processes} ended with {_how(code)}"
                      + (f"; stopped processes {others}" if others else ""), file=sys.stderr, flush=True)
                return _status(code)
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                running = [i for i, c in enumerate(codes) if c is None]
                print(f"jax_impl.launch: timed out after {timeout_s:.0f}s; stopped processes {running}",
                      file=sys.stderr, flush=True)
                return 124
            time.sleep(0.05)
    finally:
        _stop(procs)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def _status(code: int) -> int:
    return code if code >= 0 else 128 - code


def _after_sigterm(procs, codes, processes: int) -> int:
    """The launch's status once SIGTERM was passed on and no process failed otherwise: 143 when a
    process stopped on it (exit 143, or killed by the SIGTERM itself), 0 when all had finished; a
    process still running after the grace is killed and named (137)."""
    late = [i for i, c in enumerate(codes) if c is None]
    _stop(procs)
    if late:
        print(f"jax_impl.launch: SIGTERM passed on; processes {late} of {processes} did not stop in time "
              "(killed)", file=sys.stderr, flush=True)
        return 128 + signal.SIGKILL
    return TERM if any(_status(c) == TERM for c in codes) else 0


# --- in the child ---------------------------------------------------------------------------


def _die_with_parent() -> None:
    die_with_parent()
    if os.getppid() != int(os.environ["PARALLEL_TWINS_LAUNCH_PARENT"]):
        os._exit(1)  # the parent went before prctl took effect


def _child_main(work: str, process_id: int) -> None:
    _die_with_parent()
    try:
        from jax_impl.devices import init_distributed

        init_distributed()  # from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
        with open(os.path.join(work, "job.pkl"), "rb") as f:
            sys.path[:0] = [p for p in pickle.load(f) if p not in sys.path]
            fn, args = pickle.load(f)
        result = fn(*args)
        if process_id == 0:
            with open(os.path.join(work, "result0.pkl.tmp"), "wb") as f:
                pickle.dump(result, f)
            os.replace(os.path.join(work, "result0.pkl.tmp"), os.path.join(work, "result0.pkl"))
        import jax

        jax.distributed.shutdown()  # a barrier: process 0 (the coordinator) must not leave first
        status = 0
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        with open(os.path.join(work, f"error{process_id}.txt"), "w") as f:
            f.write(traceback.format_exc())
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # After a failure no shutdown (its barrier would wait for a peer the parent kills anyway);
    # skipping interpreter teardown avoids gloo's threads at exit.
    os._exit(status)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jax_impl.launch",
                                     description="Run a script as N JAX processes on this machine.")
    parser.add_argument("-n", "--processes", type=int, default=2)
    parser.add_argument("-d", "--devices-per-process", type=int, default=2, help="simulated CPU devices each")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S * 3)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="script.py and its arguments")
    ns = parser.parse_args()
    if not ns.script:
        parser.error("give the script to run, e.g. compare.py --frameworks jax")
    if ns.processes < 1 or ns.devices_per_process < 1 or not ns.timeout > 0:
        parser.error("-n and -d must be >= 1 and --timeout > 0")
    sys.exit(run_command(ns.script, ns.processes, ns.devices_per_process, ns.timeout))
