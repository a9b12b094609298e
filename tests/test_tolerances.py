"""The step-aware parity verdict (shared/tolerances.py, shared/results.within): long runs of correct code
pass, a wrong reduction still fails — on the first steps and after 600. A NumPy simulation of data
parallelism (no rank launched): the batch split in two, the halves' gradients summed and averaged (the
reordering a collective brings), against the whole batch; and the same with a wrong averaging factor."""

from __future__ import annotations

import numpy as np
import pytest

from shared.results import rel_err, within
from shared.tolerances import STEP_CEILING, tolerance


def _grads(ws, x):
    """A tanh MLP, loss mean(out^2): (loss, dL/dW per layer), by hand."""
    acts = [x]
    for w in ws:
        acts.append(np.tanh(acts[-1] @ w))
    d = 2.0 * acts[-1] / acts[-1].size
    out = [None] * len(ws)
    for i in reversed(range(len(ws))):
        d = d * (1.0 - acts[i + 1] ** 2)
        out[i] = acts[i].T @ d
        d = d @ ws[i].T
    return float(np.mean(acts[-1] ** 2)), out


def _train(steps, split=1, factor=1.0, keep=(3,), lr=1e-3, wd=0.01, b1=0.9, b2=0.999, eps=1e-8):
    """AdamW as torch's; ``split`` shards' gradients summed then × factor / split (correct: factor 1).
    {step: (losses so far, step-0 grads, params)} at the steps in ``keep`` and the last."""
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((16, 16)) / 4 for _ in range(3)]
    x = rng.standard_normal((16, 16))
    m, v = [np.zeros_like(w) for w in ws], [np.zeros_like(w) for w in ws]
    losses, g0, out = [], None, {}
    for k in range(1, steps + 1):
        parts = [_grads(ws, p) for p in np.array_split(x, split)]
        losses.append(sum(p[0] for p in parts) / split)
        gs = [sum(p[1][i] for p in parts) * (factor / split) for i in range(len(ws))]
        g0 = g0 or gs
        for i, g in enumerate(gs):
            ws[i] = ws[i] * (1 - lr * wd)
            m[i], v[i] = b1 * m[i] + (1 - b1) * g, b2 * v[i] + (1 - b2) * g * g
            ws[i] = ws[i] - lr * (m[i] / (1 - b1 ** k)) / (np.sqrt(v[i] / (1 - b2 ** k)) + eps)
        if k in keep or k == steps:
            out[k] = (list(losses), g0, [w.copy() for w in ws])
    return out


def _errors(run, ref, resumed=False):
    return {"max_rel_err_loss": rel_err(run[0], ref[0]),
            "max_rel_err_grad": 0.0 if resumed else rel_err(run[1], ref[1]),
            "max_rel_err_param": rel_err(run[2], ref[2])}


@pytest.fixture(scope="module")
def runs():
    return {name: _train(600, *args) for name, args in
            {"ref": (1,), "split": (2,), "sum": (2, 2.0), "half": (2, 0.5)}.items()}


def test_the_tolerance_grows_with_the_steps_and_stops():
    assert tolerance("float64", 5) == tolerance("float64") == 1e-12
    assert tolerance("float64", 600) == pytest.approx(1e-12 * 120**2)  # the S^2 growth of the measured drift
    assert tolerance("float64", 10**6) == STEP_CEILING["float64"] == 1e-7
    assert tolerance("float32", 600) == STEP_CEILING["float32"] and tolerance("bfloat16", 600) == 5e-2
    # the case: torch fsdp, 600 float64 steps, 1.5e-11 from the single-device run
    drift = {"max_rel_err_loss": 1.5e-11, "max_rel_err_grad": 1e-15, "max_rel_err_param": 1.5e-11}
    assert within(drift, "float64", steps=600) and not within(drift, "float64")
    assert not within(drift | {"max_rel_err_grad": 1e-11}, "float64", steps=600)  # step 0's never grows


@pytest.mark.parametrize("steps", [3, 600])
def test_correct_code_passes_a_wrong_factor_fails(runs, steps):
    ref = runs["ref"][steps]
    assert within(_errors(runs["split"][steps], ref), "float64", steps=steps)
    for bad in ("sum", "half"):  # the halves summed, not averaged / averaged twice
        errors = _errors(runs[bad][steps], ref)
        assert not within(errors, "float64", steps=steps), (bad, steps, errors)
        resumed = _errors(runs[bad][steps], ref, resumed=True)  # no step-0 gradients: the parameters alone
        assert not within(resumed, "float64", steps=steps), (bad, steps, resumed)
        assert resumed["max_rel_err_param"] > 100 * tolerance("float64", steps)


