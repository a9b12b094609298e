"""torch.compile over the parallel wrappers: torch's SPMD compiler, the twin of JAX's ``jit``.
No jax_impl/parallel/compiled.py: JAX's compile cache is set in shared/env.py, and ``jax.jit`` needs no watch or reset.

    compiled.prepare("cpu")                                # the compile caches, one compile thread per CPU rank
    compiled.reset()                                       # a fresh dynamo state for this run
    with compiled.Watch() as watch:                        # what dynamo compiled (graphs, graph breaks) …
        loss = step()                                      # … the first step: compiles every unit
    compiled.require_compiled(watch, "tp compiled/dtensor")   # ONE line when nothing was compiled
    with compiled.steady():                                # later steps: a recompile raises, never runs eagerly
        loss = step()
    compiled.compile_units(model, ["blocks.*"])            # each unit's forward compiled (torchtitan's per block)

What the compiler sees (torch 2.13): dynamo traces each unit's forward; AOTAutograd turns DTensor ops
into plain ops and *functional collectives* (``_c10d_functional.all_reduce`` …, graph nodes with a
``wait_tensor``), and the project's autograd Functions' ``dist.all_reduce`` into the same nodes
(dynamo's traceable-collective remap); inductor then writes one Python program per graph (forward,
backward) that calls those collectives between its fused kernels. So DTensor TP and the hand-written
Megatron f/g end up as collectives inside the compiled program; FSDP2's all-gathers and reduce-scatters
stay in its eager module hooks (torch 2.13 skips FSDP hooks when tracing), DDP's all-reduce in its C++
reducer (DDPOptimizer splits the graph at bucket boundaries) and the pipeline's send/recv in the
schedule: those run eagerly beside the compiled compute. compiled_ledger.py reads, from torch's profiler,
which collectives a step ran and whether a compiled program or eager code issued each.

Private torch APIs, all here and nowhere else (no public form exists in torch 2.13): dynamo's
``counters`` (graphs compiled, graph breaks) and inductor's config flags of the passes that bucket or
reorder collectives. Everything else is public (``torch.compile``,
``torch.compiler.reset`` / ``set_stance``, the TORCHINDUCTOR_* variables of torch's compile-caching guide).
"""

from __future__ import annotations

import contextlib
import logging
import os
from fnmatch import fnmatch

import torch
import torch.nn as nn

# inductor's passes that change collectives (torch 2.13 names; all off by default on CPU and GPU alike):
# bucketing (several collectives into one), reordering (moving them for overlap), DDP's fused all-reduces,
# async TP's fused matmul + collective. ``comm_passes()`` lists those a run turned on.
COMM_PASSES = ("bucket_all_gathers_fx", "bucket_reduce_scatters_fx", "bucket_all_reduces_fx",
               "reorder_for_compute_comm_overlap", "_fuse_ddp_communication", "_micro_pipeline_tp")


# torch's warnings that a compiled graph holding a ProcessGroup (the hand-written Megatron Functions keep their
# group) cannot be written to the FX / AOTAutograd caches: that graph is compiled again by the next run (said
# once here instead of a traceback-sized warning per rank and graph).
QUIET_LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")


class CompileError(RuntimeError):
    """A step that was asked to run compiled code and did not (or had to recompile)."""


def default_cache_dir() -> str:
    """Where inductor keeps its FX graphs and compiled kernels across runs: TORCHINDUCTOR_CACHE_DIR when set,
    else the user's cache folder ($XDG_CACHE_HOME or ~/.cache)/parallel-twins/torch-compile."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(base, "parallel-twins", "torch-compile")


def prepare(device_type: str) -> str:
    """Before the first compile of this process: inductor's cache folder (``default_cache_dir``; the FX graph
    and compiled-kernel caches are on by default, so a second run of the same graphs skips inductor's C++
    compile), and on CPU one compile thread per rank (the ranks already share the cores: a worker pool per
    rank made a first compile 45 s instead of 27 s on 2 cores). A value the user set is kept. Returns the folder."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    if device_type == "cpu" and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        # inductor reads that variable when its config is imported, which a rank's forkserver has done
        # already (torch_impl.launch.PRELOAD): the config's own value too
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def reset() -> None:
    """A fresh dynamo state (torch.compiler.reset): units compiled by an earlier run of this process would
    add recompiles on the same code (``nn.Module._call_impl``) until dynamo's recompile limit falls back to
    eager. The caches on disk stay, so the same graphs compile fast again."""
    torch.compiler.reset()


