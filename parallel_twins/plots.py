"""Figures (matplotlib, Agg backend: no display needed). No torch or JAX here: the inputs are
compare.py's run dicts (RunResult.to_json()), pipeline timelines and bench rows.

    write_plots("plots", runs, refs, cfg, patterns, bench=lambda: rows)   # compare.py --plots DIR
    plot_loss_curves(runs, references, "plots/loss_curves.png", title="world size 4, float64")
    plot_memory(runs, "plots/memory.png", title=..., one_device={"mlp": 131072})
    plot_bus_bandwidth(bench_results, "plots/bus_bandwidth.png", world_size=4)
    (pipeline timelines and schedules, cp's layout, ep's dispatch: plots_layouts.py)

Conventions, every figure: legends sit outside the axes; each implementation has its own colour
and the line style and marker of its style (torch explicit solid ●, builtin dash-dot ■, JAX
shard_map dashed ▲, jit dotted ◆); step axes have integer ticks; a pipeline's rows are ranks (the
devices: rank r runs stage r, or under the interleaved schedule its chunks c, stages c·p + r).
"""

from __future__ import annotations

import math
import os
import re

from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from parallel_twins.plot_style import plt  # pyplot on the Agg backend
from parallel_twins.plot_style import save as _save

# one line style and marker per style (torch: explicit, builtin; JAX: shard_map, jit); the colour is per implementation
_STYLE_LINES = {"explicit": ("-", "o"), "builtin": ("-.", "s"), "shard_map": ("--", "^"), "jit": (":", "D")}
_FW_LINES = {"torch": ("-", "o"), "jax": ("--", "^")}
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
            "#bcbd22", "#000000", "#393b79", "#ad494a", "#637939", "#7b4173", "#e7ba52", "#5254a3")
_STATE_COLOURS = (("params", "#4C72B0"), ("grads", "#DD8452"), ("optimizer", "#55A868"))


def _impl_label(r: dict) -> str:
    """"torch explicit/zero1"; a mesh run's variant is its layout, which names its panel: "torch explicit"."""
    return f"{r['framework']} {r['style']}" + (f"/{r['variant']}" if r["pattern"] != "mesh" else "")


def _impl_styles(labels_styles: list[tuple[str, str]]) -> dict[str, dict]:
    """{label: plot kwargs}: a colour of its own per implementation, the line style and marker of its style."""
    out = {}
    for i, (label, style) in enumerate(dict.fromkeys(labels_styles)):
        line, marker = _STYLE_LINES.get(style, ("-", "o"))
        out[label] = dict(color=_PALETTE[i % len(_PALETTE)], linestyle=line, marker=marker)
    return out


def _run_key(r: dict, references=None) -> tuple[str, str]:
    """(pattern, run key) of a run dict, as args.run_key names its references: mesh runs by their
    layout ("transformer dp=2,tp=2"), ep by its experts ("transformer E=4,k=2")."""
    model = r.get("model") or ""
    if r["pattern"] == "mesh":
        return "mesh", f"{model} {r['variant']}"
    keys = {k[1] for k in references or () if k[0] == r["pattern"] and k[1].split()[0] == model}
    return r["pattern"], keys.pop() if len(keys) == 1 else model


def describe_model(cfg, key: str) -> str:
    """A run key with the model's sizes: "mlp L=4 D=32 B=32", "transformer E=4,k=2 L=4 D=32 H=4 T=16 V=64 B=32"."""
    base = key.split()[0]
    extra = f" H={cfg.heads} T={cfg.seq} V={cfg.vocab}" if base == "transformer" else ""
    return f"{key} L={cfg.layers} D={cfg.dim}{extra} B={cfg.batch}"


def _config_of(cfg, key: str):
    """The Config a run key names ("transformer E=4,k=2": the MoE transformer; a mesh layout: its model)."""
    moe = re.search(r"E=(\d+),k=(\d+)", key)
    changes = dict(experts=int(moe[1]), topk=int(moe[2])) if moe else {}
    return cfg.replace(model=key.split()[0], **changes)


# --- compare.py --plots ----------------------------------------------------------------------


