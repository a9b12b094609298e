"""Bring your own model (issue 24, JAX): ``parallel.fsdp.parallelize`` on Flax NNX models the project
does not own, every ZeRO stage in every style, against single-device training from the same weights
(typed, sharding in types: parallelize states every nnx.Embed lookup's layout, so Foreign trains
unedited; ``TypedForeign`` states it itself; a raw ``table[ids]`` lookup is refused in one line).

``Foreign`` (defined here, float64) is unlike the project's models on purpose: biases, LayerNorm
(scale and bias), a Linear called twice, a bare matrix Param and a 0-d Param on the root, a kernel
whose dim 0 (5) N = 2 does not divide (replicated), a vocabulary of 13 (the embedding's rows
indivisible: replicated). ``Cell`` is a second, recurrent-style model with a tied input/output.

Tolerance: float64, 1e-12. The parallel steps compute the same sums split over devices (and the
collectives add partial sums in another order), ~1e-16 relative per op; 3 AdamW steps carry that to
~1e-15. 1e-12 leaves three orders of margin and sits far below any layout defect (a row block used as
a full weight changes the loss at 1e-2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from own_models_jax import STEPS, adamw, flat, train_single

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_from_hlo
from jax_impl.parallel import theory as model_theory
from jax_impl.parallel.fsdp import STYLES, VARIANTS, FromApply, parallelize
from jax_impl.parallel.tree import ShardReadError, WrapError
from jax_impl.parallel.typed import rows_like

TOL = 1e-12  # float64: see the module docstring
V, D, T, B, N = 13, 8, 6, 4, 2


class Foreign(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(V, D, param_dtype=jnp.float64, rngs=rngs)
        self.norm = nnx.LayerNorm(D, param_dtype=jnp.float64, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, param_dtype=jnp.float64, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, param_dtype=jnp.float64, rngs=rngs)
        self.mix = nnx.Linear(D, D, use_bias=False, param_dtype=jnp.float64, rngs=rngs)  # called twice
        self.narrow = nnx.Linear(D, 5, param_dtype=jnp.float64, rngs=rngs)
        self.out = nnx.Linear(5, V, param_dtype=jnp.float64, rngs=rngs)  # kernel (5, V): dim 0 indivisible
        self.gate = nnx.Param(jax.random.normal(rngs.params(), (D, D), jnp.float64) * 0.3)  # bare matrix, root
        self.temperature = nnx.Param(jnp.asarray(1.5, jnp.float64))  # 0-d

    def __call__(self, tokens):
        h = self.emb(tokens)  # (B, T, D)
        h = h + self.down(jax.nn.gelu(self.up(self.norm(h)), approximate=False))
        h = self.mix(jnp.tanh(self.mix(h) @ self.gate[...]))
        return self.out(jax.nn.relu(self.narrow(h))) / self.temperature[...]  # (B, T, V)


class TypedForeign(Foreign):
    """Foreign for the typed style (sharding in types): the one op whose layout JAX cannot infer from
    dp-split ids, the embedding lookup, states its output (jax_impl.parallel.typed.rows_like); same math."""

    def __call__(self, tokens):
        h = self.emb(tokens, out_sharding=rows_like(tokens))  # (B@dp, T, D)
        h = h + self.down(jax.nn.gelu(self.up(self.norm(h)), approximate=False))
        h = self.mix(jnp.tanh(self.mix(h) @ self.gate[...]))
        return self.out(jax.nn.relu(self.narrow(h))) / self.temperature[...]


class Cell(nnx.Module):
    """Tied input/output embedding read by the parent (``self.emb.attend``): zero3 must refuse it
    with per-holder units and train it when the root gathers it (units=[])."""

    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(V + 1, D, param_dtype=jnp.float64, rngs=rngs)  # 14 rows: split at N = 2
        self.cell = nnx.Linear(2 * D, D, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, tokens):
        x, h, out = self.emb(tokens), jnp.zeros((tokens.shape[0], D), jnp.float64), []
        for t in range(tokens.shape[1]):
            h = jnp.tanh(self.cell(jnp.concatenate([x[:, t], h], -1)))  # (B, D)
            out.append(self.emb.attend(h))  # (B, V+1)
        return jnp.stack(out, 1)


def ce(model, tokens, targets):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()




def batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)).astype(np.int32), rng.integers(0, V, (B, T)).astype(np.int32)




def single_device(make, loss=ce):
    """The reference: plain NNX on one device, the same AdamW."""
    return train_single(make(), loss, *batch())


def parallel(make, variant, style, loss=ce, **kw):
    mesh = make_mesh(N, "dp")
    trainer = parallelize(make(), loss, adamw(), mesh, variant, style, **kw)
    x, y = batch()
    losses = [trainer.train_step(x, y) for _ in range(STEPS)]
    return trainer, losses, flat(trainer.module())


def foreign():
    return Foreign(nnx.Rngs(0))


def foreign_typed():
    return TypedForeign(nnx.Rngs(0))  # the same weights as foreign()


REFERENCE = {}


def reference(make):
    if make not in REFERENCE:
        REFERENCE[make] = single_device(make)
    return REFERENCE[make]


# The default tier trains one style per stage (and both for zero3); pytest -m slow the other three.
DEFAULT = {("dp", "shard_map"), ("zero1", "jit"), ("zero2", "shard_map"), ("zero3", "shard_map"), ("zero3", "jit"),
           ("zero3", "typed")}
STAGE_STYLES = [pytest.param(v, s, marks=() if (v, s) in DEFAULT else pytest.mark.slow)
                for v in VARIANTS for s in STYLES]


@pytest.mark.parametrize("variant,style", STAGE_STYLES)
def test_every_stage_trains_a_foreign_model_like_one_device(variant, style, measured):
    ref_losses, ref_params = reference(foreign)
    # typed: zero3 (default tier) trains Foreign unedited (parallelize states its nnx.Embed lookup); the
    # others TypedForeign, whose own out_sharding= passes through
    typed_own = style == "typed" and variant != "zero3"
    trainer, losses, params = parallel(foreign_typed if typed_own else foreign, variant, style)
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_err = max(float(np.max(np.abs(params[k] - ref_params[k]))) for k in ref_params)
    measured(f"{variant}/{style}: loss {loss_err:.1e}, params {param_err:.1e}")
    assert loss_err <= TOL and param_err <= TOL, (variant, style, loss_err, param_err)
    assert params.keys() == ref_params.keys()


class RawLookup(Foreign):
    """The embedding read as a bare array, ``table[ids]``: a gather whose layout the program must state."""

    def __call__(self, tokens):
        h = self.emb.embedding[...][tokens]  # (B, T, D)
        return self.out(jax.nn.relu(self.narrow(h)))


def test_typed_refuses_a_forward_it_cannot_type():
    """Sharding in types: a raw lookup on dp-split ids has no inferable layout; the first trace refuses it
    in one line (an nnx.Embed call is stated by parallelize: Foreign trains unedited, the stage test)."""
    trainer = parallelize(RawLookup(nnx.Rngs(0)), ce, adamw(), make_mesh(N, "dp"), "dp", "typed")
    with pytest.raises(WrapError, match=r"^typed: the forward cannot be typed on this mesh \(Use `\.at"):
        trainer.train_step(*batch())


def test_typed_refuses_a_loss_that_maps_the_state():
    """typed calls each nnx.Embed through a stand-in (its lookup's layout stated): a loss that splits and
    maps the model's state (a hand-written freeze, an identity) would miss the table — a frozen table
    trained on, parameters ~1e307 off (seen). Refused at the first trace, naming the fix."""
    def mapped(model, tokens, targets):
        gdef, state = nnx.split(model)
        return ce(nnx.merge(gdef, jax.tree.map(lambda a: a, state)), tokens, targets)

    trainer = parallelize(foreign(), mapped, adamw(), make_mesh(N, "dp"), "dp", "typed")
    with pytest.raises(WrapError, match=r"^typed: the loss read the model's state .*style='jit'"):
        trainer.train_step(*batch())


@pytest.mark.parametrize("variant", VARIANTS)
def test_shard_map_ledger_equals_the_theory_from_the_model(variant):
    """What XLA put in the step, op by op, against model_theory from the parameters wrapped
    (zero3: the Linear called twice is gathered, re-gathered and reduce-scattered twice; the root's
    gate once; emb and out are replicated vectors; the layer fed by the data is not re-gathered)."""
    trainer = parallelize(foreign(), ce, adamw(), make_mesh(N, "dp"), variant, "shard_map")
    x, y = trainer.shard_batch(*batch())
    compiled = trainer.step.lower(*trainer.state, x, y).compile(compiler_options=trainer.compiler_options)
    ledger = comm_from_hlo(compiled.as_text())
    theory = trainer.comm_theory()
    assert sum(d["bytes"] for d in ledger.values()) == sum(b for _, b in theory.values()), (ledger, theory)
    if variant != "dp":  # dp: XLA may combine the per-parameter all-reduces; the bytes are the claim
        assert ledger == {op: {"count": c, "bytes": b} for op, (c, b) in theory.items()}, (ledger, theory)
    if variant == "zero3":
        assert trainer.unit_calls["mix"] == (2, 2), trainer.unit_calls


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_state_per_device_equals_the_theory(variant, style):
    trainer = parallelize(foreign(), ce, adamw(), make_mesh(N, "dp"), variant, style)
    params, opt_state = trainer.state
    theory = trainer.state_theory()
    assert placed_bytes(params) == theory["params"], (variant, style)
    assert placed_bytes(opt_state) == theory["optimizer"], (variant, style)


def placed_bytes(tree) -> int:
    """One device's bytes of every floating array (the 0-d Param and its moments included; AdamW's
    integer step count not: it is not a moment)."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
               for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating))


