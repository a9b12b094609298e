"""Checkpoints, torch side: save model and AdamW state with ``torch.distributed.checkpoint`` (DCP) under
any pattern, load it under any other layout, world size or framework, and continue bit for bit.

What is saved is the canonical state (shared.checkpoint.State): every parameter and both AdamW moments
under its fixture name and orientation, whole in meaning — so a checkpoint does not depend on the layout
that wrote it. Each rank writes its own Shard(0) chunk of every canonical array: the arrays are
DTensors on a 1-D mesh of the world, DCP's HuggingFaceStorageWriter(save_distributed=True) writes one
safetensors file per rank (``dcp/shard-0000R-model-00001-of-00001.safetensors``) whose header records each
chunk's offset (DCP_SHARDING_INFO). Loading is DCP's resharding: HuggingFaceStorageReader reads the
chunks of any number of writers into the tensors this run asks for (every rank: the whole arrays),
one process included; JAX reads the same files with NumPy (shared.checkpoint.read_dcp).

From the canonical arrays to a pattern's own layout, one code path for start and resume: the pattern
is built from a Problem whose ``params`` are the checkpoint's (as it is built from the fixture at step
0), and the moments are laid out the same way by building it from the moments (a *probe*: the
harness stops before the first step and hands back the optimizer's tensors). The other way, a pattern's
``Setup.fixture`` (or ``grads_fixture``, for ZeRO-1's flat slice) gathers parameters and moments alike.
A pattern whose optimizer holds tensors laid out like neither is refused before it trains.

    plan = Plan(dir="ckpt", every=2)                      # shared.checkpoint.Plan
    run_pattern(ctx, "fsdp", [cfg], checkpoint=plan)     # saves ckpt/torch-fsdp-explicit-zero3-mlp/step_000002 …
    run_pattern(ctx, "tp", [cfg], checkpoint=Plan(dir="ckpt", load=".../step_000002"))  # continues under tp

Bytes per save: 3 × the model's parameters (params, exp_avg, exp_avg_sq) in float64, 1/N per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from shared import preempt
from shared.checkpoint import (
    CheckpointError,
    Plan,
    RunLock,
    State,
    abandon,
    aside,
    commit,
    fault,
    manifest,
    read_state,
    save_error,
    step_name,
    verify,
)
from shared.problem import param_shapes


@dataclass
class Session:
    """What the harness's loop does with checkpoints in the run under way (see ``session``)."""

    plan: Plan | None = None  # saves: plan.due(done); None: saves nothing
    run_dir: str | None = None
    layout: dict = field(default_factory=dict)  # {"pattern", "style", "variant", "world_size", "mesh"}
    start: int = 0  # optimizer steps already done (the checkpoint's step)
    moments: tuple | None = None  # (exp_avg, exp_avg_sq) tensors, in the optimizer's own layout
    probe: bool = False  # stop before the first step with the optimizer's tensors (Probed)
    saved: list = field(default_factory=list)  # {"step", "path", "bytes", "save_s"} per save


_SESSIONS: list[Session] = []


@contextlib.contextmanager
def session(s: Session):
    """The checkpoint session of the runs started inside (as transformer.recomputing is for JAX)."""
    _SESSIONS.append(s)
    try:
        yield s
    finally:
        _SESSIONS.pop()


def current() -> Session | None:
    return _SESSIONS[-1] if _SESSIONS else None


class Probed(Exception):  # noqa: N818 — a signal, not an error: the probe's answer
    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__("probe")
        self.tensors = tensors


def torch_optimizer(opt) -> torch.optim.Optimizer:
    """The torch optimizer inside a pattern's (ZeRO-1 wraps AdamW on its slice: ``opt.local``)."""
    if isinstance(opt, torch.optim.Optimizer):
        return opt
    inner = [v for v in vars(opt).values() if isinstance(v, torch.optim.Optimizer)]
    if len(inner) != 1:
        raise CheckpointError(f"{type(opt).__name__}: no torch optimizer found inside it to checkpoint")
    return inner[0]


def opt_params(opt) -> list[torch.Tensor]:
    return [p for g in torch_optimizer(opt).param_groups for p in g["params"]]