def test_mixed_runs_are_judged_by_the_measured_floor():
    """A mixed run within MIXED_FACTOR x the floor passes; a lost 1/N (gradients x2) fails; a
    reference without a floor never passes silently; a ~0 floor counts as MIXED_FLOOR_MIN."""
    from shared.results import Trained, parity, within_floor
    from shared.tolerances import MIXED_FACTOR, MIXED_FLOOR_MIN, mixed_tolerance

    rng = np.random.default_rng(0)
    g, w = [rng.standard_normal((4, 4))], [rng.standard_normal((4, 4))]
    floor = {"max_rel_err_loss": 1e-4, "max_rel_err_grad": 5e-3, "max_rel_err_param": 1e-2}
    ref = Trained(losses=[1.0, 0.9], grads0=g, params=w, extra={"floor": floor})
    near = Trained(losses=[1.0 + 1e-4, 0.9], grads0=[g[0] * (1 + 1e-2)], params=[w[0] + 1e-2 * np.abs(w[0]).max()])
    assert within_floor(parity(near, ref), ref)
    halved = Trained(losses=[1.0, 0.9], grads0=[g[0] * 2], params=w)
    assert not within_floor(parity(halved, ref), ref)
    assert not within_floor(parity(near, ref), Trained(losses=[], grads0=[], params=[]))  # no floor: refused
    assert mixed_tolerance(0.0) == MIXED_FACTOR * MIXED_FLOOR_MIN
    # tp and cp's rings: other programs (MIXED_LAYOUT_FACTOR, never below MIXED_PROGRAM_MIN); a lost 1/N
    # still fails there, and every other pattern / variant keeps MIXED_FACTOR
    from shared.tolerances import MIXED_LAYOUT_FACTOR, MIXED_PROGRAM_MIN, mixed_factor

    assert mixed_factor(layout=("tp", "megatron")) == MIXED_LAYOUT_FACTOR["tp"]
    assert mixed_factor(layout=("cp", "ring")) == MIXED_LAYOUT_FACTOR["ring"] > mixed_factor(layout=("cp", "ulysses"))
    assert mixed_factor(layout=("cp", "ulysses")) == mixed_factor(layout=("pp", "1f1b")) == MIXED_FACTOR
    assert mixed_tolerance(0.0, layout=("tp", "megatron")) == MIXED_PROGRAM_MIN
    assert mixed_tolerance(0.0, layout=("dp", "naive")) == MIXED_FACTOR * MIXED_FLOOR_MIN
    for layout in (("tp", "megatron"), ("cp", "ring"), ("cp", "ring_zigzag")):
        assert not within_floor(parity(halved, ref), ref, layout=layout), layout


def test_float16_a_different_skip_fails_and_program_parameters_get_the_float16_factor():
    """float16 (dynamic loss scaling): a run that skipped other steps than its reference FAILS with one line
    saying so, whatever its errors; the same skips pass. Other programs' parameters (tp, the rings) get
    MIXED_FLOAT16_PARAM_FACTOR, their gradients do not (a lost 1/N still fails)."""
    from shared.config import Config
    from shared.results import Trained, make_result, parity, within_floor
    from shared.tolerances import MIXED_FLOAT16_PARAM_FACTOR, MIXED_LAYOUT_FACTOR, mixed_tolerance

    rng = np.random.default_rng(0)
    g, w = [rng.standard_normal((4, 4))], [rng.standard_normal((4, 4))]
    floor = {"max_rel_err_loss": 1e-5, "max_rel_err_grad": 5e-4, "max_rel_err_param": 5e-4}
    ref = Trained(losses=[1.0], grads0=g, params=w, extra={"floor": floor, "skipped_steps": [], "loss_scale": 2.0**16})
    cfg = Config(dtype="float16", precision="mixed", steps=1)
    same = Trained(losses=[1.0], grads0=g, params=w, extra={"skipped_steps": [], "loss_scale": 2.0**16})
    assert make_result("dp", "torch", "explicit", "naive", cfg, same, ref).ok
    other = Trained(losses=[1.0], grads0=g, params=w, extra={"skipped_steps": [0], "loss_scale": 2.0**15})
    row = make_result("dp", "torch", "explicit", "naive", cfg, other, ref)
    assert not row.ok and "skipped steps [0] where the reference skipped []" in row.extra["skip_mismatch"]
    tp = ("tp", "megatron")
    assert mixed_tolerance(5e-4, layout=tp, dtype="float16", quantity="max_rel_err_param") == \
        MIXED_FLOAT16_PARAM_FACTOR * MIXED_LAYOUT_FACTOR["tp"] * 5e-4
    assert mixed_tolerance(5e-4, layout=("dp", "naive"), dtype="float16", quantity="max_rel_err_param") == \
        mixed_tolerance(5e-4, layout=("dp", "naive"))  # the split run itself: no extra factor
    halved = Trained(losses=[1.0], grads0=[g[0] * 2], params=w)
    assert not within_floor(parity(halved, ref), ref, layout=tp, dtype="float16")


