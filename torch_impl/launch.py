"""Run a function on N ranks and hand the per-rank results back to the caller.

    results = launch(fn, world_size, *args)      # results[r] is fn's return value on rank r

``fn(ctx, *args)`` runs on every rank with a ``RankContext`` (rank, world size, device, the
default process group and a communication ledger). It must be a module-level function (ranks
are forked from a forkserver (``_start_method``), which pickles it by name).

- CPU: N processes, gloo. GPU node: one process per GPU, NCCL, ``torch.cuda.set_device``.
- Under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK set) this process *is* a rank: it joins
  that launch instead of spawning, runs ``fn`` once and all-gathers the results, which is also
  how it goes multi-node.
- Rendezvous through a TCPStore the parent opens on port 0 (the OS picks a free port: no fixed
  ports, no race between "find a port" and "bind it").
- Failure: a rank that raises sends its traceback; a rank that dies is seen by its exit code.
  Either way every other rank is terminated at once and ``LaunchError`` carries the traceback.
  Children get SIGKILL if the parent dies (PR_SET_PDEATHSIG) or the launcher does (a pidfd: a
  forkserver may outlive it), so nothing is orphaned.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared import preempt
from shared.checkpoint_io import CheckpointError
from shared.env import die_with_parent, die_with_process
from torch_impl.ledger import AUDIT_ENV, CommLedger

DEFAULT_TIMEOUT_S = 300.0  # whole launch; collectives time out after the same
ONE_LINE = (preempt.Preempted, CheckpointError)  # a rank's exceptions reported by their line, not a traceback


@dataclass
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "gloo" | "nccl"
    ledger: CommLedger
    # Rank 0's progress events, ("start", what) / ("done", runs), to the launching process's
    # ``launch(progress=…)``; a no-op elsewhere and when nobody listens.
    progress: Callable[[tuple], None] = lambda event: None
    devices: list[str] | None = None  # every rank's device, e.g. ["cuda:0", "cuda:1"] (all-gathered at start)
    fallback: str | None = None  # why --device auto took gloo on CPU though GPUs were there, else None

    @property
    def where(self) -> dict:
        """Where this launch runs, for Trained.where / RunResult's platform, backend, devices."""
        return {"platform": self.device.type, "backend": self.backend,
                "devices": list(self.devices or [str(self.device)]), "fallback": self.fallback}

    @property
    def group(self):
        return dist.group.WORLD


class LaunchError(RuntimeError):
    """A rank raised or died; the message holds its traceback."""


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


_SAID: set[str] = set()  # fallback lines already printed by this process (each is said once)


def fallback_reason(device: str, world_size: int) -> str | None:
    """The one line saying why --device auto runs gloo on CPU though this node has GPUs (fewer GPUs
    than ranks: NCCL cannot place two ranks on one GPU); None when auto takes the GPUs, when there
    are none, or when the device was named."""
    if device != "auto" or not torch.cuda.is_available():
        return None
    n_gpu = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size
    if 0 < n_gpu < local:
        return f"torch: {n_gpu} GPU(s) for {local} ranks on this node, so gloo on CPU (NCCL needs a GPU per rank)"
    return None


def say_fallback(line: str | None) -> None:
    """Print a fallback line to stderr, once per process."""
    if line and line not in _SAID:
        _SAID.add(line)
        print(f"note: --device auto fell back: {line}", file=sys.stderr)


