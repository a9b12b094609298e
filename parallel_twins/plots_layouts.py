"""The pictures of who runs what, when and where (matplotlib, Agg; no torch or JAX): pipeline
timelines (measured) and schedules (simulated, beside the measured), context parallelism's token
layout, expert parallelism's dispatch. plots.write_plots draws the first two for --plots; docs/cp.md
and docs/ep.md show the last two.

    plot_pipeline_timeline(trained.extra["timeline"], "plots/pp_1f1b.png", "1F1B, world size 4, M=8")
    plot_schedule(shared.schedule.simulate("zb", 4, 8), "plots/zb.png", measured=None)  # + a torch timeline
    plot_cp_layout(4, "docs/cp_layout.png")
    plot_ep_dispatch(cfg, load_layer, "docs/ep_dispatch.png")

A pipeline's rows are ranks (the devices: rank r runs stage r, or under the interleaved schedule its
chunks c, stages c·p + r); every kind drawn (F, B, W, idle) is in the legend.
"""

from __future__ import annotations

from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from parallel_twins.plot_style import IDLE as _IDLE  # one style for every figure (and the Agg backend)
from parallel_twins.plot_style import KIND_COLOURS as _KIND_COLOURS
from parallel_twins.plot_style import plt
from parallel_twins.plot_style import save as _save


def _lighten(colour: str, t: float) -> tuple[float, float, float]:
    return tuple(c + (1 - c) * t for c in to_rgb(colour))


def _pipeline_rows(timeline: list[dict]) -> list[tuple]:
    return [(e["stage"], e["kind"], e["mb"], e.get("chunk", 0), e["start"], e["end"]) for e in timeline]


def _unit(span: float, seconds: bool) -> tuple[float, str]:
    if not seconds:
        return 1.0, "unit op costs"
    return (1e3, "ms") if span < 10 else (1.0, "s")


def _draw_pipeline(ax, rows: list[tuple], ranks: int, chunks: int, scale: float) -> None:
    """Rows = ranks (rank 0 on top); a box per op coloured by kind, chunk c > 0 lighter; the hatched
    grey behind is idle time; each rank's busy share on the right."""
    span = max(row[5] for row in rows)
    ax.set_xlim(0, span * scale * 1.005)
    px_per_unit = ax.get_window_extent().width / (span * scale)
    for s in range(ranks):
        ax.broken_barh([(0, span * scale)], (s - 0.4, 0.8), **_IDLE)
    for rank, kind, mb, chunk, start, end in rows:
        x0, width = start * scale, (end - start) * scale
        t = 0.55 * chunk / (chunks - 1) if chunks > 1 else 0.0
        ax.broken_barh([(x0, width)], (rank - 0.4, 0.8), facecolors=[_lighten(_KIND_COLOURS[kind], t)],
                       edgecolor="white", linewidth=0.6)
        for label in (f"{kind}{mb}", str(mb)):  # "F3" where it fits, else the micro-batch (the colour says F/B/W)
            if width * px_per_unit > 6.5 * len(label) + 2:
                ax.text(x0 + width / 2, rank, label, ha="center", va="center", fontsize=7,
                        color="white" if t < 0.3 else "#222222")
                break
    ax.set_yticks(range(ranks), [f"rank {s}" for s in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top
    busy = ax.twinx()
    busy.set_ylim(ranks - 0.5, -0.5)
    busy.set_yticks(range(ranks), [f"busy {sum(r[5] - r[4] for r in rows if r[0] == s) / span:.0%}"
                                   for s in range(ranks)], fontsize=8)
    busy.tick_params(length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
        busy.spines[side].set_visible(False)


def _pipeline_legend(rows: list[tuple], ranks: int, chunks: int) -> list:
    kinds = {row[1] for row in rows}
    names = {"F": "F forward", "B": "B backward, input gradient" if "W" in kinds else "B backward",
             "W": "W backward, weight gradient"}
    handles = [Patch(color=_KIND_COLOURS[k], label=names[k]) for k in "FBW" if k in kinds]
    if chunks > 1:
        shade = lambda c: "dark" if c == 0 else "light" if c == chunks - 1 else "lighter"
        handles += [Patch(color=_lighten("#666666", 0.55 * c / (chunks - 1)),
                          label=f"{shade(c)}: chunk {c} = stage r{f' + {c * ranks}' if c else ''} on rank r")
                    for c in range(chunks)]
    return handles + [Patch(**_IDLE, label="idle")]


def plot_pipeline_timeline(timeline: list[dict], path: str, title: str) -> None:
    """Ranks × time: one row per rank (rank 0 on top), a box per forward (F, blue), backward (B,
    orange) and, under zb, weight gradient (W, green) of each micro-batch, labelled "F3" / "B3" (or
    "3" in narrow boxes), interleaved chunks c > 0 lighter; the hatched grey behind the boxes is idle
    time (the bubble), each rank's busy share on the right. ``timeline``: dicts {"stage" (the rank),
    "kind", "mb", "start", "end"[, "chunk"]} in seconds since the step began (torch_impl.pp's
    extra["timeline"])."""
    if not timeline:
        raise ValueError("empty timeline")
    rows = _pipeline_rows(timeline)
    ranks = max(row[0] for row in rows) + 1
    chunks = max(row[3] for row in rows) + 1
    scale, unit = _unit(max(row[5] for row in rows), seconds=True)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.35 * len(timeline) / ranks + 6), 0.7 * ranks + 1.9),
                           layout="constrained")
    _draw_pipeline(ax, rows, ranks, chunks, scale)
    ax.set_xlabel(f"time since step start ({unit})")
    ax.set_title(title, loc="left", fontsize=10)
    handles = _pipeline_legend(rows, ranks, chunks)
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    _save(fig, path, dpi=120)


