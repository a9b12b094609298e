"""ZeRO-2 / ZeRO-3 / FSDP on both models: every torch and JAX variant against its own single-device
reference and against the other framework's; the ledgers of the explicit (torch), FSDP2 and
shard_map (JAX) steps against shared.theory.fsdp_comm; the per-rank state bytes against the ZeRO
memory table with the transformer's replicated gains (shared.theory.fsdp_state_bytes).
The hand-written wrapper's own checks (bit for bit, mixed precision, padding): test_fsdp_wrapper.py."""

from __future__ import annotations

import pytest
from typed_expect import split_params, stated_kinds, zero_ledger

from jax_impl.fsdp import VARIANTS as JAX_VARIANTS
from jax_impl.harness import run_pattern as jax_run_pattern
from jax_impl.parallel.typed import summarize
from shared.config import Config
from shared.results import comm_bytes, cross_framework_ok, parity, within
from shared.theory import adam_state_bytes, fsdp_comm, fsdp_state_bytes, zero2_comm, zero3_comm
from torch_impl.harness import run_pattern as torch_run_pattern
from torch_impl.launch import launch

SIZES = dict(layers=4, dim=16, batch=16, steps=5)
TRANSFORMER = dict(model="transformer", layers=2, dim=16, seq=8, vocab=32, batch=8, steps=3)
DTYPES = ("float64", "float32")


def configs(world_size: int) -> list[Config]:
    """MLP: both dtypes at N = 2 and 4; transformer: float64 (the transformer in float32 runs in
    compare.py and in test_mesh's fsdp=2,tp=2 layout: its compiles dominate this module's time)."""
    return ([Config(world_size=world_size, dtype=dtype, **SIZES) for dtype in DTYPES]
            + [Config(world_size=world_size, dtype="float64", heads=4, **TRANSFORMER)])


def jax_configs(world_size: int) -> list[Config]:
    return [c for c in configs(world_size) if c.model == "mlp" or c.dtype == "float64"]


# N=4 under -m slow (suite budget): N=2 runs every variant, model and dtype; the N-D mesh tests
# (tests/test_mesh.py) run the fsdp wrapper again at fsdp=2 inside 2-D and 3-D layouts.
@pytest.fixture(scope="module", params=(2, pytest.param(4, marks=pytest.mark.slow)), ids=lambda n: f"N{n}")
def results(request):
    """One torch launch and one JAX run per world size: every variant × both models × both dtypes."""
    cfgs = configs(request.param)
    f16 = {F16: F16_VARIANTS} if request.param == 2 else {}  # float16: its own test, test_float16_loss_scaling
    torch_out = launch(torch_run_pattern, request.param, "fsdp", cfgs + list(f16), f16)[0]
    cfgs = jax_configs(request.param)  # typed on the MLP only (suite budget; model-generic steps)
    untyped = [sv for sv in JAX_VARIANTS if sv[0] != "typed"]
    jax_out = jax_run_pattern("fsdp", [c for c in cfgs if c.model == "mlp"]) + \
        jax_run_pattern("fsdp", [c for c in cfgs if c.model != "mlp"], untyped)
    return {"torch": torch_out, "jax": jax_out}


# float16 (mixed, dynamic loss scaling) at N = 2: the tiny MLP under zero3 (FSDP(compute_dtype=float16): casts
# before the gather) and fsdp2 (MixedPrecisionPolicy(float16, float32): DTensor gradients unscaled locally)
F16 = Config(world_size=2, layers=2, dim=8, batch=4, steps=3, dtype="float16", precision="mixed")
F16_VARIANTS = [("explicit", "zero3"), ("builtin", "fsdp2")]


def all_runs(results):
    """(framework, cfg, style, variant, run, own reference, other framework's reference); a config
    JAX does not run still gets JAX's single-device reference (computed once, cached)."""
    from jax_impl.harness import _reference as jax_reference

    refs = {fw: {e["cfg"]: e["reference"] for e in results[fw]} for fw in ("torch", "jax")}
    for fw, other in (("torch", "jax"), ("jax", "torch")):
        for entry in results[fw]:
            cfg = entry["cfg"]
            if cfg.precision == "mixed":  # test_float16_loss_scaling
                continue
            other_ref = refs[other].get(cfg) or jax_reference(cfg, "auto")
            for style, variant, run in entry["runs"]:
                yield fw, cfg, style, variant, run, entry["reference"], other_ref


def test_every_variant_matches_its_own_reference(results):
    bad = []
    for fw, cfg, style, variant, run, ref, _ in all_runs(results):
        errors = parity(run, ref)
        if not within(errors, cfg.dtype):
            bad.append((fw, cfg.model, cfg.world_size, cfg.dtype, style, variant, errors))
    assert not bad, bad


def test_every_variant_matches_the_other_frameworks_reference(results):
    bad = []
    for fw, cfg, style, variant, run, _, other_ref in all_runs(results):
        errors = parity(run, other_ref)
        if not cross_framework_ok(errors, cfg.dtype):
            bad.append((fw, cfg.model, cfg.world_size, cfg.dtype, style, variant, errors))
    assert not bad, bad


