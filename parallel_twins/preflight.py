"""Up-front checks compare.py makes before any rank, process or JAX device starts (issue 38): the
machine can hold the run (processes, memory), and the distributed environment is torchrun's, not
a stale export. Each refusal is one ValueError line naming what and how to go on. Stdlib only.

    check_environment(os.environ)            # stale RANK/WORLD_SIZE/MASTER_*, WORLD_SIZE=abc
    check_jax_environment(os.environ)        # JAX_PLATFORMS=gpu without one, a bad XLA_FLAGS
    check_resources(cfgs, frameworks)        # --world-size and sizes against cores and memory
    check_bench_resources(frameworks, world, max_bytes, iters)   # compare.py bench's sweep

The memory figure is an estimate, stated as one: per model copy the parameters, gradients and
AdamW's two moments (4·Φ·b), twice (the single-device reference and the parallel run), plus the
activations of one step (below) and ~150 MiB of interpreter and framework per process. torch
spawns one process per rank; JAX holds every simulated device in this one process.

The subcommands: ``bench`` checks its ranks and its messages (check_bench_resources), ``checkpoint``
its model as the main command does (check_resources), each with --no-resource-check; ``plan``
needs no check: it sizes a cluster on paper (no process, no device, no model is made), so 100000
GPUs or dim=200000 cost it a second; ``diff`` and ``doctor`` read files and probe what is there.
"""

from __future__ import annotations

import os

PROCESS_BYTES = 150 * 2**20  # one Python interpreter with torch or JAX imported, nothing allocated
MIN_PROCESS_CAP = 32  # ranks allowed on any machine: the test suite's 8 and the docs' 16 fit


def process_cap(cores: int | None = None) -> int:
    """The most ranks/devices allowed: max(32, 4 × CPU cores) (gloo ranks over-subscribed 4×
    still make progress; 100000 would spawn until the machine stops)."""
    return max(MIN_PROCESS_CAP, 4 * (cores or os.cpu_count() or 1))


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else the free
    physical pages from sysconf; None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def rank_bytes(cfg) -> int:
    """One rank's estimate: two model copies' state (4·Φ·b each) plus one step's activations.
    MLP: 4 tensors of B×D per layer. Transformer: ~16 of B·T×D per block, the attention scores
    (3 × B·H×T×T per block) and the logits (3 × B·T×V). Mixed precision: the state in float32, the
    activations in the compute dtype."""
    b = cfg.compute_bytes  # bfloat16 is no NumPy dtype: the project's byte table (shared.config)
    state = 2 * 4 * cfg.n_params * cfg.bytes_per_element  # mixed precision: float32 master state
    if cfg.model == "mlp":
        acts = 4 * cfg.batch * cfg.dim * cfg.layers
    else:
        tokens = cfg.batch * cfg.seq
        acts = cfg.layers * (16 * tokens * cfg.dim + 3 * cfg.batch * cfg.heads * cfg.seq * cfg.seq) \
            + 3 * tokens * cfg.vocab
    return state + acts * b


def estimate(cfgs, frameworks, processes: int) -> int:
    """Bytes the run's biggest config needs at once (the frameworks run one after the other):
    torch ``processes`` processes of one rank each, JAX one process of world-size devices."""
    need = 0
    for cfg in cfgs:
        per_rank = rank_bytes(cfg)
        if "torch" in frameworks:
            need = max(need, processes * (PROCESS_BYTES + per_rank))
        if "jax" in frameworks:
            need = max(need, PROCESS_BYTES + cfg.world_size * per_rank)
    return need


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_resources(cfgs, frameworks, under_torchrun: bool = False, available: int | None = None,
                    cores: int | None = None) -> None:
    """Refuse (ValueError, one line) a world size beyond process_cap() or a run whose estimate
    exceeds the available memory. Under torchrun this process is one rank of its node."""
    world = cfgs[0].world_size
    check_processes(world, under_torchrun, cores)
    processes = 1 if under_torchrun else world
    big = max(cfgs, key=rank_bytes)
    acc = getattr(big, "accumulate", 1)
    check_memory(estimate(cfgs, frameworks, processes), available,
                 f"{processes} process(es), {big.model} dim={big.dim} layers={big.layers} batch={big.batch}"
                 + (f" (--accumulate {acc} micro-batches of {big.batch // acc})" if acc > 1 else "")
                 + f": {_gib(rank_bytes(big))} per rank",
                 "use a smaller --accumulate" if acc > 1 else "use smaller sizes or fewer ranks")