@pytest.mark.slow  # slow tier (issue 37's budget): one refusal at the first trace (a compile)
def test_tied_embedding_read_by_the_parent():
    """zero3 with per-holder units refuses the parent's ``emb.attend`` at the first trace (it would
    get a row block); with the embedding gathered at the root (units=[]) it trains exactly."""
    make = lambda: Cell(nnx.Rngs(1))
    trainer = parallelize(make(), ce, adamw(), make_mesh(N, "dp"), "zero3", "shard_map")
    with pytest.raises(ShardReadError, match=r"'attend' of unit 'emb'.*units=\["):
        trainer.train_step(*batch())
    ref_losses, ref_params = single_device(make)
    for units in ([], ["cell"]):
        _, losses, params = parallel(make, "zero3", "shard_map", units=units)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
        assert max(float(np.max(np.abs(params[k] - ref_params[k]))) for k in ref_params) <= TOL


class WithDropout(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(D, D, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.drop(self.lin(x))


class Shared(nnx.Module):
    def __init__(self):
        self.a = nnx.Linear(D, D, rngs=nnx.Rngs(0))
        self.b = self.a


REFUSALS = {
    "variant": (lambda: (foreign(), dict(variant="zero4")), r"unknown variant/style zero4"),
    "axis": (lambda: (foreign(), dict(axis="data")), r"no 'data': pass axis="),
    "rng state": (lambda: (WithDropout(), {}), r"state other than nnx.Param.*Dropout"),
    "no match": (lambda: (foreign(), dict(variant="zero3", units=["blocks.*"])), r"'blocks\.\*' matches no submodule"),
    "nested": (lambda: (Cell(nnx.Rngs(0)), dict(variant="zero3", units=["cell", "cell"])), None),
    "shared": (lambda: (Shared(), dict(variant="zero3")), r"reachable from 2 places \(shared\)"),
    "units off zero3": (lambda: (foreign(), dict(variant="zero2", units=["up"])), r"units= is for shard_map/zero3"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_before_compiling(case):
    build, message = REFUSALS[case]
    model, kw = build()
    if message is None:  # a repeated pattern names the same unit once: accepted
        assert parallelize(model, ce, adamw(), make_mesh(N, "dp"), **kw).units == ["cell"]
        return
    with pytest.raises(WrapError, match=message):
        parallelize(model, ce, adamw(), make_mesh(N, "dp"), **kw)


def test_batch_rows_must_divide():
    trainer = parallelize(foreign(), ce, adamw(), make_mesh(N, "dp"), "dp", "jit")
    with pytest.raises(WrapError, match="batch dim 0 = 3 is not divisible by dp=2"):
        trainer.shard_batch(np.zeros((3, T), np.int32))


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_model_theory_equals_shared_theory_on_the_project_models(model):
    """The theory from the NNX model the project's runs wrap equals shared.theory's from Config."""
    from jax_impl.model import build_model, make_optimizer, model_loss
    from shared.config import Config
    from shared.problem import make_problem
    from shared.theory import dp_comm_bytes, fsdp_comm, zero1_comm_bytes

    cfg = Config(model=model, world_size=N, layers=2, dim=8, batch=4, heads=2, seq=4, vocab=16) \
        if model == "transformer" else Config(world_size=N, layers=3, dim=8, batch=4)
    problem, mesh = make_problem(cfg), make_mesh(N, "dp")
    make = lambda v: parallelize(build_model(cfg, problem), model_loss, make_optimizer(cfg), mesh, v, "shard_map")
    bytes_of = lambda comm: sum(b for _, b in comm.values())
    assert bytes_of(make("dp").comm_theory()) == dp_comm_bytes(cfg)
    assert bytes_of(make("zero1").comm_theory()) == zero1_comm_bytes(cfg)
    assert make("zero2").comm_theory() == fsdp_comm(cfg, "zero2")
    trainer = make("zero3")
    x = jnp.asarray(problem.inputs, jnp.int32 if model == "transformer" else jnp.float64)
    y = None if problem.targets is None else jnp.asarray(problem.targets, jnp.int32)
    trainer.step.lower(*trainer.state, *trainer.shard_batch(*[a for a in (x, y) if a is not None]))  # traced
    assert trainer.comm_theory() == fsdp_comm(cfg, "zero3")
    assert model_theory.comm(trainer.infos, "zero3", N, trainer.unit_calls) == trainer.comm_theory()


@pytest.mark.parametrize("variant", ["dp", "zero3"])
def test_a_mesh_from_jax_make_mesh(variant):
    """jax.make_mesh's axes are Explicit (sharding in types); parallelize re-types them Auto (the
    same devices), so the jit style trains exactly there too instead of failing in tracing."""
    mesh = jax.make_mesh((N,), ("dp",), devices=jax.devices()[:N])
    ref_losses, ref_params = reference(foreign)
    trainer = parallelize(foreign(), ce, adamw(), mesh, variant, "jit")
    losses = [trainer.train_step(*batch()) for _ in range(STEPS)]
    params = flat(trainer.module())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    assert max(float(np.max(np.abs(params[k] - ref_params[k]))) for k in ref_params) <= TOL


@pytest.mark.parametrize("variant", ["dp", pytest.param("zero1", marks=pytest.mark.slow),
                                     pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_a_parameter_pytree_with_an_apply_function(variant):
    """FromApply: a plain {name: array} pytree and apply(params, x) train like one device (shard_map)."""
    rng = np.random.default_rng(3)
    params = {"w1": rng.standard_normal((D, 2 * D)) / 3, "b1": np.zeros(2 * D),
              "w2": rng.standard_normal((2 * D, V)) / 4}
    apply = lambda p, x: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    x = rng.standard_normal((B, D))
    y = rng.integers(0, V, B).astype(np.int32)
    ce_rows = lambda model, x, y: optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    ref = {k: jnp.asarray(a) for k, a in params.items()}
    tx = adamw()
    opt = tx.init(ref)
    for _ in range(STEPS):
        grads = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean())(ref)
        updates, opt = tx.update(grads, opt, ref)
        ref = optax.apply_updates(ref, updates)
    trainer = parallelize(FromApply(params, apply), ce_rows, adamw(), make_mesh(N, "dp"), variant, "shard_map")
    for _ in range(STEPS):
        trainer.train_step(x, y)
    got = trainer.module().pytree()
    assert max(float(np.max(np.abs(np.asarray(got[k]) - np.asarray(ref[k])))) for k in ref) <= TOL