def moments_fixture(setup, where: str):
    """How this Setup's AdamW moments become canonical arrays: laid out as its parameters (fixture) or
    as its gradients (grads_fixture: ZeRO-1's flat slice); else refused (one line)."""
    ps = opt_params(setup.optimizer)
    if len(ps) == len(setup.params) and all(a is b for a, b in zip(ps, setup.params)):
        return setup.fixture
    grads = [g for g in setup.grads() if g is not None]
    if setup.grads_fixture and [p.shape for p in ps] == [g.shape for g in grads]:
        return setup.grads_fixture
    raise CheckpointError(f"{where}: its optimizer holds tensors laid out unlike its parameters and its gradients: "
                          "checkpoints are not supported for it")


def restore(setup, s: Session, where: str) -> None:
    """Put the checkpoint's moments and step count into the optimizer (before the first step)."""
    moments_fixture(setup, where)  # refused here, before training, when it could not be saved again
    opt, ps = torch_optimizer(setup.optimizer), opt_params(setup.optimizer)
    exp_avg, exp_avg_sq = s.moments
    for p, m, v in zip(ps, exp_avg, exp_avg_sq, strict=True):
        if type(m) is not type(p.detach()) or m.shape != p.shape:
            raise CheckpointError(f"{where}: moment laid out as {type(m).__name__}{tuple(m.shape)}, its parameter "
                                  f"as {type(p).__name__}{tuple(p.shape)}")
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # as AdamW makes it
        opt.state[p] = {"step": torch.tensor(float(s.start), dtype=scalar),
                        "exp_avg": m.detach().clone(), "exp_avg_sq": v.detach().clone()}


def save(cfg, ctx, setup, done: int, s: Session) -> None:
    """Save after ``done`` steps: canonical arrays (gathered by the pattern's fixture), each rank its
    Shard(0) chunk through DCP, a manifest, one rename (shared.checkpoint.commit). Every rank calls it."""
    t0 = time.perf_counter()
    where = f"torch {s.layout['pattern']} {s.layout['style']}/{s.layout['variant']}"
    conv = moments_fixture(setup, where)
    opt, ps = torch_optimizer(setup.optimizer), opt_params(setup.optimizer)
    steps = {int(opt.state[p]["step"]) for p in ps if p in opt.state}
    assert steps == {done}, (steps, done)  # AdamW's own count: the bias correction resumes from it
    groups = {"params": setup.fixture(setup.params),  # rank 0: whole float64 fixture arrays
              "adam_m": conv([opt.state[p]["exp_avg"] for p in ps]),
              "adam_v": conv([opt.state[p]["exp_avg_sq"] for p in ps])}
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    state_dict = {}
    for group, arrays in groups.items():
        for (name, shape), a in zip(param_shapes(cfg).items(), arrays, strict=True):
            full = (torch.from_numpy(a) if ctx.rank == 0 else torch.empty(shape, dtype=torch.float64)).to(ctx.device)
            state_dict[f"{group}/{name}"] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=0)
    obj = [None, None]  # rank 0's tmp folder, or its one-line failure: every rank raises the same
    if ctx.rank == 0:
        try:
            obj[0] = aside(s.run_dir, done)
        except CheckpointError as exc:
            obj[1] = str(exc)
    dist.broadcast_object_list(obj, src=0)
    if obj[1]:
        raise CheckpointError(obj[1])
    try:  # a rank's failed write (full disk, read-only) reaches every rank through DCP's own gather
        dcp.save(state_dict, storage_writer=HuggingFaceStorageWriter(os.path.join(obj[0], "dcp"),
                                                                      save_distributed=True))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 — one line, whatever DCP raised
        if ctx.rank == 0:
            abandon(obj[0])
        raise save_error(s.run_dir, done, dcp_failure(exc)) from None
    fault("save", done, ctx.rank)  # the kill test's "in the middle of a save": files written, no manifest
    dist.barrier()  # every rank's files are written: only then is the checkpoint committed
    failed = [None]
    if ctx.rank == 0:
        try:
            path = commit(obj[0], manifest(cfg, done, "torch", "dcp", s.layout), keep=s.plan.keep)
            size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
            s.saved.append({"step": done, "path": path, "bytes": size, "save_s": time.perf_counter() - t0})
        except CheckpointError as exc:
            failed[0] = str(exc)
    dist.broadcast_object_list(failed, src=0)  # (a barrier too) every rank stops with rank 0's line
    if failed[0]:
        raise CheckpointError(failed[0])


