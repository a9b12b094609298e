"""compare.py: run every pattern in torch and JAX, check parity, print one table.

    python compare.py                                   # everything, both models, CPU, world size 4 simulated
    python compare.py --model transformer --patterns tp # one model, one pattern
    python compare.py --model transformer --patterns tp,cp --show-collectives cp   # SP, ring, Ulysses
    python compare.py --patterns dp,fsdp --dtype float32 --json out.json
    python compare.py --model transformer --mesh dp=2,tp=2,pp=2 --show-collectives mesh  # 3-D, 8 ranks
    python compare.py --mesh "dp=2,tp=2;fsdp=2,tp=2;tp=2,pp=2"   # several layouts, one launch each side
    python compare.py --model transformer --patterns ep --experts 8 --topk 2 --show-collectives ep  # MoE
    python compare.py bench --frameworks torch,jax      # nccl-tests-style bandwidth sweep
    python compare.py --patterns fsdp --checkpoint-dir ckpt --checkpoint-every 2   # save; later add --resume
    python compare.py checkpoint --json matrix.json     # save under each layout × framework, load under each
    python compare.py plan --layers 80 --dim 8192 --heads 64 --gpus 256   # rank layouts (docs/plan.md)
    torchrun --nproc_per_node=8 compare.py --frameworks torch --world-size 8   # join a torchrun launch

Exit status: 0 when everything agrees, 1 when a parity check (or a run) fails, 2 for bad
arguments, a bad config or an output path that cannot be written (one line on stderr, before any
process starts), 3 when the runs agreed and were printed (and --json written) but a later output
(--plots) failed.

The flow: the command line (this file: the parser and main; configs.py: arguments → checked configs;
args.py: the shared options and output paths) → the runs (runs.py: one launch per framework into
torch_impl/ and jax_impl/, then the rows) → the report (report.py: tables, Markdown, JSON, progress;
plots.py: PNGs). ``bench`` is bench.py, ``plan`` planner.py, ``checkpoint`` checkpoint_matrix.py, ``doctor`` doctor.py.

JAX is imported only after the simulated-device flag is set (and only if asked for), and torch
ranks never import JAX: they are spawned fresh and re-import the entry point (compare.py) as
``__mp_main__``, whose imports reach only this module, args.py, the standard library and NumPy-only
modules of ``shared``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from parallel_twins.args import (
    ArgumentError,
    HelpFormatter,
    Parser,
    add_device,
    add_frameworks,
    add_json,
    add_quiet,
    add_recipe,
    add_size_preset,
    add_sizes,
    add_training,
    add_world_size,
    cfgs_for,
    check_devices,
    check_output_path,
    csv_list,
    prog,
    recipe_fields,  # noqa: F401 (tests call it through cli)
    run_key,
    write_output,
)
from parallel_twins.configs import (  # noqa: E402,F401 (the tests and scripts call them through cli)
    STYLES,
    check_styles,
    checkpoint_plan,
    compiled_unbuilt,
    default_experts,
    default_styles,
    default_world_size,
    jax_on_cpu,
    join_jax_processes,
    make_configs,
    on_gpus,
    recipe_notes,
    size_preset,
)
from shared import preempt  # stdlib only
from shared.collectives import BENCH_OPS, BENCH_SIZES  # NumPy only: safe before JAX starts
from shared.config import MODELS, PATTERNS, RECOMPUTE, parse_mesh
from shared.env import simulate_host_devices, use_compile_cache

MAX_TIMEOUT_S = 7 * 24 * 3600  # --timeout: a week at most (torch takes it as a C int of milliseconds)


def _layouts(text: str) -> list[tuple[tuple[str, int], ...]]:
    try:
        return [parse_mesh(part) for part in text.split(";") if part.strip()] or [parse_mesh(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


SUBCOMMANDS = """subcommands (each has its own --help):
  compare.py bench   nccl-tests-style sweep of the collectives in both frameworks (algbw, busbw, α–β fit)
  compare.py plan    rank the layouts of a model on a GPU cluster: memory, bytes per axis, step time
  compare.py checkpoint  save under each layout of both frameworks, load under each, continue (docs/checkpoint.md)
  compare.py doctor  on a GPU node: versions, CUDA majors, devices, NCCL, then small NCCL and JAX-on-GPU runs
  compare.py diff OLD.json NEW.json  what changed between two --json files: parity, collectives, bytes,
                     memory, step-time ratios (docs/regression.md)

