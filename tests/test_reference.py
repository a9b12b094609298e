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