def dcp_failure(exc: BaseException) -> BaseException:
    """The exception behind DCP's CheckpointException (a BaseException holding {rank: (exception,
    traceback)}; its str is every rank's traceback): the lowest failing rank's, e.g. the OSError of a
    full disk. Any other exception: itself."""
    failures = exc.failures if isinstance(exc, CheckpointException) else None
    return failures[min(failures)][0] if failures else exc


def load(path: str, cfg, ctx) -> State:
    """The canonical state of the checkpoint at ``path`` (either framework's), checked against ``cfg``:
    DCP's reader for torch's files (every rank: whole arrays), shared.orbax_files for JAX's."""
    info = verify(path, cfg)
    if info["writer"] != "dcp":
        state = read_state(path, info)
    else:
        reader = HuggingFaceStorageReader(os.path.join(path, "dcp"))
        meta = reader.read_metadata().state_dict_metadata
        tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()}
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(os.path.join(path, "dcp")))
        state = State.from_arrays(int(info["step"]), {k: t.numpy() for k, t in tensors.items()})
    state.check(cfg, where=path)
    return state


@contextlib.contextmanager
def writer_lock(plan: Plan, run_dir: str, ctx):
    """Rank 0 holds ``run_dir``'s lock (shared.checkpoint_io.RunLock) for the whole run when the run
    writes there: it creates every save's folder and commits it, and the other ranks write into
    that folder only between its barriers. A refusal reaches every rank (one line, before training)."""
    if not plan.writes:
        yield
        return
    lock, obj = RunLock(run_dir), [None]
    if ctx.rank == 0:
        try:
            lock.__enter__()
        except CheckpointError as exc:
            obj[0] = str(exc)
    dist.broadcast_object_list(obj, src=0)
    if obj[0]:
        raise CheckpointError(obj[0])
    try:
        yield
    finally:
        lock.__exit__()


def preempted(s: Session, step: int) -> preempt.Preempted:
    """What the training loop raises once every rank saved ``step`` on a signal (shared/preempt.py)."""
    return preempt.Preempted(step, os.path.join(s.run_dir, step_name(step)))


def stop_requested(ctx) -> bool:
    """Whether any rank got SIGTERM or SIGINT (one all-reduce (MAX) of the flag, outside any ledger):
    every rank answers the same."""
    flag = torch.tensor([float(preempt.requested())], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def run(module, pattern: str, cfg, problem, style: str, variant: str, ctx, plan: Plan):
    """One (style, variant) run of ``module`` under ``plan``: from step 0, or from the checkpoint
    plan.source() names (the pattern rebuilt from its arrays, its moments probed, then trained on).
    Rank 0 holds the run folder's lock throughout (``writer_lock``). A signal that came before it
    began (during a reference run, say) stops it before its first step: nothing saved."""
    if plan.writes and stop_requested(ctx):
        raise preempt.Preempted(None)
    run_dir = plan.run_dir("torch", pattern, style, variant, cfg)
    with writer_lock(plan, run_dir, ctx):
        return _run(module, pattern, cfg, problem, style, variant, ctx, plan, run_dir)


def _run(module, pattern, cfg, problem, style, variant, ctx, plan, run_dir):
    layout = {"pattern": pattern, "style": style, "variant": variant, "world_size": ctx.world_size,
              "mesh": list(cfg.mesh)}
    path = plan.source(run_dir, cfg.steps)
    if path is None:
        with session(Session(plan, run_dir, layout)) as s:
            trained = module.train(cfg, problem, style, variant, ctx)
        trained.extra["checkpoints"] = s.saved
        return trained
    t0 = time.perf_counter()
    state = load(path, cfg, ctx)
    if state.step >= cfg.steps:
        raise CheckpointError(f"{path}: saved after step {state.step}, this run has --steps {cfg.steps}: "
                              "nothing left to run")
    ordered = lambda group: {n: group[n] for n in param_shapes(cfg)}  # Problem.params: named_parameters() order
    moments = []
    for group in (state.adam_m, state.adam_v):
        try:
            with session(Session(layout=layout, probe=True)):
                module.train(cfg, dataclasses.replace(problem, params=ordered(group)), style, variant, ctx)
        except Probed as probed:
            moments.append(probed.tensors)
        else:
            raise CheckpointError(f"torch {pattern} {style}/{variant}: did not reach the training loop to probe")
    load_s = time.perf_counter() - t0
    with session(Session(plan, run_dir, layout, start=state.step, moments=tuple(moments))) as s:
        trained = module.train(cfg, dataclasses.replace(problem, params=ordered(state.params)), style, variant, ctx)
    trained.extra.update(checkpoints=s.saved, resumed_from=path, load_s=load_s)
    return trained


# --- a model's weights (a compose trainer's state), for the other framework's twin -------------------

def linear_weights(model: torch.nn.Module) -> set[str]:
    """The parameter names of ``model`` stored (out, in): every nn.Linear's weight (under each name a tied
    one has), stored transposed (x @ W) in a weights checkpoint (shared/checkpoint_weights.py)."""
    return {f"{path}.weight" if path else "weight" for path, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, torch.nn.Linear)}  # by module path: a wrapper's own parameter names do not matter