exit status: 0 every run agrees with its reference (and across frameworks); 1 a parity check or a run
failed; 2 bad arguments, config, output path, environment or resources (one line, before any process
starts); 3 the runs finished (table printed, --json written) but a later output could not be written;
130 Ctrl-C / SIGINT, 143 SIGTERM, to compare.py, a rank or the whole process group (one line saying
what is on disk: with --checkpoint-dir each run in flight saved the step it finished, continue with
--resume; without, nothing; the rows that finished are written to --json first)."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=f"{prog()}", formatter_class=HelpFormatter, epilog=SUBCOMMANDS,
               description="Run every parallelism pattern in torch and JAX, check each against a single-device\n"
                           "run and against the other framework, and print one table.")
    p.add_argument("--patterns", type=csv_list(PATTERNS), default=None, metavar="LIST",
                   help=f"comma list of {', '.join(PATTERNS)} (default: every 1-D pattern the models have; "
                        "mesh when --mesh is given)")
    p.add_argument("--mesh", type=_layouts, default=None, metavar="LAYOUT[;LAYOUT…]",
                   help="N-D layouts of the transformer, axes in device order, innermost last, e.g. "
                        "dp=2,tp=2,pp=2 (axes dp, fsdp (both: HSDP), ep (with --experts), pp, cp, tp; product = "
                        "world size) (default: none)")
    p.add_argument("--experts", type=int, default=None, metavar="E",
                   help="ep (or --mesh with an ep axis): experts per MoE layer, E %% ep == 0 (default: the "
                        "smallest multiple of the ep size >= 4)")
    p.add_argument("--topk", type=int, default=2, metavar="K", help="ep: experts per token")
    add_frameworks(p)
    p.add_argument("--model", type=csv_list(MODELS), default=list(MODELS), metavar="LIST",
                   help="comma list of workloads: mlp (the CS336 MLP), transformer (a GPT-style decoder)")
    add_world_size(p, None, "ranks / devices (default: torchrun's WORLD_SIZE, else the layout's size with --mesh, "
                            "else the local GPU count, else 4)")
    add_sizes(p, world_aware=True)
    add_size_preset(p)
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="pp (and mesh with pp): micro-batches (default: 4, or the next multiple of the world size: "
                        "the interleaved schedule needs M %% world == 0)")
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="pp: model chunks per rank of the interleaved schedule (layers %% (world·V) == 0, "
                        "microbatches %% world == 0)")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none",
                   help="transformer: activation recomputation, full (each block) or selective (the attention "
                        "core)")
    add_training(p, dtype=None)
    add_recipe(p)
    p.add_argument("--bucket-mb", type=float, default=25.0, metavar="MB",
                   help="bucket size of the bucketed DP variant")
    add_device(p)
    p.add_argument("--timeout", type=float, default=900.0, metavar="S", help="seconds before a torch launch is ended")
    p.add_argument("--no-resource-check", action="store_true",
                   help="start even when --world-size exceeds max(32, 4 × cores) or the memory estimate exceeds "
                        "the available memory (parallel_twins/preflight.py) (default: refuse)")
    add_json(p, "every run (all columns and more)")
    p.add_argument("--markdown", metavar="PATH",
                   help="write the table, every column, here as Markdown ('-': standard output) (default: none)")
    p.add_argument("--plots", metavar="DIR",
                   help="write PNGs here: loss curves, memory, pipeline timelines, bus bandwidth (with collectives) "
                        "(default: none)")
    p.add_argument("--wide", action="store_true",
                   help="print every column (separate loss and gradient errors, theory bytes, state per rank)")
    p.add_argument("--show-collectives", metavar="PATTERN", choices=PATTERNS[1:],
                   help=f"print, side by side, the collectives one step issues in each style of PATTERN "
                        f"({', '.join(PATTERNS[1:])}) instead of the parity table (default: the parity table)")
    p.add_argument("--styles", type=csv_list(STYLES), default=None, metavar="LIST",
                   help=f"comma list of {', '.join(STYLES)}: run only these ways of writing each pattern (torch: "
                        "explicit = hand-written dist.*, builtin = DTensor/FSDP2/DDP/pipelining; JAX: shard_map, "
                        "typed = sharding in types, jit) (default: every one)")
    p.add_argument("--all", action="store_true",
                   help="every style and variant of every pattern (125 runs at world size 4, ~5 min on 2 cores) "
                        "(default without --patterns or --styles: the tour, the styles explicit, builtin, shard_map "
                        "and jit by their main variant, 67 runs; --patterns / --styles: every variant of those named)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save each run's model and AdamW state here (torch: DCP, JAX: Orbax; one folder per run, "
                        "a checkpoint complete or absent; docs/checkpoint.md) (default: none)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="with --checkpoint-dir: save after every K optimizer steps (default: 1)")
    p.add_argument("--resume", action="store_true",
                   help="with --checkpoint-dir: continue each run from its newest complete checkpoint there "
                        "(a run with none starts at step 0); JSON rows say start_step")
    p.add_argument("--baseline", metavar="OLD.json", default=None,
                   help="after the runs, report what changed against this --json file of an earlier run "
                        "(compare.py diff's report); exit 1 when something regressed (default: none)")
    p.add_argument("--keep", type=int, default=None, metavar="N",
                   help="with --checkpoint-dir: keep only each run's newest N complete checkpoints "
                        "(default: every one)")
    p.add_argument("--sequential", action="store_true",
                   help="on the CPU, run torch, then JAX, one run at a time (by default the torch ranks run while "
                        "JAX compiles, two JAX runs take turns, one compiling while the other runs, and their step "
                        "times share the cores)")
    add_quiet(p)
    return p


def main(argv=None) -> int:
    """compare.py's entry: Ctrl-C anywhere is one line and exit 130 (during the runs, the rows
    that finished are still written to --json / --markdown first)."""
    try:
        return _main(argv)
    except preempt.Stopped as stop:  # SIGTERM / SIGINT before the runs: nothing ran, nothing to write
        print(f"{prog()}: stopped by {stop.signame} before the runs: nothing ran, nothing saved", file=sys.stderr,
              flush=True)
        return preempt.exit_status(stop.signame)
    except KeyboardInterrupt:
        print(f"{prog()}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130
    finally:
        preempt.reset()  # the handlers there were before the runs (a caller that goes on: the tests)
        from shared.checkpoint_io import release_locks

        release_locks()  # the run folders this invocation locked (checkpoint_plan)


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    use_compile_cache()  # before JAX starts: a second run loads the steps the first compiled (shared/env.py)
    if argv and argv[0] == "bench" and "--overhead" in argv:  # the harness's own cost (parallel_twins/overhead.py)
        from parallel_twins.overhead import overhead_main

        return overhead_main(argv[1:], build_parser, make_configs)
    if argv and argv[0] == "bench":
        from parallel_twins.bench import bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "plan":
        from parallel_twins.planner import plan_main

        return plan_main(argv[1:])
    if argv and argv[0] == "checkpoint":
        from parallel_twins.checkpoint_matrix import matrix_main

        return matrix_main(argv[1:])
    if argv and argv[0] == "doctor":
        from parallel_twins.doctor import doctor_main

        return doctor_main(argv[1:])
    if argv and argv[0] == "diff":
        from parallel_twins.diff import diff_main

        return diff_main(argv[1:])
    if "RANK" not in os.environ:  # from here a SIGTERM is one line too (not under torchrun: its agent's)
        preempt.install(graceful=False)
    try:
        args = build_parser().parse_args(argv)
        from parallel_twins.preflight import check_environment, check_jax_environment, check_resources

        check_environment(os.environ)  # a stale RANK/WORLD_SIZE/MASTER_* export, WORLD_SIZE=abc
        if "jax" in args.frameworks:  # before JAX starts: JAX_PLATFORMS=gpu without one, a bad XLA_FLAGS
            check_jax_environment(os.environ)
        if not 0 < args.timeout <= MAX_TIMEOUT_S:  # c10d's timeout is a C int of ms (1e300: OverflowError)
            raise ValueError(f"--timeout {args.timeout:g}: a number of seconds > 0 and <= {MAX_TIMEOUT_S} (a week)")
        check_output_path("--json", args.json)
        check_output_path("--markdown", args.markdown)
        check_output_path("--plots", args.plots, directory=True)
        from shared.diff import load as load_results

        baseline = load_results(args.baseline) if args.baseline else None  # a bad file: one line, exit 2
        # the tour (shared.vocab.TOUR): the plain `python compare.py`, each style's main variant; --all, or
        # naming the patterns, runs every variant
        args.tour = args.patterns is None and args.styles is None and not args.mesh and not args.show_collectives \
            and not args.all
        cfgs = make_configs(args)
        cfg = cfgs[0]
        if not args.no_resource_check:  # before any rank, process or device exists
            launched = "RANK" in os.environ or "JAX_NUM_PROCESSES" in os.environ  # this process is one of many
            check_resources(cfgs, args.frameworks, under_torchrun=launched)
        # --- multi-process JAX (one process per node, or jax_impl/launch.py): join before JAX starts ---
        if all(os.environ.get(k) for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")):
            cfgs = join_jax_processes(args, cfgs)
            cfg = cfgs[0]
        else:
            simulate_host_devices(cfg.world_size)  # before JAX starts
            if "jax" in args.frameworks:  # PARALLEL_TWINS_XLA=fast: XLA:CPU at -O0 (parity only)
                from parallel_twins.preflight import fast_cpu_compile

                fast_cpu_compile(os.environ, jax_on_cpu(args.device, cfg.world_size), args.size)
        # --- end multi-process JAX ---
        check_devices(args.frameworks, cfg.world_size, args.device)
        plan = checkpoint_plan(args, cfgs)
        default_styles(args, cfgs)
        check_styles(args, cfgs)
        recipe_notes(args, cfgs)
    except (ArgumentError, ValueError) as exc:
        print(f"{prog()}: error: {exc}", file=sys.stderr)
        return 2
    from parallel_twins import report
    from parallel_twins.runs import Interrupted, collect, planned_kinds

    rank0 = int(os.environ.get("RANK", "0")) == 0
    console = report.make_console(quiet=not rank0, json_to_stdout=args.json == "-")
    t0 = time.perf_counter()
    interrupted = None
    from parallel_twins import stops

    # On the CPU the torch ranks run while JAX compiles (a thread launches them): JAX's compiler takes one core,
    # the ranks the rest. Not with checkpoints (SIGTERM's save-and-stop is sequential) nor on GPUs (the two
    # would share the devices' time).
    side = plan is None and not on_gpus(args.device, cfg.world_size) and set(args.frameworks) == {"torch", "jax"} \
        and "RANK" not in os.environ and "JAX_PROCESS_ID" not in os.environ and not args.sequential
    stops.watch(plan, launched="RANK" in os.environ)  # SIGTERM / SIGINT: finish the step and save, or stop at once
    try:
        if args.quiet or not rank0 or not console.is_terminal:  # a live line on a terminal; in a log, a plain
            progress = None if args.quiet or not rank0 else report.Progress(  # line every 30 s of runs (stderr)
                planned_kinds(cfgs, args.patterns, args.frameworks, args.styles, args.tour), parallel=side).logger(
                sys.stderr, every_s=30.0)
            rows, xfw, errors, refs = collect(cfgs, args.patterns, args.frameworks, args.device, progress,
                                              args.timeout, checkpoint=plan, styles=args.styles, side_by_side=side,
                                              tour=args.tour)
        else:
            from rich.live import Live

            progress = report.Progress(planned_kinds(cfgs, args.patterns, args.frameworks, args.styles, args.tour),
                                       parallel=side)
            with Live(progress, console=console, refresh_per_second=4, transient=True):
                rows, xfw, errors, refs = collect(cfgs, args.patterns, args.frameworks, args.device,
                                                  progress.event, args.timeout, checkpoint=plan, styles=args.styles,
                                                  side_by_side=side, tour=args.tour)
    except Interrupted as stop:  # Ctrl-C, a signal: what finished is written below, then one line
        (rows, xfw, errors, refs), interrupted = stop.results, stop.during
    except preempt.Stopped as stop:  # a signal before the first framework started
        rows, xfw, errors, refs, interrupted = [], [], [f"stopped by {stop.signame} before the runs"], {}, \
            args.frameworks[0]
    finally:
        stops.quiet()  # from here a signal is only recorded: the results are written whole
    elapsed = time.perf_counter() - t0
    signame = stops.stopped(errors)
    ok = report.all_ok(rows, xfw, errors) and interrupted is None and signame is None
    if signame and (not rank0 or os.environ.get("JAX_PROCESS_ID", "0") != "0"):  # process 0 says it
        return preempt.exit_status(signame)
    if not rank0:
        return 130 if interrupted else 0 if ok else 1
    from shared.provenance import process_layout, provenance, provenance_markdown, stamp

    block = provenance([prog(), *argv], world_size=cfg.world_size, layout=process_layout(
        args.frameworks, cfg.world_size, args.device, [c.mesh_name for c in cfgs if c.mesh]))
    data = stamp({"config": vars(cfg), "configs": {run_key(c): vars(c) for c in cfgs},
                  "runs": [r.to_json() for r in rows], "cross_framework": xfw,
                  "errors": errors, "ok": ok, "seconds": elapsed,
                  **({"interrupted": interrupted} if interrupted else {}),
                  **({"signal": signame} if signame else {})}, block)
    try:  # the results first: nothing printed or drawn below can lose them
        if args.json:
            report.write_json(args.json, data)
        if args.markdown:
            write_output(args.markdown, provenance_markdown(block) + "\n" + report.markdown_table(rows))
    except OSError as exc:
        console.print(f"[bold red]error[/] could not write the results: {exc}")
        late_failure = True
    else:
        late_failure = False
    if signame or interrupted:
        written = [p for p in (args.json, args.markdown) if p and p != "-"]
        print(stops.line(signame, plan, errors, interrupted, len(rows), written), file=sys.stderr, flush=True)
        return preempt.exit_status(signame or "SIGINT")

    if args.show_collectives:
        from parallel_twins import report_collectives as shown
    if args.show_collectives == "mesh":
        shown.mesh_tables(rows, console)
    elif args.show_collectives == "ep":
        shown.collectives_table(rows, "ep", console)
        shown.ep_tables(rows, cfgs_for(cfgs, "ep"), console)
    elif args.show_collectives:
        shown.collectives_table(rows, args.show_collectives, console)
    else:
        report.print_table(rows, cfgs, console, wide=args.wide, preset=args.size)
        if side:
            console.print("step ms: torch's ranks ran while JAX compiled, and two JAX runs took turns (one compiling "
                          "while the other ran), on the same cores (--sequential: one run at a time; compare.py bench "
                          "--overhead: each step alone and bare)", style="dim", highlight=False)
    report.compile_lines(rows, console)
    if args.recompute != "none":
        report.recompute_lines(rows, cfgs, console)
    if "pp" in args.patterns and not args.show_collectives:
        report.pp_bubble_lines(rows, console)
    resumed = [r for r in rows if r.start_step]
    if resumed:  # --resume: say which rows ran only part of the steps
        starts = ", ".join(f"{s} ({n})" for s, n in sorted(
            {s: sum(r.start_step == s for r in resumed) for s in {r.start_step for r in resumed}}.items()))
        console.print(f"resumed: {len(resumed)} of {len(rows)} runs continued from a checkpoint, at step {starts}; "
                      "their losses and errors cover the steps they ran", highlight=False)
    report.verdict_lines(rows, xfw, errors, args.frameworks, elapsed, console)
    if args.plots:
        from parallel_twins.bench import run_bench
        from parallel_twins.plots import write_plots

        bench = lambda: run_bench(args.frameworks, cfg.world_size, BENCH_OPS, BENCH_SIZES[:6], iters=5,
                                  warmup=2, device=args.device)[0]  # a short sweep: 4 KiB … 4 MiB
        try:
            for path in write_plots(args.plots, [r.to_json() for r in rows], refs, cfg, args.patterns, bench):
                console.print(f"wrote {path}")
        except Exception as exc:  # noqa: BLE001 - the results are printed and saved: say so, exit 3
            console.print(f"[bold red]error[/] --plots {args.plots}: {type(exc).__name__}: {exc}")
            late_failure = True
    regressed = False
    if baseline is not None:  # --baseline: what changed against the stored run (docs/regression.md)
        from parallel_twins.diff import report_baseline
        from shared.results import _jsonable

        regressed = report_baseline(baseline, _jsonable(data), args.baseline, args.json or "this run") == 1
    if not ok or regressed:
        return 1
    return 3 if late_failure else 0


if __name__ == "__main__":
    sys.exit(main())
