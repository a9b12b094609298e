"""Checkpoints across frameworks: a run saved by torch (DCP) continues in JAX (Orbax's twin reads the same
canonical names and orientation) and the other way round, and the joined losses are those of one
uninterrupted single-device run. ``compare.py checkpoint`` runs the whole 12 × 12 matrix (slow tier). A
model's weights checkpoint (a compose trainer's state: test_compose_torch / test_compose_jax carry one across)
refused where it does not map.
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


def test_weights_that_do_not_map_are_refused_in_one_line(tmp_path):
    """A model's weights checkpoint (torch_impl / jax_impl.checkpoint.save_weights, docs/checkpoint.md): one
    process writes it, the same model reads it back bit for bit, the NNX twin of a Linear reads the
    transposed kernel; another model, a shape that differs (an nnx.LinearGeneral kernel (D, H, dh) against
    a torch Linear), a flipped byte, and a run's resume (verify) are refused in one line."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    from jax_impl.checkpoint import load_weights as jax_load
    from shared.checkpoint import CheckpointError, verify
    from torch_impl.checkpoint import load_weights, save_weights

    def torch_model(out=4):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(5, 4, dtype=torch.float64),
                                   torch.nn.Linear(4, out, dtype=torch.float64))

    class Twin(nnx.Module):  # the NNX names of the same model: "0.embedding", "1.kernel", "1.bias"
        def __init__(self, general=False):
            r, f64 = nnx.Rngs(1), {"param_dtype": jnp.float64}
            lin = nnx.LinearGeneral(4, (2, 2), rngs=r, **f64) if general else nnx.Linear(4, 4, rngs=r, **f64)
            self.layers = nnx.List([nnx.Embed(5, 4, rngs=r, **f64), lin])

    model = torch_model()
    path = save_weights(str(tmp_path / "run"), 1, model.state_dict(), model)
    back = load_weights(path, torch_model())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), back.parameters(), strict=True))
    twin = Twin()
    with pytest.raises(CheckpointError, match=r"no 'layers.0.weight'"):  # the names must be the model's
        jax_load(path, twin)
    renamed = {f"layers.{k}": v for k, v in model.state_dict().items()}
    path = save_weights(str(tmp_path / "renamed"), 1, renamed, torch.nn.ModuleDict({"layers": model}))
    jax_load(path, twin)
    assert np.array_equal(np.asarray(twin.layers[1].kernel[...]), model[1].weight.detach().numpy().T)
    with pytest.raises(CheckpointError, match=r"layers.1.bias has shape \(4,\), this model needs \(2, 2\)"):
        jax_load(path, Twin(general=True))
    with pytest.raises(CheckpointError, match=r"1.weight has shape \(4, 4\), this model needs \(4, 3\)"):
        load_weights(str(tmp_path / "run" / "step_000001"), torch_model(out=3))
    with pytest.raises(CheckpointError, match="a model's weights .* not a run's training state"):
        verify(path)
    victim = os.path.join(path, "dcp", sorted(os.listdir(os.path.join(path, "dcp")))[0])
    with open(victim, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        load_weights(path, torch_model())
