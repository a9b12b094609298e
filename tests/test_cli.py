"""compare.py's command line: bad input is refused with one line and exit 2, before anything runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel_twins import cli as compare
from parallel_twins import report_collectives
from shared.schema import check as check_schema

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--patterns", "dp,moe"], "'dp,moe': choose from collectives, dp, fsdp, tp, pp, cp"),
        (["--frameworks", "mxnet"], "choose from torch, jax"),
        (["--dtype", "float16"], "float16 trains only under --precision mixed"),
        (["--dtype", "float16", "--precision", "mixed", "--patterns", "ep"],
         "ep: --precision mixed --dtype float16 is built"),
        (["--steps", "0"], "steps must be a positive integer, got 0"),
        (["--patterns", "dp", "--world-size", "3", "--batch", "16"], "dp: batch=16 is not divisible by world_size=3"),
        (["--patterns", "tp", "--dim", "30", "--model", "mlp"], "tp: dim=30 is not divisible by world_size=4"),
        (["--patterns", "pp", "--layers", "6"], "pp: layers=6 is not divisible by world_size=4"),
        (["--patterns", "pp", "--virtual-stages", "2", "--layers", "4"],
         "pp: layers=4 is not divisible by world_size·virtual_stages=8"),  # given: kept (not given: 8, default_sizes)
        (["--patterns", "pp", "--virtual-stages", "2", "--layers", "8", "--microbatches", "2", "--batch", "8"],
         "interleaved: microbatches=2 is not divisible by stages=4 (Megatron)"),
        (["--patterns", "pp", "--virtual-stages", "0"], "virtual_stages must be a positive integer, got 0"),
        (["--mesh", "tp=2,pp=2", "--virtual-stages", "2", "--layers", "8"], "mesh: virtual_stages=2 (the interleaved"),
        (["--bucket-mb", "0"], "bucket_mb must be > 0"),
        # mixed precision (issue 34): a 16-bit compute dtype; the patterns it is not built for refuse it
        (["--precision", "mixed"], "precision mixed computes in a 16-bit dtype: give --dtype bfloat16"),
        (["--precision", "mixed", "--dtype", "float32", "--patterns", "dp"], "precision mixed computes in a 16-bit"),
        # (per framework, shared.config.MIXED_PATTERNS: both build dp, fsdp, tp, pp, cp, ep, mesh;
        # float16 (loss scaling) not under ep and mesh)
        (["--precision", "mixed", "--dtype", "float16", "--patterns", "ep", "--frameworks", "jax"],
         "ep: --precision mixed --dtype float16 is built in jax for dp, fsdp, cp, tp, pp only (ep's loss scaling"),
        (["--precision", "mixed", "--dtype", "float16", "--patterns", "ep"], "ep: --precision mixed --dtype float16"),
        (["--precision", "mixed", "--dtype", "float16", "--mesh", "dp=2,tp=2"],
         "mesh: --precision mixed --dtype float16 is built"),
        (["--precision", "mixed", "--dtype", "bfloat16", "--patterns", "dp", "--checkpoint-dir", "/tmp"],
         "--checkpoint-dir: --precision mixed is not built for checkpoints; use --precision pure"),
        (["checkpoint", "--precision", "mixed", "--dtype", "bfloat16"], "checkpoint: --precision mixed is not built"),
        (["--world-size", "x"], "invalid int value: 'x'"),
        (["--show-collectives", "nope"], "invalid choice: 'nope'"),
        (["bench", "--world-size", "0"], "bench needs world_size >= 1"),
        (["bench", "--world-size", "1", "--device", "cpu", "--profile", "p.json"],
         "--profile at world size 1 needs a GPU"),
        (["--seed", "-3"], "seed must be a non-negative integer, got -3"),
        (["--model", "gpt"], "'gpt': choose from mlp, transformer"),
        (["--model", "transformer", "--dim", "30", "--heads", "4"], "transformer: dim=30 is not divisible by heads=4"),
        (["--model", "transformer", "--patterns", "tp", "--heads", "2", "--dim", "8"],
         "tp (transformer): heads=2 is not divisible by world_size=4"),
        (["--model", "transformer", "--patterns", "tp", "--vocab", "30"],
         "tp (transformer): vocab=30 is not divisible by world_size=4"),
        # N-D layouts (the mesh pattern): refused before any rank starts
        (["--mesh", "dp=2,tp=2", "--world-size", "8"], "mesh dp=2,tp=2: the axes multiply to 4, not the world size 8"),
        (["--mesh", "dp=2,sp=2"], "mesh: unknown axis 'sp'; choose from dp, fsdp, ep, pp, cp, tp"),
        (["--mesh", "dp=2,ep=2", "--model", "transformer", "--experts", "3"],
         "mesh dp=2,ep=2: experts=3 is not divisible by ep=2"),
        (["--mesh", "ep=2,pp=2", "--model", "transformer"], "mesh ep=2,pp=2: ep beside pp is not composed"),
        (["--mesh", "dp=2,ep=2", "--model", "transformer", "--experts", "4", "--precision", "mixed", "--dtype",
          "bfloat16"], "mesh dp=2,ep=2: --precision mixed with --experts under --mesh is not checked"),
        (["--mesh", "dp=2,fsdp=2", "--batch", "6"], "mesh dp=2,fsdp=2: batch=6 is not divisible by dp·fsdp=4"),
        (["--mesh", "dp=2,tp=2", "--heads", "3", "--dim", "12"], "mesh dp=2,tp=2: heads=3 is not divisible by tp=2"),
        (["--mesh", "dp=2,pp=4", "--layers", "6"], "mesh dp=2,pp=4: layers=6 is not divisible by pp=4"),
        (["--mesh", "dp=2,cp=4", "--seq", "10"], "mesh dp=2,cp=4: seq=10 is not divisible by cp=4"),
        (["--mesh", "dp=4,pp=2", "--batch", "12", "--microbatches", "2"],
         "mesh dp=4,pp=2: batch=12 is not divisible by dp·microbatches=8"),
        (["--mesh", "tp=2,pp=4", "--microbatches", "2", "--layers", "4"], "microbatches=2 < pp=4"),
        (["--mesh", "dp=2,tp=2;pp=8"], "every layout of one run needs the same world size"),
        (["--mesh", "dp2"], "write axis=size pairs"),
        (["--patterns", "mesh"], "mesh: no layout given"),
        (["--mesh", "dp=2,tp=2", "--model", "mlp"], "mesh: the mlp has no N-D layout here"),
        (["--mesh", "fsdp=2,cp=2", "--vocab", "66"], "mesh fsdp=2,cp=2: vocab=66 is not divisible by tp·fsdp·cp=4"),
        # expert parallelism (the MoE transformer)
        (["--patterns", "ep", "--experts", "6"], "ep (transformer): experts=6 is not divisible by world_size=4"),
        (["--patterns", "ep", "--batch", "6", "--world-size", "4"],
         "ep (transformer): batch=6 is not divisible by world_size=4"),
        (["--patterns", "ep", "--experts", "4", "--topk", "5"], "topk=5 > experts=4"),
        (["--patterns", "ep", "--experts", "1", "--world-size", "1"], "experts must be 0 (dense) or >= 2, got 1"),
        (["--patterns", "ep", "--topk", "0"], "topk must be a positive integer, got 0"),
        (["--patterns", "ep", "--model", "mlp"], "ep: the mlp has no experts (use --model transformer --experts E)"),
        (["--patterns", "tp", "--experts", "4"], "--experts/--topk build the mixture-of-experts transformer, which "
                                                "runs under --patterns ep, or --mesh with an ep axis, only"),
        # output paths: checked before anything runs (a typo must not cost the whole run)
        (["--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json: the folder /nonexistent/dir does "
                                                "not exist"),
        (["--markdown", "/"], "--markdown /: is a folder; give a file name"),
        (["--plots", "/dev/null"], "--plots /dev/null: exists and is not a folder"),
        (["--plots", "/dev/null/plots"], "--plots /dev/null/plots: cannot create it: /dev/null is not a writable "
                                          "folder"),
        (["bench", "--json", "/nonexistent/b.json"], "--json /nonexistent/b.json: the folder /nonexistent does not"),
        (["--baseline", "/nonexistent.json"], "/nonexistent.json: no such file"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    assert compare.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1, err


def test_a_recipe_that_leaves_every_run_out_exits_2(capsys):
    """--freeze of one layer under a JAX mesh layout: compose stacks the blocks' Params (one leaf per name for
    every layer), so shard_map and jit are left out, each with its note; with nothing left to run, exit 2."""
    argv = ["--mesh", "ep=2,tp=2", "--model", "transformer", "--experts", "4", "--freeze", "blocks.1.*",
            "--frameworks", "jax"]
    assert compare.main(argv) == 2
    err = capsys.readouterr().err
    assert "jax shard_map left out" in err and "jax jit left out" in err, err
    assert "error: the recipe leaves every run out" in err and "blocks.*.NAME" in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")
@pytest.mark.parametrize("argv", [["--device", "gpu", "--patterns", "dp"], ["bench", "--device", "gpu"]])
def test_gpu_request_without_gpus_exits_2_before_anything_runs(argv, capsys):
    assert compare.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--device gpu" in err and len(err.splitlines()) == 1, err


def test_jax_is_refused_under_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # torchrun's mark: not a stale environment
    assert compare.main(["--frameworks", "jax", "--patterns", "dp"]) == 2
    assert "under torchrun" in capsys.readouterr().err


def test_bad_config_from_a_real_shell_prints_no_traceback():
    proc = subprocess.run(
        [sys.executable, "compare.py", "--patterns", "fsdp", "--dim", "30", "--model", "mlp"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "compare.py: error: fsdp: dim=30 is not divisible by world_size=4 " \
        "(every weight is split into equal slices)"
    assert "Traceback" not in proc.stderr + proc.stdout


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; Linux)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:  # it exited between the listing and the read
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # slow tier (issue 37's budget): two whole runs; determinism of each pattern is in its own module
def test_same_seed_same_losses_bit_for_bit(tmp_path):
    """Two processes, same seed: identical losses. torch, where ranks, gloo's reductions, SDPA and
    DTensor could make a run differ (JAX runs one process whose XLA:CPU programs are fixed at
    compile time; its runs are compared to the float64 references everywhere else)."""
    paths = [tmp_path / f"run{i}.json" for i in range(2)]
    procs = [subprocess.Popen(  # both at once: independent processes, the same seed
        [sys.executable, "compare.py", "--patterns", "tp", "--model", "transformer", "--world-size", "2",
         "--steps", "3", "--layers", "1", "--dim", "8", "--batch", "8", "--seq", "4", "--vocab", "16",
         "--frameworks", "torch", "--json", str(path), "--quiet"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for path in paths]
    runs = []
    for proc, path in zip(procs, paths):
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        runs.append({(r["model"], r["framework"], r["style"], r["variant"]): r["losses"]
                     for r in json.loads(path.read_text())["runs"]})
    assert {k[0] for k in runs[0]} == {"transformer"}  # SDPA, DTensor and the vocab-parallel loss
    assert {k[1] for k in runs[0]} == {"torch"}
    assert runs[0] == runs[1]  # exact float equality, not a tolerance


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_a_worker_ends_the_whole_job_quickly(measured):
    proc = subprocess.Popen(
        [sys.executable, "compare.py", "--patterns", "tp", "--frameworks", "torch", "--world-size", "2",
         "--model", "mlp", "--steps", "100000", "--dim", "8", "--batch", "8", "--quiet", "--timeout", "120"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        ranks = []
        while time.monotonic() < deadline and len(ranks) < 2:
            # ranks are the children of the launch's forkserver (torch_impl.launch; spawned children of the
            # job under PARALLEL_TWINS_START_METHOD=spawn; the resource tracker is one more child)
            kids = _children(proc.pid)
            ranks = [p for k in kids if "forkserver" in _cmdline(k) for p in _children(k)] + [
                p for p in kids if "spawn_main" in _cmdline(p) and "resource_tracker" not in _cmdline(p)]
            time.sleep(0.2)
        assert len(ranks) == 2, "ranks never started"
        time.sleep(3.0)  # let them get into training
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        seconds = time.monotonic() - t0
        measured(f"the job ended {seconds:.1f} s after a rank was killed")
        # The bug this catches (waiting for the launch's 120-s timeout) takes >= 120 s on any machine.
        assert seconds < 60, "the job did not end well before the launch's timeout"
        assert proc.returncode != 0
        assert "rank 1 died with signal SIGKILL" in out, out[-2000:]
        time.sleep(0.5)
        assert not any(_alive(p) for p in ranks), "a rank outlived the job"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_json_markdown_and_plots_contract(tmp_path):
    """The --json contract, the Markdown table and the PNGs of a small pipeline run (the MLP: every pp
    schedule in both frameworks; the transformer's pp rows are tests/test_pp.py's, and its config's JSON
    round trip is test_mesh_configs_keys_in_json's)."""
    out_json, out_md, plot_dir = tmp_path / "out.json", tmp_path / "out.md", tmp_path / "plots"
    code = compare.main(["--patterns", "pp", "--model", "mlp", "--world-size", "2", "--layers", "2", "--dim", "8",
                         "--batch", "8", "--microbatches", "2", "--steps", "3",
                         "--json", str(out_json), "--markdown", str(out_md), "--plots", str(plot_dir), "--quiet"])
    assert code == 0
    data = json.loads(out_json.read_text(), parse_constant=_refuse)
    assert check_schema(data) == []  # docs/results-schema.json, provenance block included
    assert out_md.read_text().startswith("**provenance**")
    data["runs"] = [r for r in data["runs"] if r["pattern"] == "pp"]
    data["cross_framework"] = [x for x in data["cross_framework"] if x["pattern"] == "pp"]
    required = {"pattern", "model", "framework", "style", "variant", "world_size", "dtype", "ok", "losses",
                "max_rel_err_loss", "max_rel_err_grad", "step_time_s", "comm", "comm_bytes", "comm_bytes_theory"}
    assert data["runs"] and all(required <= set(r) for r in data["runs"])
    assert {r["framework"] for r in data["runs"]} == {"torch", "jax"}
    assert all(r["ok"] and len(r["losses"]) == 3 for r in data["runs"])
    # compile time (issue 49): every JAX row (one compiled program per step), no eager torch row
    assert all(r["compile_s"] > 0 if r["framework"] == "jax" else r["compile_s"] is None for r in data["runs"])
    assert {r["model"] for r in data["runs"]} == {"mlp"}
    assert {r["variant"] for r in data["runs"]} >= {"gpipe", "1f1b", "interleaved", "zb", "circular"}
    assert [(x["model"], x["ok"]) for x in data["cross_framework"]] == [("mlp", True)]
    assert set(data["configs"]) == {"mlp"} and data["configs"]["mlp"]["microbatches"] == 2
    assert out_md.read_text().count("\n| pp |") == len(data["runs"])
    pngs = sorted(p.name for p in plot_dir.iterdir())
    assert {"loss_curves.png", "memory.png", "pp_mlp_torch_explicit_1f1b_timeline.png",
            "pp_mlp_torch_explicit_zb_schedule.png"} <= set(pngs)
    assert "bus_bandwidth.png" not in pngs  # the collectives pattern did not run
    assert all((plot_dir / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_show_collectives_contrasts_the_five_styles(capsys):
    code = compare.main(["--show-collectives", "tp", "--world-size", "2", "--dim", "8", "--batch", "4",
                         "--model", "mlp", "--steps", "2", "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "collectives of one tp step on the mlp" in out
    head = next(line for line in out.splitlines() if "torch dist.*" in line)  # the five ways, side by side
    assert all(h in head for h in ("torch dist.*", "DTensor/builtin", "shard_map", "typed", "jit")), head
    for style in ("explicit", "builtin", "shard_map", "typed", "jit"):
        assert style in out
    # XLA:CPU forms the all-gather TP backward as all-reduce, where shard_map writes reduce-scatter
    assert "allgather: XLA (jit) issued" in out
    # the typed programs' stated changes against what XLA issued (the row-parallel unreduced -> reduced)
    assert "typed/allgather: gather: 4 stated" in out and "each became one all_gather" in out
    assert "typed/megatron: reduce: 2 stated" in out and "XLA issued 3× all_reduce, 1 more than stated" in out


def test_styles_typed_refuses_pp_in_one_line(capsys):
    """--styles typed on a pattern types cannot write: exit 2, one line naming it and JAX's reason."""
    assert compare.main(["--patterns", "pp", "--model", "mlp", "--styles", "typed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("compare.py: error: --styles typed: pp: ") and \
        "ShardingTypeError" in err, err


@pytest.mark.slow  # slow tier (issue 37's budget): cp's ledgers are asserted in test_cp; this is the table's text
def test_show_collectives_cp_ring_zigzag_ulysses_and_xla(capsys):
    """Default models (both): cp runs on the transformer only; the table, XLA's choice for
    seq_sharded and the per-rank attention work (zigzag balanced)."""
    code = compare.main(["--show-collectives", "cp", "--world-size", "2", "--layers", "1", "--dim", "8",
                         "--heads", "2", "--seq", "8", "--vocab", "16", "--batch", "2", "--steps", "2", "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "collectives of one cp step on the transformer" in out and "on the mlp" not in out
    for variant in ("ring", "ring_zigzag", "ulysses", "seq_sharded"):
        assert variant in out
    assert "seq_sharded: XLA (jit) chose" in out
    assert "explicit/ring: 64, 128 (max/min 2.00)" in out and "explicit/ring_zigzag: 80, 80 (max/min 1.00)" in out


def _refuse(name):
    raise ValueError(f"{name} is not valid JSON")


def test_bench_subcommand_writes_valid_json(tmp_path, capsys):
    path, profile = tmp_path / "bench.json", tmp_path / "profile.json"
    code = compare.main(["bench", "--world-size", "2", "--min-bytes", "4096", "--max-bytes", "16384",
                         "--iters", "2", "--warmup", "1", "--json", str(path), "--profile", str(profile)])
    assert code == 0
    data = json.loads(path.read_text(), parse_constant=_refuse)  # strict JSON: no Infinity / NaN
    assert check_schema(data, "stamped") == []  # the provenance block
    assert {r["framework"] for r in data["results"]} == {"torch", "jax"}
    assert all(r["busbw"] > 0 and r["time_s"] > 0 for r in data["results"])
    assert {f["op"] for f in data["fits"]} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert set(data["compute"]) == {"float64", "float32"}  # the matmul rate plan --calibrate reads
    assert all(rate > 0 for rates in data["compute"].values() for rate in rates.values())
    # the round trip: bench --profile writes this machine's table, plan --profile plans with it
    from parallel_twins.planner import plan_main
    from shared import efficiency

    table = efficiency.load(str(profile))
    assert table["hbm_copy"] > 0 and max(f for _, f in table["matmul"]) == 1.0 and table["intra"]
    assert table["peaks"]["fp64"] == max(data["compute"]["float64"].values())
    capsys.readouterr()
    assert plan_main(["--profile", str(profile), "--dtype", "float64", "--layers", "2", "--dim", "64", "--heads", "4",
                      "--vocab", "128", "--seq", "32", "--global-batch", "8", "--gpus", "2", "--gpus-per-node", "2",
                      "--gpu-memory", "1GiB", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{table['peaks']['fp64'] / 1e12:.0f} TFLOP/s" in out and "fastest layouts that fit" in out
    assert plan_main(["--profile", str(profile)]) == 2  # bfloat16: no such peak measured on this CPU
    assert "no bfloat16 peak" in capsys.readouterr().err


def test_show_collectives_mesh_table_per_axis_and_memory():
    """The per-axis table of --show-collectives mesh, from rows shaped as the harnesses return them
    (torch: per-rank views, merged where equal; JAX: one SPMD view), marks what differs from theory."""
    import io

    from rich.console import Console

    from shared.results import RunResult

    view = lambda tp_bytes, pp_bytes: {"tp": {"all_reduce": {"count": 4, "bytes": tp_bytes}},
                                       "pp": {"send": {"count": 2, "bytes": pp_bytes},
                                              "recv": {"count": 2, "bytes": pp_bytes}}}
    per_rank = [view(100, 10), view(100, 10), view(200, 10), view(200, 10)]
    theory = [view(100, 10), view(100, 10), view(200, 10), view(200, 10)]
    theory[3] = view(200, 20)  # rank 3's pp bytes disagree with theory
    state = {"params": 8, "grads": 8, "optimizer": 16}
    rows = [
        RunResult("mesh", "torch", "explicit", "tp=2,pp=2", 4, "float64", True, model="transformer",
                  state_bytes=state, extra={"comm_by_axis_per_rank": per_rank, "comm_by_axis_theory_per_rank": theory,
                                            "state_bytes_theory": state, "activation_bytes": 2048}),
        RunResult("mesh", "jax", "shard_map", "tp=2,pp=2", 4, "float64", True, model="transformer",
                  state_bytes=state, extra={"comm_by_axis": view(100, 10), "comm_by_axis_theory": view(100, 10),
                                            "state_bytes_theory": {**state, "params": 4}, "temp_bytes": 4096}),
    ]
    out = io.StringIO()
    report_collectives.mesh_tables(rows, Console(file=out, width=200))
    text = out.getvalue()
    lines = [line.replace("│", " ").replace("┃", " ") for line in text.splitlines() if "torch" in line or "jax" in line]
    assert lines[0].split()[:3] == ["torch", "explicit", "0,1"] and lines[0].rstrip().endswith("yes")
    assert lines[1].split()[:3] == ["torch", "explicit", "2"] and lines[1].rstrip().endswith("yes")
    assert lines[2].split()[:3] == ["torch", "explicit", "3"] and "(theory 20 B)" in lines[2] and "no" in lines[2]
    assert lines[3].split()[:3] == ["jax", "shard_map", "all"] and lines[3].rstrip().endswith("yes")
    header = next(line for line in text.splitlines() if "framework" in line and "ranks" in line)
    assert header.index("tp") < header.index("pp")  # columns in the layout's order (tp=2,pp=2)
    memory = [line for line in lines[4:]]
    assert "yes" in memory[0] and "2.0 KiB (saved)" in memory[0]
    assert "4.0 KiB (XLA temp)" in memory[1] and "yes" not in memory[1]


def test_mesh_configs_keys_in_json():
    """--mesh adds the mesh pattern with one config per (model, layout), keyed by the layout, whose
    mesh survives the JSON round trip (the runs themselves: tests/test_mesh.py)."""
    args = compare.build_parser().parse_args(["--patterns", "pp", "--world-size", "2", "--mesh", "dp=2;tp=2",
                                              "--layers", "2", "--batch", "8", "--microbatches", "2"])
    cfgs = compare.make_configs(args)
    assert args.patterns == ["pp", "mesh"]
    keys = {compare.run_key(c): json.loads(json.dumps(vars(c))) for c in cfgs}
    assert set(keys) == {"mlp", "transformer", "transformer dp=2", "transformer tp=2"}
    assert keys["transformer tp=2"]["mesh"] == [["tp", 2]]
    assert [compare.run_key(c) for c in compare.cfgs_for(cfgs, "mesh")] == ["transformer dp=2", "transformer tp=2"]


def test_ep_configs_keys_and_default_experts():
    """--patterns ep adds the MoE transformer as its own config (keyed "transformer E=…,k=…"); the
    default run includes ep with E = the smallest multiple of the world size >= 4; --model mlp alone
    drops the patterns it has nothing for instead of refusing the default run."""
    args = compare.build_parser().parse_args(["--patterns", "dp,ep", "--world-size", "8", "--topk", "1"])
    cfgs = compare.make_configs(args)
    assert [compare.run_key(c) for c in cfgs] == ["mlp", "transformer", "transformer E=8,k=1"]
    assert [compare.run_key(c) for c in compare.cfgs_for(cfgs, "ep")] == ["transformer E=8,k=1"]
    assert [c.model for c in compare.cfgs_for(cfgs, "dp")] == ["mlp", "transformer"]
    assert [compare.default_experts(n) for n in (1, 2, 3, 4, 8)] == [4, 4, 6, 4, 8]
    args = compare.build_parser().parse_args([])
    compare.make_configs(args)
    assert "ep" in args.patterns and "mesh" not in args.patterns
    args = compare.build_parser().parse_args(["--model", "mlp"])
    assert [c.model for c in compare.make_configs(args)] == ["mlp"] and args.patterns == \
        ["collectives", "dp", "fsdp", "tp", "pp"]


def test_the_plain_run_is_the_tour_and_all_is_every_variant():
    """`python compare.py` (no --patterns, --styles): every pattern × framework in the README table's four
    styles, each by its TOUR variant (issue 46: the first run of a fresh clone in ~2 min on 2 cores); --all,
    --patterns or --styles: every variant (typed too)."""
    from parallel_twins.runs import chosen_variants, planned_runs
    from shared.vocab import TOUR

    def plan(argv):
        args = compare.build_parser().parse_args(argv)
        args.tour = args.patterns is None and args.styles is None and not args.mesh and not args.show_collectives \
            and not args.all  # as _main
        cfgs = compare.make_configs(args)
        return args, cfgs, planned_runs(cfgs, args.patterns, args.frameworks, args.styles, args.tour)

    args, cfgs, tour = plan([])
    _, _, every = plan(["--all"])
    assert tour == {"torch": 33, "jax": 34} and every == {"torch": 56, "jax": 69}, (tour, every)
    assert plan(["--patterns", "dp"])[2] == plan(["--patterns", "dp", "--all"])[2]
    assert plan(["--styles", "typed"])[2] == plan(["--styles", "typed", "--all"])[2]
    for pattern in (p for p in args.patterns if p != "collectives"):
        for cfg in compare.cfgs_for(cfgs, pattern):
            for fw in args.frameworks:
                styles = {s for s, _ in chosen_variants(fw, pattern, cfg)} - {"typed"}
                kept = chosen_variants(fw, pattern, cfg, tour=True)
                assert {s for s, _ in kept} == styles, (pattern, fw)  # every style keeps a row
                assert all(TOUR[pattern][s] == v for s, v in kept) and len(kept) == len(styles), (pattern, fw, kept)


def test_default_sizes_fit_the_world_size():
    """Sizes not given are the small defaults rounded up to what every 1-D pattern splits at the world size
    (args.default_sizes): on 1, 2 and 4 ranks the defaults themselves (every documented figure unchanged); on
    3 and 8 ranks the default run's configs pass every pattern's check (before this, `compare.py
    --world-size 8`, the GPU-node command of README.md, was refused: heads=4 over 8 ranks). A size given is
    never changed (refused when it does not divide), and a --mesh run keeps the defaults. Every variant of the
    4-rank run still runs (pp's micro-batches too: 8 on 8 ranks)."""
    from parallel_twins.args import SIZES, default_sizes
    from parallel_twins.runs import planned_runs

    for world in (1, 2, 4):
        assert default_sizes(world) == SIZES
    assert default_sizes(8) == dict(SIZES, layers=8, heads=8)
    args = compare.build_parser().parse_args(["--world-size", "4"])
    every = planned_runs(compare.make_configs(args), args.patterns, args.frameworks)
    for world in (3, 8):  # an odd one, and a GPU node's
        args = compare.build_parser().parse_args(["--world-size", str(world)])
        cfgs = compare.make_configs(args)  # raises on any pattern's refusal
        assert "tp" in args.patterns and "cp" in args.patterns and "pp" in args.patterns
        assert all(c.heads % world == 0 and c.layers % world == 0 and c.seq % (2 * world) == 0 and
                   c.microbatches % world == 0 for c in cfgs)  # the interleaved schedule: M % world == 0
        assert planned_runs(cfgs, args.patterns, args.frameworks) == every  # no variant left out
    with pytest.raises(ValueError, match="layers=4 is not divisible by world_size=8"):
        compare.make_configs(compare.build_parser().parse_args(["--world-size", "8", "--layers", "4"]))
    args = compare.build_parser().parse_args(["--mesh", "dp=2,tp=2,pp=2", "--model", "transformer"])
    assert all((c.layers, c.heads) == (4, 4) for c in compare.make_configs(args))
    args = compare.build_parser().parse_args(["--patterns", "pp", "--world-size", "4", "--virtual-stages", "2"])
    assert {c.layers for c in compare.make_configs(args)} == {8}  # world · chunks


def test_show_collectives_ep_routing_bytes_and_padding():
    """--show-collectives ep's routing table (load per expert and per rank of the last step), the
    torch ranks' all-to-all bytes against the routing-count formula, and the static styles' padding,
    from rows shaped as the harnesses return them."""
    import io

    import numpy as np
    from rich.console import Console

    from shared.config import Config
    from shared.results import RunResult
    from shared.theory import ep_padding

    cfg = Config(world_size=2, model="transformer", layers=1, dim=8, heads=2, seq=4, vocab=16, batch=2, steps=1,
                 experts=4, topk=1)
    load = np.array([[[[4, 0, 0, 0], [1, 1, 1, 1]]]])  # (steps, L, B, E): sequence 0 all to e0
    comm = lambda a2a: {"all_to_all": {"count": 4, "bytes": a2a}}
    rows = [RunResult("ep", "torch", "explicit", "dropless", 2, "float64", True, model="transformer",
                      extra={"expert_load": load, "comm_per_rank": [comm(100), comm(200)],
                             "comm_theory_per_rank": [comm(100), comm(200)]}),
            RunResult("ep", "torch", "builtin", "dropless", 2, "float64", True, model="transformer",
                      extra={"expert_load": load, "comm_per_rank": [comm(100), comm(200)],
                             "comm_theory_per_rank": [comm(100), comm(300)]}),
            RunResult("ep", "jax", "shard_map", "capacity", 2, "float64", True, model="transformer",
                      extra={"expert_load": load, "padding": ep_padding(cfg, load[-1])})]
    out = io.StringIO()
    report_collectives.ep_tables(rows, [cfg], Console(file=out, width=200))
    text = out.getvalue()
    # layer 0: experts e0..e3 get 5, 1, 1, 1; rank 0 owns e0, e1 (6), rank 1 e2, e3 (2): max/mean 1.50
    cells = [line.replace("│", " ").split() for line in text.splitlines()]
    assert ["0", "5", "1", "1", "1", "6", "2", "1.50"] in cells
    assert "explicit/dropless: all-to-all bytes per rank 100 B, 200 B (routing-count formula: equal on every rank)" \
        in text
    assert "builtin/dropless: all-to-all bytes per rank 100 B, 200 B (routing-count formula: 100 B, 300 B)" in text
    assert "static buffers of 16 rows per rank per all-to-all, 4 carry a token (75% padding)" in text


MIXED_TINY = ["--model", "transformer", "--precision", "mixed", "--dtype", "bfloat16", "--world-size", "2",
              "--layers", "2", "--dim", "8", "--heads", "2", "--seq", "4", "--vocab", "8", "--batch", "4", "--quiet"]


def _mixed_rows(tmp_path, patterns, extra=()):
    out = tmp_path / "mixed.json"
    assert compare.main([*MIXED_TINY, "--patterns", patterns, *extra, "--json", str(out)]) == 0
    data = json.loads(out.read_text(), parse_constant=_refuse)
    assert check_schema(data) == []
    return data


def _check_mixed(data, cfg_world=2):
    """Every row ok against its reference's measured floor, marked mixed, with the floor and the
    distance from float64 reported; float32 reductions: dp's all-reduce moves 4 bytes per element."""
    rows = data["runs"]
    assert rows and {r["framework"] for r in rows} == {"torch", "jax"}
    for r in rows:
        assert r["precision"] == "mixed" and r["ok"] and r["xfw_ok"], r
        mixed = r["extra"]["mixed"]
        assert set(mixed["floor"]) == {"max_rel_err_loss", "max_rel_err_grad", "max_rel_err_param"}
        assert mixed["loss_rel_err_vs_float64"] <= 2e-2, r  # the bar (bf16 rounding), reported
        if r["style"] in ("explicit", "shard_map"):  # hand-written collectives (jit/typed, DDP: their own choices)
            assert r["comm_bytes"] == r["comm_bytes_theory"], r  # float32 reductions, in theory too
    c = data["configs"]["transformer"]
    from shared.config import Config

    phi = Config(**{k: (tuple(map(tuple, v)) if k == "mesh" else v) for k, v in c.items()}).n_params
    naive = next(r for r in rows if (r["pattern"], r["variant"]) == ("dp", "naive"))
    assert naive["comm"]["all_reduce"]["bytes"] == 4 * phi  # float32 master gradients on the wire
    assert all(x["ok"] for x in data["cross_framework"])


def test_mixed_precision_dp_fsdp_both_frameworks(tmp_path):
    """--precision mixed (issue 34): float32 master weights, bf16 compute; torch autocast (FSDP2 through
    MixedPrecisionPolicy, explicit zero3 casting before the gather), JAX float32 params cast in the step."""
    # explicit, builtin and shard_map in the default tier (jit and typed: the slow sweep, 4 ranks; issue 37's budget)
    data = _mixed_rows(tmp_path, "dp,fsdp", ["--steps", "2", "--styles", "explicit,builtin,shard_map"])
    _check_mixed(data)
    fsdp2 = next(r for r in data["runs"] if r["variant"] == "fsdp2")
    assert fsdp2["comm_bytes"] == fsdp2["comm_bytes_theory"]  # bf16 gathers, float32 reduce-scatters


@pytest.mark.slow
def test_mixed_precision_every_pattern_both_frameworks(tmp_path):
    """Issue 34's command (--precision mixed on the transformer) for tp, pp and cp, both frameworks in one
    run, 4 ranks / devices: every style and variant; every row ok against its floor
    (shared.tolerances.MIXED_LAYOUT_FACTOR for tp and the rings), within 2e-2 of float64 training, and its
    ledger equal to theory in the dtypes it sends (torch: every style, autocast's mix; JAX: shard_map, every
    activation 16-bit). The transformer only: the MLP's rows run the same step code per style with fewer
    ops (they doubled the sweep's ~100 s and proved nothing the transformer's rows do not). dp and fsdp: the
    default tier's test_mixed_precision_dp_fsdp_both_frameworks (their jit and typed rows cast through the
    recipe's code that tp's jit and typed rows run here; ~85 s, issue 46)."""
    out = tmp_path / "mixed.json"
    argv = ["--model", "transformer", "--precision", "mixed", "--dtype", "bfloat16", "--world-size", "4",
            "--patterns", "tp,pp,cp", "--steps", "3", "--layers", "4", "--dim", "32",
            "--heads", "4", "--seq", "16", "--vocab", "64", "--batch", "16", "--quiet", "--json", str(out)]
    # (D=16 T=8 V=16 B=8: JAX pp 1F1B's loss at step 2 sat at 12.7x its split-batch floor, gradients at 0.45x:
    # one split sample's loss floor is noise at that size; D=32 T=16 V=64 B=16: 1.9x, docs/recipe.md)
    assert compare.main(argv) == 0
    data = json.loads(out.read_text(), parse_constant=_refuse)
    assert {(r["pattern"], r["framework"]) for r in data["runs"]} == {(p, f) for p in ("tp", "pp", "cp")
                                                                      for f in ("torch", "jax")}
    for r in data["runs"]:
        assert r["ok"] and r["precision"] == "mixed", r
        assert r["extra"]["mixed"]["loss_rel_err_vs_float64"] <= 2e-2, r
        if r["framework"] == "torch" or r["style"] == "shard_map":
            assert r["comm_bytes"] == r["comm_bytes_theory"], r
