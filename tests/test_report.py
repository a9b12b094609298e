"""What compare.py prints: the parity table is whole in any terminal of 80 columns or more (long names
wrap at '/', nothing is cut), one line per run when piped; --wide and Markdown carry every column;
the progress line counts runs and estimates what is left; --help lists the subcommands and every
option's default. No process is launched here."""

import os
import time

import pytest

from parallel_twins import cli as compare
from parallel_twins import report
from shared.results import RunResult


def _run(pattern, model, framework, style, variant, **kw):
    base = dict(world_size=4, dtype="float64", ok=True, max_rel_err_loss=2.1e-16, max_rel_err_grad=7.7e-15,
                max_rel_err_param=3.0e-15, step_time_s=0.01415, comm_bytes=32768, comm_bytes_theory=32768,
                state_bytes={"params": 1, "grads": 1, "optimizer": 2}, xfw_max_rel_err=1.5e-15, xfw_ok=True)
    return RunResult(pattern=pattern, framework=framework, style=style, variant=variant, model=model, **{**base, **kw})


ROWS = [  # the longest names and values the table can meet
    _run("collectives", None, "torch", "explicit", "ring_all_reduce", max_rel_err_loss=0.0, xfw_max_rel_err=None,
         step_time_s=None, comm_bytes=16),
    _run("dp", "mlp", "torch", "builtin", "ddp"),
    _run("fsdp", "transformer", "jax", "jit", "zero3", comm_bytes=862_515, comm_bytes_theory=1_268_736),
    _run("cp", "transformer", "torch", "builtin", "context_parallel", step_time_s=12.34567, comm_bytes=1_048_000),
    _run("tp", "transformer", "torch", "explicit", "megatron_sp", ok=False, max_rel_err_grad=float("inf")),
    _run("mesh", "transformer", "jax", "shard_map", "dp=2,fsdp=2,cp=2,tp=2,pp=2", xfw_ok=False),
]


def _parse(lines):
    """[(implementation, [other cells])] back from the rendered rows: the implementation column ends
    where the 'ok' column starts; a line with nothing after it continues the row above."""
    start = lines[0].text.index(" ok") + 1
    out = []
    for line in lines:
        if line.kind not in ("row", "fail"):
            continue
        piece, rest = line.text[:start].strip(), line.text[start:].split()
        if rest:
            out.append([piece, rest])
        else:
            out[-1][0] += piece
    return out


@pytest.mark.parametrize("width", [80, 100, 120, None])
def test_table_is_whole_at_any_width(width):
    lines = report.table_lines(ROWS, width)
    if width is not None:
        assert max(len(line.text) for line in lines) <= width
    parsed = _parse(lines)
    assert len(parsed) == len(ROWS)
    for (impl, rest), r in zip(parsed, ROWS):
        cells = report.compact_cells(r)
        assert impl == cells[0]  # the implementation, every character, in order
        assert " ".join(rest) == " ".join(cells[1:])  # every value whole (KiB/MiB keep their unit)
    if width in (None, 120):  # room enough: one line per run
        assert sum(line.kind in ("row", "fail") for line in lines) == len(ROWS)
    assert [line.kind for line in lines].count("fail") >= 2  # FAIL (own or cross-framework) stands out
    assert {line.text.split()[1] for line in lines if line.kind == "section"} >= {"collectives", "dp", "mesh"}


def test_wide_and_markdown_carry_every_column():
    wide = report.table_lines(ROWS, 80, wide=True)
    assert wide[0].text.split("  ")[0] == "pattern" and "state/rank" in wide[0].text
    assert sum(line.kind in ("row", "fail") for line in wide) == len(ROWS)  # never narrowed: the terminal wraps
    md = report.markdown_table(ROWS)
    assert md.count("\n") == len(ROWS) + 2 and "| 1.2 MiB |" in md and "| inf |" in md


