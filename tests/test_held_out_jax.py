"""Held-out Flax NNX models through the public JAX API (issue 33): each exact or refused by the project
in one line, never a JAX-internal error. A scan/vmap-stacked model (tests/own_models_jax.Stacked) under
parallelize zero3 (shard_map) and pp.pipeline; a Llama that reads its head count from its config
under tp shard_map (tests/test_tp_plan_jax's Llama, its attention reshaping by ``self.heads``); and the
one glob rule of module paths that units and plans share (``*`` one segment, ``**`` any).

Tolerance: float64, 1e-12 (as tests/test_own_model_jax.py: the same sums split over 2 devices,
~1e-15 after 3 AdamW steps).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from own_models_jax import Stacked, adamw, flat, train_single

from jax_impl.devices import make_mesh
from jax_impl.parallel import pp
from jax_impl.parallel.fsdp import parallelize
from jax_impl.parallel.tp import PlanError, apply_plan
from jax_impl.parallel.tree import WrapError, choose_units, matches

TOL = 1e-12  # float64: see the module docstring


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((8, 8)), rng.standard_normal((8, 4))


@pytest.mark.parametrize("path, pattern, hit", [
    ("blocks.0", "blocks.*", True), ("blocks.0.attn", "blocks.*", False),
    ("blocks.0.attn.q", "blocks.*.attn.[qkv]", True),
    ("model.layers.3.self_attn.q_proj", "**.q_proj", True), ("q_proj", "**.q_proj", True),
    ("model.layers.3.mlp", "model.**", True), ("model", "model.**", True), ("head", "**.q_proj", False)])
def test_one_glob_rule(path, pattern, hit):
    assert matches(path, pattern) == hit


def test_units_of_blocks_with_submodules_are_accepted():
    """units=["blocks.*"] on blocks that hold submodules: each block is one unit (was: 'units must not nest')."""
    from test_tp_plan_jax import Llama

    assert choose_units(Llama(nnx.Rngs(0)), ["blocks.*"]) == ["blocks.0", "blocks.1"]


def test_stacked_model_under_zero3_trains_like_one_device():
    """The default units leave the stacked module to the root, which gathers it whole before the scan."""
    x, y = batch()
    ref_losses, ref_params = train_single(Stacked(nnx.Rngs(0)), mse, x, y)
    trainer = parallelize(Stacked(nnx.Rngs(0)), mse, adamw(), make_mesh(2, "dp"), "zero3", "shard_map")
    assert "layers" not in trainer.units, trainer.units
    losses = [trainer.train_step(x, y) for _ in ref_losses]
    params = flat(trainer.module())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= TOL, (losses, ref_losses)
    assert max(float(np.max(np.abs(params[k] - ref_params[k]))) for k in ref_params) <= TOL


def test_stacked_module_as_a_unit_or_a_stage_is_refused_in_one_line():
    mesh = make_mesh(2, "dp")
    with pytest.raises(WrapError, match=r"unit 'layers' is \(inside\) a module of stacked layers.*\(2, 8, 8\)"):
        parallelize(Stacked(nnx.Rngs(0)), mse, adamw(), mesh, "zero3", "shard_map", units=["layers"])
    with pytest.raises(WrapError, match=r"pp: stage module 'layers': .*stacked layers.*list the parent"):
        pp.pipeline(Stacked(nnx.Rngs(0)), [["embed", "layers"], ["head"]], mse, adamw(), make_mesh(2, "pp"), 2)


def test_head_count_from_config_under_tp_is_refused_in_one_line(monkeypatch):
    import test_tp_plan_jax as t

    def from_config(self, h):  # (B, T, D): q reshaped to (B, T, heads, dh) with the config's head count
        b, s, _ = h.shape
        q = self.q(h).reshape(b, s, self.heads, self.head_dim)
        return self.o(q.reshape(b, s, -1))

    monkeypatch.setattr(t.Attention, "__call__", from_config)
    model = t.Llama(nnx.Rngs(0), layers=1)
    for block in model.blocks:
        block.attn.heads = 4
    plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise"}
    trainer = apply_plan(model, plan, _mean_square, adamw(), make_mesh(2, "tp"), "shard_map")
    with pytest.raises(PlanError, match=r"reads a head count or width from its config.*derive counts from the kernel"):
        trainer.train_step(*t.data("llama"))


def _mean_square(model, tokens, targets):
    return jnp.mean(model(tokens) ** 2)  # replicated logits (no colwise_vocab head in the plan)


def test_head_count_from_config_under_compose_tp_is_refused_in_one_line(monkeypatch):
    """The NNX Llama's attention patched to reshape q by the config's head count: refused at the first
    trace (before compiling), as parallel.tp refuses it."""
    from jax_impl.parallel import cp, llama
    from jax_impl.parallel.compose import ComposeError, compose
    from shared.llama import LlamaShape, batch, weights

    shape = LlamaShape()

    def from_config(self, x, cos, sin):
        b, t = x.shape[:2]
        q = self.q_proj(x).reshape(b, t, shape.heads, self.head_dim)  # (B, T, H, hd) with H from the config
        k, v = (p(x).reshape(b, t, shape.kv_heads, self.head_dim) for p in (self.k_proj, self.v_proj))
        k, v = (jnp.repeat(a, shape.heads // shape.kv_heads, axis=2) for a in (k, v))
        return self.o_proj(cp.attention(q, k, v).reshape(b, t, -1))

    monkeypatch.setattr(llama.Attention, "__call__", from_config)
    model = llama.from_numpy(weights(shape, 0))
    trainer = compose(model, {"tp": 2}, lambda logits, y: jnp.mean(logits ** 2), adamw(), plan=llama.PLAN,
                      split=llama.SPLIT)
    with pytest.raises(ComposeError, match=r"compose tp plan: .*reads a head count or width from its config"):
        trainer.train_step(*batch(shape, 8, 0))
