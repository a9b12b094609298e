"""``compare.py bench --overhead``: what the harness costs, measured (issue 46).

    python compare.py bench --overhead --json overhead.json              # compare.py's runs, default sizes
    python compare.py bench --overhead --model transformer --patterns dp,tp --size gpu

Every pattern × style × variant compare.py would run (the same options, sizes and device) runs as it does
there, then calls its own step again in a bare loop — the step, one device sync, nothing of the harness's:
no ledger, no activation meter, no checkpoint or preemption check, no loss bookkeeping
(torch_impl.harness / jax_impl.harness ``measuring_bare``). Three numbers per row:

    step_s     what compare.py reports: the median of the run's steps timed alone (not the first: warm-up,
               the meter and the step-0 gradients; not the last: the ledger's dispatch mode)
    harness_s  after the run, the median of R more of the harness's timed steps (the run's own code: the
               step, its sync, keeping the step's loss: torch reads every step's in one collective after
               the loop, JAX keeps the step's outputs) ...
    bare_s     ... taken in turns with R bare steps (the step and its sync), this the median of those
    plain_s    the same model's step on one device (the single-device reference, the whole batch)

harness/bare, the harness's cost (the target: ≤ 1.05 on every row), is the median over the rounds of each
round's harness step ÷ its bare step: the two are timed in turns (the order alternating), since on 2
shared cores the run's steps and a bare loop timed after them differed by up to 2x either way on 2 ms
steps (what else the machine did meanwhile), and a round's two steps see the machine alike.
Each row's 95 % interval of that median (``interval``: a bootstrap of its rounds) says what the machine's
noise alone moves it by; a row over the target whose interval reaches below it is not resolved by these
rounds. step_s / plain_s is what the pattern costs over one device (compare.py's "× plain"). The more rounds,
the steadier the medians: ``--repeats`` R (default 20).

The same rounds in the stepping thread's CPU time (``harness_over_bare_cpu``, its interval beside it): the
host's own work in each step, the harness's with what it keeps of the step. That is all the harness could add
(it does nothing on the device, nothing between the ranks), and no wait for another rank, core or device is
part of it: where wall-clock steps spread 3x from one to the next (more ranks than cores, each collective
a wake-up), this ratio resolves a few percent.
"""

from __future__ import annotations

import sys

HARNESS_TARGET = 1.05  # the bar: the harness adds at most 5 % to a step
REPEATS = 20  # rounds of (harness step, bare step)
RESAMPLES = 2000  # the bootstrap of each row's interval


