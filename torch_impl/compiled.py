"""The ``compiled`` style's runner side: torch.compile over the builtin wrappers (and over the hand-written
Megatron steps), the twin of JAX's ``jit`` rows. The library part (what to compile, the watch, the private
torch APIs): torch_impl/parallel/compiled.py; the patterns build their compiled variants themselves (dp.py,
fsdp.py, tp.py, pp.py, mesh.py) and mark the Setup ``compiled``; harness.train_loop runs it through
``CompiledRun`` below. No jax_impl/compiled.py twin: JAX's compiled style is ``jit``, built in each
pattern's own file (jax_impl/dp.py, tp.py, …), where XLA compiles every step anyway.

    compiled/ddp          torch.compile(DDP(model)): DDPOptimizer splits the graph at DDP's buckets; DDP's
                          reducer all-reduces eagerly (what torch documents for DDP)
    compiled/fsdp2        fully_shard per block + each block compiled (torchtitan): FSDP2's gathers and
                          reduce-scatters run in its eager hooks, the blocks' compute compiled
    compiled/dtensor(_sp) DTensor plans, each block compiled: the tp collectives become functional collectives
                          in the compiled programs (the embedding's, the head's and the loss's stay eager)
    compiled/megatron     the hand-written Megatron f/g (autograd Functions over dist.all_reduce), each block
                          compiled: dynamo rewrites dist.all_reduce into the same functional collective
    compiled/<schedule>   torch.distributed.pipelining with each stage compiled; send/recv stay eager
                          (not zb: VARIANT_REFUSALS)
The N-D mesh: compose.parallelize(compile=True) (library), not a compare.py row (MESH_REFUSAL).

A compiled run's row: ``compile_s`` (the first step's time minus the median step: dynamo + inductor, or a
cache load); extra ``compiled`` (units, graphs, graph breaks, inductor's collective-changing passes on),
``comm_compiled`` / ``comm_eager`` (the last step's collectives split by who issued them: a compiled program
or eager code; read by parallel/compiled_ledger.py from torch's profiler) and ``programs`` (each compiled
program that issued collectives: their kinds in its order, and how many times it ran in the step).
Refused in one line (REFUSALS): what torch 2.13 cannot compile on these patterns.
"""

from __future__ import annotations

import contextlib

import numpy as np

from torch_impl.parallel import compiled as lib
from torch_impl.parallel import compiled_ledger
from torch_impl.parallel.compiled import compile_units  # noqa: F401  (the runners' one import)

STYLE = "compiled"
# What the model's units are, per model: each is compiled on its own (identical blocks share one graph).
UNITS = {"transformer": ["blocks.*"], "mlp": ["layers.*"]}
# What torch 2.13 (CPU and GPU) cannot compile here, one line each (compare.py --styles compiled prints it).
REFUSALS = {
    "cp": "cp compiled: torch's context_parallel runs on CUDA only (torch_impl/cp.py BUILTIN_REFUSAL) and the "
          "hand-written ring passes K|V with dist.batch_isend_irecv inside an autograd Function, which dynamo "
          "cannot trace (torch 2.13 has no functional send/recv); no compiled cp row",
    "ep": "ep compiled: the dropless dispatcher sizes its all_to_all_single by the routing counts it reads back "
          "(.tolist()), a data-dependent shape dynamo breaks the graph on every step; no compiled ep row",
    "collectives": "collectives compiled: the collective checks call dist.* one by one; nothing to compile",
}


# Variants of a compiled pattern that torch cannot compile (the pattern's other variants run).
VARIANT_REFUSALS = {
    "pp": "pp compiled/zb: the zero-bubble schedule splits each stage's backward into the input gradient first and "
          "the weight gradients later (pipelining's stage_backward_input: autograd.grad w.r.t. the stage input "
          "alone), and a compiled stage has one fused backward that torch 2.13 cannot split ('Failed to run stage "
          "backward input'); gpipe, 1f1b and interleaved run compiled",
}


MESH_REFUSAL = (
    "mesh compiled: no compare.py row: the N-D ledger splits every collective by the mesh axis of its process group, "
    "and of a compiled step torch shows the collectives only through its profiler, which records no process group "
    "(a TorchDispatchMode, the eager ledger, makes dynamo run the units eagerly instead); the compiled layout runs "
    "through compose.parallelize(compile=True) (examples/compose_torch.py --compile), its ledger summed over axes")


def refusal(pattern: str, cfg=None) -> str | None:
    """Why the compiled style has no row for ``pattern`` (None: it has)."""
    return MESH_REFUSAL if pattern == "mesh" else REFUSALS.get(pattern)


def begin(device_type: str) -> None:
    """Before a compiled variant builds its model: the caches (lib.prepare) and a fresh dynamo state."""
    lib.prepare(device_type)
    lib.reset()


def units(cfg) -> list[str]:
    return UNITS[cfg.model]


class CompiledRun:
    """harness.train_loop's side of a compiled Setup: the first step under ``lib.Watch`` (it must compile a
    graph), the later ones under ``lib.steady`` (a recompile raises), the last step's collectives read by the
    profiler (parallel/compiled_ledger.py: who issued each, a compiled program or eager code), and the row's
    extra."""

    def __init__(self, units_compiled: list[str], params):
        self.units, self.watch, self.rec = units_compiled, None, None
        self.list_dtype = next(iter(params)).dtype  # DDP's buckets, the pipeline's messages

    @contextlib.contextmanager
    def step(self, first: bool):
        if first:
            with lib.Watch() as self.watch:
                yield
            lib.require_compiled(self.watch, f"compiled {', '.join(self.units) or 'model'}")
        else:
            with lib.steady():
                yield

    @contextlib.contextmanager
    def recording(self):
        with compiled_ledger.recording(self.list_dtype) as self.rec:
            yield self.rec

    @property
    def comm(self) -> dict:
        return self.rec.comm

    def extra(self, step_times: list[float]) -> dict:
        first, rest = step_times[0], step_times[1:]
        return {"compile_s": max(0.0, first - float(np.median(rest))) if rest else first,
                "compiled": {"units": self.units, "graphs": self.watch.graphs if self.watch else None,
                             "graph_breaks": self.watch.breaks if self.watch else {},
                             "fx_graph_cache": self.watch.cache if self.watch else {},
                             "comm_passes": lib.comm_passes()},
                "comm_compiled": self.rec.compiled if self.rec else {},
                "comm_eager": self.rec.eager if self.rec else {},
                "programs": self.rec.programs if self.rec else []}

