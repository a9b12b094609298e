"""The recipe in compare.py (issue 34, item 5): --clip, --accumulate, --schedule, --decay-mask, --freeze and
the --recipe llama preset on the project's own models, under dp, fsdp, tp and cp in both frameworks. Every run
against the single-device run of the SAME recipe (float64: the default ≤ 1e-12 of shared.tolerances), the
ledger showing what the recipe costs (the global norm's all-reduce; one gradient reduction per optimizer
step under accumulation, not K), the JSON rows recording it, and every refusal in one line before anything
runs. The library pieces under it are tested on users' models in test_recipe_torch.py / test_recipe_jax.py."""

import json

import pytest

from parallel_twins import cli as compare
from shared.config import Config
from shared.recipe import check_freeze, lr_factors, refusal
from shared.schema import check as check_schema
from shared.theory import tp_comm_bytes

# clip 0.05 beside the preset: binding at every step at these sizes (the gradient's norm is ~1), so a wrong
# norm would move the parameters; 2 micro-batches per rank and step.
TINY = ["--model", "transformer", "--world-size", "2", "--layers", "2", "--dim", "8", "--heads", "2", "--seq", "4",
        "--vocab", "8", "--batch", "8", "--steps", "3", "--patterns", "dp,fsdp,tp,cp", "--recipe", "llama",
        "--clip", "0.05", "--accumulate", "2", "--quiet"]
RECIPE = {"clip": 0.05, "accumulate": 2, "schedule": "warmup-cosine", "decay_mask": True, "freeze": []}
TENSORS = 16  # the tiny transformer's parameter tensors (L=2): wte, wpe, 6 per block, normf, head
UNITS = 11  # its >= 2-D ones (ZeRO's units); the other 5 are the norm gains (the replicated vectors)