def interval(ratios, resamples: int = RESAMPLES) -> tuple[float, float]:
    """The 95 % interval of the median of ``ratios`` (the rounds' harness/bare): a percentile bootstrap,
    seeded, so the same rounds give the same interval: what the machine's noise alone moves the median by
    (with more ranks than cores, the rounds of one and the same step code spread widely)."""
    import numpy as np

    r = np.asarray(ratios, dtype=np.float64)
    medians = np.median(r[np.random.default_rng(0).integers(0, len(r), (resamples, len(r)))], axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return float(lo), float(hi)


def split_argv(argv: list[str]) -> tuple[list[str], int]:
    """compare.py's own arguments and --repeats R (bench --overhead's one option of its own)."""
    out, repeats, it = [], REPEATS, iter(argv)
    for a in it:
        if a == "--overhead":
            continue
        if a == "--repeats" or a.startswith("--repeats="):
            text = a.partition("=")[2] if "=" in a else next(it, "")
            try:
                repeats = int(text)
            except ValueError:
                raise ValueError(f"--repeats {text!r}: a number of rounds >= 3") from None
            if repeats < 3:
                raise ValueError(f"--repeats {repeats}: a number of rounds >= 3 (their medians)")
            continue
        out.append(a)
    if not any(a == "--steps" or a.startswith("--steps=") for a in out):
        out += ["--steps", "12"]  # 10 steps timed alone: a steady median
    return out, repeats


def measure(rows) -> list[dict]:
    """One record per run row: {pattern, framework, style, variant, model, step_s, harness_s, bare_s, plain_s,
    harness_over_bare, harness_over_bare_ci95 (interval()), harness_over_bare_cpu and its _ci95 (the rounds in
    the stepping thread's CPU time), over_plain, harness_times_s, bare_times_s, harness_cpu_s, bare_cpu_s
    (round by round)}; rows without the paired steps (the collectives) are left out."""
    import numpy as np

    out = []
    for r in rows:
        bare, harness, bare_cpu, harness_cpu = ((r.extra or {}).get(k) for k in (
            "bare_step_times", "harness_step_times", "bare_step_cpu", "harness_step_cpu"))
        if not bare or not harness or r.step_time_s is None:
            continue
        bare_s, harness_s = float(np.median(bare)), float(np.median(harness))
        ratios = np.asarray(harness) / np.asarray(bare)  # round by round: the same moment
        cpu = np.asarray(harness_cpu) / np.maximum(np.asarray(bare_cpu), 1e-9)  # (a step under the clock's tick)
        out.append({"pattern": r.pattern, "framework": r.framework, "style": r.style, "variant": r.variant,
                    "model": r.model, "ok": r.ok, "step_s": r.step_time_s, "harness_s": harness_s, "bare_s": bare_s,
                    "plain_s": r.plain_step_time_s, "harness_over_bare": float(np.median(ratios)),
                    "harness_over_bare_ci95": list(interval(ratios)),
                    "harness_over_bare_cpu": float(np.median(cpu)), "harness_over_bare_cpu_ci95": list(interval(cpu)),
                    "harness_times_s": list(map(float, harness)), "bare_times_s": list(map(float, bare)),
                    "harness_cpu_s": list(map(float, harness_cpu)), "bare_cpu_s": list(map(float, bare_cpu)),
                    "over_plain": r.step_time_s / r.plain_step_time_s if r.plain_step_time_s else None})
    return out


def print_overhead(records, cfgs, console) -> None:
    from parallel_twins.report import describe_sizes, grid

    cfg = cfgs[0]
    console.print(f"harness overhead: world size {cfg.world_size}, {cfg.dtype}, {cfg.steps} steps "
                  f"({max(cfg.steps - 2, 0)} timed alone); {describe_sizes(cfgs)}", style="bold", highlight=False)
    columns = ("implementation", "step ms", "harness ms", "bare ms", "harness/bare", "95 % interval", "CPU h/b (95 %)",
               "plain ms", "× plain")
    sections: dict[str, list] = {}
    for r in records:
        sections.setdefault(f"{r['pattern']} · {r['model']}", []).append((
            f"{r['framework']}/{r['style']}/{r['variant']}", f"{1e3 * r['step_s']:.2f}", f"{1e3 * r['harness_s']:.2f}",
            f"{1e3 * r['bare_s']:.2f}",
            f"{r['harness_over_bare']:.3f}" + ("" if r["harness_over_bare"] <= HARNESS_TARGET else " >"),
            "{:.2f}-{:.2f}".format(*r["harness_over_bare_ci95"]),
            "{:.3f} ({:.2f}-{:.2f})".format(r["harness_over_bare_cpu"], *r["harness_over_bare_cpu_ci95"]),
            "-" if r["plain_s"] is None else f"{1e3 * r['plain_s']:.2f}",
            "-" if r["over_plain"] is None else f"{r['over_plain']:.1f}x"))
    width = console.width if console.is_terminal else None
    for line in grid(columns, list(sections.items()), width, wrap=0):
        console.print(line.text, highlight=False, no_wrap=True, crop=False, soft_wrap=True)
    worst = max((r["harness_over_bare"] for r in records), default=None)
    if worst is not None:
        over = sum(r["harness_over_bare"] > HARNESS_TARGET for r in records)
        clear = sum(r["harness_over_bare_ci95"][0] > HARNESS_TARGET for r in records)
        console.print(f"harness/bare: median {sorted(r['harness_over_bare'] for r in records)[len(records) // 2]:.3f}"
                      f", worst {worst:.3f}; {over} of {len(records)} rows over {HARNESS_TARGET}, {clear} of them with "
                      "the whole 95 % interval above it (the rest: the machine's noise, not resolved by these rounds: "
                      "more --repeats, an idle machine, fewer ranks than cores)", highlight=False)
        cpu = sorted(r["harness_over_bare_cpu"] for r in records)
        above = sum(r["harness_over_bare_cpu_ci95"][0] > HARNESS_TARGET for r in records)
        console.print(f"in the stepping thread's CPU time (the host's own work, all the harness could add): median "
                      f"{cpu[len(cpu) // 2]:.3f}, worst {cpu[-1]:.3f}; {sum(c > HARNESS_TARGET for c in cpu)} rows "
                      f"over {HARNESS_TARGET}, {above} with the whole 95 % interval above it", highlight=False)


def overhead_main(argv, build_parser, make_configs) -> int:
    """``build_parser`` / ``make_configs``: compare.py's (parallel_twins.cli), passed in so this module
    imports nothing of the CLI above it."""
    import os

    from parallel_twins.args import ArgumentError, check_devices, check_output_path
    from shared.env import simulate_host_devices

    try:
        argv, repeats = split_argv(argv)
        args = build_parser().parse_args(argv)
        if args.checkpoint_dir or args.show_collectives or args.baseline:
            raise ValueError("bench --overhead times the runs only: drop --checkpoint-dir, --show-collectives "
                             "and --baseline")
        if "jax" in args.frameworks:
            from parallel_twins.preflight import check_jax_environment

            check_jax_environment(os.environ)
        check_output_path("--json", args.json)
        cfgs = make_configs(args)
        if cfgs[0].steps < 4:
            raise ValueError(f"--steps {cfgs[0].steps}: bench --overhead needs >= 4 (the first and the last are "
                             "not timed alone)")
        simulate_host_devices(cfgs[0].world_size)
        check_devices(args.frameworks, cfgs[0].world_size, args.device)
    except (ArgumentError, ValueError) as exc:
        print(f"compare.py bench --overhead: error: {exc}", file=sys.stderr)
        return 2
    from parallel_twins import report
    from parallel_twins.runs import collect, planned_runs

    console = report.make_console(quiet=args.quiet, json_to_stdout=args.json == "-")
    progress = None if args.quiet else report.Progress(
        planned_runs(cfgs, args.patterns, args.frameworks, args.styles)).logger(sys.stderr, every_s=30.0)
    rows, _, errors, _ = collect(cfgs, [p for p in args.patterns if p != "collectives"], args.frameworks,
                                 args.device, progress, args.timeout, styles=args.styles, bare_steps=repeats)
    records = measure(rows)
    if args.json:
        from shared.provenance import process_layout, provenance, stamp

        block = provenance(["compare.py", "bench", "--overhead", *argv], world_size=cfgs[0].world_size,
                           layout=process_layout(args.frameworks, cfgs[0].world_size, args.device))
        report.write_json(args.json, stamp({"config": vars(cfgs[0]), "repeats": repeats, "target": HARNESS_TARGET,
                                            "rows": records, "errors": errors}, block))
    print_overhead(records, cfgs, console)
    for e in errors:
        console.print(f"[bold red]error[/] {e}", highlight=False)
    return 1 if errors else 0
