"""Pipeline parallelism: torch (explicit GPipe / 1F1B, torch.distributed.pipelining) and JAX
(circular pipeline, shard_map and jit) against the single-device references, for both models.

One torch launch and one JAX run per stage count S ∈ {2, 3, 4}, each covering every variant.
MLP: M = 1 (also M < S), M > S and, for S = 4, 1 < M < S, in float64, plus float32 for one M;
layers = 2·S (two layers per stage: stages stack more than one layer); batch = 12 divides by
every M used. Transformer (tiny: D = 16, 2 heads, T = 8, V = 32, B = 8): S = 2 with M = 2 (two
blocks per stage) in float64 and M = 1 in float32, S = 3 with M = 4 (M > S), S = 4 with M = 2
(1 < M < S). torch runs them all; JAX's default run takes the MLP only and leaves every
transformer pipeline to the slow test: each unrolled JAX schedule of transformer blocks takes
seconds to compile (~1.5 s CPU per block instance), the schedule code is the MLP's, swept over M,
and tests/test_mesh.py runs the JAX transformer pipeline by default (dp=2,tp=2,pp=2).
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
    pp_spmd_param_count,
    pp_stage_param_count,
    pp_state_bytes,
)
from torch_impl.harness import run_pattern as torch_run_pattern
from torch_impl.launch import launch

SIZES = dict(dim=8, batch=12, steps=5)
MICROBATCHES = {2: (1, 4), 3: (1, 4), 4: (1, 2, 6)}  # M = 1, (1 < M < S,) M > S


TRANSFORMER = dict(model="transformer", dim=16, heads=2, seq=8, vocab=32, batch=8, steps=3)
# S -> [(layers, M, dtype, in JAX's default run)]
TRANSFORMER_RUNS = {2: [(4, 2, "float64", False), (4, 1, "float32", False)], 3: [(3, 4, "float64", False)],
                    4: [(4, 2, "float64", False)]}


def transformer_configs(stages: int, jax_default: bool | None = None) -> list[Config]:
    return [Config(world_size=stages, layers=layers, microbatches=m, dtype=dtype, **TRANSFORMER)
            for layers, m, dtype, default in TRANSFORMER_RUNS[stages] if jax_default in (None, default)]


def configs(stages: int, jax: bool = False) -> list[Config]:
    """Every config of one launch (torch), or JAX's default run (``jax``)."""
    ms = MICROBATCHES[stages]
    cfgs = [Config(world_size=stages, layers=2 * stages, microbatches=m, **SIZES) for m in ms]
    cfgs.append(cfgs[-1].replace(dtype="float32"))
    return cfgs + transformer_configs(stages, True if jax else None)


