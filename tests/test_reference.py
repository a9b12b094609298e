"""The single-device references: torch vs JAX vs an independent NumPy float64 backprop."""

import numpy as np
import numpy_reference
import pytest

from jax_impl import reference as jax_reference
from shared.config import Config
from shared.problem import make_problem
from shared.results import parity, within
from torch_impl import reference as torch_reference

CFG = Config(world_size=1, layers=4, dim=16, batch=8, steps=5)


@pytest.fixture(scope="module")
def numpy_run():
    return numpy_reference.train(CFG, make_problem(CFG))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_jax_numpy_agree(dtype, numpy_run):
    cfg = CFG.replace(dtype=dtype)
    problem = make_problem(cfg)
    t = torch_reference.train(cfg, problem)
    j = jax_reference.train(cfg, problem)
    for name, run in (("torch", t), ("jax", j)):
        errors = parity(run, numpy_run)
        assert within(errors, dtype), (name, dtype, errors)
    assert within(parity(t, j), dtype), parity(t, j)
    assert len(t.losses) == cfg.steps and t.losses[-1] < t.losses[0]  # it trains


def test_state_bytes_match_adamw_theory():
    from shared.theory import adam_state_bytes

    cfg = CFG.replace(dtype="float32")
    problem = make_problem(cfg)
    expected = adam_state_bytes(cfg.replace(world_size=1), "dp")
    assert torch_reference.train(cfg, problem).state_bytes == expected
    assert jax_reference.train(cfg, problem).state_bytes == expected


def test_numpy_backprop_matches_finite_differences():
    """The NumPy reference's hand-written gradients are right (central differences, float64)."""
    cfg = Config(world_size=1, layers=2, dim=4, batch=3)
    p = make_problem(cfg)
    w = [x.copy() for x in p.weights]
    _, grads = numpy_reference.loss_and_grads(w, p.inputs)
    h = 1e-6
    for layer, (i, j) in [(0, (1, 2)), (1, (3, 0))]:
        plus = [x.copy() for x in w]
        minus = [x.copy() for x in w]
        plus[layer][i, j] += h
        minus[layer][i, j] -= h
        fd = (numpy_reference.loss_and_grads(plus, p.inputs)[0]
              - numpy_reference.loss_and_grads(minus, p.inputs)[0]) / (2 * h)
        # central differences are accurate to O(h^2) ~ 1e-12 relative to the loss scale
        np.testing.assert_allclose(grads[layer][i, j], fd, rtol=1e-6, atol=1e-10)


def test_fixture_recipe_is_reproducible():
    """The recipe in shared/problem.py, redrawn by hand."""
    cfg = Config(world_size=1, layers=3, dim=5, batch=2, seed=7)
    p = make_problem(cfg)
    rng = np.random.default_rng(7)
    for w in p.weights:
        np.testing.assert_array_equal(w, rng.standard_normal((5, 5)) / np.sqrt(5))
    np.testing.assert_array_equal(p.inputs, rng.standard_normal((2, 5)))


# --- the transformer -------------------------------------------------------------------------

TCFG = Config(world_size=1, model="transformer", layers=2, dim=8, heads=2, seq=5, vocab=11, batch=3, steps=3)


@pytest.fixture(scope="module")
def transformer_refs():
    problem = make_problem(TCFG)
    return problem, torch_reference.train(TCFG, problem), jax_reference.train(TCFG, problem)


def test_transformer_loss_matches_numpy_forward(transformer_refs):
    """Step 0's loss in both frameworks equals the recipe written in NumPy (float64: round-off only)."""
    problem, t, j = transformer_refs
    want = numpy_reference.transformer_loss(problem.params, problem.inputs, problem.targets, TCFG.heads)
    assert abs(t.losses[0] - want) <= 1e-12 * abs(want), (t.losses[0], want)
    assert abs(j.losses[0] - want) <= 1e-12 * abs(want), (j.losses[0], want)
    assert want > np.log(TCFG.vocab) * 0.5  # a real cross-entropy, not a degenerate one


def test_transformer_gradients_match_central_differences(transformer_refs):
    """One entry of every parameter: the frameworks' step-0 gradient vs central differences of the
    NumPy loss, float64. h = 1e-5: truncation O(h²) ~ 1e-10 and round-off ~ 1e-16/h ~ 1e-11 in a
    loss of ~2.4, so 1e-7 relative to the largest gradient entry of that parameter separates a
    right gradient from a wrong one (a missing term or scale is >= 1e-2)."""
    problem, t, j = transformer_refs
    h = 1e-5
    rng = np.random.default_rng(1)
    for idx, (name, w) in enumerate(problem.params.items()):
        at = tuple(int(rng.integers(0, s)) for s in w.shape)
        plus = {k: v.copy() for k, v in problem.params.items()}
        minus = {k: v.copy() for k, v in problem.params.items()}
        plus[name][at] += h
        minus[name][at] -= h
        fd = (numpy_reference.transformer_loss(plus, problem.inputs, problem.targets, TCFG.heads)
              - numpy_reference.transformer_loss(minus, problem.inputs, problem.targets, TCFG.heads)) / (2 * h)
        for fw, run in (("torch", t), ("jax", j)):
            scale = max(np.abs(run.grads0[idx]).max(), 1e-8)
            assert abs(run.grads0[idx][at] - fd) <= 1e-7 * scale, (fw, name, at, run.grads0[idx][at], fd)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_transformer_torch_and_jax_references_agree(dtype, transformer_refs):
    cfg = TCFG.replace(dtype=dtype)
    problem = make_problem(cfg)
    t = torch_reference.train(cfg, problem) if dtype != "float64" else transformer_refs[1]
    j = jax_reference.train(cfg, problem) if dtype != "float64" else transformer_refs[2]
    assert within(parity(t, j), dtype), parity(t, j)  # float64 ≤ 1e-12 (measured ~1e-15)
    assert t.losses[-1] < t.losses[0]  # it trains
    # state bytes: params + grads + two AdamW moments, 4·Φ·b
    assert t.state_bytes == j.state_bytes == {k: v * cfg.n_params * cfg.bytes_per_element
                                              for k, v in (("params", 1), ("grads", 1), ("optimizer", 2))}


def test_transformer_recipe_is_reproducible():
    """shared/problem.py's transformer recipe, redrawn by hand in the stated order."""
    cfg = TCFG.replace(seed=3)
    p = make_problem(cfg)
    rng = np.random.default_rng(3)
    d, n = cfg.dim, rng.standard_normal
    np.testing.assert_array_equal(p.params["wte.weight"], n((cfg.vocab, d)) * 0.02)
    np.testing.assert_array_equal(p.params["wpe.weight"], n((cfg.seq, d)) * 0.02)
    for l in range(cfg.layers):
        for name, shape, scale in (("attn.qkv", (d, 3 * d), d), ("attn.o", (d, d), d),
                                   ("mlp.up", (d, 4 * d), d), ("mlp.down", (4 * d, d), 4 * d)):
            np.testing.assert_array_equal(p.params[f"blocks.{l}.{name}.weight"], n(shape) / np.sqrt(scale))
        np.testing.assert_array_equal(p.params[f"blocks.{l}.norm1.weight"], np.ones(d))
    np.testing.assert_array_equal(p.params["head.weight"], n((d, cfg.vocab)) / np.sqrt(d))
    tokens = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1))
    np.testing.assert_array_equal(p.inputs, tokens[:, :-1])
    np.testing.assert_array_equal(p.targets, tokens[:, 1:])
    assert sum(w.size for w in p.params.values()) == cfg.n_params