def test_mixed_layout_factor_and_program_minimum():
    """tp and cp's ring round where the reference does not, by construction (shared/tolerances.py): their
    factor is MIXED_LAYOUT_FACTOR's, keyed by pattern or variant; tp's tolerance never below one program's."""
    from shared.tolerances import (
        MIXED_FACTOR,
        MIXED_FLOAT16_PARAM_FACTOR,
        MIXED_LAYOUT_FACTOR,
        MIXED_PROGRAM_MIN,
        mixed_tolerance,
    )

    assert mixed_tolerance(1e-3, "shard_map", layout=("cp", "ring")) == MIXED_LAYOUT_FACTOR["ring"] * 1e-3
    # ulysses keeps the default factor but is another program on some vector paths (AVX2's float16, issue 51):
    # never below one program's rounding, and its float16 parameters x MIXED_FLOAT16_PARAM_FACTOR
    assert mixed_tolerance(1e-2, "shard_map", layout=("cp", "ulysses")) == MIXED_FACTOR * 1e-2
    assert mixed_tolerance(1e-6, "shard_map", layout=("cp", "ulysses")) == MIXED_PROGRAM_MIN
    assert mixed_tolerance(1e-2, "explicit", layout=("cp", "ulysses"), dtype="float16",
                           quantity="max_rel_err_param") == MIXED_FACTOR * 1e-2 * MIXED_FLOAT16_PARAM_FACTOR
    assert mixed_tolerance(1e-6, "jit", layout=("tp", "megatron")) == MIXED_PROGRAM_MIN


# --- long pure runs: a measured floor (the reference against itself with the batch split in two) ------

def _trained(out, steps):
    from shared.results import Trained

    losses, g0, params = out[steps]
    return Trained(losses=losses, grads0=g0, params=params)


@pytest.fixture(scope="module")
def chaotic():
    """The simulation at lr 0.3: rounding is amplified exponentially (the split run reaches 1e-2 in the
    parameters after 600 steps, far past the growth law's 1e-7 ceiling), as compare.py's transformer
    does near its loss floor. The sharded runs: the batch in 4 and 8 parts (other sums than the floor's
    2); the wrong ones: summed not averaged, averaged twice, and 3 uneven parts averaged as if even."""
    return {name: _trained(_train(600, *args, lr=0.3), 600) for name, args in
            {"ref": (1,), "floor": (2,), "4": (4,), "8": (8,), "sum": (2, 2.0), "half": (2, 0.5),
             "uneven": (3,)}.items()}


def test_long_pure_runs_pass_by_the_measured_floor_and_a_wrong_reduction_fails(chaotic):
    from shared.results import floor_extra, losses_within_floor, parity, pure_floor

    ref = chaotic["ref"]
    ref.extra.update(floor_extra(ref, chaotic["floor"]))
    floor = pure_floor(ref)
    assert floor["max_rel_err_param"] > 1e-3  # chaos: no growth law separates this from a bug
    for name in ("4", "8"):  # correct code: fails the growth law, passes by the floor
        errors = parity(chaotic[name], ref)
        assert not within(errors, "float64", steps=600), name
        assert within(errors, "float64", steps=600, floor=floor), (name, errors, floor)
        assert losses_within_floor(chaotic[name], "float64", 1.0, ref), name
    for name in ("sum", "half", "uneven"):  # a wrong reduction: fails on its first steps, floor or not
        run = chaotic[name]
        assert not within(parity(run, ref), "float64", steps=600, floor=floor), name  # the step-0 gradients
        assert not losses_within_floor(run, "float64", 1.0, ref), name  # the losses, step by step
        first = type(run)(losses=run.losses[:3], grads0=[], params=[])  # its first 3 steps alone fail too
        head = type(ref)(losses=ref.losses[:3], grads0=[], params=[], extra={"floor_losses": ref.extra["floor_losses"]})
        assert not losses_within_floor(first, "float64", 1.0, head), name
    # resumed at step 2 (no step-0 gradients): its first steps, still within a tiny floor, fail it
    resumed = type(ref)(losses=chaotic["sum"].losses[2:], grads0=[], params=chaotic["sum"].params, start_step=2)
    assert not losses_within_floor(resumed, "float64", 1.0, ref)
    assert max(ref.extra["floor_losses"][:10]) < 1e-12  # the floor there is rounding, not chaos


