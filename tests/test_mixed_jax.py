"""--precision mixed (issue 34) under the JAX tp, pp and cp runners: float32 master weights and optax
state, bf16 compute, gradient reductions in float32, against the single-device run with the same
casts (its measured split-batch floor × the factor, shared/tolerances.py — the verdict the CLI gives).

One layout per pattern, each the one whose mixed path is its own (the whole sweep: compare.py, and
test_cli's slow tier): tp shard_map/megatron_sp (the replicated gains and wpe meet split tokens: made
device-varying before the cast, so their psum is float32), pp shard_map/1f1b (per-micro-batch vjps of the
bf16 copies, summed into float32), cp shard_map/ring (the custom-vjp ring: bf16 K|V on the wire, float32
accumulators, dK|dV home in float32). XLA:CPU runs bf16 collectives in float32 (jax_impl/ledger.py), so
the compiled ledger cannot show the dtypes: the step's jaxpr (what the program asks for, what a GPU
sends) is read instead.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_impl  # noqa: F401  (float64)
from jax_impl import harness
from shared.config import Config
from shared.results import make_result

CFG = Config(model="transformer", world_size=2, layers=2, dim=8, heads=2, seq=4, vocab=8, batch=4, microbatches=2,
             steps=2, dtype="bfloat16", precision="mixed")
COLLECTIVES = ("psum", "psum_invariant", "ppermute", "all_gather", "all_gather_invariant", "reduce_scatter",
               "psum_scatter", "all_to_all", "pmax")


def collectives(jaxpr) -> list[tuple[str, str, tuple]]:
    """(primitive, dtype, shape) of every collective in a jaxpr, its sub-jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in COLLECTIVES:
            out += [(eqn.primitive.name, str(v.aval.dtype), tuple(v.aval.shape)) for v in eqn.invars]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += collectives(inner)
    return out


@pytest.mark.parametrize("pattern,style,variant", [("tp", "shard_map", "megatron_sp"), ("pp", "shard_map", "1f1b"),
                                                   ("cp", "shard_map", "ring")])
def test_mixed_precision_per_pattern(pattern, style, variant, monkeypatch):
    module, seen = __import__(f"jax_impl.{pattern}", fromlist=["train_loop"]), []
    real = module.train_loop

    def recording(cfg, setup):  # the step's program, as traced (before XLA:CPU widens bf16 collectives)
        seen.append(collectives(jax.make_jaxpr(setup.step)(*setup.state, *setup.batch).jaxpr))
        seen.append({str(a.dtype) for a in jax.tree.leaves(setup.state) if np.issubdtype(a.dtype, np.floating)})
        return real(cfg, setup)

    monkeypatch.setattr(module, "train_loop", recording)
    entry = harness.run_pattern(pattern, [CFG], [(style, variant)])[0]
    trained = entry["runs"][0][2]
    row = make_result(pattern, "jax", style, variant, CFG, trained, entry["reference"])
    assert row.ok and row.precision == "mixed", row.extra["mixed"]
    assert row.extra["mixed"]["loss_rel_err_vs_float64"] <= 2e-2  # the bar: bf16 rounding of the losses
    assert row.comm_bytes == row.comm_bytes_theory  # XLA:CPU's float32 wire (jax_impl.devices.wire_config)
    ops, state_dtypes = seen
    assert state_dtypes == {"float32"}  # master weights and optax's moments
    if pattern == "tp":  # activations bf16; the loss's reductions and the replicated weights' gradients float32
        assert {d for op, d, _ in ops if op in ("all_gather", "reduce_scatter", "psum_scatter")} == {"bfloat16"}
        grads = [s for op, d, s in ops if op.startswith("psum") and d == "float32" and s in ((8,), (4, 8))]
        assert grads and not [s for op, d, s in ops if d == "bfloat16" and s in ((8,), (4, 8))], ops
    if pattern == "pp":  # the messages bf16, the loss float32
        assert {d for op, d, _ in ops if op == "ppermute"} == {"bfloat16"}
        assert {d for op, d, _ in ops if op.startswith("psum")} == {"float32"}
    if pattern == "cp":  # K|V bf16, dK|dV float32 (the ring's accumulators), the weights' gradient psum float32
        hops = [(d, s) for op, d, s in ops if op == "ppermute"]
        assert {d for d, _ in hops} == {"bfloat16", "float32"} and len({s for _, s in hops}) == 1
        phi = sum(int(np.prod(a.shape)) for a in entry["reference"].params)
        assert sum(int(np.prod(s)) for op, d, s in ops if op.startswith("psum") and d == "float32") >= phi
        assert not [s for op, d, s in ops if op.startswith("psum") and d == "bfloat16"], ops


@pytest.mark.parametrize("pattern,variant", [("dp", "zero1"), ("fsdp", "zero3"), ("cp", "ring"), ("tp", "megatron"),
                                            ("pp", "circular")])
def test_float16_with_loss_scaling(pattern, variant):
    """--dtype float16 (dynamic loss scaling) under dp, fsdp, cp, tp (apply_plan) and pp, shard_map: the
    reference, its floor and
    the run scale alike. This tiny model's float16 backward overflows at GradScaler's 2**16, 2**15, 2**14
    (measured): both skip steps 0-2 (the parameters untouched), train at 2**13, end at the same scale, and
    the run is ok against the floor; the ledger equals the theory (zero1 / zero3: + the flag's pmax; cp:
    the ring's float16 K|V stay 2 bytes on XLA:CPU's wire, unlike bf16's; tp, pp: XLA's 1-byte flag per
    split leaf); a run that skipped
    another step FAILs with one line."""
    import dataclasses

    cfg = CFG.replace(dtype="float16", steps=5)
    entry = harness.run_pattern(pattern, [cfg], [("shard_map", variant)])[0]
    trained, ref = entry["runs"][0][2], entry["reference"]
    skipped = ref.extra["skipped_steps"]
    assert skipped == [0, 1, 2] and ref.losses[4] < ref.losses[0], (skipped, ref.losses)  # then it trained
    assert trained.extra["skipped_steps"] == skipped and trained.extra["loss_scale"] == ref.extra["loss_scale"]
    row = make_result(pattern, "jax", "shard_map", variant, cfg, trained, ref)
    assert row.ok, (row.extra["mixed"], row.max_rel_err_loss, row.max_rel_err_grad, row.max_rel_err_param, row.losses)
    assert row.comm_bytes == row.comm_bytes_theory  # + 4 bytes: the agreed flag's all-reduce
    other = dataclasses.replace(trained, extra={**trained.extra, "skipped_steps": [cfg.steps - 1]})
    bad = make_result(pattern, "jax", "shard_map", variant, cfg, other, ref)
    assert not bad.ok and "skipped steps [4] where the reference skipped" in bad.extra["skip_mismatch"]


def test_float16_leaves_out_pps_schedules_by_hand():
    """Their micro-batch gradients are summed in float32 (the reference's float16 backward sums the whole
    batch): they overflow at other scales, so they are left out with the reason (shared.recipe.refusal)."""
    from jax_impl import pp
    from shared.recipe import refusal

    cfg = CFG.replace(dtype="float16")
    assert [v for _, v in pp.variants(cfg)] == ["circular", "circular"]
    assert "sums each micro-batch's float16" in refusal("jax", "pp", "shard_map", "1f1b", cfg)