# S=3 (an odd stage count) under -m slow (suite budget); S=2 and 4 run by default.
@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow), 4], ids=lambda s: f"S{s}")
def stages(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def torch_out(stages):
    return launch(torch_run_pattern, stages, "pp", configs(stages))[0]


@pytest.fixture(scope="module")
def jax_out(stages):
    return jax_run_pattern("pp", configs(stages, jax=True))


def runs(out):
    for entry in out:
        for style, variant, run in entry["runs"]:
            yield entry["cfg"], entry["reference"], style, variant, run


def test_torch_parity(torch_out):
    for cfg, ref, style, variant, run in runs(torch_out):
        errors = parity(run, ref)
        assert within(errors, cfg.dtype), (cfg.model, style, variant, cfg.microbatches, cfg.dtype, errors)
        # every rank reports the last stage's loss
        assert all(r == run.losses for r in run.extra["losses_per_rank"]), (style, variant)


def test_jax_parity(jax_out):
    for cfg, ref, style, variant, run in runs(jax_out):
        errors = parity(run, ref)
        assert within(errors, cfg.dtype), (cfg.model, style, variant, cfg.microbatches, cfg.dtype, errors)


def test_cross_framework(torch_out, jax_out):
    torch_by_cfg = {e["cfg"]: e for e in torch_out}
    for j_entry in jax_out:
        t_entry = torch_by_cfg[j_entry["cfg"]]
        for _, _, style, variant, run in runs([t_entry]):
            assert cross_framework_ok(parity(run, j_entry["reference"]), t_entry["cfg"].dtype), (style, variant)
        for _, _, style, variant, run in runs([j_entry]):
            assert cross_framework_ok(parity(run, t_entry["reference"]), j_entry["cfg"].dtype), (style, variant)


def test_torch_ledger_point_to_point(torch_out):
    """Every rank: M activations sent forward unless last, M gradients back unless first, each
    (B/M, D) (transformer (B/M, T, D)); receives mirror the sends. Nothing else in the ledgered step (the loss broadcast
    is outside it). The builtin schedules move exactly the same messages."""
    for cfg, _, style, variant, run in runs(torch_out):
        per_rank = run.extra["comm_per_rank"]
        for r, comm in enumerate(per_rank):
            expected = {"count": pp_p2p_count_per_rank(cfg, r), "bytes": pp_p2p_bytes_per_rank(cfg, r)}
            assert comm == {"send": expected, "recv": expected}, (style, variant, cfg.microbatches, r, comm)
        assert sum(c["send"]["bytes"] for c in per_rank) == pp_p2p_bytes(cfg)
        assert run.comm_theory == pp_p2p_bytes_per_rank(cfg, 0)


def test_jax_ledger_collective_permute(jax_out):
    """Circular pipeline: 2·(M+S−2) collective-permutes of (B/M, D) (transformer (B/M, T, D)) with
    shard_map, 3·(M+S−2) with jit (XLA splits the roll's transpose in two); one all-reduce of the
    scalar loss. Nothing else: the embedding / head slots never communicate."""
    for cfg, _, style, _, run in runs(jax_out):
        b = cfg.bytes_per_element
        assert run.comm == {
            "collective_permute": {"count": pp_circular_permute_count(cfg, style),
                                   "bytes": pp_circular_permute_bytes(cfg, style)},
            "all_reduce": {"count": 1, "bytes": b},
        }, (style, cfg.microbatches, run.comm)


def test_state_bytes_one_stage_per_rank(torch_out, jax_out):
    """torch: rank s holds Φ_s (its blocks; + embeddings on 0, + final norm and head on S−1),
    Σ Φ_s = Φ; the MLP's Φ/S each. JAX: every device holds its blocks and a slot of the
    embeddings and of the head (SPMD): the MLP's Φ/S, more than torch's for the transformer."""
    for cfg, _, style, variant, run in runs(torch_out):
        S = cfg.world_size
        assert run.extra["state_bytes_per_rank"] == [pp_state_bytes(pp_stage_param_count(cfg, s), cfg)
                                                     for s in range(S)], (style, variant)
        assert run.state_bytes == run.extra["state_bytes_per_rank"][0]  # the reporting rank's
        assert sum(pp_stage_param_count(cfg, s) for s in range(S)) == cfg.n_params
    for cfg, _, style, variant, run in runs(jax_out):
        assert run.state_bytes == pp_state_bytes(pp_spmd_param_count(cfg), cfg), (style, variant)
    for cfg, _, _, _, run in [*runs(torch_out), *runs(jax_out)]:
        if cfg.model == "mlp":
            stage_bytes = cfg.n_params * cfg.bytes_per_element // cfg.world_size  # Φ·b/S
            assert run.state_bytes == {"params": stage_bytes, "grads": stage_bytes, "optimizer": 2 * stage_bytes}


@pytest.mark.slow
def test_jax_transformer_rest(torch_out, stages):
    """The JAX transformer configs the default run leaves out, through the same checks."""
    rest = jax_run_pattern("pp", transformer_configs(stages, jax_default=False))
    test_jax_parity(rest)
    test_cross_framework(torch_out, rest)
    test_jax_ledger_collective_permute(rest)
    test_state_bytes_one_stage_per_rank(torch_out, rest)


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
    (dict(model="transformer", layers=6), r"pp \(transformer\): layers=6 is not divisible by world_size=4"),
])
def test_bad_input_raises_before_launch(changes, message):
    cfg = Config(**{"world_size": 4, "layers": 8, **SIZES, **changes})
    with pytest.raises(ValueError, match=message):
        cfg.check("pp")
