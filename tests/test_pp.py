"""Pipeline parallelism: torch (explicit GPipe / 1F1B, torch.distributed.pipelining) and JAX
(circular pipeline, shard_map and jit) against the single-device references.

One torch launch and one JAX run per stage count S ∈ {2, 3, 4}, each covering every variant for
M = 1 (also M < S), M > S and, for S = 4, 1 < M < S, in float64, plus float32 for one M.
layers = 2·S (two layers per stage: stages stack more than one layer, and the unrolled JAX
schedules stay quick to compile); batch = 12 divides by every M used.
"""

from __future__ import annotations

import pytest

from jax_impl.harness import run_pattern as jax_run_pattern
from plots import plot_pipeline_timeline
from shared.config import Config
from shared.results import cross_framework_ok, parity, within
from shared.theory import (
    pp_bubble_fraction,
    pp_circular_permute_bytes,
    pp_circular_permute_count,
    pp_p2p_bytes,
    pp_p2p_bytes_per_rank,
    pp_p2p_count_per_rank,
    pp_peak_activations,
)
from torch_impl.harness import run_pattern as torch_run_pattern
from torch_impl.launch import launch

SIZES = dict(dim=8, batch=12, steps=5)
MICROBATCHES = {2: (1, 4), 3: (1, 4), 4: (1, 2, 6)}  # M = 1, (1 < M < S,) M > S


def configs(stages: int) -> list[Config]:
    ms = MICROBATCHES[stages]
    cfgs = [Config(world_size=stages, layers=2 * stages, microbatches=m, **SIZES) for m in ms]
    return cfgs + [cfgs[-1].replace(dtype="float32")]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda s: f"S{s}")
def stages(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def torch_out(stages):
    return launch(torch_run_pattern, stages, "pp", configs(stages))[0]


@pytest.fixture(scope="module")
def jax_out(stages):
    return jax_run_pattern("pp", configs(stages))


def runs(out):
    for entry in out:
        for style, variant, run in entry["runs"]:
            yield entry["cfg"], entry["reference"], style, variant, run


def test_torch_parity(torch_out):
    for cfg, ref, style, variant, run in runs(torch_out):
        errors = parity(run, ref)
        assert within(errors, cfg.dtype), (style, variant, cfg.microbatches, cfg.dtype, errors)
        # every rank reports the last stage's loss
        assert all(r == run.losses for r in run.extra["losses_per_rank"]), (style, variant)


def test_jax_parity(jax_out):
    for cfg, ref, style, variant, run in runs(jax_out):
        errors = parity(run, ref)
        assert within(errors, cfg.dtype), (style, variant, cfg.microbatches, cfg.dtype, errors)


def test_cross_framework(torch_out, jax_out):
    for t_entry, j_entry in zip(torch_out, jax_out, strict=True):
        assert t_entry["cfg"] == j_entry["cfg"]
        for _, _, style, variant, run in runs([t_entry]):
            assert cross_framework_ok(parity(run, j_entry["reference"]), t_entry["cfg"].dtype), (style, variant)
        for _, _, style, variant, run in runs([j_entry]):
            assert cross_framework_ok(parity(run, t_entry["reference"]), j_entry["cfg"].dtype), (style, variant)


def test_torch_ledger_point_to_point(torch_out):
    """Every rank: M activations sent forward unless last, M gradients back unless first, each
    (B/M, D); receives mirror the sends. Nothing else in the ledgered step (the loss broadcast
    is outside it). The builtin schedules move exactly the same messages."""
    for cfg, _, style, variant, run in runs(torch_out):
        per_rank = run.extra["comm_per_rank"]
        for r, comm in enumerate(per_rank):
            expected = {"count": pp_p2p_count_per_rank(cfg, r), "bytes": pp_p2p_bytes_per_rank(cfg, r)}
            assert comm == {"send": expected, "recv": expected}, (style, variant, cfg.microbatches, r, comm)
        assert sum(c["send"]["bytes"] for c in per_rank) == pp_p2p_bytes(cfg)
        assert run.comm_theory == pp_p2p_bytes_per_rank(cfg, 0)


def test_jax_ledger_collective_permute(jax_out):
    """Circular pipeline: 2·(M+S−2) collective-permutes of (B/M, D) with shard_map, 3·(M+S−2)
    with jit (XLA splits the roll's transpose in two); one all-reduce of the scalar loss."""
    for cfg, _, style, _, run in runs(jax_out):
        b = cfg.bytes_per_element
        assert run.comm == {
            "collective_permute": {"count": pp_circular_permute_count(cfg, style),
                                   "bytes": pp_circular_permute_bytes(cfg, style)},
            "all_reduce": {"count": 1, "bytes": b},
        }, (style, cfg.microbatches, run.comm)


def test_state_bytes_one_stage_per_rank(torch_out, jax_out):
    for cfg, _, style, variant, run in [*runs(torch_out), *runs(jax_out)]:
        stage_bytes = cfg.n_params * cfg.bytes_per_element // cfg.world_size  # Φ·b/S
        assert run.state_bytes == {"params": stage_bytes, "grads": stage_bytes,
                                   "optimizer": 2 * stage_bytes}, (style, variant)


def expected_order(schedule: str, stages: int, stage: int, m: int) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def test_torch_schedule_timeline_and_memory(torch_out):
    """Each stage runs its schedule's order of F/B blocks, never two at once; peak stashed
    activations are M for GPipe and min(M, S − s) for 1F1B; the bubble is reported."""
    for cfg, _, style, variant, run in runs(torch_out):
        if style != "explicit":
            continue
        S, M, extra = cfg.world_size, cfg.microbatches, run.extra
        assert extra["peak_activations"] == [pp_peak_activations(variant, S, M, s) for s in range(S)]
        for s in range(S):
            blocks = [e for e in extra["timeline"] if e["stage"] == s]
            assert [(e["kind"], e["mb"]) for e in blocks] == expected_order(variant, S, s, M), (variant, s)
            assert all(a["end"] <= b["start"] for a, b in zip(blocks, blocks[1:]))
        assert extra["bubble_theory"] == pp_bubble_fraction(S, M)
        assert 0.0 <= extra["bubble_measured"] <= 1.0
        assert all(b + i == pytest.approx(extra["span_s"]) for b, i in zip(extra["busy_s"], extra["idle_s"]))


def test_plot_pipeline_timeline(torch_out, tmp_path):
    run = next(r for _, _, style, _, r in runs(torch_out) if style == "explicit")
    path = tmp_path / "timeline.png"
    plot_pipeline_timeline(run.extra["timeline"], str(path), "gpipe")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


@pytest.mark.parametrize("changes, message", [
    (dict(layers=6), "layers=6 is not divisible by world_size=4"),
    (dict(batch=12, microbatches=5), "batch=12 is not divisible by microbatches=5"),
])
def test_bad_input_raises_before_launch(changes, message):
    cfg = Config(**{"world_size": 4, "layers": 8, **SIZES, **changes})
    with pytest.raises(ValueError, match=message):
        cfg.check("pp")
