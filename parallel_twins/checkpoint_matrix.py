"""compare.py checkpoint: save under every layout of both frameworks, load under every one, continue.

    python compare.py checkpoint                       # the MLP, 4 steps: save after 2, continue to 4
    python compare.py checkpoint --model transformer --steps 6 --json matrix.json

Each of {single device, dp, zero1, fsdp, tp, pp} × {torch, jax} trains ``--steps // 2`` steps and saves
(torch: DCP, JAX: Orbax; docs/checkpoint.md); then each of them loads each of the 12 checkpoints —
its own, other layouts', the other framework's — and trains on to ``--steps``. Every continued run is
compared with the loading framework's uninterrupted single-device run: the losses of the steps it ran
and the final parameters (the worst relative error of the two). Same-framework pairs must agree to the
dtype's tolerance, cross-framework pairs to the cross-framework one (shared/tolerances.py).
Single device: the dp pattern on one rank / one device (no collective does anything).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from math import lcm

from parallel_twins.args import (
    ArgumentError,
    HelpFormatter,
    Parser,
    add_frameworks,
    add_json,
    add_quiet,
    add_resource_check,
    add_sizes,
    add_training,
    add_world_size,
    check_output_path,
    given_sizes,
    launched,
    prog,
)
from shared.config import MODELS
from shared.env import simulate_host_devices

# name -> (pattern, style, variant, world size: 0 = --world-size)
LAYOUTS = {
    "torch": {"single": ("dp", "explicit", "naive", 1), "dp": ("dp", "explicit", "naive", 0),
              "zero1": ("dp", "explicit", "zero1", 0), "fsdp": ("fsdp", "explicit", "zero3", 0),
              "tp": ("tp", "explicit", "megatron", 0), "pp": ("pp", "explicit", "1f1b", 0)},
    "jax": {"single": ("dp", "shard_map", "dp", 1), "dp": ("dp", "shard_map", "dp", 0),
            "zero1": ("dp", "shard_map", "zero1", 0), "fsdp": ("fsdp", "shard_map", "zero3", 0),
            "tp": ("tp", "shard_map", "megatron", 0), "pp": ("pp", "shard_map", "1f1b", 0)},
}


def _torch_job(ctx, cfg, runs):
    """On every rank of one launch: [(fw-name, pattern, style, variant, Plan)] → rank 0's answers."""
    from torch_impl.harness import run_pattern

    out = []
    for key, pattern, style, variant, plan in runs:
        entry = run_pattern(ctx, pattern, [cfg], [(style, variant)], checkpoint=plan)
        if ctx.rank == 0:
            out.append((key, entry[0]["runs"][0][2], entry[0]["reference"]))
    return out if ctx.rank == 0 else None


def _run(framework, world, cfg, runs, device):
    """Every run of ``runs`` on ``world`` ranks/devices: [(key, Trained, reference)]."""
    if framework == "torch":
        from torch_impl.launch import launch

        return launch(_torch_job, world, cfg, runs, device=device)[0]
    from jax_impl.harness import run_pattern

    return [(key, (e := run_pattern(pattern, [cfg], [(style, variant)], device=device, checkpoint=plan)[0])
             ["runs"][0][2], e["reference"]) for key, pattern, style, variant, plan in runs]


def matrix(cfg, frameworks, folder, device="cpu", say=print) -> tuple[list[dict], dict]:
    """The rows of the matrix (see the module docstring) and, per framework, what its saves cost:
    {"bytes", "files" (per checkpoint), "save_s", "load_s" (medians)}."""
    import numpy as np

    from shared.checkpoint import Plan
    from shared.results import parity, within
    from shared.tolerances import CROSS_FRAMEWORK_FACTOR

    half = cfg.steps // 2
    worlds = lambda fw: sorted({w or cfg.world_size for *_, w in LAYOUTS[fw].values()})
    saved, cost = {}, {fw: {"bytes": [], "files": [], "save_s": [], "load_s": []} for fw in frameworks}
    for fw in frameworks:
        for world in worlds(fw):
            runs = [((fw, name), p, s, v, Plan(dir=os.path.join(folder, "save", f"{fw}-{name}"), save_at=(half,)))
                    for name, (p, s, v, w) in LAYOUTS[fw].items() if (w or cfg.world_size) == world]
            say(f"{fw}: training {half} steps and saving under {', '.join(k[1] for k, *_ in runs)} ({world} "
                f"{'ranks' if fw == 'torch' else 'devices'})")
            for key, trained, _ in _run(fw, world, cfg.replace(world_size=world, steps=half), runs, device):
                done = trained.extra["checkpoints"][-1]
                saved[key] = done["path"]
                cost[fw]["bytes"].append(done["bytes"])
                cost[fw]["save_s"].append(done["save_s"])
                cost[fw]["files"].append(sum(len(f) for _, _, f in os.walk(done["path"])))
    rows = []
    for fw in frameworks:
        for world in worlds(fw):
            runs = [(((sfw, sname), (fw, name)), p, s, v, Plan(dir=os.path.join(folder, "load"), load=path))
                    for name, (p, s, v, w) in LAYOUTS[fw].items() if (w or cfg.world_size) == world
                    for (sfw, sname), path in saved.items()]
            say(f"{fw}: loading {len(saved)} checkpoints under each of {len(runs) // max(len(saved), 1)} layouts "
                f"and training to step {cfg.steps} ({world} {'ranks' if fw == 'torch' else 'devices'})")
            for ((sfw, sname), (lfw, lname)), trained, ref in _run(fw, world, cfg.replace(world_size=world), runs,
                                                                  device):
                cost[fw]["load_s"].append(trained.extra["load_s"])
                errs = parity(trained, ref)
                err = max(errs["max_rel_err_loss"], errs["max_rel_err_param"])
                factor = 1.0 if sfw == lfw else CROSS_FRAMEWORK_FACTOR
                side = lambda f, n: dict(zip(("pattern", "style", "variant"), LAYOUTS[f][n][:3]), framework=f,
                                         layout=n)
                rows.append({"save": side(sfw, sname), "load": side(lfw, lname), "start_step": trained.start_step,
                             "losses": [float(x) for x in trained.losses], "max_rel_err": err,
                             "ok": trained.start_step == half and len(trained.losses) == cfg.steps - half
                             and within({"e": err}, cfg.dtype, factor, steps=cfg.steps)})
    return rows, {fw: {k: float(np.median(v)) for k, v in c.items() if v} for fw, c in cost.items()}