def resolve_device(device: str, world_size: int) -> str:
    """'auto' | 'cpu' | 'gpu' -> 'cpu' | 'cuda'; raises ValueError if a GPU run cannot fit."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, got {device!r}")
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu":
        return "cpu"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size
    if device == "gpu":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU build: install the CUDA wheel (pip install torch) on a GPU node"
                   if torch.version.cuda is None else
                   f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU")
            raise ValueError(f"--device gpu needs {local} GPUs on this node for world_size={world_size}, "
                             f"found 0 ({why})")
        if n_gpu < local:
            raise ValueError(
                f"--device gpu needs {local} GPUs on this node for world_size={world_size}, found {n_gpu} "
                "(NCCL cannot place two ranks on one GPU)"
            )
        return "cuda"
    return "cuda" if n_gpu >= local else "cpu"


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: Callable[[tuple], None] | None = None,
    cancel: threading.Event | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` fresh ranks (or join torchrun's); returns every
    rank's answer. ``progress`` hears rank 0's ``ctx.progress`` events while they run. ``cancel`` (a
    launch in a thread: compare.py's side-by-side runs): once set, the ranks are stopped and LaunchError
    raised."""
    kind = resolve_device(device, world_size)
    fallback = fallback_reason(device, world_size) if kind == "cpu" else None
    say_fallback(fallback)
    if under_torchrun():
        return _join_torchrun(fn, world_size, args, kind, timeout_s, progress, fallback)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    ctx = _start_method()
    results_q = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, store.port, fn, args, kind, results_q, timeout_s, threads, progress is not None,
                  fallback, dict(os.environ, PARALLEL_TWINS_LAUNCHER_PID=str(os.getpid()))),
            daemon=True,
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    forward = functools.partial(_forward_sigterm, procs)  # preemption: SIGTERM reaches every rank
    preempt.forwarders.append(forward)
    try:
        with preempt.deferred():  # a stop raised mid-start would leave a rank the teardown cannot see
            for p in procs:
                p.start()
        while len(results) < world_size:
            try:
                rank, status, payload = results_q.get(timeout=0.05)
            except queue_mod.Empty:
                for rank, p in enumerate(procs):
                    if rank not in results and p.exitcode is not None:
                        # It may have posted just before exiting: drain once more.
                        time.sleep(0.2)
                        _drain(results_q, results, procs)
                        if rank not in results:
                            raise LaunchError(f"rank {rank} died with {_describe_exit(p.exitcode)}") from None
                if time.monotonic() > deadline:
                    raise LaunchError(f"launch timed out after {timeout_s:.0f}s; done: {sorted(results)}") from None
                if cancel is not None and cancel.is_set():
                    raise LaunchError("launch cancelled") from None
                continue
            if status == "progress":
                progress(payload)
                continue
            if status == "error":
                raise LaunchError(_died_first(procs, results) + f"rank {rank} raised:\n{payload}")
            if status == "refused":  # one line of its own (a stop by signal, a checkpoint refused)
                raise LaunchError(f"rank {rank}: {payload}")
            results[rank] = payload
    finally:
        preempt.forwarders.remove(forward)
        _stop([p for p in procs if p.pid is not None], graceful=len(results) == world_size)
        results_q.close()
    return [results[r] for r in range(world_size)]


# What a forkserver imports once, before it forks any rank (a rank unpickles ``fn`` and imports the rest):
# the harness and every torch_impl module a runner or wrapper may use (DTensor, FSDP2, pipelining come with
# them) — imported after the fork they cost each rank ~1-2 CPU-s, 4-8 ranks per launch; here once per
# launching process; ``preload()`` adds modules (the test suite: transformers' Llama and Qwen2). A module
# that fails to import is skipped there (multiprocessing's forkserver) and the rank imports it as before.
# A library that reads an environment variable when imported (inductor's TORCHINDUCTOR_COMPILE_THREADS)
# sees the environment of the first launch: set such a value in code, as compiled.prepare does.
PRELOAD = ["torch_impl.launch", "torch_impl.harness", "torch_impl.mesh", "torch_impl.dp", "torch_impl.fsdp",
           "torch_impl.tp", "torch_impl.pp", "torch_impl.cp", "torch_impl.ep", "torch_impl.collectives",
           "torch_impl.checkpoint", "torch_impl.parallel.compose", "torch_impl.parallel.llama"]
START_METHOD_ENV = "PARALLEL_TWINS_START_METHOD"