def test_progress_counts_runs_and_estimates_what_is_left(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def at(t, framework, event):
        now[0] = t
        p.event(framework, event)

    p = report.Progress({"torch": 3, "jax": 2})  # t0 = 0
    at(0, "torch", ("framework", "torch"))
    at(1, "torch", ("start", "dp mlp explicit/naive"))  # nothing counted yet
    at(3, "torch", ("done", 1))  # torch: 3 s per run (launch included)
    assert p.estimate() == 2 * 3.0 + 2 * 3.0  # jax not started: torch's rate stands in
    at(4, "jax", ("framework", "jax"))
    at(4, "jax", ("start", "dp mlp jit/dp"))
    at(10, "jax", ("done", 1))  # jax: 6 s per run
    assert p.estimate() == 2 * 3.0 + 1 * 6.0
    assert p.text().startswith("[2/5 runs] jax: dp mlp jit/dp") and "left" in p.text()


def test_progress_in_a_log_is_a_line_every_30_s_of_runs(monkeypatch):
    """Piped (CI, a GPU node's script): no live line, so a plain line once a run ends 30 s after the last."""
    import io

    now, out = [0.0], io.StringIO()
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    event = report.Progress({"torch": 3}).logger(out, every_s=30.0)
    for t, ev in ((1, ("start", "dp")), (10, ("done", 1)), (31, ("done", 1)), (40, ("done", 1))):
        now[0] = t
        event("torch", ev)
    assert out.getvalue().splitlines() == ["[2/3 runs] torch: dp · 0:31 · about 0:16 left"]


@pytest.mark.parametrize("argv", [[], ["bench"]])
def test_help_lists_subcommands_and_every_default(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        compare.main([*argv, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    subcommands = all(f"compare.py {sub}" in text for sub in ("bench", "plan", "doctor"))
    assert bool(argv) or (subcommands and "exit status" in text)
    parser = compare.build_parser() if not argv else __import__("parallel_twins.bench").bench.build_bench_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.dest
        shown = compare.HelpFormatter("compare.py")._get_help_string(action)
        if action.default is not False:  # (switches are off unless given)
            assert "(default: " in shown, action.dest  # None: worked out at run time, said in its own words


def test_readme_blocks_all_have_a_recipe():
    """Every measured block of README.md and docs/ is regenerated by scripts/readme_figures.py (no run here)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "scripts/readme_figures.py", "--check"], cwd=root, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_plan_page_generated_blocks_are_current():
    """docs/plan.md's constants, published comparison and memory blocks are what scripts/plan_docs.py renders
    from the code as it is (the planner is arithmetic: the same on every machine); a change to the planner or
    to a cited constant regenerates them (``PYTHONPATH=. python scripts/plan_docs.py``)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("plan_docs", root / "scripts" / "plan_docs.py")
    plan_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_docs)
    text = (root / "docs" / "plan.md").read_text()
    assert plan_docs.render(text) == text, "docs/plan.md is stale: PYTHONPATH=. python scripts/plan_docs.py"


def test_documented_compare_commands_are_accepted(monkeypatch):
    """Every `python compare.py …` run command in a code block of README.md and docs/ (not a subcommand, not
    one marked as a refusal, "exit 2", nor one with placeholders) is accepted: parsed, configured and checked
    for every pattern it asks for, as compare.py does before anything runs (no run here). README's GPU-node
    command, `--world-size 8`, was refused until the default sizes followed the world size."""
    import glob
    import re
    import shlex

    from parallel_twins import cli

    for name in ("WORLD_SIZE", "RANK", "JAX_NUM_PROCESSES"):
        monkeypatch.delenv(name, raising=False)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commands = []
    for path in [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]:
        text = open(path).read()
        blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S)
        blocks.append("\n".join(line[4:] for line in text.splitlines() if line.startswith("    python compare.py")))
        for line in re.sub(r"\\\n\s*", " ", "\n".join(blocks)).splitlines():
            command, _, comment = line.strip().partition(" #")
            if not command.startswith("python compare.py") or re.search(r"exit 2|refus|error", comment) or \
                    re.search(r"\.\.\.|<|\{|\[", command):
                continue
            argv = shlex.split(command)[2:]
            if argv and argv[0] not in ("plan", "bench", "checkpoint", "doctor", "diff"):
                commands.append((os.path.relpath(path, root), command, argv))
    assert len(commands) >= 20, commands
    for path, command, argv in commands:
        try:
            args = cli.build_parser().parse_args(argv)
            cfgs = cli.make_configs(args)
            cli.check_styles(args, cfgs)
        except (SystemExit, ValueError) as exc:
            raise AssertionError(f"{path}: `{command}` is refused: {exc}") from None
