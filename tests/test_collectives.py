"""Every collective in both frameworks at world sizes 2, 3 and 4, against NumPy.

torch: one launch of ``check_all`` per world size, every rank's output and ledger checked.
JAX: ``check_all`` and ``spmd_reshardings`` on 1-D meshes of 2, 3, 4 simulated devices.
Both: the hand-made ring all-reduce and reduce-scatter + all-gather equal the library all-reduce,
and each call's ledger equals its nccl-tests size S. Plus a tiny bandwidth-sweep smoke test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import jax_impl  # noqa: F401 - x64 / matmul precision settings
from jax_impl import collectives as jc
from jax_impl.devices import make_mesh
from shared.collectives import NAMES, expected, expected_bytes, fit_per_op, rank_input
from shared.results import comm_bytes
from shared.theory import fit_alpha_beta
from shared.tolerances import COLLECTIVES
from torch_impl import collectives as tc
from torch_impl.launch import launch

WORLDS = (2, 3, 4)

# The ledger entries each collective must produce: torch (c10d ops) and JAX (HLO ops).
TORCH_OPS = {
    "broadcast": {"broadcast"}, "reduce": {"reduce"}, "all_reduce_sum": {"all_reduce"},
    "all_reduce_avg": {"all_reduce"}, "all_reduce_max": {"all_reduce"}, "gather": {"gather"},
    "all_gather": {"all_gather"}, "scatter": {"scatter"}, "reduce_scatter": {"reduce_scatter"},
    "all_to_all": {"all_to_all"}, "ring_shift": {"send", "recv"}, "barrier": {"barrier"},
    "ring_all_reduce": {"send", "recv"}, "rs_then_ag": {"reduce_scatter", "all_gather"},
}
JAX_OPS = {
    "broadcast": {"all_reduce"}, "reduce": {"all_reduce"}, "all_reduce_sum": {"all_reduce"},
    "all_reduce_avg": {"all_reduce"}, "all_reduce_max": {"all_reduce"}, "gather": {"all_gather"},
    "all_gather": {"all_gather"}, "scatter": {"all_to_all"}, "reduce_scatter": {"reduce_scatter"},
    "all_to_all": {"all_to_all"}, "ring_shift": {"collective_permute"}, "barrier": {"all_reduce"},
    "ring_all_reduce": {"collective_permute"}, "rs_then_ag": {"reduce_scatter", "all_gather"},
}
BENCH_KEYS = {"op", "size_bytes", "time_s", "algbw", "busbw"}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"N{n}")
def world(request):
    return request.param


@pytest.fixture(scope="module")
def torch_rows(world):
    """rows[r][i]: rank r's result for NAMES[i] — one launch per world size."""
    return launch(tc.check_all, world)


@pytest.fixture(scope="module")
def jax_rows(world):
    mesh = make_mesh(world, "x")
    return jc.check_all(mesh), jc.spmd_reshardings(mesh)


def _close(got, want) -> bool:
    if want is None:
        return True  # a rooted collective's non-root rank: nothing defined
    got = np.asarray(got, dtype=np.float64)
    return got.shape == want.shape and float(np.max(np.abs(got - want), initial=0.0)) <= COLLECTIVES


def test_torch_outputs_equal_numpy(world, torch_rows):
    assert len(torch_rows) == world
    for rank, rows in enumerate(torch_rows):
        assert [row["variant"] for row in rows] == list(NAMES)
        for row in rows:
            assert row["ok"], (rank, row)
            assert _close(row["output"], expected(row["variant"], rank, world)), (rank, row)


def test_torch_ring_and_rs_ag_equal_library_all_reduce(world, torch_rows):
    for rank, rows in enumerate(torch_rows):
        by = {row["variant"]: row for row in rows}
        for name in ("ring_all_reduce", "rs_then_ag"):
            assert by[name]["vs_library_max_abs_err"] <= COLLECTIVES, (rank, by[name])
            # same input (arange(N·c) + rank) as the library all-reduce rebuilt here in NumPy
            lib = np.sum([rank_input(name, r, world) for r in range(world)], axis=0)
            assert _close(by[name]["output"], lib)