def test_ledger_matches_theory(results):
    """explicit / shard_map ZeRO-3: every unit gathered fwd, every unit whose weight the backward
    needs gathered again (not the embeddings, not the MLP's layer 0), every unit reduce-scattered,
    the transformer's gains in ONE all-reduce; ZeRO-2: reduce-scatter + all-gather per unit; FSDP2:
    its per-block groups. Op by op, count and bytes. jit: whatever XLA chose (docs/fsdp.md)."""
    for fw, cfg, style, variant, run, _, _ in all_runs(results):
        if style == "jit":
            assert "reduce_scatter" not in run.comm, run.comm  # XLA:CPU all-reduces instead (docs)
            continue
        if style == "typed":  # XLA's choice per platform (tests/typed_expect.py), and what was stated
            want = zero_ledger(cfg, variant, run.where["platform"])
            assert want is None or run.comm == want, (cfg.model, cfg.world_size, variant, run.comm, want)
            if want is not None:  # each stated gather became one all-gather of the same bytes
                assert summarize(run.extra["stated"])["gather"] == run.comm["all_gather"], run.extra["stated"]
            n = len(split_params(cfg, variant))
            assert stated_kinds(run) == ({"gather": n, "slice": n} if variant == "zero3"  # reshard(w, P()), its
                                         else {"slice": 2 * n, "gather": n}), run.extra["stated"]  # transpose
            continue
        expected = {op: {"count": c, "bytes": b} for op, (c, b) in fsdp_comm(cfg, variant).items()}
        assert run.comm == expected, (fw, cfg.model, cfg.world_size, cfg.dtype, style, variant, run.comm)
        assert comm_bytes(run.comm) == run.comm_theory, (fw, style, variant)


def test_mlp_ledger_is_unchanged(results):
    """The generic formulas reduce to the MLP's: 2L−1 gathers + L reduce-scatters of D²·b (ZeRO-3),
    FSDP2 2L gathers (3·Φ·b), ZeRO-2 L + L."""
    for fw, cfg, style, variant, run, _, _ in all_runs(results):
        if cfg.model != "mlp" or style in ("jit", "typed"):
            continue
        table = zero2_comm(cfg) if variant == "zero2" else zero3_comm(cfg, regather_first=variant == "fsdp2")
        assert run.comm == {op: {"count": c, "bytes": b} for op, (c, b) in table.items()}, (fw, style, variant)


def test_state_bytes_match_the_zero_memory_table(results):
    for fw, cfg, style, variant, run, _, _ in all_runs(results):
        assert run.state_bytes == fsdp_state_bytes(cfg, variant), (fw, cfg.model, cfg.world_size, style, variant)
        if cfg.model == "mlp":  # no vectors: exactly the ZeRO table
            assert run.state_bytes == adam_state_bytes(cfg, "zero2" if variant == "zero2" else "zero3")


def test_transformer_state_is_a_little_above_phi_over_n():
    cfg = Config(world_size=4, dtype="float32", heads=4, **TRANSFORMER)
    gains = (2 * cfg.layers + 1) * cfg.dim * 4  # replicated RMSNorm gains, bytes
    z3 = fsdp_state_bytes(cfg, "zero3")
    assert sum(z3.values()) == pytest.approx(16 * cfg.n_params / 4 + 4 * gains * (1 - 1 / 4))


@pytest.mark.parametrize("changes", [dict(dim=18), dict(batch=18)], ids=["dim", "batch"])
def test_indivisible_sizes_fail_before_any_process_starts(changes):
    bad = Config(world_size=4, **{**SIZES, **changes})  # a valid Config on its own…
    with pytest.raises(ValueError, match="not divisible by world_size=4"):
        bad.check("fsdp")  # …that fsdp refuses (compare.py calls check before launching)
    with pytest.raises(ValueError, match="not divisible"):
        jax_run_pattern("fsdp", [bad])  # checked before anything is compiled


def test_transformer_needs_even_row_blocks():
    with pytest.raises(ValueError, match="vocab=30 is not divisible by world_size=4"):
        Config(world_size=4, **{**TRANSFORMER, "vocab": 30}).check("fsdp")


def test_float16_loss_scaling(results):
    """--precision mixed --dtype float16 at N = 2: ok against the single-device float16 run (the same
    LossScaler and casts) within its measured floor; the same skipped steps and final scale; the ledger
    equal to theory with the found-inf flag's 4-byte all-reduce."""
    from shared.results import make_result

    entries = [e for e in results["torch"] if e["cfg"] == F16]
    if not entries:
        pytest.skip("float16 runs at N = 2")
    (entry,) = entries
    assert [(s, v) for s, v, _ in entry["runs"]] == F16_VARIANTS
    for style, variant, run in entry["runs"]:
        ref = entry.get("references", {}).get(variant, entry["reference"])  # zero3 / fsdp2: the casts they make
        row = make_result("fsdp", "torch", style, variant, F16, run, ref)
        assert row.ok, (variant, row.extra["mixed"])
        assert (run.extra["skipped_steps"], run.extra["loss_scale"]) == (ref.extra["skipped_steps"],
                                                                        ref.extra["loss_scale"]), run.extra
        assert comm_bytes(run.comm) == run.comm_theory, (variant, run.comm, run.comm_theory)