def plot_schedule(timeline, path: str, measured: list[dict] | None = None, title: str = "") -> None:
    """A simulated pipeline schedule (shared.schedule.simulate's Timeline): one row per rank, a box
    per op — F blue, B orange, W (zb's weight gradient) green; interleaved chunks c > 0 lighter —
    labelled with its micro-batch. With ``measured`` (torch_impl.pp's extra["timeline"]: dicts
    {"stage", "kind", "mb", "start", "end"[, "chunk"]} in seconds) the measured run is drawn below
    it on its own time axis (simulate it with ``shared.schedule.measured_costs(measured)`` so both
    are in seconds), each panel titled with its span and bubble (idle / (ranks · span))."""
    sim = [(e.rank, e.op.kind, e.op.mb, e.op.chunk, e.start, e.end) for e in timeline.events]
    panels = [("simulated", sim)]
    if measured:
        panels.append(("measured, last step", _pipeline_rows(measured)))
    ranks = max(row[0] for _, rows in panels for row in rows) + 1
    chunks = max(row[3] for _, rows in panels for row in rows) + 1
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, (0.55 * ranks + 1.25) * len(panels) + 1.0),
                             squeeze=False, layout="constrained")
    for ax, (name, rows) in zip(axes[:, 0], panels):
        span = max(row[5] for row in rows)
        busy = sum(row[5] - row[4] for row in rows)
        scale, unit = _unit(span, seconds=bool(measured))
        _draw_pipeline(ax, rows, ranks, chunks, scale)
        ax.set_xlabel(f"time ({unit})", fontsize=8)
        if name == "simulated":
            costs = {k: [row[5] - row[4] for row in rows if row[1] == k] for k in "FBW"}
            costs = ", ".join(f"{k} {sum(v) / len(v) * scale:.3g}" for k, v in costs.items() if v)
            name = (f"simulated at the measured mean op durations ({costs} {unit}), messages free"
                    if measured else f"simulated ({costs} {unit})")
        ax.set_title(f"{name}: span {span * scale:.3g} {unit}, bubble {1 - busy / (ranks * span):.2f}",
                     loc="left", fontsize=9)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    handles = _pipeline_legend([row for _, rows in panels for row in rows], ranks, chunks)
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    _save(fig, path, dpi=120)


# --- context and expert parallelism ------------------------------------------------------------


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
