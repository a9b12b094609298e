"""compare.py's command line: bad input is refused with one line and exit 2, before anything runs."""

import subprocess
import sys
from pathlib import Path

import pytest

import compare

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--patterns", "dp,moe"], "'dp,moe': choose from collectives, dp, fsdp, tp, pp"),
        (["--frameworks", "mxnet"], "choose from torch, jax"),
        (["--dtype", "float16"], "invalid choice: 'float16'"),
        (["--steps", "0"], "steps must be a positive integer, got 0"),
        (["--patterns", "dp", "--world-size", "3", "--batch", "16"], "dp: batch=16 is not divisible by world_size=3"),
        (["--patterns", "tp", "--dim", "30"], "tp: dim=30 is not divisible by world_size=4"),
        (["--patterns", "pp", "--layers", "6"], "pp: layers=6 is not divisible by world_size=4"),
        (["--bucket-mb", "0"], "bucket_mb must be > 0"),
        (["--world-size", "x"], "invalid int value: 'x'"),
        (["--show-collectives", "nope"], "invalid choice: 'nope'"),
        (["bench", "--world-size", "1"], "bench needs world_size >= 2"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    assert compare.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1, err


def test_bad_config_from_a_real_shell_prints_no_traceback():
    proc = subprocess.run(
        [sys.executable, "compare.py", "--patterns", "fsdp", "--dim", "30"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "compare.py: error: fsdp: dim=30 is not divisible by world_size=4 " \
        "(every weight is split into equal slices)"
    assert "Traceback" not in proc.stderr + proc.stdout