def write_plots(directory, runs: list[dict], refs, cfg, patterns, bench=None) -> list[str]:
    """The pictures a run's patterns produce, into ``directory``; returns their paths. ``runs``:
    RunResult.to_json() dicts; ``refs``: {(pattern, run key, framework): reference losses}; ``cfg``:
    the run's first Config (world size, dtype, sizes); ``bench``: a zero-argument callable giving the
    collectives' bench rows, called only when the collectives pattern ran (bus bandwidth).

      loss_curves.png                  any training pattern: loss and distance from the reference
      memory.png                       training patterns that report per-rank state bytes
      pp_<model>_<fw>_<style>_<variant>_timeline.png / _schedule.png   pp runs with a measured timeline
      bus_bandwidth.png                the collectives pattern, world size ≥ 2
    """
    from parallel_twins.plots_layouts import plot_pipeline_timeline, plot_schedule
    from shared import schedule  # pure Python

    os.makedirs(directory, exist_ok=True)
    written = []

    def out(name):
        written.append(os.path.join(directory, name))
        return written[-1]

    runs = [r for r in runs if r["pattern"] in patterns]
    training = [r for r in runs if r["pattern"] != "collectives"]
    keys = list(dict.fromkeys(_run_key(r, refs)[1] for r in training))
    bases = list(dict.fromkeys(k.split()[0] for k in keys))
    setting = f"world size {cfg.world_size}, {cfg.dtype}"
    sizes = "; ".join(describe_model(cfg, b) for b in bases)
    if training:
        m = f", M={cfg.microbatches}" if "pp" in patterns else ""
        plot_loss_curves(training, refs, out("loss_curves.png"),
                         title=f"loss per step, {cfg.steps} steps, {setting}{m}\n{sizes}")
    if any(r.get("state_bytes") for r in training):
        plot_memory(training, out("memory.png"), references=refs,
                    title=f"training state per rank (rank 0's where they differ), {setting}\n{sizes}",
                    one_device={k: _config_of(cfg, k).n_params * cfg.bytes_per_element * 4
                                for k in keys})
    for r in training:
        timeline = r["extra"].get("timeline")
        if r["pattern"] != "pp" or not timeline:
            continue
        name = f"pp_{r['model']}_{r['framework']}_{r['style']}_{r['variant']}"
        ranks = max(e["stage"] for e in timeline) + 1
        v = r["extra"].get("virtual_stages", 1)  # interleaved: its chunks per rank
        layout = f"{v} chunks per rank ({ranks * v} stages), " if v > 1 else ""
        head = (f"pp {_impl_label(r)} · {describe_model(cfg, r['model'])}, {cfg.dtype} · world size {ranks}, "
                f"{layout}M={cfg.microbatches}")
        plot_pipeline_timeline(timeline, out(f"{name}_timeline.png"),
                               f"{head}\nlast step, measured: bubble {r['extra'].get('bubble_measured', math.nan):.2f} "
                               f"(theory {r['extra'].get('bubble_theory', math.nan):.2f})")
        if r["variant"] in schedule.SCHEDULES:  # the simulator at the measured mean op durations, beside it
            simulated = schedule.simulate(r["variant"], ranks, cfg.microbatches, v, **schedule.measured_costs(timeline))
            plot_schedule(simulated, out(f"{name}_schedule.png"), measured=timeline, title=head)
    if "collectives" in patterns and cfg.world_size >= 2 and bench is not None:
        plot_bus_bandwidth(bench(), out("bus_bandwidth.png"), world_size=cfg.world_size)
    return written


# --- loss curves -----------------------------------------------------------------------------


def _reference(references: dict, pattern: str, key: str) -> tuple[list[float] | None, str]:
    for fw in ("torch", "jax"):
        if references.get((pattern, key, fw)):
            return references[pattern, key, fw], fw
    return None, ""


