"""``compare.py plan --measured RUN_JSON``: the plan against runs (parallel_twins/planner.py reads the
arguments and dispatches here). For every torch mesh or ep run of a ``compare.py --json`` file, the plan's
bytes per axis and state per rank against the run's ledger (equal, or what differs), and its predicted step
time against the measured median, with the --calibrate / --profile rates in the run's own dtype.
"""

from __future__ import annotations

from dataclasses import replace

from parallel_twins.plan_inputs import read_measured
from shared import efficiency, plan
from shared.config import Config


def runnable(run: dict, configs: dict):
    """(Config, Model, Layout) of a torch run the plan predicts (mesh and ep), else None."""
    if run["framework"] != "torch" or run["pattern"] not in ("mesh", "ep"):
        return None
    key = f"{run['model']} {run['variant']}" if run["pattern"] == "mesh" else next(
        (k for k in configs if k.startswith(f"{run['model']} E=")), None)
    if key not in configs:
        return None
    raw = dict(configs[key], dtype=run["dtype"])
    raw["mesh"] = tuple(tuple(a) for a in raw.get("mesh", ()))
    cfg = Config(**raw)
    return cfg, plan.Model.from_config(cfg), plan.Layout.from_config(cfg, run["pattern"])


def measured_main(args, cluster) -> int:
    """Per torch run of a compare.py --json file: the plan's bytes per axis and state per rank against the
    ledger's (equal, or what differs), and the predicted step time against the measured median."""
    from rich.table import Table

    from parallel_twins.report import make_console
    from shared.theory import mesh_coords

    data = args.measured_data if hasattr(args, "measured_data") else read_measured(args.measured)
    console = make_console(json_to_stdout=getattr(args, "json", None) == "-")
    source = f"from {args.calibrate or args.profile}" if args.calibrate or args.profile else "of the --gpu defaults"
    table = Table(title=f"plan vs measured ({args.measured}; α–β and FLOP/s {source})")
    for col in ("run", "style", "ranks", "bytes per axis = ledger", "state = ledger", "step ms plan", "measured",
                "error"):
        table.add_column(col)
    bad = 0
    for run in data["runs"]:
        found = runnable(run, data.get("configs", {}))
        if not found:
            continue
        cfg, model, lay = found
        b, style = cfg.bytes_per_element, run["style"]
        ranks = range(cfg.world_size)
        stages = [mesh_coords(cfg, r).get("pp", 0) if cfg.mesh else 0 for r in ranks]
        stage = stages.__getitem__
        if run["pattern"] == "mesh":
            views = run["extra"]["comm_by_axis_per_rank"]
            got = [{a: {op: (v["count"], v["bytes"]) for op, v in ops.items()} for a, ops in view.items()}
                   for view in views]
            same_comm = all(plan.comm(model, lay, stage(r), cfg.batch, b, style) == got[r] for r in ranks)
            states = run["extra"]["state_bytes_per_rank"]
        else:  # ep: the all-to-all depends on the routing; the other ops and the state do not
            flat = {op: (v["count"], v["bytes"]) for op, v in run["comm"].items()}
            pred = {op: v for ops in plan.comm(model, lay, 0, cfg.batch, b, style).values() for op, v in ops.items()}
            same_comm = all(flat.get(op) == pred[op] for op in ("all_gather", "all_reduce")) and \
                flat["all_to_all"][0] == pred["all_to_all"][0]
            states = [run["state_bytes"]]
        same_state = all(plan.state(model, lay, stage(r), b, style, "pure") == {
            k: states[r][k] for k in ("params", "grads", "optimizer")} for r in range(len(states)))
        bad += not (same_comm and same_state)
        if args.calibrate:
            here = plan.calibrated(cluster, args.bench, cfg.dtype, shapes=args.matmul == "shapes")
        elif args.profile:  # the profile's rate in the run's dtype, every link one machine's
            here = replace(cluster, flops=efficiency.peak(efficiency.load(args.profile), cfg.dtype),
                           gpus_per_node=max(cluster.gpus_per_node, cfg.world_size))
        else:
            here = cluster
        pred = plan.predict(model, lay, here, cfg.batch, b, "pure", style)
        measured = run.get("step_time_s")
        err = f"{100 * (pred.time['step'] / measured - 1):+.0f}%" if measured else "-"
        table.add_row(f"{run['pattern']} {run['variant']} {cfg.dtype}", style, str(cfg.world_size),
                      "yes" if same_comm else "[red]no[/]", "yes" if same_state else "[red]no[/]",
                      f"{1e3 * pred.time['step']:.2f}", f"{1e3 * measured:.2f}" if measured else "-", err)
    console.print(table)
    if any(r["pattern"] == "ep" for r in data["runs"]):
        console.print("ep: the all-to-alls' bytes follow the routing; compared are their calls, the counts' "
                      "all-gathers and the gradients' all-reduce (tests/test_ep.py checks the routing formula)")
    if not (args.calibrate or args.profile):
        console.print("step times: the --gpu defaults' FLOP/s and links (--profile profile.json: this machine's)")
    return 1 if bad else 0