def test_torch_ledger_is_nccl_tests_size(world, torch_rows):
    for rank, rows in enumerate(torch_rows):
        for row in rows:
            name, comm = row["variant"], row["comm"]
            assert set(comm) == TORCH_OPS[name], (rank, name, comm)
            assert comm_bytes(comm) == row["expected_bytes"] == expected_bytes(name, world), (rank, comm)
            calls = 2 * (world - 1) if name == "ring_all_reduce" else 1
            for op, entry in comm.items():
                assert entry["count"] == calls, (rank, name, op, entry)
            if "recv" in comm:  # what a rank sends, its neighbour receives: same bytes
                assert comm["recv"] == comm["send"]


def test_jax_outputs_equal_numpy(world, jax_rows):
    rows, _ = jax_rows
    assert [row["variant"] for row in rows] == list(NAMES)
    for row in rows:
        assert row["ok"], row
        for device, got in enumerate(row["outputs"]):
            assert _close(got, expected(row["variant"], device, world)), (device, row)


def test_jax_ring_and_rs_ag_equal_library_all_reduce(world, jax_rows):
    by = {row["variant"]: row for row in jax_rows[0]}
    for name in ("ring_all_reduce", "rs_then_ag"):
        assert by[name]["vs_library_max_abs_err"] <= COLLECTIVES, by[name]


def test_jax_ledger_is_nccl_tests_size(world, jax_rows):
    for row in jax_rows[0]:
        name, comm = row["variant"], row["comm"]
        assert set(comm) == JAX_OPS[name], (name, comm)
        extra = 4 if name == "barrier" else 0  # the psum of one int32 standing in for a barrier
        assert comm_bytes(comm) == row["expected_bytes"] == expected_bytes(name, world) + extra, (name, comm)
        calls = 2 * (world - 1) if name == "ring_all_reduce" else 1
        assert all(entry["count"] == calls for entry in comm.values()), (name, comm)


def test_torch_and_jax_move_the_same_bytes(world, torch_rows, jax_rows):
    jax_bytes = {row["variant"]: comm_bytes(row["comm"]) for row in jax_rows[0]}
    for row in torch_rows[0]:
        extra = 4 if row["variant"] == "barrier" else 0
        assert comm_bytes(row["comm"]) + extra == jax_bytes[row["variant"]], row["variant"]


def test_jax_spmd_reshardings(world, jax_rows):
    rows = jax_rows[1]
    assert {row["collective"] for row in rows} >= {"all_gather", "all_to_all", "reduce_scatter", "broadcast"}
    for row in rows:
        assert row["ok"], row
        if row["collective"] == "reduce_scatter" and not row["matches"]:
            assert set(row["chosen"]) == {"all_reduce"}, row  # XLA:CPU: all-reduce + dynamic-slice
        else:
            assert row["matches"], row


def test_fit_alpha_beta_recovers_the_model():
    sizes = [4096 * 4**k for k in range(7)]
    alpha, beta = fit_alpha_beta(sizes, [2e-5 + n / 3e9 for n in sizes])
    assert math.isclose(alpha, 2e-5, rel_tol=1e-9) and math.isclose(beta, 3e9, rel_tol=1e-9)
    with pytest.raises(ValueError):
        fit_alpha_beta([4096], [1e-3])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="unknown collective"):
        rank_input("all_reduce_min", 0, 2)
    with pytest.raises(ValueError, match="unknown bench op"):
        jc.bench(make_mesh(2, "x"), ops=("broadcast",), sizes_bytes=(4096,), iters=1, warmup=0)


def _check_bench(rows, ops, sizes):
    assert [(r["op"], r["size_bytes"]) for r in rows] == [(op, s) for op in ops for s in sizes]
    for r in rows:
        assert set(r) == BENCH_KEYS and all(r[k] > 0 for k in ("time_s", "algbw", "busbw")), r
    fits = fit_per_op(rows)
    assert set(fits) == set(ops) and all(f["beta_bytes_per_s"] > 0 for f in fits.values())


def test_bench_smoke_both_frameworks():
    ops, sizes = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"), (4096, 65536)
    torch_out = launch(tc.bench, 2, ops, sizes, 2, 1)
    assert torch_out[0] == torch_out[1]  # every rank reports the slowest rank's medians
    _check_bench(torch_out[0], ops, sizes)
    _check_bench(jc.bench(make_mesh(2, "x"), ops, sizes, iters=2, warmup=1), ops, sizes)