def _zero_floor_axis(ax, values: list[float]) -> float:
    """A log axis for relative distances where exact zeros sit on a labelled floor a decade below
    the smallest non-zero value: ticks at whole decades, the floor's labelled "0". Returns the floor."""
    positive = [x for x in values if x > 0]
    low = math.floor(math.log10(min(positive))) - 1 if positive else -17
    high = max(math.ceil(math.log10(max(positive))), low + 2) if positive else low + 2
    floor = 10.0 ** low
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, 10.0 ** high * 1.5)
    step = 1 if high - low <= 8 else 2
    decades = [low] + list(range(high, low, -step))[::-1]
    ax.yaxis.set_major_locator(FixedLocator([10.0 ** e for e in decades]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(
        lambda y, _: "0" if abs(math.log10(y) - low) < 1e-6 else f"$10^{{{round(math.log10(y))}}}$"))
    ax.axhspan(floor / 3, floor * 2, color="#E4E4E4", zorder=0, lw=0)
    return floor


def plot_loss_curves(runs: list[dict], references: dict, path: str, title: str = "") -> None:
    """One row per pattern and model: every implementation's loss per step (they lie on top of each
    other, over the wide grey 1-device reference) and, beside it, each one's relative distance
    |loss − reference| / reference per step on a log scale, which is where they differ (1e-16
    float64, 1e-7 float32); an exact zero (bit-identical) sits on the grey floor labelled 0.
    ``runs``: RunResult.to_json() dicts; ``references``: {(pattern, run key, framework): losses}
    (the torch reference, else JAX's)."""
    panels = list(dict.fromkeys(_run_key(r, references) for r in runs if r["pattern"] != "collectives"))
    if not panels:
        raise ValueError("no training runs to plot")
    fig, axes = plt.subplots(len(panels), 2, figsize=(13.5, 2.55 * len(panels) + 0.5), squeeze=False,
                             layout="constrained", gridspec_kw=dict(width_ratios=(1, 1.5)))
    for (ax_loss, ax_err), (pattern, key) in zip(axes, panels):
        mine = [r for r in runs if _run_key(r, references) == (pattern, key)]
        ref, ref_fw = _reference(references, pattern, key)
        styles = _impl_styles([(_impl_label(r), r["style"]) for r in mine])
        handles = []
        if ref:
            handles.append(ax_loss.plot(range(len(ref)), ref, color="#C8C8C8", lw=6, solid_capstyle="round",
                                        zorder=1, label=f"{ref_fw} 1-device reference")[0])
        dists = {}
        for r in mine:
            label = _impl_label(r)
            handles.append(ax_loss.plot(range(len(r["losses"])), r["losses"], **styles[label], lw=1.2, ms=3.5,
                                        alpha=0.9, label=label)[0])
            if ref:
                dists[label] = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(r["losses"], ref)]
        ax_loss.set_title(f"{pattern} · {key}: loss", loc="left", fontsize=10)
        ax_err.set_title(f"|loss − {ref_fw} reference| / reference (a step's points spread sideways)" if ref
                         else "no reference", loc="left", fontsize=10)
        if dists:
            floor = _zero_floor_axis(ax_err, [x for d in dists.values() for x in d])
            width = min(0.4 / len(mine), 0.05)  # equal points side by side: each implementation stays visible
            for i, r in enumerate(mine):
                label, dodge = _impl_label(r), (i - (len(mine) - 1) / 2) * width
                ax_err.plot([s + dodge for s in range(len(dists[label]))],
                            [x if x > 0 else floor for x in dists[label]], **styles[label], lw=1.2, ms=3.5, alpha=0.9)
            handles.append(Patch(color="#E4E4E4", label="floor 0: exactly equal (bit-identical)"))
        for ax in (ax_loss, ax_err):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(True, axis="y", alpha=0.25)
        ax_err.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.02), fontsize=7.5,
                      frameon=False, borderaxespad=0, handlelength=3.2)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.get_layout_engine().set(h_pad=0.06)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    _save(fig, path, dpi=100)


# --- memory ----------------------------------------------------------------------------------


