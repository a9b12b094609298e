"""The runs: one launch per framework for every pattern and model compare.py asked for, and the rows
of the table built from what the harnesses return (parity against both references).

    rows, xfw, errors, refs = collect(cfgs, ["dp", "tp"], ["torch", "jax"], "auto", progress.event)

torch: one spawn of N ranks (torch_impl.launch) runs every pattern (torch_impl.harness.run_jobs); JAX:
this process drives the simulated (or real) devices (jax_impl.harness.run_pattern). Nothing here
prints: report.py does.
"""

from __future__ import annotations

import os
import threading
import traceback

from parallel_twins.args import FRAMEWORKS, cfgs_for, run_key


def chosen_variants(framework, pattern, cfg, styles=None, full=False, tour=False) -> list[tuple[str, str]]:
    """The (style, variant)s ``framework`` runs of ``pattern`` on ``cfg``, as its harness chooses them
    (the module's variants(cfg), else VARIANTS), only those of ``styles`` when given (--styles).
    ``full``: VARIANTS, before variants(cfg) leaves any out. ``tour``: only each style's variant in
    shared.vocab.TOUR (python compare.py without --patterns or --all)."""
    import importlib

    module = importlib.import_module(f"{'torch_impl' if framework == 'torch' else 'jax_impl'}.{pattern}")
    every = list(module.VARIANTS if full and hasattr(module, "VARIANTS") else  # mesh: per layout only
                 module.variants(cfg, full=True) if full and pattern == "mesh" and framework == "jax" else
                 getattr(module, "variants", lambda c: module.VARIANTS)(cfg))
    if styles is not None and "compiled" in styles:  # torch's compiled style runs only when asked for
        every += list(getattr(module, "COMPILED", ()) if full else
                      getattr(module, "compiled_variants", lambda c: getattr(module, "COMPILED", ()))(cfg))
    from shared.vocab import in_tour

    return [sv for sv in every if (styles is None or sv[0] in styles) and (not tour or in_tour(pattern, *sv))]


def compiled_refusal(pattern, cfg) -> str | None:
    """Why torch's compiled style has no row for ``pattern`` on ``cfg`` (one line naming torch's limitation),
    or None: torch_impl.compiled.refusal."""
    from torch_impl.compiled import refusal

    return refusal(pattern, cfg)


def compiled_notes(pattern) -> str | None:
    """A variant of ``pattern`` that torch's compiled style leaves out, and why (torch_impl.compiled)."""
    from torch_impl.compiled import VARIANT_REFUSALS

    return VARIANT_REFUSALS.get(pattern)


def typed_refusal(pattern, cfg) -> str | None:
    """Why JAX's typed style (sharding in types) cannot write ``pattern`` on ``cfg`` (one line naming
    the pattern), or None: jax_impl.mesh_typed.typed_refusal."""
    from jax_impl.mesh_typed import typed_refusal

    return typed_refusal(pattern, cfg)


def planned_runs(cfgs, patterns, frameworks, styles=None, tour=False) -> dict[str, int]:
    """{framework: the number of table rows it will produce}: what the progress line counts towards."""
    from shared.collectives import NAMES

    out = {}
    for fw in frameworks:
        out[fw] = 0
        for pattern in patterns:
            if pattern == "collectives":
                out[fw] += len(NAMES)
                continue
            out[fw] += sum(len(chosen_variants(fw, pattern, cfg, styles, tour=tour)) for cfg in cfgs_for(cfgs, pattern))
    return out


def planned_kinds(cfgs, patterns, frameworks, styles=None, tour=False) -> dict[str, dict[tuple, int]]:
    """{framework: {(pattern, model): runs}}: planned_runs by kind, what the progress line weighs its estimate
    by (report.Progress; the collectives are one kind, ("collectives",))."""
    from shared.collectives import NAMES

    out = {}
    for fw in frameworks:
        kinds = out.setdefault(fw, {})
        for pattern in patterns:
            if pattern == "collectives":
                kinds[("collectives",)] = len(NAMES)
                continue
            for cfg in cfgs_for(cfgs, pattern):
                key = (pattern, cfg.model)
                kinds[key] = kinds.get(key, 0) + len(chosen_variants(fw, pattern, cfg, styles, tour=tour))
    return out