def _rows(tmp_path, framework, extra=()):
    out = tmp_path / f"{framework}.json"
    assert compare.main([*TINY, "--frameworks", framework, *extra, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert check_schema(data) == []
    for r in data["runs"]:
        assert r["ok"] and r["recipe"] == RECIPE, r
    assert data["configs"]["transformer"]["accumulate"] == 2
    return {(r["style"], r["variant"]): r for r in data["runs"]}


def test_recipe_torch_dp_fsdp_tp(tmp_path):
    rows = _rows(tmp_path, "torch")
    assert len(rows) == 14  # dp 4, fsdp 3, tp 4, cp 3 (context_parallel needs CUDA)
    b = 8  # float64
    # accumulation: ONE reduction per optimizer step (no_sync / one all-reduce after the last backward)
    assert rows["explicit", "naive"]["comm"]["all_reduce"]["count"] == TENSORS  # one per tensor, once, not K×
    assert rows["explicit", "bucketed"]["comm"]["all_reduce"]["count"] == 1
    assert rows["builtin", "ddp"]["comm"]["all_reduce"]["count"] == 1
    # clipping where the gradient is whole on every rank: torch's own norm, no communication
    assert rows["builtin", "ddp"]["comm_bytes"] == rows["explicit", "naive"]["comm_bytes"]
    # ZeRO-1: one flat buffer per param group (the decay mask: matrices, vectors), the norm's scalar all-reduce
    zero1 = rows["explicit", "zero1"]["comm"]
    assert zero1["reduce_scatter"]["count"] == 2 and zero1["all_reduce"] == {"count": 1, "bytes": b}
    zero2 = rows["explicit", "zero2"]["comm"]  # no_sync: every unit reduce-scattered once; vectors + the norm
    assert zero2["reduce_scatter"]["count"] == UNITS and zero2["all_reduce"]["count"] == 2
    zero3 = rows["explicit", "zero3"]["comm"]  # every micro-batch gathers again, reduce-scatters once
    assert zero3["reduce_scatter"]["count"] == UNITS
    fsdp2 = rows["builtin", "fsdp2"]["comm"]  # set_requires_gradient_sync: one reduce-scatter per group
    assert fsdp2["reduce_scatter"]["count"] == 3  # two blocks and the root
    assert fsdp2["all_reduce"] == {"count": 1, "bytes": TENSORS * b}  # torch's DTensor norm: the stacked norms
    for variant in ("ring", "ring_zigzag", "ulysses"):  # cp: one bucket all-reduce per step; the norm is local
        assert rows["explicit", variant]["comm"]["all_reduce"]["count"] == 1
    # tp: K micro-batches move the same activation bytes (B/K rows each); the norm: explicit one scalar
    # all-reduce (split squares summed over tp, replicated ones once), DTensor torch's norm per tensor
    tiny = Config(model="transformer", world_size=2, layers=2, dim=8, heads=2, seq=4, vocab=8, batch=8)
    for style, variant, norm in (("explicit", "megatron", b), ("builtin", "dtensor", TENSORS * b),
                                 ("explicit", "megatron_sp", b), ("builtin", "dtensor_sp", TENSORS * b)):
        assert rows[style, variant]["comm_bytes"] == tp_comm_bytes(tiny, variant) + norm, variant
    for r in rows.values():
        assert r["comm_bytes"] == r["comm_bytes_theory"], r  # shared/theory prices the recipe


def test_recipe_jax_dp_fsdp_tp(tmp_path, capsys):
    """shard_map only in the default tier (hand-written collectives; one compile per variant): jit and typed
    run in the slow sweep."""
    rows = _rows(tmp_path, "jax", ["--styles", "shard_map"])
    assert ("shard_map", "zero1") not in rows  # a mask on one flat vector: left out, said before the runs
    assert "jax shard_map/zero1 left out" in capsys.readouterr().err
    assert set(rows) == {("shard_map", v) for v in ("dp", "zero2", "zero3", "megatron", "megatron_sp", "ring",
                                                    "ring_zigzag", "ulysses")}
    b, phi = 8, Config(model="transformer", layers=2, dim=8, heads=2, seq=4, vocab=8).n_params
    # the K micro-batches' gradients summed, then ONE reduction; the whole gradient's norm is local (dp)
    assert rows["shard_map", "dp"]["comm"] == {"all_reduce": {"count": 1, "bytes": phi * b}}
    zero2 = rows["shard_map", "zero2"]["comm"]
    assert zero2["reduce_scatter"]["count"] == UNITS and zero2["all_reduce"]["count"] == 1  # the norm rides along
    zero3 = rows["shard_map", "zero3"]["comm"]  # each micro-batch's gathers transpose to reduce-scatters: K×
    assert zero3["reduce_scatter"]["count"] == 2 * UNITS
    # tp: the norm's squares, one scalar per split leaf (XLA's); megatron_sp: the gains' and wpe's partial
    # gradients all-reduced once per micro-batch (K shard_map calls)
    tiny = Config(model="transformer", world_size=2, layers=2, dim=8, heads=2, seq=4, vocab=8, batch=8)
    split = 2 + 4 * 2  # wte, head, 4 matrices per block
    assert rows["shard_map", "megatron"]["comm_bytes"] == tp_comm_bytes(tiny, "megatron") + split * b
    assert rows["shard_map", "megatron_sp"]["comm_bytes"] == tp_comm_bytes(tiny, "megatron_sp") + split * b + \
        (5 * 8 + 4 * 8) * b  # (2L+1)·D gains + T·D wpe, once more
    for (_, variant), r in rows.items():
        if variant in ("ring", "ring_zigzag", "ulysses"):  # each micro-batch's shard_map psums its gradient:
            assert r["comm"]["all_reduce"]["bytes"] == 2 * phi * b  # XLA fuses them into one op of K·Φ·b
            assert r["comm_bytes_theory"] is None  # not modelled
        else:
            assert r["comm_bytes"] == r["comm_bytes_theory"], r


@pytest.mark.parametrize("argv, message", [
    (["--accumulate", "3", "--patterns", "ep", "--model", "transformer", "--experts", "2", "--batch", "8"],
     "ep (transformer): batch=8 is not divisible by ranks_accumulate=6"),
    (["--accumulate", "3", "--patterns", "tp", "--model", "transformer", "--batch", "8"], "tp (transformer): batch=8"),
    (["--accumulate", "3", "--patterns", "cp", "--model", "transformer", "--batch", "8"], "cp (transformer): batch=8"),
    (["--clip", "1", "--patterns", "ep", "--model", "transformer", "--experts", "2", "--precision", "mixed",
      "--dtype", "float16"], "ep: --precision mixed --dtype float16 is built"),
    (["--accumulate", "3", "--patterns", "pp", "--model", "mlp", "--batch", "16", "--microbatches", "2"],
     "pp: batch=16 is not divisible by pipeline_parts=6"),
    (["--freeze", "nothing.*", "--patterns", "dp", "--model", "mlp"], "freeze: 'nothing.*' matches no parameter"),
    (["--freeze", "layers.*", "--patterns", "dp", "--model", "mlp"], "freezes every parameter"),
    (["--accumulate", "3", "--patterns", "dp", "--model", "mlp", "--batch", "32"],  # given: kept (default: 36)
     "dp: batch=32 is not divisible by ranks_accumulate"),
    (["--clip", "0", "--patterns", "dp"], "clip must be a finite max norm > 0"),
    (["--recipe", "llama", "--precision", "mixed", "--dtype", "bfloat16", "--patterns", "dp"], "--precision mixed"),
    (["--recipe", "llama", "--patterns", "dp", "--checkpoint-dir", "/tmp"], "not built for checkpoints"),
])
def test_recipe_refusals_in_one_line(argv, message, capsys):
    assert compare.main(argv + ["--world-size", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("compare.py: error: ") and message in err, err


def test_recipe_pieces():
    """The schedule table both frameworks read, the preset, the refusals."""
    f = lr_factors("warmup-cosine", 8)  # warm-up over 2 steps, then a cosine to 10%
    assert f[:2] == [1 / 3, 2 / 3] and f[2] == 1.0 and f[1] < f[2] > f[3] > f[-1] > 0.1
    assert lr_factors("constant", 3) == [1.0] * 3
    args = compare.build_parser().parse_args(["--recipe", "llama", "--clip", "0.5", "--freeze", "wte.*, head.*"])
    cfg = Config(model="transformer", **compare.recipe_fields(args))
    assert (cfg.clip, cfg.schedule, cfg.decay_mask, cfg.freeze) == (0.5, "warmup-cosine", True, ("wte.*", "head.*"))
    check_freeze(cfg)  # both globs name parameters
    assert refusal("jax", "fsdp", "shard_map", "zero3", cfg) and not refusal("jax", "fsdp", "jit", "zero3", cfg)
    assert not refusal("torch", "dp", "explicit", "zero1", cfg)


@pytest.mark.slow
def test_recipe_sweep_both_models_frozen(tmp_path):
    """The wider sweep: every style, parts of each model frozen (2 ranks), both frameworks, and
    cross-framework agreement of the two recipe references: the transformer's dp, fsdp and tp (tp: frozen
    gains under DTensor's SequenceParallel, frozen entries under JAX's shard_map/megatron dict step; its
    cp: the default tier's TINY runs), the MLP's dp (its fsdp units are the transformer's kind; issue 37's budget)."""
    for model, freeze, patterns, world in (("transformer", "wte.*,blocks.0.*", "dp,fsdp,tp", "2"),
                                           ("mlp", "layers.0.*", "dp", "2")):
        out = tmp_path / f"{model}.json"
        argv = ["--model", model, "--world-size", world, "--patterns", patterns, "--steps", "3", "--layers", "2",
                "--dim", "16", "--heads", "4", "--seq", "8", "--vocab", "16", "--batch", "16", "--recipe", "llama",
                "--clip", "0.05", "--accumulate", "2", "--freeze", freeze, "--quiet", "--json", str(out)]
        assert compare.main(argv) == 0
        data = json.loads(out.read_text())
        assert data["runs"] and all(r["ok"] and r["xfw_ok"] for r in data["runs"])
        assert all(x["ok"] for x in data["cross_framework"])
        for r in data["runs"]:  # --freeze: the bytes are not modelled where XLA / FSDP / tp's f drop frozen reductions
            if r["framework"] == "jax" or r["variant"] in ("zero3", "fsdp2") or r["pattern"] in ("tp", "cp"):
                assert r["comm_bytes_theory"] is None, r
            elif r["style"] == "explicit":
                assert r["comm_bytes"] == r["comm_bytes_theory"], r


def test_mesh_recipe_config_and_theory():
    """The recipe under --mesh (issue 48): --accumulate K is K·M micro-batches (K parts without pp), --clip one
    world all-reduce of one scalar, --precision mixed with the recipe built for the mesh only, float16 refused."""
    from shared.theory import mesh_comm_torch

    cfg = Config(world_size=4, model="transformer", layers=2, dim=16, heads=4, seq=8, vocab=16, batch=16,
                 microbatches=2, mesh=(("tp", 2), ("pp", 2)), accumulate=2, clip=1.0)
    assert cfg.pipeline_microbatches == 4 and cfg.check("mesh") is cfg
    assert cfg.replace(mesh=(("dp", 2), ("tp", 2))).pipeline_microbatches == 2  # no pp: the K parts
    plain = mesh_comm_torch(cfg.replace(clip=None), "explicit", 0)
    assert mesh_comm_torch(cfg, "explicit", 0)["world"] == {"all_reduce": (1, 8)} and "world" not in plain
    mixed = cfg.replace(dtype="bfloat16", precision="mixed")
    assert mixed.check("mesh", "torch") is mixed and mixed.check("mesh", "jax") is mixed
    with pytest.raises(ValueError, match="dp: the recipe flags .* --precision mixed are built for mesh, pp, ep only"):
        mixed.replace(world_size=2, mesh=()).check("dp")
    with pytest.raises(ValueError, match=r"mesh: --precision mixed --dtype float16 is built"):
        mixed.replace(dtype="float16").check("mesh")


@pytest.mark.slow  # 4 gloo ranks and 4 simulated devices, tp × pp: ~2-4 min on 2 cores
def test_mesh_recipe_mixed_both_frameworks(tmp_path):
    """--mesh tp=2,pp=2 with every recipe flag and bf16 mixed precision: every style (typed refuses) within
    its measured floor, both frameworks; per-axis ledger = theory where a formula exists (torch: --freeze
    has none; JAX: --clip and mixed have none)."""
    out = tmp_path / "mesh.json"
    argv = ["--model", "transformer", "--mesh", "tp=2,pp=2", "--layers", "2", "--dim", "16", "--heads", "4",
            "--seq", "8", "--vocab", "16", "--batch", "16", "--microbatches", "2", "--steps", "3", "--clip", "1.0",
            "--accumulate", "2", "--precision", "mixed", "--dtype", "bfloat16", "--schedule", "warmup-cosine",
            "--decay-mask", "--freeze", "wpe.*", "--quiet", "--json", str(out)]
    assert compare.main(argv) == 0
    data = json.loads(out.read_text())
    assert {(r["framework"], r["style"]) for r in data["runs"]} == {
        ("torch", "explicit"), ("torch", "builtin"), ("jax", "shard_map"), ("jax", "jit")}
    assert all(r["ok"] for r in data["runs"]) and all(x["ok"] for x in data["cross_framework"])


@pytest.mark.slow  # 2 gloo ranks / 2 simulated devices, every pp variant of both frameworks: ~3-7 min on 2 cores
def test_pp_recipe_both_frameworks(tmp_path):
    """--patterns pp with every recipe flag (issue 48): accumulation as K·M micro-batches of one schedule, the
    stages' global clip (binding), frozen wpe, the decay mask on the stacked tree; float64: every variant of
    both frameworks within the default tolerance of the same recipe on one device, and across frameworks."""
    out = tmp_path / "pp.json"
    argv = ["--model", "transformer", "--patterns", "pp", "--world-size", "2", "--layers", "2", "--dim", "16",
            "--heads", "4", "--seq", "8", "--vocab", "16", "--batch", "16", "--microbatches", "2", "--steps", "3",
            "--clip", "0.05", "--accumulate", "2", "--schedule", "warmup-cosine", "--decay-mask", "--freeze", "wpe.*",
            "--quiet", "--json", str(out)]
    assert compare.main(argv) == 0
    data = json.loads(out.read_text())
    assert len(data["runs"]) >= 10 and all(r["ok"] for r in data["runs"]), [r["variant"] for r in data["runs"]]
    assert all(x["ok"] for x in data["cross_framework"])
