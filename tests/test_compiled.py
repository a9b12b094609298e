"""torch's compiled style (issue 49): torch.compile over DDP, FSDP2, DTensor tp / tp+sp, the hand-written Megatron
steps and pipelining, checked as every other row — against both single-device references (float64 and mixed
precision), its collectives read from the compiled step (torch's profiler: who issued each, a compiled program or
eager code) against shared/theory and against the same variant run eagerly — and its refusals.

Budget (torch.compile costs tens of seconds per graph on 2 shared cores; inductor's caches live in the user's cache
folder, torch_impl/parallel/compiled.py, so a second run only loads them): the default tier has the profiler
ledger's reading (no compile), the refusals (no launch) and ONE small compiled run, tp compiled/dtensor on the MLP
at 2 ranks (its two layers compile as two small graphs) beside builtin/dtensor; the slow tier runs every compiled
variant beside JAX's jit in one compare.py launch per precision (the transformer in float64, the MLP in mixed), and
tests/test_compose_torch.py the compiled Llama of examples/compose_torch.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import compare
from shared.config import Config
from shared.results import make_result
from shared.theory import tp_comm_bytes
from torch_impl.harness import run_pattern
from torch_impl.launch import launch
from torch_impl.parallel.compiled_ledger import CALL, Recording

# --- the profiler's ledger, on events as torch's profiler gives them (no compile) -----------------------


def _event(name, shapes=(), dtypes=(), concrete=None, parent=None):
    return SimpleNamespace(name=name, structured_input_shapes=list(shapes), input_shapes=list(shapes),
                           input_dtypes=list(dtypes), concrete_inputs=concrete or [None] * len(shapes),
                           cpu_parent=parent)


def test_profiler_ledger_counts_each_collective_once_and_says_who_issued_it():
    fwd = _event("CompiledFunction")
    call = _event(CALL + "abcdef123456xyz ##", parent=fwd)
    bwd_call = _event(CALL + "bwdkey000000xyz ##", parent=_event("CompiledFunctionBackward"))
    functional = _event("_c10d_functional::all_reduce_", [[4, 8, 16], [], []], ["double", "", ""], parent=call)
    events = [
        fwd, call, functional,
        _event("c10d::allreduce_", [[], []], ["TensorList", ""], parent=functional),  # dispatched by the functional
        _event("_c10d_functional::wait_tensor", [[4, 8, 16]], ["double"], parent=call),
        _event("_c10d_functional::all_gather_into_tensor", [[8, 16], [], []], ["float", "Scalar", ""],
               [None, 2, None], parent=bwd_call),  # the gathered output: input × group size
        _event("c10d::_reduce_scatter_base_", [[8], [16], []], ["double", "double", ""]),  # FSDP2's hook: eager
        _event("c10d::allreduce_", [[[7376]], []], ["TensorList", ""]),  # DDP's bucket: the list's dtype given
        _event("c10d::send", [[[2, 8, 16]], []], ["TensorList", ""]),
        _event("gloo:all_reduce", [[4, 8, 16]], ["double"]),  # gloo's own thread: not a dispatched op
    ]
    rec = Recording(list_dtype=torch.float64)
    rec.read(events)
    assert rec.comm == {"all_gather": {"count": 1, "bytes": 2 * 8 * 16 * 4},
                        "all_reduce": {"count": 2, "bytes": 4 * 8 * 16 * 8 + 7376 * 8},
                        "reduce_scatter": {"count": 1, "bytes": 16 * 8}, "send": {"count": 1, "bytes": 2 * 8 * 16 * 8}}
    assert rec.compiled == {"all_gather": {"count": 1, "bytes": 1024}, "all_reduce": {"count": 1, "bytes": 4096}}
    assert set(rec.eager) == {"all_reduce", "reduce_scatter", "send"}
    assert sorted((p["pass"], p["collectives"], p["runs"]) for p in rec.programs) == [
        ("backward", ["all_gather"], 1), ("forward", ["all_reduce"], 1)]


# --- refusals: one line, before any process starts -----------------------------------------------------


@pytest.mark.parametrize("pattern, match", [("cp", "context_parallel runs on CUDA only"),
                                            ("ep", "data-dependent shape")])
def test_what_torch_cannot_compile_is_refused_in_one_line(pattern, match, capsys):
    argv = ["--patterns", pattern, "--styles", "compiled", "--model", "transformer", "--world-size", "2",
            "--frameworks", "torch", "--quiet"]
    assert compare.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{pattern} compiled:" in err[0] and match in err[0], err


@pytest.mark.parametrize("extra", [["--clip", "1.0"], ["--precision", "mixed", "--dtype", "float16"]])
def test_what_the_compiled_style_is_not_built_for_is_refused_in_one_line(extra, capsys):
    argv = ["--patterns", "tp", "--styles", "compiled", "--world-size", "2", "--frameworks", "torch", "--quiet", *extra]
    assert compare.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--styles compiled: not built with" in err[0], err


def test_compiled_is_left_out_of_the_default_run_on_cpu():
    from parallel_twins.cli import STYLES, build_parser, default_styles
    from parallel_twins.runs import chosen_variants

    args = build_parser().parse_args(["--device", "cpu"])
    default_styles(args)
    assert args.styles is None and "compiled" in STYLES  # None: every style but compiled
    cfg = Config(world_size=2, model="transformer")
    assert not [sv for sv in chosen_variants("torch", "tp", cfg) if sv[0] == "compiled"]
    assert ("compiled", "dtensor_sp") in chosen_variants("torch", "tp", cfg, ["compiled"])
    assert ("compiled", "zb") not in chosen_variants("torch", "pp", cfg, ["compiled"])  # one fused backward


# --- one small compiled run (the default tier's only compile) -------------------------------------------


def test_compiled_dtensor_tp_runs_compiled_code_equal_to_the_reference_and_theory(measured):
    """The MLP's DTensor plan (colwise, rowwise) with each layer compiled, 2 ranks, float64: equal to the
    single-device run to <= 1e-12, its collectives equal to the formula and to builtin/dtensor's, every
    tp all-reduce issued from inside a compiled program (the rowwise layer's g forward, the colwise layer's f
    backward), the first step compiling and the later ones running without a recompile."""
    cfg = Config(world_size=2, layers=2, dim=8, batch=4, steps=3)
    entry = launch(run_pattern, 2, "tp", [cfg], {cfg: [("builtin", "dtensor"), ("compiled", "dtensor")]})[0][0]
    (_, _, builtin), (_, _, done) = entry["runs"]
    row = make_result("tp", "torch", "compiled", "dtensor", cfg, done, entry["reference"])
    assert row.ok and max(row.max_rel_err_loss, row.max_rel_err_grad, row.max_rel_err_param) <= 1e-12, row
    assert row.comm == builtin.comm and row.comm_bytes == row.comm_bytes_theory == tp_comm_bytes(cfg, "dtensor")
    assert row.extra["comm_compiled"] == row.comm and row.extra["comm_eager"] == {}  # every one compiled
    assert {p["pass"] for p in row.extra["programs"]} == {"forward"}  # layer 0's input needs no gradient: no f
    info = row.extra["compiled"]
    assert info["units"] == ["layers.0", "layers.1"] and info["graphs"] >= 2 and info["graph_breaks"] == {}
    assert row.compile_s is not None and row.compile_s > 0
    measured(f"tp compiled/dtensor, MLP L=2 D=8 on 2 ranks: compile {row.compile_s:.1f} s, step "
             f"{1e3 * row.step_time_s:.1f} ms (builtin {1e3 * sorted(builtin.step_times[1:])[0]:.1f} ms)")


# --- the slow tier: every compiled pattern beside JAX's jit, one compare.py launch per precision -------------

SMALL = ["--world-size", "2", "--layers", "2", "--dim", "16", "--heads", "2", "--seq", "8", "--vocab", "32",
         "--batch", "8", "--microbatches", "2", "--steps", "3", "--styles", "compiled,jit"]


def _run(tmp_path, *argv) -> list[dict]:
    out = tmp_path / "out.json"
    code = compare.main([*argv, *SMALL, "--json", str(out), "--quiet"])
    data = json.loads(out.read_text())
    assert code == 0, [(r["style"], r["variant"], r["ok"], r["xfw_ok"]) for r in data["runs"]] + data["errors"]
    assert data["cross_framework"] and all(x["ok"] for x in data["cross_framework"])
    return data["runs"]


@pytest.mark.slow
def test_every_compiled_pattern_agrees_with_both_references_and_theory(tmp_path, measured):
    """The transformer, float64: every compiled variant of dp, fsdp, tp and pp within 1e-12 of torch's and
    JAX's single-device runs, its bytes equal to the formula, its compile time in the row (and JAX's)."""
    rows = _run(tmp_path, "--model", "transformer", "--patterns", "dp,fsdp,tp,pp")
    compiled = [r for r in rows if r["style"] == "compiled"]
    assert {r["variant"] for r in compiled} == {"ddp", "fsdp2", "dtensor", "dtensor_sp", "megatron", "megatron_sp",
                                                 "gpipe", "1f1b", "interleaved"}
    for r in compiled:
        what = (r["pattern"], r["variant"])
        assert r["ok"] and r["xfw_ok"], what
        assert max(r["max_rel_err_loss"], r["max_rel_err_grad"], r["max_rel_err_param"], r["xfw_max_rel_err"]) \
            <= 1e-12, what
        assert r["comm_bytes"] == r["comm_bytes_theory"], what
        assert r["compile_s"] > 0 and r["extra"]["compiled"]["graphs"] >= 1, what
        inside = r["extra"]["comm_compiled"]
        assert bool(inside) == (r["pattern"] == "tp"), what  # tp's collectives compiled; the others' eager
        assert {op: v["count"] for op, v in inside.items()} == (
            {"all_reduce": 8} if r["variant"] in ("dtensor", "megatron") else
            {"all_gather": 8, "reduce_scatter": 8} if r["pattern"] == "tp" else {}), what  # 2 blocks × 4
    assert all(r["compile_s"] > 0 for r in rows if r["framework"] == "jax")
    measured("compile s: " + ", ".join(f"{r['pattern']}/{r['variant']} {r['compile_s']:.0f}" for r in compiled))


@pytest.mark.slow
def test_compiled_mixed_precision_within_the_measured_floor(tmp_path):
    """--precision mixed (bf16 compute, float32 master weights) on the MLP, where inductor's fused kernels round
    other points than eager autocast (a different program: shared/tolerances.py MIXED_PROGRAM_STYLES): each
    compiled row within its reference's measured floor and the other framework's (shared/results.py)."""
    rows = _run(tmp_path, "--model", "mlp", "--patterns", "dp,fsdp,tp,pp", "--precision", "mixed", "--dtype",
                "bfloat16")
    compiled = [r for r in rows if r["style"] == "compiled"]
    assert len(compiled) == 7 and all(r["ok"] and r["xfw_ok"] for r in compiled), compiled
    assert all(r["comm_bytes"] == r["comm_bytes_theory"] for r in compiled)
