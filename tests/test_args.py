"""parallel_twins/args.py: the subcommands that train spell their shared flags alike (through --help),
and output paths: a regular file replaced whole, a FIFO or a symlink written in place (never
replaced), ``-`` standard output, a folder refused in one line (exit 2). In process, no run."""

import json
import os
import threading

import pytest

from parallel_twins import args, checkpoint_matrix
from parallel_twins import cli as compare
from parallel_twins.report import write_json

# The flags that mean the same wherever a subcommand trains a model (compare.py and compare.py checkpoint).
TRAINING_FLAGS = ("--frameworks", "--world-size", "--layers", "--dim", "--batch", "--heads", "--seq", "--vocab",
                  "--steps", "--seed", "--dtype", "--lr", "--weight-decay", "--json", "--quiet")


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        compare.main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _option_lines(text: str) -> dict[str, str]:
    """{flag: its help line's first words} of an argparse --help text."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if words and words[0].startswith("--"):
            out[words[0].rstrip(",")] = " ".join(words[1:])
    return out


def test_training_subcommands_share_their_flags(capsys):
    main, checkpoint = _option_lines(_help([], capsys)), _option_lines(_help(["checkpoint"], capsys))
    for flag in TRAINING_FLAGS:
        assert flag in main and flag in checkpoint, flag
    for flag in ("--seed", "--lr", "--weight-decay", "--dtype", "--dim", "--heads"):  # the same words, defaults too
        assert main[flag] == checkpoint[flag], flag
    bench = _option_lines(_help(["bench"], capsys))
    for flag in ("--frameworks", "--world-size", "--device", "--json", "--quiet"):
        assert flag in bench, flag
    assert "--json" in _option_lines(_help(["plan"], capsys))


def test_checkpoint_passes_seed_lr_and_weight_decay_through(monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after the test
    seen = []
    monkeypatch.setattr(checkpoint_matrix, "matrix", lambda cfg, *a, **k: seen.append(cfg) or ([], {}))
    assert compare.main(["checkpoint", "--frameworks", "torch", "--seed", "7", "--lr", "0.02",
                         "--weight-decay", "0.5", "--quiet"]) == 0
    assert (seen[0].seed, seen[0].lr, seen[0].weight_decay) == (7, 0.02, 0.5)
    assert compare.main(["checkpoint", "--seed", "-3"]) == 2  # Config's check: one line, exit 2
    err = capsys.readouterr().err.strip()
    assert "seed must be a non-negative integer" in err and len(err.splitlines()) == 1, err


def test_regular_file_replaced_whole(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    (tmp_path / "old-link").hardlink_to(path)  # the old inode: a rename leaves it as it was
    write_json(str(path), {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert (tmp_path / "old-link").read_text() == "old"  # replaced by a rename, never truncated in place
    assert sorted(os.listdir(tmp_path)) == ["old-link", "out.json"]  # no temporary file left


def test_fifo_is_written_in_place(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
    reader.start()
    args.check_output_path("--json", fifo)  # accepted up front
    write_json(fifo, {"runs": [1, 2]})
    reader.join(timeout=10)
    assert json.loads(got[0]) == {"runs": [1, 2]}
    assert os.path.exists(fifo) and not os.path.isfile(fifo) and os.listdir(tmp_path) == ["fifo"]  # still a FIFO


def test_symlink_is_written_through(tmp_path):
    target = tmp_path / "target.md"
    target.write_text("old")
    link = tmp_path / "link.md"
    link.symlink_to(target)
    args.write_output(str(link), "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_dash_is_standard_output(capsys):
    args.check_output_path("--json", "-")
    write_json("-", {"ok": True})
    assert json.loads(capsys.readouterr().out) == {"ok": True}


@pytest.mark.parametrize("sub", [[], ["bench"], ["checkpoint"], ["plan"]])
def test_folder_refused_up_front(sub, tmp_path, capsys):
    assert compare.main([*sub, "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--json {tmp_path}: is a folder; give a file name" in err and len(err.splitlines()) == 1, err
    with pytest.raises(IsADirectoryError):
        args.write_output(str(tmp_path), "x")