def plot_memory(runs: list[dict], path: str, title: str = "", one_device: dict | None = None,
                references=None) -> None:
    """Per-rank bytes of parameters, gradients and optimizer state (stacked; rank 0's where ranks
    differ, as under pp) of every implementation, one panel per pattern and model, the models in
    columns with a shared scale: the picture behind the ZeRO paper's table (DP 16Φ … ZeRO-3 16Φ/N in
    fp32 mixed precision; here params + grads + AdamW's two moments = 4Φ elements on one device).
    ``one_device``: {run key: bytes of that model on one device}, drawn as a dashed line."""
    rows = [r for r in runs if r.get("state_bytes")]
    if not rows:
        raise ValueError("no state bytes to plot")
    panels: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        panels.setdefault(_run_key(r, references), []).append(r)
    bases = list(dict.fromkeys(key.split()[0] for _, key in panels))
    # one grid row per pattern (and mesh layout / MoE variant), one column per model
    row_ids = list(dict.fromkeys((p, " ".join(key.split()[1:])) for p, key in panels))
    heights = [max(len(v) for (p, key), v in panels.items() if (p, " ".join(key.split()[1:])) == rid) + 1.6
               for rid in row_ids]
    fig = plt.figure(figsize=(6.2 * len(bases) + 1.2, 0.19 * sum(heights) + 1.2), layout="constrained")
    grid = fig.add_gridspec(len(row_ids), len(bases), height_ratios=heights)
    shared: dict[str, plt.Axes] = {}  # one scale per model (the MoE transformer its own)
    line = False
    for (pattern, key), mine in panels.items():
        base = key.split()[0]
        i, j = row_ids.index((pattern, " ".join(key.split()[1:]))), bases.index(base)
        scale = key if "E=" in key else base
        ax = fig.add_subplot(grid[i, j], sharex=shared.get(scale))
        shared.setdefault(scale, ax)
        left = [0.0] * len(mine)
        for part, colour in _STATE_COLOURS:
            vals = [r["state_bytes"].get(part, 0) / 1024 for r in mine]
            ax.barh(range(len(mine)), vals, left=left, color=colour, height=0.72)
            left = [a + b for a, b in zip(left, vals)]
        for y, total in enumerate(left):
            ax.text(total, y, f" {total:,.0f}", va="center", fontsize=7, color="#444444")
        if one_device and key in one_device:
            ax.axvline(one_device[key] / 1024, color="#444444", ls="--", lw=1)
            line = True
        ax.set_yticks(range(len(mine)), [_impl_label(r) for r in mine], fontsize=7.5)
        ax.set_ylim(len(mine) - 0.4, -0.6)
        ax.set_title(f"{pattern} · {key}", loc="left", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(True, axis="x", alpha=0.25)
        ax.set_xlabel("KiB per rank", fontsize=8)
    for ax in shared.values():
        ax.set_xlim(0, None)
        ax.margins(x=0.12)
    handles = [Patch(color=c, label=part if part != "optimizer" else "optimizer (AdamW moments)")
               for part, c in _STATE_COLOURS]
    if line:
        handles.append(Line2D([], [], color="#444444", ls="--", lw=1, label="the same model on 1 device"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=9)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    _save(fig, path, dpi=100)


# --- bus bandwidth ---------------------------------------------------------------------------


def _fmt_size(n: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def plot_bus_bandwidth(results: list[dict], path: str, world_size: int | None = None, title: str = "") -> None:
    """nccl-tests-style busbw against message size, one panel per collective, both frameworks.
    ``results``: dicts {framework, op, size_bytes, busbw} from the collectives' bench()."""
    ops = list(dict.fromkeys(r["op"] for r in results))
    if not ops:
        raise ValueError("no bench results to plot")
    fws = list(dict.fromkeys(r["framework"] for r in results))
    fig, axes = plt.subplots(1, len(ops), figsize=(3.5 * len(ops) + 1.4, 3.6), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, op in zip(axes[0], ops):
        for i, fw in enumerate(fws):
            pts = sorted((r["size_bytes"], r["busbw"]) for r in results if r["op"] == op and r["framework"] == fw)
            if pts:
                line, marker = _FW_LINES.get(fw, ("-", "o"))
                ax.loglog([p[0] for p in pts], [p[1] / 1e9 for p in pts], color=_PALETTE[i], linestyle=line,
                          marker=marker, label=fw)
        sizes = sorted({r["size_bytes"] for r in results if r["op"] == op})
        ax.xaxis.set_major_locator(FixedLocator(sizes[::2] if len(sizes) > 4 else sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _fmt_size(x)))
        ax.set_title(op, loc="left", fontsize=10)
        ax.set_xlabel("message size S")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    fig.legend(handles=axes[0][0].get_lines(), loc="outside right upper", frameon=False)
    world = f", world size {world_size}" if world_size else ""
    fig.suptitle(title or f"bus bandwidth (nccl-tests busbw) per collective{world}, float32", x=0.01, ha="left",
                 fontsize=11)
    _save(fig, path, dpi=110)


# --- pipelines -------------------------------------------------------------------------------