def run_torch(cfgs, patterns, device, timeout_s, progress=None, checkpoint=None, styles=None, bare_steps=0,
              cancel=None, tour=False):
    """One launch for every pattern and model: per rank, {pattern: checks (collectives) | entries}.
    ``progress(event)``: rank 0's ("start", what) / ("done", runs) as they happen. ``bare_steps``: compare.py
    bench --overhead's bare loop after each run (torch_impl.harness.measuring_bare)."""
    from torch_impl.harness import run_jobs
    from torch_impl.launch import launch

    pick = lambda p: {c: chosen_variants("torch", p, c, styles, tour=tour) for c in cfgs_for(cfgs, p)}
    jobs = [(p, cfgs_for(cfgs, p)) + (() if (styles is None and not tour) or p == "collectives" else (pick(p),))
            for p in patterns]
    return launch(run_jobs, cfgs[0].world_size, jobs, checkpoint, bare_steps, device=device, timeout_s=timeout_s,
                  progress=progress, cancel=cancel)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during ``collect``: ``results`` = (rows, xfw, errors, refs) of every pattern that
    finished (a framework's whole torch launch, JAX's patterns one by one); ``during`` = the
    framework that was running."""

    def __init__(self, results, during: str):
        super().__init__(during)
        self.results, self.during = results, during


def run_jax(cfgs, patterns, device, progress=None, checkpoint=None, styles=None, out=None, bare_steps=0, tour=False,
            threads=1):
    """{pattern: the harness's entries}; ``out``: the dict filled as each pattern finishes (what
    a Ctrl-C keeps). ``bare_steps``: as run_torch's (jax_impl.harness.measuring_bare). ``threads``: 2 runs
    (pattern × model) at a time, one compiling while the other traces or runs (CPU; not with checkpoints)."""
    from jax_impl import harness

    with harness.measuring_bare(bare_steps):
        return _run_jax(cfgs, patterns, device, progress, checkpoint, styles, out, tour,
                        threads if checkpoint is None and not bare_steps else 1)


def _run_jax(cfgs, patterns, device, progress=None, checkpoint=None, styles=None, out=None, tour=False,
             threads=1):
    from jax_impl import harness
    from jax_impl.devices import make_mesh
    from shared.collectives import NAMES

    progress = progress or (lambda event: None)
    out = {} if out is None else out
    if "collectives" in patterns:
        from jax_impl import collectives

        progress(("start", "collectives"))
        out["collectives"] = collectives.check_all(make_mesh(cfgs[0].world_size, "x", device))
        progress(("done", len(NAMES)))
    jobs = [(p, cfg) for p in patterns if p != "collectives" for cfg in cfgs_for(cfgs, p)]
    run = lambda p, cfg, report: harness.run_pattern(p, [cfg], chosen_variants("jax", p, cfg, styles, tour=tour),
                                                     device=device, progress=report, checkpoint=checkpoint)
    if threads > 1 and len(jobs) > 1:
        return _taking_turns(jobs, run, progress, out, threads)
    for p in dict.fromkeys(p for p, _ in jobs):
        out[p] = [entry for q, cfg in jobs if q == p for entry in run(p, cfg, progress)]
    return out


class _Cancelled(Exception):
    """A JAX worker thread stops before its next run (Ctrl-C, or another run's error)."""


def _taking_turns(jobs, run, progress, out, threads):
    """``run(pattern, cfg, report)`` for every job in ``threads`` threads that take turns on the devices
    (jax_impl.harness.taking_turns: one compiles while another traces or runs); out[pattern] filled as each
    pattern's jobs finish. A worker's error, or Ctrl-C here: the others stop before their next run."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    from jax_impl.harness import taking_turns

    turn, said, cancel = threading.Lock(), threading.Lock(), threading.Event()

    def report(event):
        if cancel.is_set() and event[0] == "start":
            raise _Cancelled()
        with said:
            progress(event)

    def job(p, cfg):
        with taking_turns(turn):
            return run(p, cfg, report)

    results, left = {}, {p: sum(q == p for q, _ in jobs) for p, _ in jobs}
    pool = ThreadPoolExecutor(threads, thread_name_prefix="jax-runs")
    # the transformer's runs first (their compiles take several times the MLP's): the threads end together
    # rather than one compiling the last transformer while the other idles; out keeps the jobs' order
    first = sorted(range(len(jobs)), key=lambda i: jobs[i][1].model != "transformer")
    futures = {pool.submit(job, *jobs[i]): i for i in first}
    try:
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in done:
                i = futures[future]
                results[i] = future.result()  # a run's error: raised here, the others cancelled below
                p = jobs[i][0]
                left[p] -= 1
                if not left[p]:
                    out[p] = [entry for j, (q, _) in enumerate(jobs) if q == p for entry in results[j]]
    except BaseException:
        cancel.set()
        pool.shutdown(wait=True, cancel_futures=True)  # the runs in flight finish (seconds), none starts
        raise
    pool.shutdown()
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
            **{k: first.get("where", {}).get(k) for k in ("platform", "backend", "fallback")},
            devices=first.get("where", {}).get("devices", []),
        ))
    return rows


def pattern_rows(pattern, framework, entry, other_ref):
    from shared.results import make_result

    refs = entry.get("references", {})  # mixed precision: a variant whose reference makes its casts
    return [make_result(pattern, framework, style, variant, entry["cfg"], trained,
                        refs.get(variant, entry["reference"]), other_ref) for style, variant, trained in entry["runs"]]


def collect(cfgs, patterns, frameworks, device, progress=None, timeout_s=900.0, checkpoint=None, styles=None,
            bare_steps=0, side_by_side=False, tour=False):
    """Run everything; returns (rows, cross-framework reference comparisons, errors,
    {(pattern, model, framework): reference losses}). ``progress(framework, event)`` hears each
    framework start and each run start and finish. Ctrl-C: ``Interrupted`` carrying the rows of
    what finished. ``bare_steps``: compare.py bench --overhead (rows' extra["harness_step_times"] and
    extra["bare_step_times"]).
    ``side_by_side``: the torch launch runs in a thread while this process runs JAX (compare.py on CPU:
    JAX compiles on one core while the ranks use the rest; their step times then share the cores).
    ``tour``: each style's one variant of shared.vocab.TOUR (compare.py's default run)."""
    from shared.results import (
        cross_framework_ok,
        losses_within_floor,
        mixed_parity,
        parity,
        pure_floor,
        references_apart,
        routing_mismatch,
        skip_mismatch,
        within_floor,
    )
    from shared.tolerances import CROSS_FRAMEWORK_FACTOR, MIXED_CROSS_FRAMEWORK_FACTOR, MIXED_FACTOR

    raw, errors, cfg, interrupted = {}, [], cfgs[0], None
    models_of = {p: [run_key(c) for c in cfgs_for(cfgs, p)] for p in patterns}  # cp, mesh: the transformer only
    from shared import preempt

    cancel = threading.Event()  # side by side: Ctrl-C in the JAX runs stops the torch launch too

    def one(fw) -> str | None:
        """Run ``fw``'s part into raw[fw]; "interrupted", "stop" (the rest is not run) or None."""
        report = (lambda event, fw=fw: progress(fw, event)) if progress else None
        if report:
            report(("framework", fw))
            report(("start", "starting the ranks" if fw == "torch" else "starting JAX"))
        try:  # raw[fw][pattern]: the collectives' checks, or {model: the harness's entry}
            if fw == "torch":
                per_rank = run_torch(cfgs, patterns, device, timeout_s, report, checkpoint, styles, bare_steps,
                                     cancel=cancel, tour=tour)
                raw[fw] = {p: ([r[p] for r in per_rank] if p == "collectives"
                               else dict(zip(models_of[p], per_rank[0][p], strict=True))) for p in patterns}
            else:
                res = {}
                try:
                    run_jax(cfgs, patterns, device, report, checkpoint, styles, out=res, bare_steps=bare_steps,
                            tour=tour, threads=2 if side_by_side else 1)
                finally:  # also on Ctrl-C: the patterns that finished
                    raw[fw] = {p: (res[p] if p == "collectives" else dict(zip(models_of[p], res[p], strict=True)))
                               for p in patterns if p in res}
        except KeyboardInterrupt as exc:  # Ctrl-C, or a signal without --checkpoint-dir (preempt.Stopped)
            errors.append(f"{fw}: stopped by {exc.signame}" if isinstance(exc, preempt.Stopped)
                          else f"{fw}: interrupted (Ctrl-C)")
            return "interrupted"
        except Exception as exc:  # noqa: BLE001 - reported as a failed framework, exit 1
            errors.append(f"{fw}: {type(exc).__name__}: {exc}" if not cancel.is_set() else
                          f"{fw}: interrupted (Ctrl-C during the other framework's runs)")
            if os.environ.get("PARALLEL_TWINS_DEBUG"):
                traceback.print_exc()
            if preempt.is_stop(exc):  # a run stopped on a signal (a rank's, in a LaunchError's line): so does
                return "stop"  # the rest
        return None

    if side_by_side and set(frameworks) == {"torch", "jax"}:  # the torch launch in a thread, JAX here
        torch_outcome = []
        thread = threading.Thread(target=lambda: torch_outcome.append(one("torch")), name="torch-launch", daemon=True)
        thread.start()
        jax_done = False
        try:
            if one("jax") == "interrupted":
                interrupted = "jax"
                cancel.set()
            jax_done = True
            thread.join()
            interrupted = interrupted or ("torch" if torch_outcome == ["interrupted"] else None)
        except KeyboardInterrupt:  # while waiting for the ranks: stop them, keep what finished
            interrupted = interrupted or ("torch" if jax_done else "jax")
            cancel.set()
            thread.join(timeout=30)
    else:
        for fw in frameworks:
            if preempt.requested():  # SIGTERM / SIGINT (with --checkpoint-dir): the runs in flight saved and stopped
                errors.append(f"{fw}: not run ({preempt.signal_name()})")
                break
            outcome = one(fw)
            if outcome == "interrupted":
                interrupted = fw
            if outcome:
                break
    preempt.quiet()  # the runs are over: a later signal is recorded, and the rows below are built whole
    rows, xfw, refs = [], [], {}
    for pattern in patterns:
        if pattern == "collectives":  # model-independent
            for fw in (f for f in frameworks if pattern in raw.get(f, {})):
                rows += collective_rows(fw, cfg, raw[fw][pattern] if fw == "torch" else [raw[fw][pattern]])
            continue
        for model in models_of[pattern]:
            for fw in (f for f in frameworks if pattern in raw.get(f, {})):
                data = raw[fw][pattern][model]
                refs[pattern, model, fw] = list(data["reference"].losses)
                other = next((o for o in frameworks if o != fw and pattern in raw.get(o, {})), None)
                other_ref = raw[other][pattern][model]["reference"] if other else None
                rows += pattern_rows(pattern, fw, data, other_ref)
            if all(pattern in raw.get(fw, {}) for fw in FRAMEWORKS):
                t_ref, j_ref = raw["torch"][pattern][model]["reference"], raw["jax"][pattern][model]["reference"]
                errs = mixed_parity(t_ref, j_ref, cfg)[0] if cfg.precision == "mixed" or cfg.dtype != "float64" \
                    else parity(t_ref, j_ref)  # below float64: noise-driven entries split off (make_result)
                routing = routing_mismatch(t_ref, j_ref)  # MoE: the same routing
                skips = skip_mismatch(j_ref, t_ref)  # float16: the same skipped steps (torch's, where it records)
                # float16: other overflows, other steps trained; mixed MoE: other routing (shared.parity)
                apart = references_apart(t_ref, j_ref, cfg.precision == "mixed")
                if cfg.precision == "mixed":  # vs the two references' floors
                    agree = within_floor(errs, t_ref, j_ref, factor=MIXED_CROSS_FRAMEWORK_FACTOR / MIXED_FACTOR,
                                         program=True)
                else:
                    agree = cross_framework_ok(errs, cfg.dtype, cfg.steps, pure_floor(t_ref, j_ref)) \
                        and losses_within_floor(j_ref, cfg.dtype, CROSS_FRAMEWORK_FACTOR, t_ref, j_ref)
                xfw.append({"pattern": pattern, "model": model, "what": "torch reference vs jax reference",
                            **errs, "ok": None if apart else agree and routing is None and skips is None,
                            **({"routing_mismatch": routing} if routing and not apart else {}),  # apart says it
                            **({"not_comparable": apart} if apart else {"skip_mismatch": skips} if skips else {})})
    if interrupted:
        raise Interrupted((rows, xfw, errors, refs), interrupted)
    return rows, xfw, errors, refs
