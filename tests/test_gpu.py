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


# --- what the first lent GPU found and measured (docs/gpu.md), checked on CPU ----------------------------


def test_one_device_profile_takes_its_presets_links():
    """bench at world size 1 (a one-GPU node) times no collective: the profile's links are the preset's
    the device's name belongs to, and it says so; a device of no preset is refused."""
    from shared import efficiency

    bench = {"world_size": 1, "fits": [], "results": [],
             "compute": {"bfloat16": {"1024": 4e14, "4096": 8e14}, "float32": {"4096": 5e13}}}
    prof = efficiency.from_bench(bench, memcpy=3.8e12, memory=143771 * 2 ** 20, device_name="NVIDIA H200")
    assert prof["intra"] == efficiency.TABLES["h200"]["intra"] and prof["inter"] == efficiency.TABLES["h200"]["inter"]
    # the datasheet's peaks kept (MFU's reference), the fractions of them: the same rates
    assert prof["peaks"] == efficiency.TABLES["h200"]["peaks"] and "bf16 800.0 TFLOP/s" in prof["cite"]["peaks"]
    assert prof["matmul"] == ((1024, round(4e14 / 989e12, 4)), (4096, round(8e14 / 989e12, 4)))
    assert "h200 preset" in prof["cite"]["intra"]
    with pytest.raises(ValueError, match="matches no GPU preset"):
        efficiency.from_bench(bench, device_name="cpu")
    assert [efficiency.preset_of(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "Tesla T4")] == \
        ["h100", "a100-40gb", None]


def test_bench_profile_at_world_size_1_needs_a_gpu(capsys):
    from parallel_twins.bench import bench_main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the one-device profile is allowed")
    assert bench_main(["--world-size", "1", "--device", "cpu", "--profile", "p.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a GPU" in err and len(err.splitlines()) == 1, err


def test_the_measured_h200_profile_plans(tmp_path, capsys):
    """The profile the H200 wrote (docs/gpu/) loads and drives the planner."""
    import os

    from parallel_twins.planner import plan_main
    from shared import efficiency

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "gpu", "h200_profile.json")
    prof = efficiency.load(path)
    assert prof["peaks"] == efficiency.TABLES["h200"]["peaks"]  # a GPU of a preset keeps the datasheet's
    assert 0.6 < max(f for _, f in prof["matmul"]) < 0.8  # the training shapes at the power limit: 0.73
    assert plan_main(["--profile", path, "--gpus", "8", "--layers", "8", "--dim", "1024", "--heads", "8",
                      "--seq", "1024", "--global-batch", "16", "--top", "1"]) == 0


def test_bfloat16_runs_pass_the_resource_check():
    """The pre-check sized a bf16 run with NumPy, which has no bfloat16 (every --dtype bfloat16 run died)."""
    from parallel_twins import preflight
    from shared.config import Config

    pure, mixed = Config(dtype="bfloat16"), Config(dtype="bfloat16", precision="mixed")
    assert preflight.rank_bytes(pure) < preflight.rank_bytes(mixed) < preflight.rank_bytes(Config(dtype="float64"))


def test_adamw_loops_per_parameter():
    """CUDA's foreach AdamW refuses a DTensor plan's mix of DTensor and plain parameters (seen on an H200)."""
    from shared.config import Config
    from torch_impl.model import make_optimizer

    assert make_optimizer([torch.nn.Parameter(torch.ones(2))], Config()).defaults["foreach"] is False


def test_gpu_bench_grid_sustained_and_attention_run_at_toy_sizes_on_cpu(tmp_path):
    """What bench adds on a GPU (parallel_twins/bench.py), run here on CPU at toy sizes: the training-shaped
    GEMM grid (one side s, two large, in each of the three places), the sustained product's rates, SDPA's
    causal forward + backward per backend; then the profile built from them (shared/efficiency.py): the size
    table is the grid's mean per smallest side over the fastest rate, the attention table SDPA's default
    (flash) backend over it, and a loaded profile gives the planner both."""
    from parallel_twins import bench as b
    from shared import efficiency, plan

    cpu = torch.device("cpu")
    shapes = b._cuda_shapes(cpu, 2, sides=(16, 32), large=64, dtype="float32")
    assert set(shapes) == {"16x64x64", "64x16x64", "64x64x16", "32x64x64", "64x32x64", "64x64x32"}
    sus = b._cuda_sustained(cpu, seconds=0.05, n=32, dtype="float32")
    assert sus["first"] > 0 and sus["last"] > 0 and sus["seconds"] >= 0.05
    att = b._cuda_attention(cpu, lengths=(16, 32), heads=(2, 4), hd=8, backends=("MATH", "FLASH_ATTENTION"),
                            dtype="float32", reps=3)
    assert set(att) <= {"math", "flash"} and all(set(r) == {"2x16", "2x32", "4x16", "4x32"} for r in att.values())
    fits = [{"framework": "torch", "op": "all_gather", "alpha_s": 1e-5, "beta_bytes_per_s": 1e11}]
    bench = {"world_size": 2, "fits": fits, "results": [], "compute": {"bfloat16": {"64": 4e12}},
             "shapes": {"16x64x64": 1e12, "64x16x64": 2e12, "64x64x16": 3e12, "64x64x64": 5e12},
             "sustained": sus, "attention": {"flash": {"16x16": 1e12, "16x64": 2e12, "64x16": 2.5e12},
                                               "cudnn": {"16x64": 4e12}}}
    prof = efficiency.from_bench(bench, memcpy=1e12, device_name="a CPU")  # no GPU preset: its own peaks
    assert prof["peaks"]["bf16"] == 5e12  # the fastest rate measured, a shape's here
    assert prof["matmul"] == ((16, 0.4), (64, 1.0))  # (1 + 2 + 3) / 3 over 5
    assert prof["attention"] == ((16, 16, 0.2), (16, 64, 0.4), (64, 16, 0.5))  # flash (SDPA's default)
    path = tmp_path / "p.json"
    efficiency.save(str(path), prof)
    c = plan.Cluster.preset("h100", 8, profile=efficiency.load(str(path)))
    assert (c.flops, c.attention_at(8), c.attention_at(32), c.attention_at(1 << 20)) == (5e12, 0.2, 0.2, 0.4)
    # width: the widest measured at or below (sequences × heads on the rank), the narrowest below all
    assert (c.attention_at(16, 128), c.attention_at(16, 63), c.attention_at(16, 4)) == (0.5, 0.2, 0.2)
    gpu = efficiency.from_bench(bench, memcpy=1e12, device_name="NVIDIA H100 80GB HBM3")
    assert gpu["peaks"]["bf16"] == 989e12 and gpu["attention"][:2] == ((16, 16, round(1e12 / 989e12, 4)),
                                                                     (16, 64, round(2e12 / 989e12, 4)))
    assert plan.Cluster(8).attention_at(8192) == plan.ATTENTION_EFFICIENCY  # no table: the cited constant
    path.write_text(json.dumps(dict(json.loads(path.read_text()), attention=[[64, 0.5]])))  # an older profile:
    assert efficiency.load(str(path))["attention"] == ((16, 64, 0.5),)  # (T, fraction), 16 heads
    path.write_text(json.dumps(dict(json.loads(path.read_text()), attention=[[16, 64, 1.5]])))
    with pytest.raises(ValueError, match="attention fractions must lie in"):
        efficiency.load(str(path))
