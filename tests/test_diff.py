"""compare.py diff and the results schema, on real output: one small run (the MLP, dp, both frameworks,
2 ranks, torch's styles and JAX's jit) written once for the module, then copies of it edited in known
ways (a renamed variant, a recompute policy's activations, an op XLA issues differently, a failed row).
The slow tier adds a second real run at another world size. Times are left out of the exact-findings
checks (two runs' step times differ by noise; the time rule has its own crafted test)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest

from parallel_twins import cli as compare
from parallel_twins.diff import diff_main
from shared.diff import diff, load
from shared.provenance import stamp
from shared.schema import check

SMALL = ["--model", "mlp", "--patterns", "dp", "--layers", "2", "--dim", "8", "--batch", "8", "--steps", "2",
         "--styles", "explicit,builtin,jit", "--quiet"]  # 6 rows: torch's four, JAX's jit dp and zero1


def _run(path, world_size: int) -> dict:
    argv = [*SMALL, "--world-size", str(world_size), "--json", str(path)]
    assert compare.main(argv) == 0
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    path = tmp_path_factory.mktemp("diff") / "base.json"
    return path, _run(path, 2)


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _findings(old, new, **kw):
    return [(f["severity"], f["kind"], f["row"], f["what"]) for f in diff(old, new, **kw)["findings"]]


def test_real_output_validates_against_the_schema(real):
    _, data = real
    assert check(data) == []
    broken = copy.deepcopy(data)
    broken["runs"][1]["ok"] = "yes"
    del broken["provenance"]["git"]
    assert check(broken) == ["provenance: missing 'git'", "runs[1].ok: expected boolean, got 'yes'"]


def test_provenance_reads_no_framework_and_stamps_any_file():
    """The block is read from metadata (torch and JAX are never imported: a torch rank must not load
    JAX); bench / plan / checkpoint files carry it as $defs/stamped."""
    code = ("import sys, json; from shared.provenance import provenance; b = provenance(world_size=2); "
            "print(json.dumps([b, sorted(m for m in ('torch', 'jax', 'jaxlib') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    block, imported = json.loads(out.stdout)
    assert imported == [] and check(block, "provenance") == []
    assert block["world_size"] == 2 and block["packages"]["numpy"] and "commit" in block["git"]
    assert check(stamp({"world_size": 2, "results": []}, block), "stamped") == []


def test_identical_runs_have_no_findings_and_exit_0(real, tmp_path, capsys):
    path, data = real
    out = tmp_path / "d.json"
    assert diff_main([str(path), _write(tmp_path, "same.json", data), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["findings"] == [] and not result["regressed"]
    assert result["rows"] == {"old": 6, "new": 6, "matched": 6}
    assert "nothing regressed" in capsys.readouterr().out


def test_a_renamed_variant_is_one_row_gone_and_one_new(real, tmp_path, capsys):
    path, data = real
    new = copy.deepcopy(data)
    row = next(r for r in new["runs"] if r["variant"] == "bucketed")
    row["variant"] = "bucketed_v2"
    assert _findings(data, new, time_factor=None) == [
        ("regression", "rows", "dp mlp torch/explicit/bucketed", "only in OLD: no longer runs"),
        ("changed", "rows", "dp mlp torch/explicit/bucketed_v2", "only in NEW: a new row")]
    assert diff_main([str(path), _write(tmp_path, "new.json", new), "--time-factor", "0"]) == 1
    assert "REGRESSIONS (1)" in capsys.readouterr().out


def test_a_recompute_policy_shows_as_config_and_activation_memory(real):
    """What --recompute none -> full does to a torch transformer run (docs/regression.md has the real
    pair): the config line, and fewer activation bytes saved on each torch row (an improvement)."""
    _, data = real
    new = copy.deepcopy(data)
    for c in [new["config"], *new["configs"].values()]:
        c["recompute"] = "full"
    torch_rows = [r for r in new["runs"] if "activation_bytes" in r["extra"]]
    for r in torch_rows:
        r["extra"]["activation_bytes"] //= 2
    got = _findings(data, new, time_factor=None)
    assert got[0] == ("changed", "config", "", 'recompute: "none" -> "full" (mlp)')
    assert [(s, k, row) for s, k, row, _ in got[1:]] == [
        ("improved", "memory", f"dp mlp torch/{r['style']}/{r['variant']}") for r in torch_rows]
    assert len(torch_rows) == 4 and not diff(data, new, time_factor=None)["regressed"]


def test_a_collective_choice_parity_and_status_change_regress(real):
    """XLA issuing a reduce-scatter + all-gather where it issued an all-reduce (jit dp), a row whose
    parity error grew 1000x, and a row that failed."""
    _, data = real
    new = copy.deepcopy(data)
    jit = next(r for r in new["runs"] if r["style"] == "jit" and r["variant"] == "dp")
    size = jit["comm"]["all_reduce"]["bytes"]
    jit["comm"] = {"reduce_scatter": {"count": 1, "bytes": size}, "all_gather": {"count": 1, "bytes": size}}
    jit["comm_bytes"] = 2 * size
    naive = next(r for r in new["runs"] if r["variant"] == "naive")
    # 1e-13: within float64's 1e-12 tolerance (still ok), 100x above the 1e-15 round-off floor (a finding)
    naive_before, naive["max_rel_err_grad"] = naive["max_rel_err_grad"], 1e-13
    ddp = next(r for r in new["runs"] if r["variant"] == "ddp")
    ddp["ok"] = False
    assert jit["comm_bytes_theory"] != 2 * size  # so no "bytes vs theory" finding: it differed before too
    assert _findings(data, new, time_factor=None) == [
        ("regression", "parity", "dp mlp torch/explicit/naive",
         f"step-0 gradient error {naive_before:.1e} -> 1.0e-13 (×{1e-13 / max(naive_before, 1e-15):.0f})"),
        ("regression", "status", "dp mlp torch/builtin/ddp", "ok -> FAIL"),
        ("changed", "collectives", "dp mlp jax/jit/dp", f"all_gather ×1 ({size} B) added"),
        ("changed", "collectives", "dp mlp jax/jit/dp", f"all_reduce ×1 ({size} B) gone"),
        ("changed", "collectives", "dp mlp jax/jit/dp", f"reduce_scatter ×1 ({size} B) added")]


def test_step_time_ratios_compare_across_machines(real):
    """A machine 3x slower everywhere is no finding; one row 3x slower against its anchor is."""
    _, data = real
    slower = copy.deepcopy(data)
    for r in slower["runs"]:
        r["step_time_s"] = r["step_time_s"] and 3 * r["step_time_s"]
    assert _findings(data, slower, time_factor=2.0) == []
    row = next(r for r in slower["runs"] if r["variant"] == "zero1" and r["framework"] == "torch")
    row["step_time_s"] *= 3
    got = _findings(data, slower, time_factor=2.0)
    assert [(s, k, r) for s, k, r, _ in got] == [("regression", "time", "dp mlp torch/explicit/zero1")]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
    ("[1, 2]", "not a compare.py --json result (no list 'runs' at the top level)"),
    ('{"runs": [{"pattern": "dp", "framework": "torch"}]}', "runs[0] lacks style, variant, ok"),
])
def test_malformed_input_exits_2_in_one_line(real, tmp_path, capsys, content, message):
    path, _ = real
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    assert diff_main([str(path), str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"compare.py diff: error: {bad}: {message}\n"
    with pytest.raises(ValueError, match=re.escape(message)):
        load(str(bad))


@pytest.mark.slow
def test_a_real_world_size_change(real, tmp_path):
    """Two real runs, 2 then 4 ranks: the config line, and memory that shrinks per rank (zero1's optimizer
    state halves; activations and XLA's temp buffer hold fewer rows); nothing regresses."""
    _, data = real
    other = _run(tmp_path / "w4.json", 4)
    got = _findings(data, other, time_factor=None)
    assert got[0] == ("changed", "config", "", "world_size: 2 -> 4 (mlp)")
    assert {(s, k) for s, k, _, _ in got[1:]} == {("improved", "memory")}
    assert {row for _, _, row, what in got if what.startswith("state optimizer")} == {
        f"dp mlp {r['framework']}/{r['style']}/zero1" for r in data["runs"] if r["variant"] == "zero1"}
    assert not diff(data, other, time_factor=None)["regressed"]
