"""Checkpoints across frameworks: a run saved by torch (DCP) continues in JAX (Orbax's twin reads the same
canonical names and orientation) and the other way round, and the joined losses are those of one
uninterrupted single-device run. ``compare.py checkpoint`` runs the whole 12 × 12 matrix (slow tier).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shared.checkpoint import Plan
from shared.config import Config
from shared.results import rel_err
from torch_impl.launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = Config(world_size=2, layers=4, dim=16, batch=16, steps=6, dtype="float64")
GPT = Config(world_size=2, model="transformer", layers=2, dim=16, heads=4, seq=8, vocab=32, batch=8, steps=6,
             dtype="float64")
# float64 on both sides: every op is IEEE double; the frameworks' AdamW and matmuls differ in rounding
# order only (~1e-16 per op), so 6 steps stay far inside 1e-12 (the bar).
TOL = 1e-12


def _torch(ctx, pattern, style, variant, cfg, plan):
    from torch_impl.harness import run_pattern

    out = run_pattern(ctx, pattern, [cfg], [(style, variant)], checkpoint=plan)
    return (out[0]["runs"][0][2], out[0]["reference"]) if ctx.rank == 0 else None


def _jax(pattern, style, variant, cfg, plan):
    from jax_impl.harness import run_pattern

    out = run_pattern(pattern, [cfg], [(style, variant)], device="cpu", checkpoint=plan)[0]
    return out["runs"][0][2], out["reference"]


def _torch_then_jax(tmp, cfg):
    """3 steps of torch under fsdp (saved), then 3 steps of JAX under tp from that checkpoint."""
    half = cfg.steps // 2
    first, _ = launch(_torch, 2, "fsdp", "explicit", "zero3", cfg.replace(steps=half),
                      Plan(dir=str(tmp / "t"), save_at=(half,)))[0]
    path = first.extra["checkpoints"][-1]["path"]
    second, ref = _jax("tp", "shard_map", "megatron", cfg, Plan(dir=str(tmp / "j"), load=path))
    return first, second, ref


def _jax_then_torch(tmp, cfg):
    """3 steps of JAX under dp (saved), then 3 steps of torch under pp from that checkpoint."""
    half = cfg.steps // 2
    first, _ = _jax("dp", "shard_map", "dp", cfg.replace(steps=half), Plan(dir=str(tmp / "j"), save_at=(half,)))
    path = first.extra["checkpoints"][-1]["path"]
    second, ref = launch(_torch, 2, "pp", "explicit", "1f1b", cfg, Plan(dir=str(tmp / "t"), load=path))[0]
    return first, second, ref


def _check(first, second, ref, cfg, measured, what):
    half = cfg.steps // 2
    assert second.start_step == half and len(second.losses) == cfg.steps - half, what
    joined = list(first.losses) + list(second.losses)
    err_loss, err_param = rel_err(joined, ref.losses), rel_err(second.params, ref.params)
    measured(f"{what}: 6 losses vs single device {err_loss:.1e}, final params {err_param:.1e}")
    assert err_loss <= TOL and err_param <= TOL, (what, err_loss, err_param)


@pytest.mark.parametrize("cfg", [MLP, pytest.param(GPT, marks=pytest.mark.slow)], ids=["mlp", "transformer"])
def test_torch_fsdp_then_jax_tp(tmp_path, cfg, measured):
    _check(*_torch_then_jax(tmp_path, cfg), cfg, measured, f"torch fsdp 3 → jax tp 3 ({cfg.model})")


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [MLP, GPT], ids=["mlp", "transformer"])
def test_jax_dp_then_torch_pp(tmp_path, cfg, measured):
    _check(*_jax_then_torch(tmp_path, cfg), cfg, measured, f"jax dp 3 → torch pp 3 ({cfg.model})")


@pytest.mark.slow
def test_the_matrix_is_all_ok(tmp_path, measured):
    """compare.py checkpoint: 12 savers × 12 loaders, every pair within its tolerance; JSON as the issue says."""
    out = tmp_path / "m.json"
    r = subprocess.run([sys.executable, "compare.py", "checkpoint", "--json", str(out), "--quiet"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert len(rows) == 144 and all(row["ok"] for row in rows)
    assert {row["save"]["framework"] for row in rows} == {"torch", "jax"}
    assert set(rows[0]) >= {"save", "load", "start_step", "losses", "max_rel_err", "ok"}
    assert set(rows[0]["save"]) >= {"framework", "pattern", "style", "variant"}
    xfw = [row["max_rel_err"] for row in rows if row["save"]["framework"] != row["load"]["framework"]]
    measured(f"checkpoint matrix: worst {max(row['max_rel_err'] for row in rows):.1e}, cross-framework worst "
             f"{max(xfw):.1e}; {data['cost']}")
