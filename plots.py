"""Figures for the docs (matplotlib, Agg backend: no display needed).

    plot_pipeline_timeline(trained.extra["timeline"], "plots/pp_1f1b.png", "1F1B, 4 stages, M=8")
    plot_schedule(shared.schedule.simulate("zb", 4, 8), "plots/zb.png", measured=None)  # + a torch timeline
    plot_loss_curves(runs, references, "plots/loss_curves.png")     # compare.py --plots DIR
    plot_bus_bandwidth(bench_results, "plots/bus_bandwidth.png")
    plot_memory(runs, "plots/memory.png")
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def plot_pipeline_timeline(timeline: list[dict], path: str, title: str) -> None:
    """Stages × time: one row per stage (stage 0 on top), a box per forward (F, blue) and
    backward (B, orange) of each micro-batch, labelled "F3" / "B3" (or "3" in narrow boxes); the hatched grey behind
    the boxes is idle time (the bubble). ``timeline``: dicts {"stage", "kind", "mb", "start",
    "end"} in seconds since the step began (torch_impl.pp's extra["timeline"])."""
    if not timeline:
        raise ValueError("empty timeline")
    stages = max(e["stage"] for e in timeline) + 1
    span = max(e["end"] for e in timeline)
    scale, unit = (1e3, "ms") if span < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(max(8.0, 0.35 * len(timeline) / stages + 6), 0.7 * stages + 1.6))
    for s in range(stages):
        ax.broken_barh([(0, span * scale)], (s - 0.4, 0.8), facecolors="#EEEEEE", hatch="///",
                       edgecolor="#BBBBBB", linewidth=0)
        busy = sum(e["end"] - e["start"] for e in timeline if e["stage"] == s)
        ax.text(span * scale * 1.01, s, f"busy {busy / span:.0%}", va="center", fontsize=8)
    ax.set_xlim(0, span * scale * 1.1)
    px_per_unit = ax.get_window_extent().width / (span * scale * 1.1)
    for e in timeline:
        x0, width = e["start"] * scale, (e["end"] - e["start"]) * scale
        ax.broken_barh([(x0, width)], (e["stage"] - 0.4, 0.8), facecolors=_COLOURS[e["kind"]],
                       edgecolor="white", linewidth=0.6)
        # "F3" where it fits, else just the micro-batch index (the colour says F or B)
        for label in (f"{e['kind']}{e['mb']}", str(e["mb"])):
            if width * px_per_unit > 6.5 * len(label) + 2:
                ax.text(x0 + width / 2, e["stage"], label, ha="center", va="center", fontsize=7, color="white")
                break
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_ylim(stages - 0.5, -0.5)  # stage 0 on top
    ax.set_xlabel(f"time since step start ({unit})")
    ax.set_title(title, loc="left")
    ax.legend(handles=[Patch(color=_COLOURS["F"], label="forward"), Patch(color=_COLOURS["B"], label="backward"),
                       Patch(facecolor="#EEEEEE", hatch="///", edgecolor="#BBBBBB", label="idle")],
              loc="upper right", bbox_to_anchor=(1.0, -0.16), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_FW_STYLE = {"torch": "-", "jax": "--"}


def plot_loss_curves(runs: list[dict], references: dict, path: str) -> None:
    """Per pattern and model: every implementation's loss per step (torch solid, JAX dashed) — they
    lie on top of each other — and, beside it, each one's relative distance from the torch
    single-device reference per step on a log scale, which is where they differ (1e-16 float64,
    1e-7 float32). ``runs``: RunResult.to_json() dicts; ``references``: {(pattern, model,
    framework): losses}."""
    # mesh runs: one panel per layout (their references are keyed "transformer dp=2,tp=2", as compare.run_key)
    key = lambda r: (r["pattern"], f"{r.get('model')} {r['variant']}" if r["pattern"] == "mesh" else r.get("model"))
    panels = list(dict.fromkeys(key(r) for r in runs if r["pattern"] != "collectives"))
    if not panels:
        raise ValueError("no training runs to plot")
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3.0 * len(panels)), squeeze=False)
    for (ax_loss, ax_err), (pattern, model) in zip(axes, panels):
        ref = references.get((pattern, model, "torch")) or references.get((pattern, model, "jax"))
        for r in (r for r in runs if key(r) == (pattern, model)):
            label = f"{r['framework']} {r['style']}/{r['variant']}"
            steps = range(len(r["losses"]))
            ax_loss.plot(steps, r["losses"], _FW_STYLE[r["framework"]], marker=".", label=label, alpha=0.8)
            if ref:
                dev = [max(abs(a - b) / abs(b), 1e-18) for a, b in zip(r["losses"], ref)]
                ax_err.semilogy(steps, dev, _FW_STYLE[r["framework"]], marker=".", label=label, alpha=0.8)
        ax_loss.set_title(f"{pattern} ({model}): loss per step", loc="left")
        ax_loss.set_xlabel("step")
        ax_err.set_title(f"{pattern} ({model}): |loss − torch reference| / loss", loc="left")
        ax_err.set_xlabel("step")
        ax_err.legend(fontsize=7, ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bus_bandwidth(results: list[dict], path: str) -> None:
    """nccl-tests-style busbw against message size, one panel per collective, both frameworks.
    ``results``: dicts {framework, op, size_bytes, busbw} from the collectives' bench()."""
    ops = list(dict.fromkeys(r["op"] for r in results))
    if not ops:
        raise ValueError("no bench results to plot")
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.4), squeeze=False, sharey=True)
    for ax, op in zip(axes[0], ops):
        for fw in dict.fromkeys(r["framework"] for r in results):
            pts = sorted((r["size_bytes"], r["busbw"]) for r in results if r["op"] == op and r["framework"] == fw)
            if pts:
                ax.loglog([p[0] for p in pts], [p[1] / 1e9 for p in pts], _FW_STYLE.get(fw, "-"), marker="o", label=fw)
        ax.set_title(op, loc="left")
        ax.set_xlabel("message size S (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("busbw (GB/s)")
    axes[0][0].legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(runs: list[dict], path: str) -> None:
    """Per-rank bytes of parameters, gradients and optimizer state for every strategy (stacked),
    the picture behind the ZeRO paper's table (DP 16Φ … ZeRO-3 16Φ/N in fp32)."""
    rows = [r for r in runs if r.get("state_bytes")]
    if not rows:
        raise ValueError("no state bytes to plot")
    labels = [f"{r['pattern']} {(r.get('model') or '')[:3]} {r['framework'][0]}:{r['style']}/{r['variant']}"
              for r in rows]
    bottom = [0.0] * len(rows)
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows)), 4.5))
    for part, colour in (("params", "#4C72B0"), ("grads", "#DD8452"), ("optimizer", "#55A868")):
        vals = [r["state_bytes"].get(part, 0) / 1024 for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, color=colour, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("KiB per rank")
    ax.set_title("per-rank training state by strategy", loc="left")
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cp_layout(n: int, path: str) -> None:
    """Context parallelism over ``n`` ranks, three panels: the ring (rank r sends its K|V block to
    r+1, n−1 hops), and the causal query×key matrix in 2n chunks coloured by the rank that computes
    each chunk pair — contiguous layout (ring: rank r holds T/n consecutive tokens) vs zigzag
    (rank r holds chunks r and 2n−1−r) — with each rank's share of the work (shared.theory)."""
    import math

    from matplotlib.patches import FancyArrowPatch, Rectangle

    from shared.config import Config
    from shared.theory import cp_attention_scores, cp_chunks

    colours = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2))
    ax = axes[0]
    for r in range(n):
        a = math.pi / 2 - 2 * math.pi * r / n
        ax.add_patch(plt.Circle((math.cos(a), math.sin(a)), 0.22, color=colours[r % 10]))
        ax.text(math.cos(a), math.sin(a), f"rank {r}\nQ{r} K{r}V{r}", ha="center", va="center", fontsize=8,
                color="white")
        b = math.pi / 2 - 2 * math.pi * (r + 1) / n
        ax.add_patch(FancyArrowPatch((math.cos(a - 0.35), math.sin(a - 0.35)), (math.cos(b + 0.35), math.sin(b + 0.35)),
                                     connectionstyle="arc3,rad=-0.25", arrowstyle="-|>", mutation_scale=14))
    ax.set_xlim(-1.5, 1.5), ax.set_ylim(-1.5, 1.5), ax.set_aspect("equal"), ax.axis("off")
    ax.set_title(f"ring: every hop sends K|V to rank r+1\n{n - 1} hops forward; backward K|V + dK|dV", fontsize=10)
    cfg = Config(world_size=n, model="transformer", layers=1, dim=n, heads=n, seq=2 * n, vocab=n, batch=1)
    for ax, variant, title in ((axes[1], "ring", "contiguous (ring)"), (axes[2], "ring_zigzag", "zigzag")):
        owner = {c: r for r in range(n) for c in cp_chunks(n, r, variant)}  # chunk (of its size) -> rank
        size = 2 if variant == "ring" else 1  # in units of T/(2n)
        for q in range(2 * n):
            for k in range(2 * n):  # chunk pairs of T/(2n); a diagonal block of the ring is computed whole
                if k // size > q // size:
                    continue  # wholly in the future: skipped
                rank, masked = owner[q // size], k > q
                ax.add_patch(Rectangle((k, 2 * n - 1 - q), 1, 1, facecolor=colours[rank % 10],
                                       alpha=0.3 if masked else 0.85, hatch="//" if masked else None, lw=0))
                if k == q:
                    ax.plot([k, k + 1], [2 * n - q, 2 * n - 1 - q], color="white", lw=1)
        ax.set_xlim(0, 2 * n), ax.set_ylim(0, 2 * n), ax.set_aspect("equal")
        ax.set_xticks([]), ax.set_yticks([]), ax.set_xlabel("key position →"), ax.set_ylabel("← query position")
        work = cp_attention_scores(cfg, variant)
        ax.set_title(f"{title}: score entries computed per rank\n" + " : ".join(f"{w / min(work):.2g}" for w in work)
                     + ("  (hatched: computed, masked)" if variant == "ring" else ""), fontsize=10)
    fig.legend(handles=[Patch(color=colours[r % 10], label=f"rank {r}") for r in range(n)], loc="lower center", ncol=n)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ep_dispatch(cfg, load_layer, path: str) -> None:
    """Expert parallelism's dispatch for one MoE layer's real routing (``load_layer``: (B, E) counts,
    a run's extra["expert_load"][step][layer]), three panels: the counts matrix C[source rank][expert]
    that the counts exchange hands every rank (experts grouped by their owner); the dispatch
    all-to-all's rows from each source to each destination rank (uneven: Megatron's dropless
    splits); and per rank the rows a dropless all-to-all moves against the capacity-padded static
    buffer (E·C rows) that shard_map's all_to_all and GShard's einsums carry."""
    import numpy as np

    from shared.theory import ep_capacity, ep_matrix, ep_split_sizes

    n, e = cfg.world_size, cfg.experts
    c = np.array(ep_matrix(cfg, load_layer))  # (n, E)
    splits = np.array([ep_split_sizes(cfg, load_layer, r)[0] for r in range(n)])  # (src, dst)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, data, xlabel, title in (
            (axes[0], c, "expert (owner rank below)", "C[source rank, expert] (all_gather of counts)"),
            (axes[1], splits, "destination rank", "dispatch all_to_all: rows source → destination")):
        im = ax.imshow(data, cmap="Blues", vmin=0)
        for (i, j), v in np.ndenumerate(data):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=9,
                    color="white" if v > data.max() * 0.6 else "black")
        ax.set_xticks(range(data.shape[1]))
        if data.shape[1] == e:
            ax.set_xticklabels([f"e{j}\nr{j // (e // n)}" for j in range(e)], fontsize=8)
        ax.set_yticks(range(n)), ax.set_yticklabels([f"rank {r}" for r in range(n)])
        ax.set_xlabel(xlabel), ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax, fraction=0.046)
    ax = axes[2]
    sent = splits.sum(1)
    received = splits.sum(0)
    padded = e * ep_capacity(cfg)
    x = np.arange(n)
    ax.bar(x - 0.25, sent, 0.25, label="dropless: rows sent (k·n)")
    ax.bar(x, received, 0.25, label="dropless: rows received (the rank's load)")
    ax.bar(x + 0.25, [padded] * n, 0.25, label="capacity-padded buffer (E·C)", color="lightgray")
    ax.set_xticks(x), ax.set_xticklabels([f"rank {r}" for r in range(n)]), ax.set_ylabel("rows of D")
    ax.set_title(f"rows per all-to-all per rank (E={e}, k={cfg.topk}, n={cfg.batch // n * cfg.seq} tokens)",
                 fontsize=10)
    ax.set_ylim(0, padded * 1.35)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_schedule(timeline, path: str, measured: list[dict] | None = None, title: str = "") -> None:
    """A simulated pipeline schedule (shared.schedule.simulate's Timeline): one row per rank, a box
    per op — F blue, B orange, W (zb's weight gradient) green; interleaved chunks c > 0 lighter —
    labelled with its micro-batch. With ``measured`` (torch_impl.pp's extra["timeline"]: dicts
    {"stage", "kind", "mb", "start", "end"[, "chunk"]} in seconds) the measured run is drawn below
    it on the same time axis (simulate it with ``shared.schedule.measured_costs(measured)`` so both
    are in seconds), each panel titled with its bubble (idle / (ranks · span))."""
    scale, unit = 1.0, "unit costs"
    panels = [("simulated", [(e.rank, e.op.kind, e.op.mb, e.op.chunk, e.start, e.end) for e in timeline.events])]
    if measured:
        scale, unit = (1e3, "ms") if max(e["end"] for e in measured) < 10 else (1.0, "s")
        panels.append(("measured", [(e["stage"], e["kind"], e["mb"], e.get("chunk", 0), e["start"], e["end"])
                                    for e in measured]))
    ranks = max(row[0] for _, rows in panels for row in rows) + 1
    xmax = max(row[5] for _, rows in panels for row in rows) * scale
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, (0.55 * ranks + 1.3) * len(panels) + 0.6), squeeze=False)
    for ax, (name, rows) in zip(axes[:, 0], panels):
        span = max(row[5] for row in rows)
        busy = sum(row[5] - row[4] for row in rows)
        ax.set_xlim(0, xmax)
        px_per_unit = ax.get_window_extent().width / xmax
        for rank, kind, mb, chunk, start, end in rows:
            x0, width = start * scale, (end - start) * scale
            ax.broken_barh([(x0, width)], (rank - 0.4, 0.8), facecolors=_COLOURS[kind],
                           alpha=1.0 if chunk % 2 == 0 else 0.55, edgecolor="white", linewidth=0.6)
            if width * px_per_unit > 6.5 * len(str(mb)) + 2:
                ax.text(x0 + width / 2, rank, str(mb), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        ax.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top
        ax.set_xlabel(f"time ({unit})", fontsize=8)
        ax.set_title(f"{title + ': ' if title else ''}{name}, bubble {1 - busy / (ranks * span):.2f}",
                     loc="left", fontsize=9)
    axes[-1, 0].legend(handles=[Patch(color=_COLOURS["F"], label="F forward"),
                                Patch(color=_COLOURS["B"], label="B backward (zb: input grad)"),
                                Patch(color=_COLOURS["W"], label="W weight grad")],
                       loc="upper right", bbox_to_anchor=(1.0, -0.22), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