def save_weights(run_dir: str, step: int, state: dict[str, torch.Tensor], model: torch.nn.Module,
                 layout: dict | None = None) -> str:
    """Write ``state`` ({name: whole tensor}: ``Trainer.full_state_dict()``, or a model's own state dict)
    as a weights checkpoint ``run_dir/step_N`` (DCP, each rank its Shard(0) chunk; one process without a
    process group writes it alone) and commit it; returns its path on every rank. ``model``: the model the
    names are of (before or after ``parallelize``: its nn.Linear weights are stored transposed). float64
    stays float64, every other dtype is stored as float32 (lossless; NumPy reads it)."""
    from shared.checkpoint_weights import weights_manifest

    flip, dist_on = linear_weights(model), dist.is_available() and dist.is_initialized()
    arrays = {}
    for name, t in state.items():
        t = t.detach().to("cpu", torch.float64 if t.dtype == torch.float64 else torch.float32)
        arrays[f"params/{name}"] = (t.T if name in flip else t).contiguous()
    rank = dist.get_rank() if dist_on else 0
    if dist_on:  # every rank holds the whole state: each keeps its Shard(0) chunk of it
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        arrays = {k: distribute_tensor(a.to(device), mesh, [Shard(0) if a.ndim else Replicate()], src_data_rank=None)
                  for k, a in arrays.items()}
    folder = _rank0(lambda: aside(run_dir, step), rank, dist_on)
    try:
        with warnings.catch_warnings():  # one process: DCP warns that it saves without a process group (meant)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(arrays, storage_writer=HuggingFaceStorageWriter(os.path.join(folder, "dcp"),
                                                                     save_distributed=dist_on), no_dist=not dist_on)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 — one line, whatever DCP raised
        if rank == 0:
            abandon(folder)
        raise save_error(run_dir, step, dcp_failure(exc)) from None
    if dist_on:
        dist.barrier()
    shapes = {k.partition("/")[2]: tuple(a.shape) for k, a in arrays.items()}
    return _rank0(lambda: commit(folder, weights_manifest(step, "torch", "dcp", shapes, layout)), rank, dist_on)


def _rank0(fn, rank: int, dist_on: bool):
    """``fn()`` on rank 0, its result (or its CheckpointError, raised on every rank) broadcast to all."""
    out = [None, None]
    if rank == 0:
        try:
            out[0] = fn()
        except CheckpointError as exc:
            out[1] = str(exc)
    if dist_on:
        dist.broadcast_object_list(out, src=0)
    if out[1]:
        raise CheckpointError(out[1])
    return out[0]


def load_weights(path: str, model: torch.nn.Module) -> torch.nn.Module:
    """Copy a weights checkpoint (either framework's: shared.checkpoint_weights.read_weights) into
    ``model``'s parameters (every one, by name; nn.Linear weights transposed back); returns ``model``.
    A name or shape that does not map: CheckpointError, one line, before anything is copied."""
    from shared.checkpoint_weights import check_names, read_weights

    arrays, flip = read_weights(path), linear_weights(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    want = {n: tuple(p.shape[::-1]) if n in flip else tuple(p.shape) for n, p in params.items()}
    check_names(arrays, want, path)
    with torch.no_grad():
        for n, p in params.items():
            a = torch.from_numpy(np.ascontiguousarray(arrays[n]))
            p.copy_((a.T if n in flip else a).to(p.dtype))
    return model
