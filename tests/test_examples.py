"""The README's "Bring your own model" examples run as a user runs them: a fresh interpreter, exit 0,
their parity line printed (each script asserts its own parity against single-device training)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, *args: str) -> str:
    # the script asks for its own devices; the suite's compile-time flags (tests/conftest.py) stay
    flags = [w for w in os.environ.get("XLA_FLAGS", "").split() if not w.startswith("--xla_force_host_platform")]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)
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


# docs/compose.md's examples per model family (the Llama's: tests/test_compose_torch.py / _jax.py)
@pytest.mark.slow  # 4 gloo ranks importing transformers: ~60 s on 2 cores
def test_compose_qwen2_example(measured):
    """transformers' Qwen2 (biased q/k/v), its own tp plan (plan="auto"), V = 97 under explicit fsdp × tp:
    exit 0 (every loss and parameter within 1e-12 of one process; the state dict loaded back strict)."""
    out = run_example("compose_torch.py", "--family", "qwen2", "--vocab", "97", "--plan", "auto", "--layout",
                      "fsdp=2,tp=2", "--style", "explicit")
    assert "theory per axis == ledger on every rank (axes derived): True" in out, out
    measured(out.rstrip().splitlines()[-1])


@pytest.mark.slow  # 8 simulated devices, two compiles: ~60 s on 2 cores
def test_compose_gpt2_example(measured):
    """The GPT-2-style NNX model (biases, tied head, V = 97) under fsdp × tp × pp: exit 0 (1e-12)."""
    out = run_example("compose_jax.py", "--family", "gpt2", "--layout", "fsdp=2,tp=2,pp=2")
    assert "theory per axis == ledger (one SPMD program): True" in out, out
    measured(out.rstrip().splitlines()[-1])


# docs/compose.md's MoE family: a user's MoE model under compose's expert axis, at the default fsdp=2,ep=2,tp=2
def _moe_example(name, tmp_path, measured):
    out_json = tmp_path / "moe.json"
    out = run_example(name, "--json", str(out_json))
    import json

    r = json.loads(out_json.read_text())
    assert r["max_rel_loss_diff"] <= 1e-12 and r["max_abs_param_diff"] <= 1e-12, r
    assert r["theory_is_ledger"] is True, out
    assert r["losses"][-1] < r["losses"][0], r  # it trains
    measured(f"{name} {r['layout']}: loss rel {r['max_rel_loss_diff']:.1e}, params {r['max_abs_param_diff']:.1e}")


@pytest.mark.slow  # 8 gloo ranks: ~30 s on 2 cores
def test_moe_torch_example(tmp_path, measured):
    """examples/moe_torch.py: MoENet under fsdp × ep × tp (builtin) = one process to 1e-12; theory = ledger."""
    _moe_example("moe_torch.py", tmp_path, measured)


@pytest.mark.slow  # 8 simulated devices, two compiles: ~40 s on 2 cores
def test_moe_jax_example(tmp_path, measured):
    """examples/moe_jax.py: the NNX MoENet under fsdp × ep × tp (shard_map) = one device to 1e-12; theory = ledger."""
    _moe_example("moe_jax.py", tmp_path, measured)
