"""Tolerances that hold on any CPU (issue 51): the precision-sensitive torch runs (mixed precision in
bfloat16 and float16, pure float32; every pattern, the variants that round differently) on torch's other
vector paths. ``ATEN_CPU_CAPABILITY`` makes ATen dispatch to its AVX2 or scalar ("default") kernels, which
block and order their sums as another CPU's would (an AMD EPYC without AVX-512 runs the AVX2 ones): a
tolerance fitted to one machine's rounding fails here first. One launch per path (tests/cpu_paths.py, a
subprocess: the variable must be set before torch dispatches a kernel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_precision_verdicts_hold_on_another_vector_path(capability):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "cpu_paths.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["capability"] == capability.upper(), out["capability"]  # the path was taken
    failed = [r for r in out["rows"] if not r["ok"]]
    assert not failed, failed
    assert {r["pattern"] for r in out["rows"]} == {"dp", "fsdp", "tp", "cp", "pp"}