def compile_units(model: nn.Module, units: list[str], **options) -> list[str]:
    """``torch.compile(module.forward, **options)`` on every submodule whose path matches a glob of ``units``
    (``*`` = one path segment; "" = the model itself): torchtitan's per-block compile. The module's hooks (FSDP2's,
    pipelining's) stay eager around the compiled forward, as does ``own_inputs`` (below). Identical blocks share
    one compiled graph. Returns the paths compiled; none matching is refused (the step would run eagerly)."""
    paths = [path for path, _ in model.named_modules() if any(_matches(path, u) for u in units)]
    if not paths:
        raise CompileError(f"compile: no module of {type(model).__name__} matches {units}; name the units to "
                           "compile by module path (e.g. 'blocks.*', 'model.layers.*', or '' for the whole model)")
    for path in paths:
        module = model.get_submodule(path)
        module.register_forward_pre_hook(own_inputs, with_kwargs=True)
        module.forward = torch.compile(module.forward, **options)
    return paths


def own_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A compiled unit's tensor arguments that are views needing a gradient, copied (eagerly, before the compiled
    forward). torch 2.13's AOTAutograd mis-differentiates a compiled graph whose input is the view that DTensor's
    ``to_local()`` returns (a DTensor plan's module output, e.g. a vocabulary-parallel embedding's, fed straight to
    the first compiled block): under tp alone DTensor's Redistribute backward then fails ("'Tensor' object has no
    attribute '_local_tensor'"), under FSDP2 × TP the gradients come out silently wrong (measured on transformers'
    Llama, fsdp=2,tp=2: step 0's loss equal, step 2's 6.4e-3 off). A copy is a fresh graph input; it costs one
    activation copy per unit whose input is a view (none in the project's transformer)."""
    own = lambda a: a.clone() if isinstance(a, torch.Tensor) and a.requires_grad and a._is_view() else a  # noqa: E731
    return tuple(own(a) for a in args), {k: own(v) for k, v in kwargs.items()}


def _matches(path: str, pattern: str) -> bool:
    if pattern == "":
        return path == ""
    a, b = path.split("."), pattern.split(".")
    return len(a) == len(b) and all(fnmatch(x, y) for x, y in zip(a, b, strict=True))


def _counters() -> dict:
    """dynamo's counters (private: torch._dynamo.utils.counters, stable across 2.x): graphs compiled, graph
    breaks by reason, frames compiled."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"],
            "breaks": dict(counters["graph_break"]), "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "cache_misses": counters["inductor"]["fxgraph_cache_miss"]}


class Watch:
    """What dynamo compiled while the block ran: ``graphs`` (new graphs), ``frames`` (frames compiled),
    ``breaks`` ({reason: count}: where a unit's trace stopped and ran the rest eagerly) and ``cache`` (inductor's
    FX graph cache: {"hits", "misses"}, forward and backward graphs apart)."""

    def __enter__(self):
        self._before = _counters()
        return self

    def __exit__(self, *exc):
        after = _counters()
        self.graphs = after["graphs"] - self._before["graphs"]
        self.frames = after["frames"] - self._before["frames"]
        self.breaks = {k.split("\n")[0][:160]: v - self._before["breaks"].get(k, 0)
                       for k, v in after["breaks"].items() if v > self._before["breaks"].get(k, 0)}
        # inductor's FX graph cache: graphs loaded from it (a warm cache: no C++ compile) and graphs compiled
        self.cache = {k: after[f"cache_{k}"] - self._before[f"cache_{k}"] for k in ("hits", "misses")}
        return False


def require_compiled(watch: Watch, what: str) -> None:
    """Refuse (CompileError, one line) a first step in which dynamo compiled no graph: the units would run
    eagerly under the name 'compiled'."""
    if watch.graphs < 1:
        raise CompileError(f"{what}: the first step compiled no graph (dynamo skipped every unit), so it would run "
                           "eagerly; nothing is reported as compiled")


@contextlib.contextmanager
def steady():
    """Later steps must run what the first step compiled: torch.compiler.set_stance("fail_on_recompile")
    turns any recompile (a guard that no longer holds) into an error instead of a new compile."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def comm_passes() -> list[str]:
    """inductor's collective-changing passes (COMM_PASSES) this process turned on (private: torch._inductor.config)."""
    import torch._inductor.config as config

    on = [name for name in COMM_PASSES if getattr(config, name, None) not in (None, False, "none")]
    overlap = getattr(getattr(config, "aten_distributed_optimizations", None), "enable_overlap_scheduling", False)
    return on + (["enable_overlap_scheduling"] if overlap else [])