def check_processes(world: int, launched: bool = False, cores: int | None = None) -> None:
    """--world-size beyond process_cap() (not when this process is one rank of a launch)."""
    cap = process_cap(cores)
    if world > cap and not launched:
        raise ValueError(f"--world-size {world}: more ranks than this machine can run "
                         f"(at most {cap} = max({MIN_PROCESS_CAP}, 4 × {cores or os.cpu_count()} CPU cores)); "
                         "pass --no-resource-check to start them anyway")


def check_memory(need: int, available: int | None, detail: str, fix: str) -> None:
    """``need`` bytes against ``available`` (default: available_memory(); unknown: no check)."""
    available = available_memory() if available is None else available
    if available is not None and need > available:
        raise ValueError(f"this run needs about {_gib(need)} of memory ({detail}) but {_gib(available)} is "
                         f"available; {fix}, or pass --no-resource-check")


def bench_bytes(frameworks, world: int, max_bytes: int, iters: int, processes: int) -> int:
    """compare.py bench's host memory at its largest message S: a torch rank holds its input and
    output (≤ 2·S) and gloo's staging (≤ S) in its own process; JAX holds, per device, the input
    and the ``iters`` outputs dispatched back to back (≤ (iters + 2)·S) in this one process."""
    need = 0
    if "torch" in frameworks:
        need = processes * (PROCESS_BYTES + 3 * max_bytes)
    if "jax" in frameworks:
        need = max(need, PROCESS_BYTES + world * (iters + 2) * max_bytes)
    return need


def check_bench_resources(frameworks, world: int, max_bytes: int, iters: int, on_gpu: bool = False,
                          launched: bool = False, available: int | None = None, cores: int | None = None) -> None:
    """compare.py bench's up-front check (the main command's, for a sweep): ranks against the
    cores; on CPU, the messages against the memory (on GPUs they live in device memory: the
    processes alone are checked)."""
    check_processes(world, launched, cores)
    if not on_gpu:
        processes = 1 if launched else world
        check_memory(bench_bytes(frameworks, world, max_bytes, iters, processes), available,
                     f"{processes} process(es), messages up to {_gib(max_bytes)}, {iters} iterations",
                     "lower --max-bytes or --iters, or use fewer ranks")


# --- the distributed environment -----------------------------------------------------------------

TORCHRUN_MARKS = ("TORCHELASTIC_RUN_ID",)  # set by torchrun's agent for every worker, never by hand
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT")
INT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT",
            "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def check_environment(env) -> None:
    """Refuse a distributed environment this process was not started into: RANK/WORLD_SIZE/
    MASTER_* exported by hand (or left over from a torchrun job) with no torchrun around would
    wait for peers that never come (905 s, then a DistStoreError). torchrun marks its workers with
    TORCHELASTIC_RUN_ID; another launcher that sets the rank variables must set it too. Also: each
    integer variable must be an integer (the message names it)."""
    for name in INT_VARS:
        value = env.get(name)
        if value is not None:
            try:
                n = int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
            if n < 0 or (n == 0 and name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "JAX_NUM_PROCESSES")) or (
                    name == "MASTER_PORT" and n > 65535):
                raise ValueError(f"environment variable {name}={value!r} is out of range")
    present = [name for name in RANK_VARS if name in env]
    if present and not any(env.get(mark) for mark in TORCHRUN_MARKS):
        raise ValueError(f"{', '.join(f'{n}={env[n]}' for n in present)} set, but this process was not "
                         "started by torchrun (no TORCHELASTIC_RUN_ID): a stale environment would wait for "
                         f"ranks that never come; unset {' '.join(present)}, or launch with torchrun")


# --- JAX's environment: JAX_PLATFORMS and XLA_FLAGS, before JAX starts ---------------------------

GPU_PLATFORMS = ("gpu", "cuda")  # what the driver query below can answer for (ROCm: JAX's own error)
SAFE_XLA_FLAGS = ("xla_force_host_platform_device_count",)  # this project's own (shared.env)
# XLA:CPU's faster compilation, the tests' (tests/conftest.py) and compare.py's when asked (fast_cpu_compile):
# LLVM at -O0, the element-wise emitters, LLVM's module in one piece (not split over threads)
CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                     "--xla_cpu_parallel_codegen_split_count=1")
COMPILE_TIME_XLA_FLAGS = tuple(flag[2:].split("=")[0] for flag in CPU_COMPILE_FLAGS)
PROBED_MARK = "PARALLEL_TWINS_XLA_PROBED"  # set where known_xla_flags chose them: known to this XLA, no probe