def test_short_runs_measure_no_floor():
    from shared.config import Config
    from shared.results import Trained, losses_within_floor, needs_floor
    from shared.tolerances import PURE_FLOOR_STEPS, floor_tolerance

    assert not needs_floor(Config(steps=PURE_FLOOR_STEPS)) and needs_floor(Config(steps=PURE_FLOOR_STEPS + 1))
    assert not needs_floor(Config(steps=600, precision="mixed", dtype="bfloat16"))  # mixed: its own floor
    assert floor_tolerance("float64", 600, None) == tolerance("float64", 600)
    assert floor_tolerance("float64", 600, 0.0) == tolerance("float64", 600)  # never below the growth law
    run = Trained(losses=[1.0], grads0=[], params=[])
    assert losses_within_floor(run, "float64", 1.0, Trained(losses=[2.0], grads0=[], params=[]))  # no floor: within's


def test_float16_references_that_skip_apart_are_not_comparable_across_frameworks():
    """torch's autocast and Flax's dtype=float16 round different ops in float16, so their backwards overflow at
    different loss scales (measured: L=2 D=8, torch none, JAX steps 0-2). Then the cross-framework check is
    neither ok nor FAIL but not comparable, saying why; each run is still judged against its own reference."""
    from parallel_twins.report import all_ok
    from shared.config import Config
    from shared.diff import _xfw_status
    from shared.results import Trained, make_result

    rng = np.random.default_rng(0)
    g, w = [rng.standard_normal((4, 4))], [rng.standard_normal((4, 4))]
    floor = {"max_rel_err_loss": 1e-5, "max_rel_err_grad": 5e-4, "max_rel_err_param": 5e-4}
    mine = Trained(losses=[1.0], grads0=g, params=w, extra={"floor": floor, "skipped_steps": [], "loss_scale": 1.0})
    other = Trained(losses=[2.0], grads0=g, params=w, extra={"floor": floor, "skipped_steps": [0], "loss_scale": 0.5})
    run = Trained(losses=[1.0], grads0=g, params=w, extra={"skipped_steps": [], "loss_scale": 1.0})
    row = make_result("dp", "torch", "explicit", "naive", Config(dtype="float16", precision="mixed", steps=1), run,
                      mine, other)
    assert row.ok and row.xfw_ok is None and "skipped steps [] and [0]" in row.extra["xfw_not_comparable"]
    assert all_ok([row], [{"ok": None}], []) and not all_ok([row], [{"ok": False}], [])
    assert [_xfw_status(v) for v in (True, False, None)] == ["ok", "FAIL", "not comparable"]


def test_adam_ratio_bound_holds_for_any_gradient_sequence():
    """shared.tolerances.adam_ratio_bound: |m̂_t| / √v̂_t never exceeds it (random and adversarial
    sequences, torch's bias-corrected moments without eps), and it is 1 at the first step."""
    from shared.tolerances import adam_ratio_bound

    assert adam_ratio_bound(1, 0.9, 0.999) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    for t in (1, 2, 3, 10, 50):
        bound = adam_ratio_bound(t, 0.9, 0.999)
        seqs = [rng.standard_normal(t), np.abs(rng.standard_normal(t)), 0.9 ** -np.arange(t)]  # the last: growing
        for g in seqs:
            m = v = 0.0
            for gk in g:
                m, v = 0.9 * m + 0.1 * gk, 0.999 * v + 0.001 * gk * gk
            ratio = abs(m / (1 - 0.9 ** t)) / np.sqrt(v / (1 - 0.999 ** t))
            assert ratio <= bound * (1 + 1e-12), (t, ratio, bound)


