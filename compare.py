"""compare.py: run every pattern in torch and JAX, check parity, print one table.

    python compare.py                                   # everything, both models, CPU, world size 4 simulated
    python compare.py --model transformer --patterns tp # one model, one pattern
    python compare.py --model transformer --patterns tp,cp --show-collectives cp   # SP, ring, Ulysses
    python compare.py --patterns dp,fsdp --dtype float32 --json out.json
    python compare.py --model transformer --mesh dp=2,tp=2,pp=2 --show-collectives mesh  # 3-D, 8 ranks
    python compare.py --mesh "dp=2,tp=2;fsdp=2,tp=2;tp=2,pp=2"   # several layouts, one launch each side
    python compare.py --model transformer --patterns ep --experts 8 --topk 2 --show-collectives ep  # MoE
    python compare.py bench --frameworks torch,jax      # nccl-tests-style bandwidth sweep
    python compare.py plan --layers 80 --dim 8192 --heads 64 --gpus 256   # rank layouts (docs/plan.md)
    torchrun --nproc_per_node=8 compare.py --frameworks torch --world-size 8   # join a torchrun launch

Exit status: 0 when everything agrees, 1 when a parity check (or a run) fails, 2 for bad
arguments or a bad config (one line on stderr, before any process starts).

JAX is imported only after the simulated-device flag is set (and only if asked for), and torch
ranks never import JAX: they are spawned fresh and re-import this file as ``__mp_main__``, whose
top level imports only the standard library and two NumPy-only modules of ``shared``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from shared.collectives import BENCH_OPS, BENCH_SIZES  # NumPy only: safe before JAX starts
from shared.config import DTYPES, MODELS, PATTERNS, RECOMPUTE, format_mesh, parse_mesh
from shared.env import simulate_host_devices

FRAMEWORKS = ("torch", "jax")


class ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, exit 2 (argparse prints usage + error otherwise)
        raise ArgumentError(message)


def _csv(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return items

    return parse


def _layouts(text: str) -> list[tuple[tuple[str, int], ...]]:
    try:
        return [parse_mesh(part) for part in text.split(";") if part.strip()] or [parse_mesh(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="compare.py", description="Run every parallelism pattern in torch and JAX and check parity.")
    p.add_argument("--patterns", type=_csv(PATTERNS), default=None,
                   help="comma list (default: every 1-D pattern; mesh when --mesh is given)")
    p.add_argument("--mesh", type=_layouts, default=None, metavar="LAYOUT[;LAYOUT…]",
                   help="N-D layouts of the transformer, axes in device order, innermost last, e.g. "
                        "dp=2,tp=2,pp=2 (axes dp|fsdp, pp, cp, tp; product = world size)"),
    p.add_argument("--experts", type=int, default=None, metavar="E",
                   help="ep: experts per MoE layer, E %% world size == 0 (default: the smallest multiple of "
                        "the world size >= 4)")
    p.add_argument("--topk", type=int, default=2, metavar="K", help="ep: experts per token (default 2)")
    p.add_argument("--frameworks", type=_csv(FRAMEWORKS), default=list(FRAMEWORKS))
    p.add_argument("--model", type=_csv(MODELS), default=list(MODELS),
                   help="comma list of workloads (default: both): the CS336 MLP, a GPT-style transformer")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks / devices (default: torchrun's WORLD_SIZE, else the local GPU count, else 4)")
    p.add_argument("--layers", type=int, default=4, help="layers (MLP) / blocks (transformer)")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="sequences (transformer) or rows (MLP) per step")
    p.add_argument("--heads", type=int, default=4, help="transformer: attention heads (dim %% heads == 0)")
    p.add_argument("--seq", type=int, default=16, help="transformer: sequence length T")
    p.add_argument("--vocab", type=int, default=64, help="transformer: vocabulary size V")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="pp: model chunks per rank of the interleaved schedule (layers %% (world·V) == 0, "
                        "microbatches %% world == 0)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--recompute", choices=RECOMPUTE, default="none",
                   help="transformer: activation recomputation, full (each block) or selective (the attention "
                        "core) (default none; needs --model transformer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of the bucketed DP variant")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a torch launch is ended (default 900)")
    p.add_argument("--json", metavar="PATH", help="write {'runs': [...], 'cross_framework': [...]} here")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown here")
    p.add_argument("--plots", metavar="DIR", help="write PNGs: loss curves, bus bandwidth, pipeline timeline, memory")
    p.add_argument("--show-collectives", metavar="PATTERN", choices=PATTERNS[1:],
                   help="print, side by side, the collectives one step issues in each style of PATTERN")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    return p


def build_bench_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="compare.py bench", description="nccl-tests-style bandwidth sweep of the collectives.")
    p.add_argument("--frameworks", type=_csv(FRAMEWORKS), default=list(FRAMEWORKS))
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--ops", type=_csv(BENCH_OPS), default=list(BENCH_OPS))
    p.add_argument("--min-bytes", type=int, default=4 * 1024)
    p.add_argument("--max-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--json", metavar="PATH")
    return p


def default_world_size(device: str) -> int:
    """torchrun's WORLD_SIZE; else one rank per local GPU (NCCL); else 4 simulated CPU ranks."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if device != "cpu":
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
    return 4