def print_matrix(rows, console) -> None:
    """One grid: a row per saving layout, a column per loading one, the worst relative error in each."""
    from rich.table import Table

    label = lambda side: f"{side['framework'][0]}:{side['layout']}"  # t:single, j:tp
    saves = list(dict.fromkeys(label(r["save"]) for r in rows))
    loads = list(dict.fromkeys(label(r["load"]) for r in rows))
    cell = {(label(r["save"]), label(r["load"])): r for r in rows}
    t = Table(title="save (rows) → load (columns): worst relative error", box=None, pad_edge=False,
              padding=(0, 1))
    t.add_column("save\\load", no_wrap=True)
    for name in loads:
        t.add_column(name, justify="right", no_wrap=True)
    for s in saves:
        t.add_row(s, *[f"{cell[s, ld]['max_rel_err']:.0e}" if cell[s, ld]["ok"] else
                       f"[bold red]{cell[s, ld]['max_rel_err']:.0e}![/]" for ld in loads])
    console.print(t)


def matrix_main(argv) -> int:
    p = Parser(prog=f"{prog()} checkpoint", formatter_class=HelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="mlp", help="the workload")
    add_frameworks(p)
    add_world_size(p, 2, "ranks of every layout but single")
    add_sizes(p, batch=16, world_aware=True)
    add_training(p, steps=4, steps_help="save after S//2, continue to S")
    p.add_argument("--dir", metavar="DIR", help="keep the checkpoints here (default: a temporary folder)")
    add_json(p, "the rows")
    add_quiet(p, "no progress lines")
    add_resource_check(p)
    try:
        args = p.parse_args(argv)
        from shared.config import Config

        frameworks = args.frameworks
        check_output_path("--json", args.json)
        check_output_path("--dir", args.dir, directory=True)
        if args.precision != "pure":
            raise ValueError("checkpoint: --precision mixed is not built for checkpoints; use --precision pure")
        # sizes not given: rounded up to what every layout's world size splits (args.default_sizes)
        world = lcm(*{w or max(1, args.world_size) for fw in frameworks for *_, w in LAYOUTS[fw].values()})
        sizes = given_sizes(args, world, base={"batch": 16})
        cfg = Config(model=args.model, world_size=args.world_size, steps=args.steps, dtype=args.dtype,
                     seed=args.seed, lr=args.lr, weight_decay=args.weight_decay, **sizes)
        if args.steps < 2:
            raise ValueError(f"--steps {args.steps}: at least 2 (save after steps//2, then continue)")
        for fw in frameworks:
            for pattern, *_, w in LAYOUTS[fw].values():
                cfg.replace(world_size=w or cfg.world_size).check(pattern)
        from parallel_twins.preflight import check_jax_environment, check_resources

        if "jax" in frameworks:
            check_jax_environment(os.environ)
        if not args.no_resource_check:  # the main command's estimate, at the largest layout's world size
            worlds = {w or cfg.world_size for fw in frameworks for *_, w in LAYOUTS[fw].values()}
            check_resources([cfg.replace(world_size=max(worlds))], frameworks, under_torchrun=launched())
    except (ArgumentError, ValueError) as exc:
        print(f"{prog()} checkpoint: error: {exc}", file=sys.stderr)
        return 2
    simulate_host_devices(cfg.world_size)  # before JAX starts
    from parallel_twins.report import make_console, write_json

    console = make_console(json_to_stdout=args.json == "-")  # --json -: the JSON alone on stdout
    say = (lambda text: None) if args.quiet else (lambda text: console.print(text, highlight=False))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pt-ckpt-") as tmp:
        rows, cost = matrix(cfg, frameworks, args.dir or tmp, "cpu", say)
    print_matrix(rows, console)
    for fw, c in cost.items():
        from parallel_twins.report import fmt_bytes

        console.print(f"{fw} ({'DCP' if fw == 'torch' else 'Orbax'}): {fmt_bytes(int(c['bytes']))} in {c['files']:.0f} "
                      f"files per checkpoint; save {c['save_s'] * 1e3:.0f} ms, load {c['load_s'] * 1e3:.0f} ms "
                      "(medians; load: read, check, probe the moments' layout)", highlight=False)
    ok = all(r["ok"] for r in rows)
    bad = sum(not r["ok"] for r in rows)
    console.print(f"verdict: {'all' if ok else f'{bad} of'} {len(rows)} save → load pairs "
                  f"{'agree' if ok else 'failed'} ({time.perf_counter() - t0:.0f} s)", highlight=False)
    if args.json:
        from shared.provenance import process_layout, provenance, stamp

        block = provenance([prog(), "checkpoint", *argv], world_size=cfg.world_size,
                           layout=process_layout(args.frameworks, cfg.world_size, "cpu"))
        write_json(args.json, stamp({"config": vars(cfg), "rows": rows, "cost": cost, "ok": ok}, block))
    return 0 if ok else 1