def test_mixed_parity_splits_off_noise_driven_entries_only():
    """shared.results.mixed_parity (issue 51): an entry whose two step-0 gradients differ by more than
    half the reference's is judged by AdamW's bound, the rest by the floor; a move past the bound keeps
    the whole error; gradients wrong everywhere (a bug, not rounding) are not split."""
    from types import SimpleNamespace

    from shared.results import Trained, mixed_parity

    cfg = SimpleNamespace(lr=1e-3, schedule="constant", steps=3, beta1=0.9, beta2=0.999)
    g = np.linspace(1.0, 2.0, 400).reshape(20, 20)
    g[3, 4] = 1e-5  # a rounding-noise gradient entry
    p = np.full((20, 20), 0.08)
    ref = Trained(losses=[1.0], grads0=[g], params=[p])
    g_run, p_run = g.copy(), p.copy()
    g_run[3, 4] = -2e-5  # the other program's noise points the other way …
    p_run[3, 4] += 3e-3  # … and AdamW moved that entry 3 lr apart
    run = Trained(losses=[1.0], grads0=[g_run], params=[p_run])
    errors, noise = mixed_parity(run, ref, cfg)
    assert errors["max_rel_err_param"] == 0.0 and noise["noise_entries"] == 1
    assert noise["noise_bound"] == pytest.approx(2e-3 * (1 + 1.0009995 + 1.0037), rel=1e-3)
    p_run[3, 4] = 0.08 + 7e-3  # further than any AdamW run can move it apart in 3 steps
    assert mixed_parity(run, ref, cfg)[0]["max_rel_err_param"] == pytest.approx(7e-3 / 0.08)
    p_run[3, 4], p_run[0, 0] = 0.08 + 3e-3, 0.08 + 1e-3  # a determined entry off: judged by the floor
    assert mixed_parity(run, ref, cfg)[0]["max_rel_err_param"] == pytest.approx(1e-3 / 0.08)
    bug = Trained(losses=[1.0], grads0=[-g], params=[p + 3e-3])  # every gradient wrong: no split
    assert mixed_parity(bug, ref, cfg)[0]["max_rel_err_param"] == pytest.approx(3e-3 / 0.08)
    resumed = Trained(losses=[1.0], grads0=[], params=[p_run], start_step=1)  # no step-0 gradients: no split
    assert mixed_parity(resumed, ref, cfg)[1] == {}


def test_a_routing_drift_after_step_0_holds_its_entries_to_adamw_bound():
    """An MoE run in mixed precision that routed a token otherwise after step 0 (a near-tie; measured on an
    AMD EPYC: one position-embedding entry, step-0 gradients equal, ended 1.6 lr from the reference's, 12x the
    floor): with ``drift_tol`` (make_result passes it when the run reports a routing drift) the entries past
    the floor's tolerance are held to AdamW's bound; without, the whole error stands; a move past the bound,
    or drift entries past NOISE_MAX_FRACTION of all entries (not a token's worth), keep it."""
    from types import SimpleNamespace

    from shared.results import Trained, mixed_parity
    from shared.tolerances import NOISE_MAX_FRACTION

    cfg = SimpleNamespace(lr=1e-3, schedule="constant", steps=3, beta1=0.9, beta2=0.999)
    g, p = np.linspace(1.0, 2.0, 400).reshape(20, 20), np.full((20, 20), 0.08)
    ref = Trained(losses=[1.0], grads0=[g], params=[p])
    p_run = p.copy()
    p_run[3, 4] += 1.6e-3  # the token's entry: its step-0 gradient agrees (determined), it moved later
    p_run[0, 0] += 1e-5  # rounding elsewhere, within the floor
    run = Trained(losses=[1.0], grads0=[g.copy()], params=[p_run])
    assert mixed_parity(run, ref, cfg)[0]["max_rel_err_param"] == pytest.approx(1.6e-3 / 0.08)
    errors, noise = mixed_parity(run, ref, cfg, drift_tol=1e-3)
    assert errors["max_rel_err_param"] == pytest.approx(1e-5 / 0.08) and noise["drift_entries"] == 1
    p_run[3, 4] = 0.08 + 7e-3  # past AdamW's bound for 3 steps: not rounding, the whole error
    assert mixed_parity(run, ref, cfg, drift_tol=1e-3)[0]["max_rel_err_param"] == pytest.approx(7e-3 / 0.08)
    wide = p + np.where(np.arange(400).reshape(20, 20) < NOISE_MAX_FRACTION * 400 + 1, 1e-3, 0.0)
    errors, noise = mixed_parity(Trained(losses=[1.0], grads0=[g], params=[wide]), ref, cfg, drift_tol=1e-3)
    assert errors["max_rel_err_param"] == pytest.approx(1e-3 / 0.08) and noise["drift_entries"] is None