def preload(*modules: str) -> None:
    """Modules this process's forkserver imports once too, before it forks any rank (heavy imports a
    launched ``fn`` needs, e.g. transformers' model classes). Takes effect if called before the first launch
    on a CPU (the forkserver starts then); a process that never launches imports nothing."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


@functools.cache
def _start_method():
    """Ranks are forked from a forkserver that imported torch and the harness once (per launching
    process), not spawned: a spawned rank imports them anew (seconds of CPU per rank), which
    dominated short launches. Like spawn, the forkserver is a fresh interpreter (no threads, no CUDA,
    nothing of the caller's state inherited); each rank gets the caller's sys.path, working folder
    and (_rank_main) environment of the moment, as spawn would.
    PARALLEL_TWINS_START_METHOD=spawn starts every rank afresh instead (where forkserver is missing)."""
    ctx = mp.get_context(os.environ.get(START_METHOD_ENV, "forkserver"))
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
        _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start the forkserver now with SIGTERM blocked in this thread, a mask it keeps across its exec:
    ``kill -TERM -PGID``, GNU ``timeout`` and batch schedulers signal the whole process group, and a
    forkserver that died of it would take every rank with it (a rank dies with its parent:
    PR_SET_PDEATHSIG) in the middle of the step they were finishing to save. It still ends with this
    process (its pipe closes); each rank unblocks SIGTERM and restores its default as it starts
    (``_rank_main``). Blocked in this thread only, and only while the forkserver starts: a SIGTERM to
    this process meanwhile is delivered (to the main thread), not lost; any thread may launch."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # first: starting it unblocks SIGTERM in this thread, whatever was set
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _forward_sigterm(procs) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            os.kill(p.pid, signal.SIGTERM)


def _drain(q, results: dict[int, Any], procs) -> None:
    while True:
        try:
            rank, status, payload = q.get_nowait()
        except queue_mod.Empty:
            return
        if status == "progress":
            continue
        if status == "error":  # maybe a reaction to the rank that died: name the dead first
            raise LaunchError(_died_first(procs, results) + f"rank {rank} raised:\n{payload}")
        if status == "refused":
            raise LaunchError(f"rank {rank}: {payload}")
        results[rank] = payload


def _died_first(procs, results) -> str:
    """A rank that raised may only be reacting to a peer that died (gloo reports a closed
    connection): name the dead ranks first, so the message points at the cause."""
    time.sleep(0.3)
    dead = [f"rank {r} died with {_describe_exit(p.exitcode)}" for r, p in enumerate(procs)
            if r not in results and p.exitcode not in (None, 0, 1)]
    return "".join(d + "\n" for d in dead)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _stop(procs, graceful: bool) -> None:
    """Join finished ranks briefly; terminate, then kill, whatever is left. Not graceful (a rank
    failed, a signal stopped the launch): killed at once: a rank still starting has SIGTERM blocked
    (the forkserver's mask, until ``_rank_main`` unblocks it), and a rank that saves on a signal has
    already saved when it reports."""
    if graceful:
        end = time.monotonic() + 10.0
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate() if graceful else p.kill()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)


def set_float32_ieee() -> None:
    """float32 parity needs IEEE matmuls: no TF32 (JAX: jax_default_matmul_precision="highest").

    Only the matmul flag, through the new API. Neither model has a convolution, and on torch 2.13
    setting any cuDNN ``fp32_precision`` (conv, rnn or cudnn as a whole) makes every later read of
    the legacy ``torch.backends.cudnn.allow_tf32`` (and ``cudnn.flags()``, which library code
    enters) raise "a mix of the legacy and new APIs" (tests/test_gpu_readiness.py reproduces it)."""
    torch.backends.cuda.matmul.fp32_precision = "ieee"


def _init(rank: int, world_size: int, local_rank: int, kind: str, timeout_s: float, store=None) -> RankContext:
    timeout = timedelta(seconds=timeout_s)
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
        set_float32_ieee()
    else:
        device = torch.device("cpu")
        backend = "gloo"
    kwargs = {"backend": backend, "timeout": timeout}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    if kind == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    ctx = RankContext(rank, world_size, local_rank, device, backend, CommLedger(world_size))
    ctx.devices = _gather_devices(device, world_size)
    if os.environ.get(AUDIT_ENV):
        start_audit(ctx, meta=os.environ[AUDIT_ENV] == "meta")
    return ctx


def start_audit(ctx: RankContext, meta: bool = True) -> None:
    """The device audit (tests/conftest.py: PARALLEL_TWINS_AUDIT): the ledger checks every collective
    it records (device, contiguity, NCCL dtype: torch_impl.ledger.audit_tensors); with ``meta`` the
    default device becomes meta, so a factory call without ``device=`` makes a meta tensor that fails
    (or gives a wrong answer the parity check sees) on CPU, where on a GPU it would silently put a
    tensor on the CPU."""
    ctx.ledger.audit_device = ctx.device
    if meta:
        torch.set_default_device("meta")


def _gather_devices(device: torch.device, world_size: int) -> list[str]:
    """Every rank's device (one all_gather_object at start, outside every ledger), so the rows
    say where each rank ran, on a multi-node torchrun launch too."""
    if world_size == 1:
        return [str(device)]
    names: list[Any] = [None] * world_size
    dist.all_gather_object(names, str(device))
    return [str(n) for n in names]


def _rank_main(rank, world_size, port, fn, args, kind, results_q, timeout_s, threads, listened=False,
               fallback=None, environ=None) -> None:
    if environ is not None:  # the launching process's environment now, not the forkserver's at its start
        os.environ.clear()
        os.environ.update(environ)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # the forkserver blocks it; a rank does not
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent()  # the forkserver
    if "PARALLEL_TWINS_LAUNCHER_PID" in os.environ:  # and the launcher: a forkserver may outlive it
        die_with_process(int(os.environ["PARALLEL_TWINS_LAUNCHER_PID"]))
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout_s))
        ctx = _init(rank, world_size, rank, kind, timeout_s, store=store)
        ctx.fallback = fallback
        if listened and rank == 0:
            ctx.progress = lambda event: results_q.put((rank, "progress", event))
        result = fn(ctx, *args)
        results_q.put((rank, "ok", result))
        status = 0
    except ONE_LINE as exc:  # a stop by signal, a checkpoint refused: their own line says it all
        results_q.put((rank, "refused", f"{type(exc).__name__}: {exc}"))
        status = 1
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results_q.put((rank, "error", traceback.format_exc()))
        status = 1
    results_q.close()
    results_q.join_thread()  # the answer is in the pipe before this process goes
    if status == 0:
        _destroy_group()
    # Skip interpreter teardown: C++ threads of a process group left in reference cycles can abort
    # ("terminate called without an active exception") while Python finalises.
    os._exit(status)


def _torchrun_store(world_size: int, timeout_s: float):
    """torchrun's agent store for this attempt, or None (init_process_group's env:// then). The
    agent keeps one TCPStore across a --max-restarts restart (TORCHELASTIC_USE_AGENT_STORE=True),
    so a restarted group would read the dead group's gloo addresses and fail to connect (or hang):
    pytorch/pytorch#135712. Each attempt gets its own key prefix, TORCHELASTIC_RESTART_COUNT, which
    every worker of a one-node torchrun shares. Several nodes: their counts can differ (a healthy
    node restarts without counting), so set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 there (rank 0
    then hosts a fresh store each attempt, and this returns None)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False,
                          timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"parallel_twins/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _destroy_group() -> None:
    """Destroy the process group while the interpreter is whole (a launched rank before os._exit; torchrun's
    at exit). Left to finalisation, gloo's threads still holding work objects abort the process ("terminate
    called without an active exception", SIGABRT), which torchrun counts as a failed attempt: a rank that
    finished first (rank 1, with nothing to write) turned a good run red (pytorch/pytorch#179291)."""
    if dist.is_initialized():
        gc.collect()  # free pipeline schedules / DDP reducers still holding the group
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after the results are out is best-effort
            pass


def _join_torchrun(fn, world_size, args, kind, timeout_s, progress=None, fallback=None) -> list[Any]:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(f"torchrun started {env_world} ranks but world_size={world_size} was asked for")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if not dist.is_initialized():
        ctx = _init(rank, env_world, local_rank, kind, timeout_s, store=_torchrun_store(env_world, timeout_s))
        atexit.register(_destroy_group)  # this process made the group: it takes it down before Python does
    else:
        device = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
        ctx = RankContext(rank, env_world, local_rank, device, dist.get_backend(), CommLedger(env_world))
        ctx.devices = _gather_devices(device, env_world)
    ctx.fallback = fallback
    if progress is not None and rank == 0:
        ctx.progress = progress
    try:
        result = fn(ctx, *args)
    except BaseException:
        # torchrun's agent tears the other ranks down when this one exits non-zero.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    gathered: list[Any] = [None] * env_world
    dist.all_gather_object(gathered, result)
    return gathered