def check_devices(frameworks, world_size: int, device: str) -> None:
    """Refuse (ValueError) a device request that cannot be met, before any rank starts."""
    if "torch" in frameworks:
        from torch_impl.launch import resolve_device

        resolve_device(device, world_size)
    if "jax" in frameworks and "RANK" not in os.environ:
        from jax_impl.devices import devices

        devices(world_size, device)


def join_jax_processes(args, cfgs):
    """Multi-controller JAX: this process is one of JAX_NUM_PROCESSES (process JAX_PROCESS_ID,
    coordinator at JAX_COORDINATOR_ADDRESS), every one running this same command. Joins
    jax.distributed before any JAX use; the world size is the global device count (CPU: each
    process simulates world_size / processes devices; GPU: a world size not given is every GPU of
    every process); only process 0 prints and writes files, every process exits with the status
    of the same (gathered) results. Returns the configs, rebuilt when the world size changed."""
    from jax_impl.launch import host_device_flags

    n = int(os.environ["JAX_NUM_PROCESSES"])
    if args.frameworks != ["jax"]:
        raise ValueError("a multi-process JAX launch (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                         "JAX_PROCESS_ID set) runs JAX only: use --frameworks jax (torch: torchrun)")
    if args.plots:
        raise ValueError("--plots is not available under a multi-process JAX launch")
    if cfgs[0].world_size % n:
        raise ValueError(f"world_size={cfgs[0].world_size} is not divisible by JAX_NUM_PROCESSES={n}")
    os.environ["XLA_FLAGS"] = host_device_flags(cfgs[0].world_size // n, os.environ.get("XLA_FLAGS", ""))
    from jax_impl.devices import init_distributed

    init_distributed()
    import jax

    if args.world_size is None and not args.mesh and jax.device_count() != cfgs[0].world_size:
        args.world_size = jax.device_count()  # GPU nodes: every GPU of every process
        cfgs = make_configs(args)
    if jax.device_count() != cfgs[0].world_size:
        raise ValueError(f"world_size={cfgs[0].world_size} but the {n} JAX processes hold "
                         f"{jax.device_count()} devices")
    if jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w")  # for the rest of this process: only process 0 prints
        args.json = args.markdown = None
    return cfgs


def make_configs(args):
    """The run's Configs, one per model (plus one per mesh layout, and the MoE transformer for ep),
    checked for every requested pattern (ValueError on a bad one)."""
    from shared.config import Config

    defaulted = args.patterns is None
    if defaulted:  # the mesh pattern runs when layouts are given, and only then by default
        args.patterns = ["mesh"] if args.mesh else [p for p in PATTERNS if p != "mesh"]
    elif args.mesh and "mesh" not in args.patterns:
        args.patterns = [*args.patterns, "mesh"]
    if args.show_collectives:
        args.patterns = [args.show_collectives]
        defaulted = False
    layouts = args.mesh or []
    sizes = sorted({_product(layout) for layout in layouts})
    if len(sizes) > 1:
        raise ValueError(f"--mesh: every layout of one run needs the same world size, got "
                         f"{', '.join(f'{format_mesh(m)} ({_product(m)})' for m in layouts)}")
    world = args.world_size if args.world_size is not None else \
        sizes[0] if sizes and "WORLD_SIZE" not in os.environ else default_world_size(args.device)
    base = Config(world_size=world, layers=args.layers, dim=args.dim, batch=args.batch,
                  microbatches=args.microbatches, steps=args.steps, seed=args.seed, dtype=args.dtype,
                  lr=args.lr, weight_decay=args.weight_decay, bucket_mb=args.bucket_mb,
                  heads=args.heads, seq=args.seq, vocab=args.vocab, virtual_stages=args.virtual_stages)
    if args.experts is not None and "ep" not in args.patterns:
        raise ValueError("--experts/--topk build the mixture-of-experts transformer, which runs under "
                         "--patterns ep only")
    cfgs = [base.replace(model=m) for m in args.model]
    if "mesh" in args.patterns:  # one config per (model, layout); the 1-D patterns ignore cfg.mesh
        cfgs += [base.replace(model=m, mesh=layout) for m in args.model for layout in layouts]
    if "ep" in args.patterns and "transformer" in args.model:  # the MoE transformer: ep's own config
        experts = args.experts if args.experts is not None else default_experts(world)
        cfgs.append(base.replace(model="transformer", experts=experts, topk=args.topk))
    cfgs = [c.replace(recompute=args.recompute) for c in cfgs]  # the MLP refuses all but "none"
    if "RANK" in os.environ and "jax" in args.frameworks:
        raise ValueError("under torchrun every rank runs this script: use --frameworks torch "
                         "(run the JAX side once, without torchrun)")
    if defaulted and not args.mesh:  # every 1-D pattern by default: those a requested model has (no cp on the MLP)
        args.patterns = [p for p in args.patterns if p == "collectives" or cfgs_for(cfgs, p)]
    for pattern in args.patterns:
        mine = [cfg for cfg in cfgs if _belongs(cfg, pattern)] or \
            [base.replace(model=m) for m in args.model]  # --patterns mesh without --mesh: its one-line reason
        applying = [cfg for cfg in mine if cfg.applies(pattern)]
        for cfg in applying or mine:  # a pattern no requested model has (cp on the MLP): its one-line reason
            cfg.check(pattern)
    return [c for c in cfgs if not c.mesh or c.applies("mesh")]  # the mesh runs the transformer only


def default_experts(world: int) -> int:
    """ep's E when --experts is not given: the smallest multiple of the world size that is >= 4
    (ep = world size needs E % N == 0; 4 experts on 1, 2 or 4 ranks, 8 on 8)."""
    return world * -(-4 // world)


def _belongs(cfg, pattern) -> bool:
    """Which of the run's configs a pattern takes: mesh those with a layout, ep the MoE transformer,
    the 1-D patterns the plain models."""
    return bool(cfg.mesh) == (pattern == "mesh") and cfg.moe == (pattern == "ep")


def _product(layout) -> int:
    out = 1
    for _, n in layout:
        out *= n
    return out


def cfgs_for(cfgs, pattern):
    """The configs ``pattern`` runs (``_belongs``), only the models it applies to (cp, mesh and ep:
    the transformer)."""
    return [c for c in cfgs if _belongs(c, pattern) and c.applies(pattern)]


def run_key(cfg) -> str:
    """What one entry of a pattern is reported under: the model, and the layout (mesh) or the
    experts (ep), e.g. "transformer dp=2,tp=2" or "transformer E=4,k=2"."""
    return f"{cfg.model} {cfg.mesh_name}" if cfg.mesh else f"{cfg.model} {cfg.moe_name}" if cfg.moe else cfg.model


# --- running --------------------------------------------------------------------------------


def run_torch(cfgs, patterns, device, timeout_s):
    """One launch for every pattern and model: per rank, {pattern: checks (collectives) | entries}."""
    from torch_impl.harness import run_jobs
    from torch_impl.launch import launch

    jobs = [(p, cfgs_for(cfgs, p)) for p in patterns]
    return launch(run_jobs, cfgs[0].world_size, jobs, device=device, timeout_s=timeout_s)


def run_jax(cfgs, patterns, device):
    from jax_impl import harness
    from jax_impl.devices import make_mesh

    out = {}
    for pattern in patterns:
        if pattern == "collectives":
            from jax_impl import collectives

            out[pattern] = collectives.check_all(make_mesh(cfgs[0].world_size, "x", device))
        else:
            out[pattern] = harness.run_pattern(pattern, cfgs_for(cfgs, pattern), device=device)
    return out


def collective_rows(framework, cfg, per_rank_checks):
    """Merge every rank's collective checks into one row per collective (ok on all ranks)."""
    import numpy as np

    from shared.collectives import DTYPE
    from shared.results import RunResult, comm_bytes

    style = "explicit" if framework == "torch" else "shard_map"
    rows = []
    for i, first in enumerate(per_rank_checks[0]):
        checks = [rank_checks[i] for rank_checks in per_rank_checks]
        rows.append(RunResult(
            pattern="collectives", framework=framework, style=first.get("style", style),
            variant=first["variant"], model=None, world_size=cfg.world_size, dtype=np.dtype(DTYPE).name,
            ok=all(c["ok"] for c in checks), comm=first.get("comm", {}),
            comm_bytes=comm_bytes(first.get("comm", {})), comm_bytes_theory=first.get("expected_bytes"),
            extra={"max_abs_err": max(float(c.get("max_abs_err", 0.0)) for c in checks)},
        ))
    return rows


def pattern_rows(pattern, framework, entry, other_ref):
    from shared.results import make_result

    return [make_result(pattern, framework, style, variant, entry["cfg"], trained, entry["reference"], other_ref)
            for style, variant, trained in entry["runs"]]


def collect(cfgs, patterns, frameworks, device, progress, timeout_s=900.0):
    """Run everything; returns (rows, cross-framework reference comparisons, errors,
    {(pattern, model, framework): reference losses})."""
    from shared.results import cross_framework_ok, parity, routing_mismatch

    raw, errors, cfg = {}, [], cfgs[0]
    models = list(dict.fromkeys(c.model for c in cfgs))
    models_of = {p: [run_key(c) for c in cfgs_for(cfgs, p)] for p in patterns}  # cp, mesh: the transformer only
    for fw in frameworks:
        progress(f"{fw}: {', '.join(patterns)} on {' + '.join(models)} at world size {cfg.world_size}")
        try:  # raw[fw][pattern]: the collectives' checks, or {model: the harness's entry}
            if fw == "torch":
                per_rank = run_torch(cfgs, patterns, device, timeout_s)
                raw[fw] = {p: ([r[p] for r in per_rank] if p == "collectives"
                               else dict(zip(models_of[p], per_rank[0][p], strict=True))) for p in patterns}
            else:
                res = run_jax(cfgs, patterns, device)
                raw[fw] = {p: (res[p] if p == "collectives" else dict(zip(models_of[p], res[p], strict=True)))
                           for p in patterns}
        except Exception as exc:  # noqa: BLE001 - reported as a failed framework, exit 1
            errors.append(f"{fw}: {type(exc).__name__}: {exc}")
            if os.environ.get("PARALLEL_TWINS_DEBUG"):
                traceback.print_exc()
    rows, xfw, refs = [], [], {}
    for pattern in patterns:
        if pattern == "collectives":  # model-independent
            for fw in (f for f in frameworks if f in raw):
                rows += collective_rows(fw, cfg, raw[fw][pattern] if fw == "torch" else [raw[fw][pattern]])
            continue
        for model in models_of[pattern]:
            for fw in (f for f in frameworks if f in raw):
                data = raw[fw][pattern][model]
                refs[pattern, model, fw] = list(data["reference"].losses)
                other = next((o for o in frameworks if o != fw and o in raw), None)
                other_ref = raw[other][pattern][model]["reference"] if other else None
                rows += pattern_rows(pattern, fw, data, other_ref)
            if all(fw in raw for fw in FRAMEWORKS):
                t_ref, j_ref = raw["torch"][pattern][model]["reference"], raw["jax"][pattern][model]["reference"]
                errs, routing = parity(t_ref, j_ref), routing_mismatch(t_ref, j_ref)  # MoE: the same routing
                xfw.append({"pattern": pattern, "model": model, "what": "torch reference vs jax reference",
                            **errs, "ok": cross_framework_ok(errs, cfg.dtype) and routing is None,
                            **({"routing_mismatch": routing} if routing else {})})
    return rows, xfw, errors, refs


# --- reporting ------------------------------------------------------------------------------


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt_err(x) -> str:
    return "-" if x is None else f"{x:.1e}"


TABLE_COLUMNS = ("pattern", "model", "framework", "style", "variant", "ok", "rel err loss", "rel err grad",
                 "vs other fw", "step ms", "comm/step", "theory", "state/rank")


def table_rows(rows):
    out = []
    for r in rows:
        is_coll = r.pattern == "collectives"
        out.append((
            r.pattern, r.model or "-", r.framework, r.style, r.variant,
            "ok" if r.ok and r.xfw_ok is not False else "FAIL",
            "-" if is_coll else _fmt_err(r.max_rel_err_loss),
            "-" if is_coll else _fmt_err(max(r.max_rel_err_grad, r.max_rel_err_param)),
            _fmt_err(r.xfw_max_rel_err),
            "-" if r.step_time_s is None else f"{1e3 * r.step_time_s:.2f}",
            _fmt_bytes(r.comm_bytes),
            _fmt_bytes(r.comm_bytes_theory),
            "-" if not r.state_bytes else _fmt_bytes(sum(r.state_bytes.values())),
        ))
    return out


def describe_sizes(cfgs) -> str:
    """The sizes each model runs at, e.g. 'mlp L=4 D=32 B=32 | transformer L=4 D=32 H=4 T=16 V=64 B=32'."""
    parts = []
    for c in {(c.model, c.moe_name): c for c in cfgs}.values():  # mesh layouts share their model's sizes
        extra = f" H={c.heads} T={c.seq} V={c.vocab}" if c.model == "transformer" else ""
        moe = f" MoE E={c.experts} k={c.topk}" if c.moe else ""
        recompute = f" recompute={c.recompute}" if c.recompute != "none" else ""
        parts.append(f"{c.model}{moe} L={c.layers} D={c.dim}{extra} B={c.batch}{recompute} (Φ={c.n_params:,})")
    return " | ".join(parts)


def print_table(rows, cfgs, console) -> None:
    from rich.table import Table

    cfg = cfgs[0]
    table = Table(title=f"parallel-twins: world size {cfg.world_size}, {cfg.dtype}, M={cfg.microbatches}, "
                        f"{cfg.steps} steps; {describe_sizes(cfgs)}")
    left = ("pattern", "model", "framework", "style", "variant")
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="left" if col in left else "right")
    ok_col = TABLE_COLUMNS.index("ok")
    for r in table_rows(rows):
        table.add_row(*r, style=None if r[ok_col] == "ok" else "bold red")
    console.print(table)


def pp_bubble_lines(rows, console) -> None:
    """pp: each torch explicit schedule's bubble (last step): theory (the closed form at F = B = W),
    the simulator's at the run's measured mean F / B / W times, and measured (idle / (stages · span)).
    JAX's hand-written schedules run in lock-step ticks inside one compiled program (no per-op clock):
    theory beside the tick grid's idle fraction."""
    for r in rows:
        x = r.extra
        if r.pattern == "pp" and r.framework == "jax" and "bubble_ticks" in x:
            v = x.get("virtual_stages", 1)
            console.print(f"pp bubble {r.model} {r.framework} {r.style}/{r.variant}{f' (v={v})' if v > 1 else ''}: "
                          f"theory {x['bubble_theory']:.3f}, tick grid {x['bubble_ticks']:.3f} (one program: "
                          "no per-op time to measure)")
        if r.pattern == "pp" and "bubble_measured" in x:
            v = x.get("virtual_stages", 1)
            console.print(f"pp bubble {r.model} {r.framework} {r.style}/{r.variant}{f' (v={v})' if v > 1 else ''}: "
                          f"theory {x['bubble_theory']:.3f}, simulated at measured costs "
                          f"{x.get('bubble_simulated', float('nan')):.3f}, measured {x['bubble_measured']:.3f}")


def recompute_lines(rows, cfgs, console) -> None:
    """--recompute: per transformer run, rank 0's activations (torch: bytes saved for backward; JAX:
    XLA's temp buffer, a proxy) against shared.theory.activation_bytes where the formula is exact for
    the layout, beside the other policies' theory; and the extra forward FLOPs."""
    from shared.theory import activation_bytes, recompute_extra_flops

    for c in {(c.model, c.moe_name): c for c in cfgs if c.model == "transformer"}.values():
        n, dense = c.world_size, c.replace(experts=0)
        flops = recompute_extra_flops(c, sequences=c.batch // n)  # per rank of a data-parallel layout
        policies = " / ".join(f"{p} {_fmt_bytes(activation_bytes(dense, p))}" for p in RECOMPUTE)
        console.print(f"recompute={c.recompute}: extra forward FLOPs per step {flops['extra'] / 1e6:.2f} M per "
                      f"rank of dp={n} ({100 * flops['fraction']:.1f}% of the step's 3×forward); single-device "
                      f"activations (theory): {policies}")
    c = next((c for c in cfgs if c.model == "transformer" and not c.mesh and not c.moe), None)
    for r in rows:
        if r.model != "transformer" or c is None:
            continue
        n, theory = c.world_size, None
        if r.framework == "torch" and (r.pattern == "dp" or (r.pattern == "fsdp" and r.variant != "zero3")):
            theory = activation_bytes(c, sequences=c.batch // n, id_sequences=c.batch)
        elif r.framework == "torch" and r.pattern == "cp" and r.variant.startswith("ring"):
            theory = activation_bytes(c.replace(seq=c.seq // n))
        measured = r.extra.get("activation_bytes", r.extra.get("temp_bytes"))
        kind = "saved" if "activation_bytes" in r.extra else "XLA temp"
        console.print(f"  {r.pattern} {r.framework} {r.style}/{r.variant}: {kind} {_fmt_bytes(measured)}"
                      + (f" (theory {_fmt_bytes(theory)}{', equal' if theory == measured else ''})" if theory else ""))


def markdown_table(rows) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    return "\n".join(lines) + "\n"


def collectives_table(rows, pattern, console) -> None:
    """The SPMD-vs-explicit contrast: what one training step communicates in each style, per model."""
    rows = [r for r in rows if r.pattern == pattern]
    for model in dict.fromkeys(r.model for r in rows):
        _collectives_table([r for r in rows if r.model == model], pattern, model, console)


def _collectives_table(rows, pattern, model, console) -> None:
    from rich.table import Table

    ops = sorted({op for r in rows for op in r.comm})
    table = Table(title=f"collectives of one {pattern} step on the {model}, per rank (count × / payload bytes)")
    for col in ("framework", "style", "variant", *ops, "total", "theory", "vs theory"):
        table.add_column(col, justify="left" if col in ("framework", "style", "variant") else "right")
    for r in rows:
        cells = [f"{r.comm[op]['count']}× {_fmt_bytes(r.comm[op]['bytes'])}" if op in r.comm else "" for op in ops]
        diff = None if r.comm_bytes_theory is None else r.comm_bytes - r.comm_bytes_theory
        match = "-" if diff is None else "yes" if diff == 0 else f"{'+' if diff > 0 else '−'}{_fmt_bytes(abs(diff))}"
        table.add_row(r.framework, r.style, r.variant, *cells, _fmt_bytes(r.comm_bytes),
                      _fmt_bytes(r.comm_bytes_theory), match)
    console.print(table)
    # Where XLA's choice (jit) differs from the hand-written shard_map step of the same variant, say so.
    by_key = {(r.framework, r.style, r.variant): r for r in rows}
    for r in rows:
        if r.framework == "jax" and r.style == "jit":
            twin = by_key.get(("jax", "shard_map", r.variant))
            if twin is None:  # nothing hand-written to mirror (cp's seq_sharded): what XLA chose
                console.print(f"[yellow]{r.variant}[/]: XLA (jit) chose {_describe(r.comm)}")
            elif _counts(twin.comm) != _counts(r.comm):
                console.print(f"[yellow]{r.variant}[/]: XLA (jit) issued {_describe(r.comm)}; "
                              f"the shard_map step issues {_describe(twin.comm)}")
    work = {(r.style, r.variant): r.extra["attention_scores"] for r in rows if r.extra.get("attention_scores")}
    for (style, variant), scores in work.items():  # cp: the causal work each rank does (zigzag balances it)
        console.print(f"attention score entries per rank per layer, {style}/{variant}: "
                      f"{', '.join(str(s) for s in scores)} (max/min {max(scores) / max(min(scores), 1):.2f})")


def ep_tables(rows, cfgs, console) -> None:
    """ep's data-dependent side: the routing of the last step (load per expert and per rank, the
    same in every style since the routing is), the torch ranks' all-to-all bytes against the
    routing-count formula, and the padding the static-shape (JAX) styles carry."""
    from rich.table import Table

    from shared.theory import ep_load

    for cfg in cfgs:
        mine = [r for r in rows if r.pattern == "ep" and r.extra.get("expert_load") is not None]
        if not mine:
            continue
        load = mine[0].extra["expert_load"][-1]  # (L, B, E): the step the ledger recorded
        table = Table(title=f"ep routing of the last step, {cfg.moe_name}, ep={cfg.world_size}: assignments "
                            f"per expert and per rank (ideal {cfg.topk * cfg.batch * cfg.seq // cfg.experts} "
                            f"per expert)")
        for col in ("layer", *(f"e{e}" for e in range(cfg.experts)), *(f"rank {r}" for r in range(cfg.world_size)),
                    "max/mean"):
            table.add_column(col, justify="right")
        for layer, load_layer in enumerate(load):
            lo = ep_load(cfg, load_layer)
            ranks = lo["per_rank"]
            table.add_row(str(layer), *map(str, lo["per_expert"]), *map(str, ranks),
                          f"{max(ranks) / (sum(ranks) / len(ranks)):.2f}")
        console.print(table)
        for r in mine:
            per_rank, theory = r.extra.get("comm_per_rank"), r.extra.get("comm_theory_per_rank")
            if per_rank and theory:
                a2a = [v.get("all_to_all", {}).get("bytes", 0) for v in per_rank]
                a2a_theory = [_by_axis({"x": t})["x"].get("all_to_all", (0, 0))[1] for t in theory]
                verdict = "equal on every rank" if a2a == a2a_theory else ", ".join(map(_fmt_bytes, a2a_theory))
                console.print(f"{r.framework} {r.style}/{r.variant}: all-to-all bytes per rank "
                              f"{', '.join(_fmt_bytes(b) for b in a2a)} (routing-count formula: {verdict})")
            pad = r.extra.get("padding")
            if pad:
                console.print(f"{r.framework} {r.style}/{r.variant}: static buffers of {pad['buffer_rows']} rows per "
                              f"rank per all-to-all, {pad['useful_rows']} carry a token "
                              f"({100 * pad['sent_waste']:.0f}% padding); the busiest rank received "
                              f"{pad['max_received_rows']} real rows")


def _by_axis(view) -> dict[str, dict[str, tuple[int, int]]]:
    """{label: {op: (count, bytes)}} from a ledger view or a theory ({op: {count, bytes}} or (count, bytes))."""
    out = {}
    for label, ops in (view or {}).items():
        out[label] = {op: (v["count"], v["bytes"]) if isinstance(v, dict) else tuple(v) for op, v in ops.items()}
    return out


def _axis_bytes(view) -> dict[str, int]:
    """Payload bytes per axis label, a message counted once (on the sender: recv skipped)."""
    from shared.plan import comm_bytes

    return comm_bytes(_by_axis(view))


def mesh_tables(rows, console) -> None:
    """The N-D contrast: per layout, what one step moves on each mesh axis in every style, per rank
    (torch ranks with the same view merged; JAX runs one SPMD program: every device alike), against
    shared.theory; then the memory per rank against theory."""
    from rich.table import Table

    rows = [r for r in rows if r.pattern == "mesh"]
    for layout in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == layout]
        views = []  # (framework, style, ranks, measured, theory)
        for r in mine:
            per_rank = r.extra.get("comm_by_axis_per_rank")
            theory = r.extra.get("comm_by_axis_theory_per_rank") or [r.extra.get("comm_by_axis_theory")] * len(
                per_rank or [0])
            if not per_rank:
                views.append((r, "all", r.extra.get("comm_by_axis"), r.extra.get("comm_by_axis_theory")))
                continue
            groups: dict = {}
            for rank, (view, th) in enumerate(zip(per_rank, theory, strict=True)):
                key = repr((_by_axis(view), _by_axis(th)))
                groups.setdefault(key, [rank, view, th])
                groups[key].append(rank) if groups[key][0] != rank else None
            for first, view, th, *more in groups.values():
                views.append((r, ",".join(str(x) for x in [first, *more]), view, th))
        order = [name for name, _ in parse_mesh(layout)]  # the layout's axes, outermost first
        labels = sorted({a for _, _, v, t in views for a in {**_by_axis(v), **_by_axis(t)}},
                        key=lambda a: (order.index(a.split("+")[0]) if a.split("+")[0] in order else len(order), a))
        table = Table(title=f"{layout} ({mine[0].world_size} ranks): payload per step per rank on each mesh axis "
                            "(count × / bytes; = theory unless marked)")
        for col in ("framework", "style", "ranks", *labels, "vs theory"):
            table.add_column(col, justify="left" if col in ("framework", "style", "ranks") else "right")
        for r, ranks, view, th in views:
            measured, expected = _by_axis(view), _axis_bytes(th) if th is not None else None
            cells = []
            for a in labels:
                ops = measured.get(a, {})
                n, nbytes = sum(c for op, (c, _) in ops.items() if op != "recv"), _axis_bytes(view).get(a, 0)
                text = f"{n}× {_fmt_bytes(nbytes)}" if ops else "-"
                if expected is not None and expected.get(a, 0) != nbytes:
                    text += f" [red](theory {_fmt_bytes(expected.get(a, 0))})[/]"
                cells.append(text)
            same = "-" if expected is None else "yes" if all(
                expected.get(a, 0) == _axis_bytes(view).get(a, 0) for a in labels) else "[red]no[/]"
            table.add_row(r.framework, r.style, ranks, *cells, same)
        console.print(table)
        memory = Table(title=f"{layout}: memory per rank (rank 0; params + grads + AdamW, and activations)")
        for col in ("framework", "style", "params", "grads", "optimizer", "theory", "activations"):
            memory.add_column(col, justify="left" if col in ("framework", "style") else "right")
        for r in mine:
            th = r.extra.get("state_bytes_theory")
            total = sum(r.state_bytes.values()) if r.state_bytes else None
            match = "-" if not th else "yes" if all(abs(r.state_bytes.get(k, 0) - v) < 1 for k, v in th.items()) \
                else f"[red]{_fmt_bytes(sum(th.values()))}[/]"
            act = r.extra.get("activation_bytes", r.extra.get("temp_bytes"))
            kind = "saved" if "activation_bytes" in r.extra else "XLA temp"
            act_text = "-" if act is None else f"{_fmt_bytes(act)} ({kind})"
            state = (_fmt_bytes(r.state_bytes.get(k)) for k in ("params", "grads", "optimizer"))
            memory.add_row(r.framework, r.style, *state, match if total is not None else "-", act_text)
        console.print(memory)
    refused = {r.extra.get("refused") for r in rows if r.extra.get("refused")}
    for reason in refused:
        console.print(f"[yellow]not run[/]: {reason}")


def _counts(comm) -> dict[str, int]:
    return {op: v["count"] for op, v in comm.items()}


def _describe(comm) -> str:
    return ", ".join(f"{v['count']}× {op}" for op, v in comm.items()) or "nothing"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return bench_main(argv[1:])
    if argv and argv[0] == "plan":
        from planner import plan_main

        return plan_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        cfgs = make_configs(args)
        cfg = cfgs[0]
        # --- multi-process JAX (one process per node, or jax_impl/launch.py): join before JAX starts ---
        if all(os.environ.get(k) for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")):
            cfgs = join_jax_processes(args, cfgs)
            cfg = cfgs[0]
        else:
            simulate_host_devices(cfg.world_size)  # before JAX starts
        # --- end multi-process JAX ---
        check_devices(args.frameworks, cfg.world_size, args.device)
    except (ArgumentError, ValueError) as exc:
        print(f"compare.py: error: {exc}", file=sys.stderr)
        return 2
    from rich.console import Console

    from shared.results import _jsonable

    rank0 = int(os.environ.get("RANK", "0")) == 0
    # Piped output (CI logs, `| tee`) would wrap the table at 80 columns: give it room.
    console = Console(quiet=not rank0, width=None if sys.stdout.isatty() else 170)
    t0 = time.perf_counter()
    if args.quiet or not rank0:
        rows, xfw, errors, refs = collect(cfgs, args.patterns, args.frameworks, args.device, lambda msg: None,
                                          args.timeout)
    else:
        with console.status("starting…") as status:
            rows, xfw, errors, refs = collect(cfgs, args.patterns, args.frameworks, args.device,
                                        lambda msg: status.update(f"running {msg}"), args.timeout)
    elapsed = time.perf_counter() - t0
    if not rank0:
        return 0 if not errors and all(r.ok for r in rows) else 1

    if args.show_collectives == "mesh":
        mesh_tables(rows, console)
    elif args.show_collectives == "ep":
        collectives_table(rows, "ep", console)
        ep_tables(rows, cfgs_for(cfgs, "ep"), console)
    elif args.show_collectives:
        collectives_table(rows, args.show_collectives, console)
    else:
        print_table(rows, cfgs, console)
    if args.recompute != "none":
        recompute_lines(rows, cfgs, console)
    if "pp" in args.patterns and not args.show_collectives:
        pp_bubble_lines(rows, console)
    for x in xfw:
        console.print(f"cross-framework {x['pattern']} ({x['model']}): torch vs jax reference, max rel err "
                      f"{max(x['max_rel_err_loss'], x['max_rel_err_grad'], x['max_rel_err_param']):.1e} "
                      f"({'ok' if x['ok'] else 'FAIL'})")
    for r in rows:  # MoE: a run that routed a token unlike its reference (a float32 near-tie) says where
        if r.extra.get("routing_mismatch"):
            console.print(f"[bold red]{r.pattern} {r.framework} {r.style}/{r.variant}[/]: "
                          f"{r.extra['routing_mismatch']}")
    for x in xfw:
        if x.get("routing_mismatch"):
            console.print(f"[bold red]cross-framework {x['pattern']} ({x['model']})[/]: {x['routing_mismatch']}")
    for e in errors:
        console.print(f"[bold red]error[/] {e}")
    failed = [r for r in rows if not r.ok or r.xfw_ok is False]
    ok = not errors and not failed and all(x["ok"] for x in xfw)
    verdict = (f"verdict: all {len(rows)} runs agree with their reference"
               f"{' and across frameworks' if len(args.frameworks) > 1 else ''} ({elapsed:.0f} s)"
               if ok else f"verdict: {len(failed)} of {len(rows)} runs failed parity, {len(errors)} errors")
    console.print(verdict, style="bold green" if ok else "bold red")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(cfg), "configs": {run_key(c): vars(c) for c in cfgs},
                       "runs": [r.to_json() for r in rows],
                       "cross_framework": _jsonable(xfw), "errors": errors, "ok": ok, "seconds": elapsed}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(rows))
    if args.plots:
        from plots import write_plots

        bench = lambda: run_bench(args.frameworks, cfg.world_size, BENCH_OPS, BENCH_SIZES[:6], iters=5,
                                  warmup=2, device=args.device)[0]  # a short sweep: 4 KiB … 4 MiB
        for path in write_plots(args.plots, [r.to_json() for r in rows], refs, cfg, args.patterns, bench):
            console.print(f"wrote {path}")
    return 0 if ok else 1


def bench_main(argv) -> int:
    try:
        args = build_bench_parser().parse_args(argv)
        if args.world_size < 2:
            raise ValueError(f"bench needs world_size >= 2, got {args.world_size}")
        if not 0 < args.min_bytes <= args.max_bytes:
            raise ValueError(f"need 0 < --min-bytes <= --max-bytes, got {args.min_bytes}, {args.max_bytes}")
        if args.iters < 1 or args.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
        simulate_host_devices(args.world_size)  # before JAX starts
        check_devices(args.frameworks, args.world_size, args.device)
    except (ArgumentError, ValueError) as exc:
        print(f"compare.py bench: error: {exc}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    from shared.collectives import fit_per_op
    from shared.results import _jsonable

    sizes, s = [], args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 4
    results, matmul = run_bench(args.frameworks, args.world_size, args.ops, sizes, args.iters, args.warmup,
                                args.device, matmul=True)
    console = Console(width=None if sys.stdout.isatty() else 170)
    table = Table(title=f"collective bandwidth, world size {args.world_size} (median of {args.iters})")
    for col in ("framework", "op", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(col, justify="left" if col in ("framework", "op") else "right")
    for r in results:
        table.add_row(r["framework"], r["op"], _fmt_bytes(r["size_bytes"]), f"{1e6 * r['time_s']:.1f}",
                      f"{r['algbw'] / 1e9:.3f}", f"{r['busbw'] / 1e9:.3f}")
    console.print(table)
    fits = []
    for fw in args.frameworks:
        for op, fit in fit_per_op([r for r in results if r["framework"] == fw]).items():
            fits.append({"framework": fw, "op": op, **fit})
            beta = fit["beta_bytes_per_s"]
            beta_text = f"{beta / 1e9:7.3f} GB/s" if beta != float("inf") else "   n/a (no size dependence measured)"
            console.print(f"{fw:5s} {op:15s} t = α + n/β:  α = {1e6 * fit['alpha_s']:8.1f} us,  β = {beta_text}")
    compute = {}  # every torch rank multiplying at once: the FLOP/s a rank of a run gets (plan --calibrate)
    for dtype in matmul[0] if matmul else ():
        compute[dtype] = {n: sorted(r[dtype][n] for r in matmul)[len(matmul) // 2] for n in matmul[0][dtype]}
        console.print(f"torch matmul {dtype:8s} FLOP/s per rank, {args.world_size} at once (median rank): " + ", ".join(
            f"n={n}: {rate / 1e9:.2f} G" for n, rate in compute[dtype].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_jsonable({"world_size": args.world_size, "results": results, "fits": fits, "compute": compute}),
                      f, indent=1)
    return 0


def run_bench(frameworks, world_size, ops, sizes, iters, warmup, device, matmul=False) -> tuple[list[dict], list]:
    """The nccl-tests-style sweep in each framework: dicts {framework, op, size_bytes, time_s, algbw, busbw};
    with ``matmul`` also every torch rank's matmul rates, in the same launch (_torch_matmul)."""
    results, rates = [], []
    for fw in frameworks:
        if fw == "torch":
            from torch_impl.launch import launch

            per_rank = launch(_torch_bench, world_size, tuple(ops), tuple(sizes), iters, warmup, matmul, device=device)
            results += per_rank[0]["rows"]
            rates = [r["matmul"] for r in per_rank] if matmul else []
        else:
            from jax_impl.collectives import bench
            from jax_impl.devices import make_mesh

            results += [dict(r, framework="jax") for r in
                        bench(make_mesh(world_size, "x", device), tuple(ops), tuple(sizes), iters, warmup)]
    return results, rates


def _torch_matmul(ctx, sizes=(32, 64, 128, 256), iters=20) -> dict:
    """{dtype: {n: FLOP/s}} of an (n, n) @ (n, n) product on this rank (the median of ``iters``)."""
    import torch

    out = {}
    for dtype in ("float64", "float32"):
        out[dtype] = {}
        for n in sizes:
            a = torch.randn(n, n, dtype=getattr(torch, dtype), device=ctx.device)
            times = []
            for _ in range(iters + 2):
                t0 = time.perf_counter()
                a @ a
                if a.is_cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[dtype][str(n)] = 2 * n ** 3 / sorted(times[2:])[iters // 2]
    return out


def _torch_bench(ctx, ops, sizes, iters, warmup, matmul=False):
    from torch_impl.collectives import bench

    rows = [dict(r, framework="torch") for r in bench(ctx, ops, sizes, iters, warmup)]
    return {"rows": rows, "matmul": _torch_matmul(ctx) if matmul else None}


if __name__ == "__main__":
    sys.exit(main())
