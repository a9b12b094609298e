"""The single-device path a one-GPU node takes (world size 1), on CPU always and on a GPU when
there is one (NCCL for torch, JAX on the GPU). NCCL cannot put two ranks on one GPU, so multi-rank
runs stay on CPU; these tests never require a GPU.

On a GPU machine:  PARALLEL_TWINS_TEST_JAX_PLATFORMS=cuda,cpu pytest -m gpu
"""

import json

import pytest
import torch

from parallel_twins import cli as compare


def _run(tmp_path, *argv):
    """Both models at small sizes (the transformer: 2 blocks, D=16, T=8, V=32)."""
    path = tmp_path / "out.json"
    code = compare.main(["--world-size", "1", "--steps", "3", "--layers", "2", "--dim", "16", "--batch", "8",
                         "--seq", "8", "--vocab", "32", "--microbatches", "2", "--quiet", "--json", str(path), *argv])
    data = json.loads(path.read_text())
    return code, data


@pytest.mark.slow  # slow tier (issue 37's budget): the one-rank paths, a whole compare.py run
def test_world_size_1_every_pattern_on_cpu(tmp_path):
    """The one-rank path of every pattern. torch on the transformer (its single-stage pipeline,
    1-way TP plan, FSDP units and one-rank ring take the same code paths as the MLP's, plus
    embeddings, norms and the loss); JAX's one-device meshes on the MLP (its transformer steps
    compile for seconds each; every JAX pattern body is model-generic and tested at N >= 2)."""
    code, data = _run(tmp_path, "--device", "cpu", "--model", "transformer", "--layers", "1", "--frameworks", "torch")
    assert code == 0, [r for r in data["runs"] if not r["ok"]] or data["errors"]
    assert {r["pattern"] for r in data["runs"]} == {"collectives", "dp", "fsdp", "tp", "pp", "cp", "ep"}
    assert {r["model"] for r in data["runs"] if r["pattern"] != "collectives"} == {"transformer"}
    code, data = _run(tmp_path, "--device", "cpu", "--model", "mlp", "--frameworks", "jax",
                      "--patterns", "collectives,dp,fsdp,tp,pp")
    assert code == 0, [r for r in data["runs"] if not r["ok"]] or data["errors"]
    assert {r["pattern"] for r in data["runs"]} == {"collectives", "dp", "fsdp", "tp", "pp"}


def _jax_sees_gpu() -> bool:
    import jax

    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_world_size_1_float32(tmp_path):
    # float32 on GPU with TF32 off (torch_impl.launch sets fp32_precision = "ieee"): float32 tolerance
    code, data = _run(tmp_path, "--device", "gpu", "--frameworks", "torch", "--dtype", "float32")
    assert code == 0, [r for r in data["runs"] if not r["ok"]] or data["errors"]


@pytest.mark.gpu
@pytest.mark.skipif(not _jax_sees_gpu(), reason="JAX sees no GPU (set PARALLEL_TWINS_TEST_JAX_PLATFORMS=cuda,cpu)")
def test_jax_on_gpu_float32(tmp_path):
    code, data = _run(tmp_path, "--device", "gpu", "--frameworks", "jax", "--dtype", "float32")
    assert code == 0, [r for r in data["runs"] if not r["ok"]] or data["errors"]
