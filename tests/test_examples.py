"""The README's "Bring your own model" examples run as a user runs them: a fresh interpreter, exit 0,
their parity line printed (each script asserts its own parity against single-device training)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str) -> str:
    # the script asks for its own devices; the suite's compile-time flags (tests/conftest.py) stay
    flags = [w for w in os.environ.get("XLA_FLAGS", "").split() if not w.startswith("--xla_force_host_platform")]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow  # ~30 s: every pattern, its own compile each
def test_own_model_jax_example(measured):
    out = run_example("own_model_jax.py")
    assert out.rstrip().splitlines()[-1].startswith("ok: worst parameter difference"), out
    measured(out.rstrip().splitlines()[-1])


def test_own_model_torch_example(measured):
    """2 gloo ranks started by the script itself; ~5 s on 2 cores."""
    out = run_example("own_model_torch.py")
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("ok: worst parameter difference"), out
    patterns = {line.split()[0] for line in out.splitlines()[1:-1]}
    assert patterns == {"ddp", "zero1", "zero2", "fsdp", "tp", "pp", "cp"}, out
    measured(last)
