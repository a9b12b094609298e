"""parallel_twins/plots.py without a run (synthetic run dicts, no process launched): which PNGs write_plots draws for
a run's patterns, the bench called only for the collectives, and what the figures promise a reader
(distinct implementations, a labelled zero floor, W in the zero-bubble legend, rank rows)."""

import os

import matplotlib.pyplot as plt
import pytest

from parallel_twins import plots, plots_layouts
from shared.config import Config
from shared.schedule import simulate

CFG = Config(world_size=2, layers=2, dim=8, batch=8, microbatches=2, steps=3)
REF = [1.0, 0.9, 0.8]


def _run(pattern, framework, style, variant, losses=REF, **extra):
    return {"pattern": pattern, "framework": framework, "style": style, "variant": variant, "model": "mlp",
            "losses": list(losses), "state_bytes": {"params": 256, "grads": 256, "optimizer": 512}, "extra": extra}


def _timeline(variant):
    sim = simulate(variant, 2, 2, f=1e-3, b=2e-3, w=1e-3 if variant == "zb" else 1.0)
    return [{"stage": e.rank, "kind": e.op.kind, "mb": e.op.mb, "start": e.start, "end": e.end} for e in sim.events]


def _never():
    raise AssertionError("bench called for a run without the collectives pattern")


def test_write_plots_draws_only_what_the_patterns_produce(tmp_path):
    pp = [_run("pp", "torch", "explicit", "zb", timeline=_timeline("zb"), bubble_measured=0.3, bubble_theory=0.2),
          _run("pp", "jax", "shard_map", "circular", [1.0, 0.9 + 1e-16, 0.8])]
    refs = {("pp", "mlp", "torch"): REF, ("pp", "mlp", "jax"): REF}
    written = plots.write_plots(tmp_path / "pp", pp, refs, CFG, ["pp"], bench=_never)
    assert sorted(os.path.basename(p) for p in written) == ["loss_curves.png", "memory.png",
                                                            "pp_mlp_torch_explicit_zb_schedule.png",
                                                            "pp_mlp_torch_explicit_zb_timeline.png"]
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in written)

    calls = []
    bench = [{"framework": fw, "op": "all_reduce", "size_bytes": s, "busbw": s * 1e3} for fw in ("torch", "jax")
             for s in (4096, 16384)]
    collectives = [{"pattern": "collectives", "framework": "torch", "style": "explicit", "variant": "all_reduce",
                    "model": None, "losses": [], "state_bytes": {}, "extra": {}}]
    written = plots.write_plots(tmp_path / "c", collectives + pp, refs, CFG, ["collectives"],
                                bench=lambda: calls.append(1) or bench)
    assert [os.path.basename(p) for p in written] == ["bus_bandwidth.png"] and calls == [1]


def test_implementations_distinct_and_zero_floor_labelled():
    labels = [(f"{fw} {style}/{v}", style) for fw, style in (("torch", "explicit"), ("torch", "builtin"),
                                                             ("jax", "shard_map"), ("jax", "jit")) for v in "abcd"]
    styles = plots._impl_styles(labels)
    assert len({s["color"] for s in styles.values()}) == len(labels)  # 16: one colour each
    assert {s["linestyle"] for s in styles.values()} == {"-", "-.", "--", ":"}
    fig, ax = plt.subplots()
    floor = plots._zero_floor_axis(ax, [0.0, 3e-16, 2e-15])
    assert floor == pytest.approx(1e-17)
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_yticklabels()][0] == "0"
    plt.close(fig)


def test_pipeline_legend_and_rows():
    zb = plots_layouts._pipeline_rows(_timeline("zb"))
    labels = [h.get_label() for h in plots_layouts._pipeline_legend(zb, 2, 1)]
    assert labels == ["F forward", "B backward, input gradient", "W backward, weight gradient", "idle"]
    interleaved = [(r, k, mb, c, s, e) for r, k, mb, c, s, e in zb if k != "W"] + [(0, "F", 0, 1, 9.0, 9.5)]
    labels = [h.get_label() for h in plots_layouts._pipeline_legend(interleaved, 2, 2)]
    assert "light: chunk 1 = stage r + 2 on rank r" in labels
    fig, ax = plt.subplots()
    plots_layouts._draw_pipeline(ax, zb, 2, 1, 1e3)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    plt.close(fig)