def check_jax_environment(env, gpus=None, probe=None) -> None:
    """Refuse (ValueError, one line naming the variable) what would otherwise abort or raise inside
    JAX: JAX_PLATFORMS=gpu|cuda on a machine whose driver shows no GPU (``gpus``: the count, default
    shared.env.local_gpu_count()); an XLA_FLAGS word that is not a --flag (XLA then reads the whole
    value as a file name) or a flag XLA does not know (XLA:CPU aborts the process with a C++ log
    line). A flag other than this project's own is tried first in a child interpreter (``probe``:
    flags -> None or XLA's complaint; a second or so, only then). An unknown JAX_PLATFORMS name is
    caught where JAX starts (args.check_devices)."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    wants_gpu = [p for p in platforms if p.lower() in GPU_PLATFORMS]
    if wants_gpu:  # JAX starts every platform listed
        if gpus is None:
            from shared.env import local_gpu_count

            gpus = local_gpu_count()
        if gpus == 0:
            raise ValueError(f"environment variable JAX_PLATFORMS={env['JAX_PLATFORMS']!r}: this machine has no "
                             "GPU the CUDA driver shows; unset it, or set JAX_PLATFORMS=cpu")
    flags = env.get("XLA_FLAGS", "").split()
    bad = [word for word in flags if not word.startswith("--") or len(word) < 3]
    if bad:
        raise ValueError(f"environment variable XLA_FLAGS={env['XLA_FLAGS']!r}: {bad[0]!r} is not a --flag "
                         "(XLA would read the whole value as a file name); use --name=value words")
    safe = SAFE_XLA_FLAGS + (COMPILE_TIME_XLA_FLAGS if env.get(PROBED_MARK) else ())  # jaxlib 0.11 dropped one
    unusual = [word for word in flags if word[2:].split("=", 1)[0] not in safe]
    if unusual:
        complaint = (probe or probe_xla_flags)(env["XLA_FLAGS"])
        if complaint:
            raise ValueError(f"environment variable XLA_FLAGS={env['XLA_FLAGS']!r}: {complaint} (XLA would abort); "
                             "fix or remove that flag")


XLA_CHOICE = "PARALLEL_TWINS_XLA"  # "fast": compare.py's JAX compiles at -O0 on the CPU (parity only)


def fast_cpu_compile(env, jax_on_cpu: bool, preset: str | None, probe=None) -> list[str]:
    """Asked for (PARALLEL_TWINS_XLA=fast), compare.py's table on the CPU at the cpu / tiny sizes: XLA:CPU
    compiles at -O0 with its element-wise emitters (the tests' flags, tests/conftest.py), added to
    ``env["XLA_FLAGS"]`` before JAX starts; returns the flags added. Not the default: measured on 2 cores at the
    cpu sizes (dp, fsdp, tp; 18 JAX runs) it takes the run from 88 s to 56 s, but the steps it times run 1.1-3.1x
    slower (median 1.8x), so the time column would no longer say what XLA makes of a pattern, and the rounding
    differs from XLA's defaults (every parity verdict holds either way: the tests run so). The rows then say
    "XLA -O0" where they ran (jax_impl.devices.where). Nothing is added off the CPU, at --size gpu, or with a
    flag of these already in XLA_FLAGS; compare.py bench (the timing subcommands) never comes here."""
    if not jax_on_cpu or preset == "gpu" or env.get(XLA_CHOICE, "").lower() != "fast":
        return []
    present = env.get("XLA_FLAGS", "")
    if any(flag.split("=")[0] in present for flag in CPU_COMPILE_FLAGS):
        return []
    flags = list(CPU_COMPILE_FLAGS) if env.get(PROBED_MARK) else known_xla_flags(CPU_COMPILE_FLAGS, probe)
    env["XLA_FLAGS"] = " ".join([present, *flags]).strip()
    env[PROBED_MARK] = "1"
    return flags


def known_xla_flags(flags, probe=None) -> list[str]:
    """Of ``flags`` (--name=value words), those the installed XLA knows: one probe of them all, and one per
    flag only when that fails. XLA aborts the process on a flag it does not know, silently under pytest
    (jaxlib 0.11 dropped --xla_cpu_use_fusion_emitters, which tests/conftest.py passes to older ones)."""
    flags = list(flags)
    probe = probe or probe_xla_flags
    if not flags or probe(" ".join(flags)) is None:
        return flags
    return [flag for flag in flags if probe(flag) is None]


def probe_xla_flags(flags: str, timeout_s: float = 120.0) -> str | None:
    """Start XLA:CPU with ``flags`` in a child interpreter: None when it starts, else XLA's own
    complaint (its last log line about XLA_FLAGS, without the log prefix)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        done = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return None  # not XLA_FLAGS' fault that we know of: let the run say what happens
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    line = next((x for x in reversed(lines) if "XLA_FLAGS" in x), lines[-1] if lines else f"exit {done.returncode}")
    return line.split("] ", 1)[1] if "] " in line else line.strip()
