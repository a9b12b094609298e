"""Sharding in types ("typed": JAX's Explicit axes, jax_impl/parallel/typed.py): the facts the typed style
rests on, checked on this jax (the issue's check, the row-parallel matmul that must state its
output, the pipeline shift that cannot be typed), the stated-change recorder, and the refusals.
The typed runs' parity and ledgers: tests/test_dp.py, test_fsdp.py, test_tp.py (typed_expect.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, reshard
from jax.sharding import PartitionSpec as P

from jax_impl.devices import make_mesh
from jax_impl.ledger import comm_of
from jax_impl.parallel.typed import Stated, explicit_mesh, moves, rows_like, summarize


def test_the_issue_check_gather_and_all_reduce():
    """In a jitted loss, reshard(w, P()) of a P('dp', None) weight: the gradient is typed like w
    (float32[8@dp,8]) and XLA issues one all-gather and one all-reduce."""
    mesh = explicit_mesh(make_mesh(4, "dp"))
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((8, 8), jnp.float32), NamedSharding(mesh, P("dp", None)))
        x = jax.device_put(jnp.ones((16, 8), jnp.float32), NamedSharding(mesh, P("dp", None)))
        grad = jax.jit(jax.grad(lambda w, x: jnp.mean((x @ reshard(w, P())) ** 2)))
        assert str(jax.typeof(grad(w, x))) == "float32[8@dp,8]"
        assert set(comm_of(grad, w, x)) == {"all_gather", "all_reduce"}


def test_row_parallel_must_state_its_output_and_unreduced_is_offered():
    """A contraction over a split dim is refused unless its out_sharding says what to do; P(unreduced=)
    keeps each device's partial sum, reshard(·, P()) reduces it (XLA: an all-reduce)."""
    mesh = explicit_mesh(make_mesh(4, "tp"))
    with jax.set_mesh(mesh):
        h = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "tp")))
        w = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("tp", None)))
        with pytest.raises(Exception, match="Contracting dimensions are sharded"):
            jax.jit(lambda h, w: h @ w).lower(h, w)
        seen = []

        def row(h, w):
            z = jnp.matmul(h, w, out_sharding=P(None, None, unreduced={"tp"}))
            seen.append(str(jax.typeof(z)))
            return reshard(z, P())
        reduced = jax.jit(row)
        np.testing.assert_array_equal(reduced(h, w), np.full((8, 4), 16.0))
        assert seen[0].endswith("[8,4]{U:tp}"), seen  # e.g. float64[8,4]{U:tp}
        assert comm_of(reduced, h, w) == {"all_reduce": {"count": 1, "bytes": 8 * 4 * jnp.ones(()).dtype.itemsize}}


def test_pipeline_shift_cannot_be_typed_as_pp_quotes():
    """pp.TYPED_REFUSAL quotes what this jax says about jnp.roll over the pp-split stage axis."""
    from jax_impl import pp
    from shared.config import Config

    mesh = explicit_mesh(make_mesh(4, "pp"))
    with jax.set_mesh(mesh):
        y = jax.device_put(jnp.ones((4, 4, 16)), NamedSharding(mesh, P("pp")))
        with pytest.raises(Exception) as err:
            jax.jit(lambda a: reshard(jnp.roll(a, 1, axis=0), P("pp"))).lower(y)
    quoted = pp.TYPED_REFUSAL.split("ShardingTypeError: ")[1].split(" Got input")[0]
    assert quoted in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=r"^pp: the typed style .* is refused: the stage-to-stage shift"):
        pp.train(Config(), None, "typed", "circular", None)


def test_stated_records_each_change_with_its_types():
    mesh = explicit_mesh(make_mesh(2, "dp"))
    stated = Stated(mesh)
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P("dp", None)))
        jax.jit(stated.traced(lambda w: stated.reshard(stated.reshard(w, P(), "w"), P(), "again"))).lower(w)
    assert stated.entries == [{"what": "reshard w P('dp') -> P()", "from": "float64[4@dp,2]", "to": "float64[4,2]",
                               "moves": "gather", "bytes": 4 * 2 * 8}]  # the no-op second one is not a change
    assert summarize(stated.entries) == {"gather": {"count": 1, "bytes": 64}}
    assert moves(P(), P("dp")) == "slice" and moves(P("dp"), P("dp", None)) == "none"
    assert moves(P(None, unreduced={"tp"}), P()) == "reduce"
    assert moves(P(None, unreduced={"tp"}), P("tp")) == "reduce-scatter"
    assert rows_like(jnp.zeros((2, 3), jnp.int32)) is None  # outside an Explicit-axes trace: no statement


def test_parallelize_typed_refusals():
    from jax_impl.model import MLP
    from jax_impl.parallel.fsdp import parallelize
    from jax_impl.parallel.tree import WrapError

    model = MLP({"layers.0.linear.weight": np.ones((4, 4))}, jnp.float64)
    with pytest.raises(WrapError, match="units= is for shard_map/zero3"):
        parallelize(model, lambda m, x: m(x).mean(), None, make_mesh(2, "dp"), "zero3", "typed", units=["layers.*"])
    with pytest.raises(WrapError, match="unknown variant/style zero4/typed"):
        parallelize(model, lambda m, x: m(x).mean(), None, make_mesh(2, "dp"), "zero4", "typed")


def test_refusal_names_the_pattern_and_the_reason():
    from jax_impl.mesh_typed import typed_refusal as refusal
    from shared.config import Config, parse_mesh

    assert refusal("pp", Config()).startswith("pp: the typed style (sharding in types) is refused: the stage-to-stage")
    mesh = lambda m: Config(world_size=4, model="transformer", heads=4, mesh=parse_mesh(m))
    assert refusal("mesh", mesh("dp=2,pp=2")).startswith("mesh dp=2,pp=2: the typed style has no pp")
    assert refusal("mesh", mesh("cp=2,tp=2")).startswith("mesh cp=2,tp=2: the typed style is written for")
    assert refusal("mesh", mesh("fsdp=2,tp=2")) is None and refusal("dp", Config()) is None
    assert "\n" not in refusal("pp", Config())

