"""The layout planner (shared/plan.py, ``compare.py plan``). Its formulas are shared.theory's — one form:
``plan.comm`` IS ``theory.mesh.comm``, the function the tiny runs' ledgers are checked against per rank
and per axis (tests/test_mesh.py, tests/test_ep.py, which also check the plan against their runs
directly). Here: the adapters from a runnable Config describe every tiny layout, the formulas' own
invariants on all of them, published figures at full size, and a bounded search (its seconds are
reported)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from shared import efficiency, plan, schedule, theory
from shared.config import Config

TINY = ((4, 16, 4, 16, 32, 8), (4, 32, 4, 16, 64, 16))  # L, D, H, T, V, B


def tiny_mesh_configs():
    """Every mesh layout (data axis dp|fsdp|none × pp × cp × tp, sizes 1–4) Config.check("mesh") accepts
    on 1–8 ranks, at two tiny sizes and M = 2, 4."""
    for ws, data, pp, cp, tp, m, sizes in itertools.product(
            (1, 2, 4, 8), ("dp", "fsdp", None), (1, 2, 4), (1, 2, 4), (1, 2, 4), (2, 4), TINY):
        if ws % (pp * cp * tp):
            continue
        rest = ws // (pp * cp * tp)
        mesh = tuple((a, n) for a, n in ((data, rest), ("pp", pp), ("cp", cp), ("tp", tp)) if a and n > 1)
        if (data is None and rest > 1) or not mesh:
            continue
        L, D, H, T, V, B = sizes
        try:
            yield Config(world_size=ws, model="transformer", layers=L, dim=D, heads=H, seq=T, vocab=V, batch=B,
                         microbatches=m, mesh=mesh).check("mesh")
        except ValueError:
            continue


def test_the_one_form_on_every_tiny_mesh_layout():
    """Every layout the mesh pattern accepts on 1–8 ranks: Model/Layout.from_config describe it (GPUs, Φ),
    the torch styles' ledger formula is the planner's own function evaluated at the run's sizes, and it
    keeps its invariants: every send has its receive on the pp and cp axes, and the state of a stage
    sums, over the gradient group's shards, to the stage's parameters."""
    seen = 0
    for cfg in tiny_mesh_configs():
        model, lay = plan.Model.from_config(cfg), plan.Layout.from_config(cfg)
        assert lay.gpus == cfg.world_size and model.params == cfg.n_params, cfg.mesh_name
        for style in ("explicit", "builtin"):
            for rank in range(cfg.world_size):
                s = theory.mesh_coords(cfg, rank).get("pp", 0)
                view = theory.mesh_comm_torch(cfg, style, rank)
                assert view == plan.comm(model, lay, s, cfg.batch, cfg.bytes_per_element, style)
                for axis in ("pp", "cp"):
                    assert view.get(axis, {}).get("send") == view.get(axis, {}).get("recv"), (cfg.mesh_name, axis)
                held = theory.mesh_state_bytes_torch(cfg, style, rank)["params"] // cfg.bytes_per_element
                stage = theory.mesh_stage_param_count(cfg, s)
                g = cfg.data_size * cfg.axis("cp") if cfg.data_axis == "fsdp" else 1
                assert held * g >= stage >= held, (cfg.mesh_name, style, rank, held, stage)  # ZeRO-3: 1/g (+ gains)
                seen += 1
    assert seen > 3000  # 1-, 2- and 3-D layouts, both data axes, both styles, every rank


@pytest.mark.parametrize("ws,experts,topk", [(2, 4, 1), (2, 4, 2), (4, 4, 2), (4, 8, 2)])
def test_plan_equals_theory_for_ep(ws, experts, topk):
    """ep: the plan's routing-independent ops and its balanced-routing all-to-alls equal
    theory.ep_comm_torch evaluated on a perfectly balanced routing (the runs' all-to-all bytes follow
    their routing: tests/test_ep.py); the state is mesh.state on the ep layout (one form)."""
    cfg = Config(world_size=ws, model="transformer", layers=2, dim=16, heads=4, seq=8, vocab=32, batch=4,
                 experts=experts, topk=topk).check("ep")
    per = cfg.seq * topk // experts
    balanced = [[[per] * experts for _ in range(cfg.batch)] for _ in range(cfg.layers)]
    model, lay = plan.Model.from_config(cfg), plan.Layout.from_config(cfg, "ep")
    predicted = plan.comm(model, lay, 0, cfg.batch, cfg.bytes_per_element, "explicit")
    assert set(predicted) == {"ep", "dp"}  # the dispatch on ep, the replicated gradients on the data axis
    flat = {op: v for ops in predicted.values() for op, v in ops.items()}
    for rank in range(ws):
        assert flat == theory.ep_comm_torch(cfg, "explicit", balanced, rank)
    assert plan.state(model, lay, 0, cfg.bytes_per_element, "explicit", "pure") == theory.ep_state_bytes_torch(cfg)


def test_bubble_and_in_flight_equal_the_schedule_simulator():
    """The plan's closed forms against shared.schedule (the simulator the executed schedules are checked
    against): 1F1B and interleaved bubbles, and the chunks each stage holds at its peak."""
    for p, m, v in itertools.product((1, 2, 3, 4), (1, 2, 4, 6, 8, 12), (1, 2, 3)):
        if v > 1 and (p == 1 or m % p):
            continue
        name = "1f1b" if v == 1 else "interleaved"
        lay = plan.Layout(pp=p, microbatches=m, virtual=v)
        assert lay.bubble == pytest.approx(schedule.simulate(name, p, m, v, f=1, b=2, w=0).bubble)
        peaks = schedule.simulate(name, p, m, v).peak_in_flight
        assert [plan.in_flight(lay, s) for s in range(p)] == peaks, (p, m, v)


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2020 (ZeRO, arXiv:1910.02054) Figure 1: Ψ = 7.5B, N_d = 64, K = 12 (mixed-precision
    Adam, 16Ψ bytes unsharded): 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device."""
    psi = 7.5e9
    published = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for zero, gb in published.items():
        total = sum(plan.zero_state(psi, 64, zero, "mixed").values()) / 1e9
        assert total == pytest.approx(gb, abs=0.05), (zero, total)  # the figure rounds to 0.1 GB


def test_mixed_precision_adam_is_16_bytes_per_parameter():
    """16Φ (2 + 2 + 12) for the whole model on one GPU; the Ultrascale Playbook's 70B: 1.12 TB unsharded."""
    model = plan.Model(80, 8192, 64, 128256, 8192)
    one = plan.state(model, plan.Layout(), 0, 2, "builtin", "mixed")
    assert sum(one.values()) == 16 * model.params
    assert 16 * plan.Model(126, 16384, 128, 128256, 8192).params / 1e12 == pytest.approx(6.56, abs=0.01)  # 405B-class


def test_activations_match_korthikanti_without_dropout():
    """Korthikanti et al. 2022 (arXiv:2205.05198) §4.1–4.2: per layer s·b·h·(34/t) bytes with tp + sp (b = 2
    bytes, MLP 4h, flash-style attention without the 5as/h term). This model has no dropout: their 34 less
    the attention and MLP dropout masks (1 byte each) is 32, i.e. 16·h/t elements, + the log-sum-exp."""
    model = plan.Model(4, 1024, 16, 1000, 512)
    for t in (1, 2, 8):
        lay = plan.Layout(tp=t, sp=t > 1)
        assert plan.activation_elements(model, lay, "none") == pytest.approx(16 * 1024 / t + 2 * 16 / t)
        assert plan.activation_elements(model, lay, "full") == 1024 / t  # the block's input only
    no_sp = plan.activation_elements(model, plan.Layout(tp=8), "none")
    assert no_sp == pytest.approx(4 * 1024 + 12 * 1024 / 8 + 2 * 16 / 8)  # their 10 + 24/t, less the masks
    math = plan.activation_elements(model, plan.Layout(tp=8, sp=True), "none", attention="math")
    assert math - plan.activation_elements(model, plan.Layout(tp=8, sp=True), "selective", "math") == 16 * 512 / 8


def test_activations_with_dropout_are_korthikanti_exactly():
    """With dropout (GPT as Korthikanti et al. 2022 count it, arXiv:2205.05198 §4.1, eq. 1–2): per layer
    s·b·h·(34 + 5·a·s/h) bytes with math attention and no parallelism; 10 + 24/t + 5as/(ht) with tp;
    34/t + 5as/(ht) with tp and sp. 2-byte elements: bytes = 2 × elements."""
    h, a, s = 2048, 16, 1024
    model = plan.Model(4, h, a, 1000, s, dropout=True)
    for t, sp, small in ((1, False, 34), (8, False, 10 + 24 / 8), (8, True, 34 / 8)):
        got = 2 * plan.activation_elements(model, plan.Layout(tp=t, sp=sp), "none", attention="math")
        assert got == pytest.approx(small * h + 5 * a * s / t), (t, sp)
    flash = 2 * plan.activation_elements(model, plan.Layout(tp=8, sp=True), "none")
    assert flash == pytest.approx(34 * h / 8 + 2 * 2 * a / 8)  # + the log-sum-exp; no a·s term


def test_activations_against_the_measured_formula_of_this_implementation():
    """shared.theory.block_saved_elements equals what torch saves here (tests/test_recompute.py measures it);
    the plan assumes fused kernels at scale. The difference is exactly torch's composite RMSNorm, which
    saves x·rsqrt (D) and rsqrt (1) besides its input in each of a block's two norms, and the log-sum-exp,
    which the plan counts as fp32 (2 elements of 2 bytes per head) and torch stores in the run's dtype; the
    math kernel saves the softmax instead (no log-sum-exp), selective recomputation neither."""
    cfg = Config(model="transformer", layers=2, dim=16, heads=4, seq=8, vocab=32, batch=4)
    model = plan.Model.from_config(cfg)
    for policy in ("none", "selective"):
        for attention in ("flash", "math"):
            fused = plan.activation_elements(model, plan.Layout(), policy, attention)
            lse = cfg.heads if (policy, attention) == ("none", "flash") else 0
            assert fused + 2 * (cfg.dim + 1) - lse == theory.block_saved_elements(cfg, policy, attention), \
                (policy, attention)
    assert plan.activation_elements(model, plan.Layout(), "full") == theory.block_saved_elements(cfg, "full")


def test_llama3_405b_published_layout_fits():
    """Llama 3 (Grattafiori et al. 2024, arXiv:2407.21783) Table 4: 16,384 H100 80 GB, TP 8, CP 1, PP 16,
    DP 128 (FSDP: optimizer and gradients sharded, the weights not resharded after the forward, §3.3.2:
    the stage's gathered weights stay while its micro-batches are in flight), sequence 8,192, 16 sequences
    per DP rank per step (M = 16 micro-batches of one sequence), bf16; the paper's shape (GQA, SwiGLU,
    126 layers with one fewer on the first and the last stage), on the H100 as it reports its memory
    (79.6 GiB, less the 10 % headroom). It fits without recomputation; ZeRO-1 would not (the bf16 weights and
    gradients of a stage, unsharded, tip it over)."""
    from shared.published import preset

    model = preset("llama3-405b")
    cluster = plan.Cluster.preset("h100", 16384)
    lay = plan.Layout(dp=128, tp=8, pp=16, zero=3, microbatches=16, sp=True, trim=1)
    fsdp = plan.predict(model, lay, cluster, 2048)
    assert fsdp.fits, fsdp.reason
    weights = {s: plan.stage_params(model, lay, s) for s in (0, 1, 15)}  # the fullest: a middle stage's 8 blocks
    assert fsdp.memory["buffers"] in {2 * (w["units"] + w["vectors"]) for w in weights.values()}  # gathered, bf16
    assert fsdp.memory["activations"] > 0.75 * fsdp.memory["total"]  # activations dominate once states are sharded
    zero1 = plan.predict(model, replace(lay, zero=1), cluster, 2048)
    assert not zero1.fits
    assert 0.15 < fsdp.mfu < 0.6  # the paper: 38–43 % (interleaved schedule; here 1F1B's 48 % bubble)


@pytest.mark.parametrize("name,model,gpus,batch", [
    ("70B", plan.Model(80, 8192, 64, 128256, 8192), 256, 1024),
    ("405B", plan.Model(126, 16384, 128, 128256, 8192), 16384, 2048),
    ("MoE", plan.Model(32, 4096, 32, 32000, 4096, 4, 8, 2), 1024, 2048),
])
def test_full_scale_plans_are_fast_and_follow_the_rules_of_thumb(name, model, gpus, batch, measured):
    """Fast: the seconds are the machine's (reported, "measured, not asserted"; 0.05–1.6 s on a loaded
    2-core CPU); what keeps them few on any machine is the size of the search, asserted: the layouts
    the planner evaluates (70B on 256 GPUs: 9,208 measured) stay within 50,000."""
    t0 = time.perf_counter()
    fit, over = plan.plan(model, plan.Cluster(gpus), batch)
    seconds = time.perf_counter() - t0
    measured(f"plan {name} on {gpus} GPUs: {len(fit) + len(over)} layouts evaluated in {seconds:.2f} s")
    assert len(fit) + len(over) <= 50_000
    assert fit and over
    best = fit[0].layout
    assert best.tp <= 8  # tensor parallelism stays inside a node (NVLink)
    assert all(p.memory["total"] <= plan.Cluster(gpus).usable for p in fit)
    assert all(p.reason.startswith("needs") for p in over)
    if model.moe:
        assert best.ep > 1  # the experts are sharded


def test_calibrate_reads_the_bench_fits_and_matmul_rate():
    """plan --calibrate: α and β per op from compare.py bench's fits (β: algbw × the bus factor at the bench's
    world size), the median matmul rate per rank as the compute rate; then an op costs α + S·factor/β."""
    bench = {"world_size": 4, "compute": {"float64": {"32": 1e9, "64": 3e9, "128": 4e9}},
             "fits": [{"framework": "torch", "op": "all_reduce", "alpha_s": 1e-4, "beta_bytes_per_s": 2e8},
                      {"framework": "torch", "op": "all_gather", "alpha_s": 2e-4, "beta_bytes_per_s": float("inf")},
                      {"framework": "jax", "op": "all_reduce", "alpha_s": 9.0, "beta_bytes_per_s": 1.0}]}
    cluster = plan.calibrated(plan.Cluster(4), bench, "float64")
    assert cluster.flops == 3e9 and cluster.efficiency == 1.0
    assert cluster.intra == cluster.inter and cluster.intra.per_op == {"all_reduce": (1e-4, 2e8 * 1.5)}
    assert cluster.intra.time("all_reduce", 2, 3e6, 4) == pytest.approx(2e-4 + 3e6 * 1.5 / 3e8)
    with pytest.raises(ValueError, match="no torch"):
        plan.calibrated(plan.Cluster(4), {"world_size": 4, "fits": []})
    # --matmul shapes: the machine's own size table, each size's rate over the fastest, under that rate
    shaped = plan.calibrated(plan.Cluster(4), bench, "float64", shapes=True)
    assert shaped.matmul == "shapes" and shaped.flops == 4e9 and shaped.efficiency == 1.0
    assert shaped.size_table == ((32, 0.25), (64, 0.75), (128, 1.0))
    assert plan.matmul_seconds(64, 64, 64, replace(shaped, hbm=1e30)) == pytest.approx(2 * 64 ** 3 / 3e9)


def test_cli_plan_prints_ranked_layouts_and_json(tmp_path):
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "compare.py", "plan", "--layers", "32", "--dim", "4096", "--heads", "32",
                          "--vocab", "32000", "--seq", "4096", "--global-batch", "512", "--gpus", "64",
                          "--gpu-memory", "80GiB", "--json", str(out)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "fastest layouts that fit" in run.stdout and "do not fit" in run.stdout
    data = json.loads(out.read_text())
    assert data["n_fit"] > 0 and data["fit"][0]["fits"] and data["fit"][0]["memory"]["total"] <= 0.9 * 80 * 2 ** 30


@pytest.mark.parametrize("args,message", [
    (["--dim", "100", "--heads", "3"], "not divisible"),
    (["--gpu-memory", "lots"], "write a size"),
    (["--layout", "zz=2"], "unknown axis"),
    (["--experts", "1"], "experts"),
    (["--efficiency", "2"], "--efficiency"),
])
def test_cli_plan_refuses_bad_input(args, message, capsys):
    from parallel_twins.planner import plan_main  # in process: compare.py dispatches "plan" to it before anything else

    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


# --- GPU presets, the shape-dependent matmul time, pins, GQA / SwiGLU / RoPE, published runs --------------


def test_gpu_presets_carry_the_datasheet_figures():
    """NVIDIA datasheets (cited in shared/plan.py): dense BF16 peak, HBM capacity and bandwidth, NVLink each
    way (half the bidirectional figure), one 200 Gb/s HDR (A100) / 400 Gb/s NDR (H100, H200) port per GPU."""
    expect = {"a100-40gb": (312e12, 40e9, 1555e9, 300e9, 25e9), "a100-80gb": (312e12, 80e9, 2039e9, 300e9, 25e9),
              "h100": (989e12, 80e9, 3.35e12, 450e9, 50e9), "h200": (989e12, 141e9, 4.8e12, 450e9, 50e9)}
    for name, (flops, memory, hbm, nvlink, net) in expect.items():
        g = plan.gpu(name.upper())
        got = (g["flops"], g["memory"], g["hbm"], g["intra"].beta, g["inter"].beta)
        assert got == (flops, memory, hbm, nvlink, net)
        # the preset cluster: what the GPU achieves (shared/efficiency.py, each cited): memory as the device
        # reports it (H100: 81559 MiB = 79.6 GiB), HBM copies at 0.9 of the datasheet, nccl-tests' busbw
        # (H100 ring 370 GB/s, NVLS all-reduce 480, NDR 47 per NIC) below the line rates
        c = plan.Cluster.preset(name, 64)
        t = efficiency.TABLES[name]
        assert (c.flops, c.memory, c.hbm) == (flops, t["memory"], t["hbm_copy"]) and c.hbm < hbm
        assert c.intra.beta < nvlink and c.inter.beta < net and c.efficiency == max(f for _, f in t["matmul"])
        cited = {"peaks", "memory", "matmul", "hbm_copy", "intra", "inter", "overlap_cost"}
        assert cited <= set(efficiency.citations(name)) <= cited | {"attention"}  # attention: where measured
    assert plan.Cluster.preset("h100", 8).memory / plan.GiB == pytest.approx(79.65, abs=0.01)
    assert plan.Cluster.preset("h100", 8, "float8").flops == 1979e12
    assert plan.Cluster.preset("a100", 8, "float32").flops == 156e12  # TF32
    with pytest.raises(ValueError, match="no float8 peak"):
        plan.Cluster.preset("a100", 8, "float8")
    assert plan.gpu("a100") is plan.GPUS["a100-80gb"]
    with pytest.raises(ValueError, match="known: a100-40gb, a100-80gb, h100, h200"):
        plan.gpu("b200")


def test_matmul_time_is_a_roofline_with_a_size_table():
    """Monotone: the size factor never falls as the smallest side grows, and a square matmul's achieved
    FLOP/s rises with its size up to efficiency × peak. Roofline: a matmul with a thin side (K = 16: an
    arithmetic intensity of ~16 FLOP/byte, far under the H100's ridge of 989/3.35 ≈ 295) takes exactly its
    bytes over the HBM bandwidth; a large one its FLOPs at efficiency × peak. Flat: the old single efficiency."""
    sides = [2 ** k for k in range(3, 15)]
    factors = [plan.size_factor(s) for s in sides]
    assert factors == sorted(factors) and factors[-1] == 1.0 and factors[0] < 0.1
    c = plan.Cluster(8)
    rates = [2 * s ** 3 / plan.matmul_seconds(s, s, s, c) for s in sides]
    assert rates == sorted(rates)
    assert rates[-1] == pytest.approx(c.flops * c.efficiency)
    thin = plan.matmul_seconds(8192, 8192, 16, c)
    assert thin == pytest.approx((8192 * 16 * 2 + 8192 * 8192) * 2 / c.hbm)
    assert thin > 2 * 8192 * 8192 * 16 / (c.flops * c.efficiency * plan.size_factor(16))
    flat = replace(c, matmul="flat", efficiency=0.6)
    assert plan.matmul_seconds(64, 64, 64, flat) == 2 * 64 ** 3 / (c.flops * 0.6)
    # training: forward, dX and dW (the three shapes of one weight's matmuls), a second forward with full recompute
    assert plan.train_matmul_seconds(4096, 1024, 8192, c, forwards=2) == pytest.approx(
        2 * plan.matmul_seconds(4096, 1024, 8192, c) + plan.matmul_seconds(4096, 8192, 1024, c) +
        plan.matmul_seconds(8192, 1024, 4096, c))


def test_small_matmuls_make_small_models_slower_per_flop():
    """The shape model makes utilisation rise with the model's width, as Narayanan et al. 2021 §5.1 report
    (Table 1: 44 % of peak at h = 2304, 52 % at h = 25 600): the step's MFU at a fixed layout grows with D."""
    mfus = []
    for d in (1024, 2048, 4096, 8192):
        model = plan.Model(24, d, d // 128, 51200, 2048)
        pred = plan.predict(model, plan.Layout(dp=8, microbatches=8), plan.Cluster.preset("a100-80gb", 8), 64)
        mfus.append(pred.mfu)
    assert mfus == sorted(mfus) and mfus[-1] - mfus[0] > 0.05


def test_pins_fix_the_settings_and_v_may_be_any_divisor():
    """--pin's settings: every layout enumerated has them; v = 3 (not among the default 1, 2, 4) is
    enumerated where the chunks divide the layers (Megatron's 530B row: 105 layers, pp = 35, v = 3)."""
    model = plan.Model(24, 1024, 16, 32000, 1024)
    pins = {"zero": 0, "recompute": "full", "sp": False, "microbatches": 8, "virtual": 3}
    found = list(plan.layouts(model, plan.Cluster(64), 256, pins=pins))
    assert found and all((l.zero, l.recompute, l.sp, l.microbatches, l.virtual) == (0, "full", False, 8, 3)
                         for l in found)
    assert {l.pp for l in found} <= {2, 4, 8} and all(24 % (l.pp * 3) == 0 for l in found)
    assert any(l.tp > 1 for l in found)  # sp=off with tp: Megatron before sequence parallelism
    from parallel_twins.planner import parse_pins

    assert parse_pins("zero=1,recompute=none,sp=on,M=4,v=3,overlap=off") == {
        "zero": 1, "recompute": "none", "sp": True, "microbatches": 4, "virtual": 3, "overlap": False}


def test_full_recompute_reruns_the_forward_tp_collectives():
    """Megatron's full recomputation runs the forward's 2 all-reduces (with sp: all-gather + reduce-scatter)
    per block again: 6 per block per micro-batch instead of 4 (Korthikanti et al. 2022 §5, Table 2)."""
    model = plan.Model(8, 1024, 16, 32000, 1024)
    base = plan.Layout(dp=2, tp=4, microbatches=2)
    none = plan.comm(model, base, 0, 8, 2)["tp"]["all_reduce"][0]
    full = plan.comm(model, replace(base, recompute="full"), 0, 8, 2)["tp"]["all_reduce"][0]
    assert full - none == 2 * model.layers * base.microbatches


def test_llama3_and_gpt3_presets_have_the_published_parameter_counts():
    """Llama 3 paper (arXiv:2407.21783) Table 3 shapes give 8.0B, 70.6B and 405.9B parameters (untied
    head; Meta's model cards: 8.03B, 70.6B, 405B); GPT-3 175B (Brown et al. 2020 Table 2.1: 175.0B) gives
    174.6B with biases, LayerNorm and the tied head."""
    from shared.published import PRESETS

    assert PRESETS["llama3-8b"].params / 1e9 == pytest.approx(8.03, abs=0.01)
    assert PRESETS["llama3-70b"].params / 1e9 == pytest.approx(70.55, abs=0.05)
    assert PRESETS["llama3-405b"].params / 1e9 == pytest.approx(405.9, abs=0.5)
    gpt = PRESETS["gpt3-175b"]
    assert gpt.params / 1e9 == pytest.approx(174.6, abs=0.05)  # biases, tied head: "175.0B" in Table 2.1
    assert replace(gpt, vocab=50257).params / 1e9 == pytest.approx(174.6, abs=0.05)  # GPT-2's vocabulary: the same


def test_gpt_with_biases_and_tied_head_is_megatrons_parameter_count():
    """Narayanan et al. 2021 eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) for GPT with biases,
    LayerNorm and the head tied to the embedding; Table 1's parameter column, every row, to its 0.1 B
    (the model here also counts the final LayerNorm, 2h, which eq. 2 leaves out). Tied with pp > 1: the
    last stage keeps a copy, and the first and last stage all-reduce its gradient once per step."""
    from shared.published import MEGATRON_TABLE1

    for params, heads, h, l, *_ in MEGATRON_TABLE1:
        model = plan.Model(l, h, heads, 51200, 2048, bias=True, tied=True)
        eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * l * h))
        assert model.params - 2 * h == pytest.approx(eq2)
        assert round(model.params / 1e9, 1) == params
    model = plan.Model(4, 1024, 16, 32000, 512, bias=True, tied=True)
    one = plan.stage_params(model, plan.Layout(), 0)
    assert one["units"] + one["vectors"] == model.params  # one stage: one matrix
    lay = plan.Layout(pp=2, microbatches=2)
    both = sum(sum(plan.stage_params(model, lay, s)[k] for k in ("units", "vectors")) for s in (0, 1))
    assert both == model.params + 1024 * 32000  # the last stage's copy
    assert plan.comm(model, lay, 1, 4, 2)["pp"]["all_reduce"] == (1, 32000 * 1024 * 2)


def test_gqa_and_swiglu_by_hand():
    """Hand derivations for what the runs do not have. GQA (kv heads G of H): W_qkv is D·(D + 2·G·D/H);
    each block saves q (D) and k, v (G·D/H each) per token; the cp ring sends K|V of G heads (tp-local,
    at least one). SwiGLU: three D×F matrices; it saves the gate's and up's outputs and W_down's input
    (3F/t). RoPE: no position table."""
    d, h, g, f, t = 4096, 32, 8, 14336, 4
    mha = plan.Model(2, d, h, 1000, 512, ffn_dim=f)
    gqa = replace(mha, kv_heads=g, gated=True, rope=True)
    assert gqa.block_units(t) == (5, (d * (d + 2 * g * d // h) + d * d + 3 * d * f) // t)
    # per layer: W_k, W_v shrink from D² to D·G·D/H each, W_gate adds D·F; RoPE drops the T·D position table
    assert mha.params - gqa.params == mha.layers * (2 * d * (d - g * d // h) - d * f) + 512 * d
    lay = plan.Layout(tp=t, sp=True)
    assert plan.activation_elements(gqa, lay, "none") - plan.activation_elements(mha, lay, "none") == \
        pytest.approx(2 * (g * d // h - d) / t + f / t)
    cp = plan.Layout(cp=4, tp=t)
    ring = lambda m: plan.comm(m, cp, 0, 4, 2)["cp"]["send"][1]
    assert ring(gqa) * h == ring(mha) * g  # K|V of 8 heads, not 32
    assert ring(replace(gqa, kv_heads=2)) == ring(replace(gqa, kv_heads=4))  # 2 kv heads over tp 4: one per rank


def test_published_runs_predicted_within_their_error(measured):
    """Published runs predicted with every published setting pinned and the rest searched (shared/published.py,
    each row's source beside it; the cited efficiencies of shared/efficiency.py, none fitted to these runs),
    each in its paper's FLOP convention: Megatron-LM 2021 Table 1 (ten GPT sizes on 32–3 072 A100s), Llama 3
    Table 4 (405B on 8 192 / 16 384 H100s), Korthikanti et al. 2022 Table 5 (22B–1T, sp + selective and full
    recompute), MT-NLG 530B (2 240–3 360 A100s), BLOOM 176B (384 A100s), torchtitan's FSDP2 runs (64 A100s).
    The table is printed (docs/plan.md shows it). Asserted: every published layout fits (best() keeps fitting
    layouts only and other_rows refuses a run with none); the cited figures lower the Megatron rows' median
    error against the datasheet figures; and regression guards at what the model reaches today (all rows:
    median 10.6 %, worst 27.1 %: MT-NLG's DeepSpeed pipeline runs; Megatron median 11.2 %, worst 14.7 %;
    Korthikanti worst 10.4 %, with Megatron's sp re-gather), a margin of ~1.5 points (the search's ties may
    shift). Issue 35's worst-case bound (≤ 25 %) is not reached: test_published_runs_within_issue_35s_bounds,
    strict xfail, turns when it is."""
    from shared.published import markdown, published_rows, summary

    before, after = published_rows(datasheet=True), published_rows()
    for line in (markdown(before, after) + "\n" + summary(after)).splitlines():
        measured(line)
    assert all(r["prediction"].fits for r in after) and len(after) == 28
    median = lambda errs: sorted(abs(e) for e in errs)[len(errs) // 2]
    meg_b = [r["error"] for r in before if r["paper"].startswith("Megatron")]
    meg_a = [r["error"] for r in after if r["paper"].startswith("Megatron")]
    assert median(meg_a) < median(meg_b) - 0.03
    assert median(meg_a) <= 0.125 and all(abs(e) <= 0.175 for e in meg_a)
    errs = [r["error"] for r in after]
    assert median(errs) <= 0.12 and max(abs(e) for e in errs) <= 0.285
    kort = [r["error"] for r in after if r["paper"].startswith("Korthikanti")]
    assert all(abs(e) <= 0.12 for e in kort)  # both policies: selective + sp, and full recompute


@pytest.mark.xfail(strict=True, reason="issue 35, blocked on an A100 measurement (docs/plan.md's what-if): MT-NLG "
                                       "at dp = 12 (+27 %) lies beyond 25 % and the median is 10.6 %")
def test_published_runs_within_issue_35s_bounds():
    """Issue 35's Done-when: median absolute error ≤ 10 % and worst ≤ 25 % over every published run, blind."""
    from shared.published import published_rows

    errs = sorted(abs(r["error"]) for r in published_rows())
    median = (errs[(len(errs) - 1) // 2] + errs[len(errs) // 2]) / 2
    assert median <= 0.10 and errs[-1] <= 0.25


def test_a100_what_if_changes_only_the_a100_rows():
    """a100_sensitivity (docs/plan.md: what an A100 measurement would have to show) re-predicts the A100 rows
    with their largest GEMMs at another fraction of peak: at the cited 0.80 it is the published table itself,
    row for row; at 0.76 the H100 rows stay as they are and every A100 row predicts a slower step."""
    from shared.published import published_rows

    cited, lower = published_rows(), published_rows(a100=0.76)
    assert [r["predicted"] for r in published_rows(a100=0.8)] == pytest.approx([r["predicted"] for r in cited])
    for a, b in zip(cited, lower):
        assert a["name"] == b["name"]
        assert (b["predicted"] < a["predicted"]) if "A100" in a["name"] else b["predicted"] == a["predicted"]


def test_published_memory_readings_bound_the_plan_from_above(measured):
    """torchtitan's memory readings of its H100 layouts (shared/published_memory.py) against the planner's
    memory per GPU for the same layouts: the planner's is a lower bound (no loss transients, no allocator
    reserve, no Float8 casts), today 0.51–0.64 of the reading (docs/plan.md). Asserted: below every
    reading, and above 0.45 of it (a regression guard: the model must not lose what it counts)."""
    from shared.published_memory import markdown, memory_rows

    rows = memory_rows()
    for line in markdown(rows).splitlines():
        measured(line)
    assert all(0.45 < r["ratio"] < 1 for r in rows), [(r["name"], round(r["ratio"], 2)) for r in rows]


def test_llama3_rows_bracket_the_report_over_v():
    """Each Llama 3 row's reported rate lies within 20 % of the prediction at one of v = 1, 2, 4, 8
    (docs/plan.md prints the four; the table pins v = 8, shared.published.LLAMA3_V). A regression guard:
    with the H100's measured GEMMs and FlashAttention (gpu-h100) the closest v is 16 / 6 / 12 % off."""
    from shared.published import llama3_rows

    per_v = [llama3_rows(vs=(v,)) for v in (1, 2, 4, 8)]
    for i in range(3):
        assert min(abs(rows[i]["error"]) for rows in per_v) < 0.2, per_v[0][i]["name"]


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_hopper_presets_are_the_lent_gpus_measurements(name):
    """The H100 and H200 presets' GEMM table, FlashAttention table and copy (gpu-h100, gpu-h200) are what
    ``compare.py bench --profile`` measured on a lent GPU of each (docs/gpu/NAME_bench.json), re-derived here
    from that file, not typed in: the training-shaped GEMMs' mean per smallest side and SDPA's default
    (flash) backend, each over the datasheet's 989 TFLOP/s. The burst maximum (the short squares) agrees
    with two public measurements of the largest GEMMs (h100-gemm 780, xla-sm90 783.3 TFLOP/s) within 2 %;
    the training shapes, timed at the power limit's clock, run 0.66–0.74 of the datasheet."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "gpu", f"{name}_bench.json")) as f:
        bench = json.load(f)
    burst = max(bench["compute"]["bfloat16"].values())
    table, top = efficiency.shaped_table(bench, "bfloat16", burst)
    t = efficiency.TABLES[name]
    assert t["matmul"] == tuple((s, round(f * top["top"] / 989e12, 3)) for s, f in table)
    measured = tuple((h, n, round(f, 3)) for h, n, f in efficiency.attention_table(bench, 989e12))
    assert t["attention"][:len(measured)] == measured  # the H100 measured 16 heads; its 64 are the H200's
    assert t["attention"][len(measured):] == efficiency.TABLES["h200"]["attention"][len(measured):]
    assert t["hbm_copy"] == pytest.approx(bench["memcpy"], rel=1e-3)
    assert burst / 989e12 == pytest.approx(783.3e12 / 989e12, abs=0.02)
    assert 0.65 < min(f for s, f in t["matmul"] if s >= 1024) <= max(f for _, f in t["matmul"]) < 0.75
    assert f"gpu-{name}" in t["cite"]["matmul"] and f"gpu-{name}" in t["cite"]["attention"]


def test_selective_recompute_runs_the_softmax_again():
    """Selective recomputation (math attention) runs the attention core again: QKᵀ and ·V, and the softmax
    and dropout over the scores, one more forward pass each (Korthikanti et al. 2022 §5); the other
    memory-bound ops are not recomputed. Under FlashAttention there are no scores in HBM."""
    model = plan.Model(4, 1024, 16, 32000, 2048, dropout=True)
    c = plan.Cluster.preset("a100", 8)
    none, sel = (plan.block_seconds(model, plan.Layout(tp=8, recompute=r), 2, c, attention="math")
                 for r in ("none", "selective"))
    n, heads = 2 * 2048, 16 // 8
    scores_pass = 2 * heads * 2048 * 2 * n * 2 / c.hbm_at(n * heads * 2048 * 2)  # softmax + dropout, in and out
    assert sel["elementwise"] - none["elementwise"] == pytest.approx(scores_pass)
    flash = [plan.block_seconds(model, plan.Layout(tp=8, recompute=r), 2, c)["elementwise"]
             for r in ("none", "selective")]
    assert flash[0] == flash[1]


def test_flop_conventions_and_hfu():
    """causal < full < megatron; megatron is Narayanan et al.'s eq. 3 exactly for their GPT; HFU counts the
    recomputed forward (and math attention's whole T×T), so HFU > MFU with recomputation."""
    from shared.published import megatron_flops, preset

    m = preset("gpt3-175b")
    causal, full, meg = (plan.model_flops(m, 8, c) for c in plan.FLOPS)
    assert causal < full < meg and meg == pytest.approx(megatron_flops(m, 8), rel=1e-12)
    assert full - causal == 8 * m.seq * 6 * m.layers * m.seq * m.dim  # full attention: the other half
    with pytest.raises(ValueError, match="causal, full, megatron"):
        plan.model_flops(m, 8, "palm")
    c = plan.Cluster.preset("a100", 64)
    p = plan.predict(m, plan.Layout(dp=1, tp=8, pp=8, microbatches=8, recompute="full"), c, 8)
    assert p.hfu > p.mfu and p.hfu == pytest.approx(
        plan.hardware_flops(m, p.layout, 8) / (p.time["step"] * 64 * c.flops))


def test_overlap_modes_tp_overlap_and_fp32_main_grads():
    """The data axis' traffic hidden behind every micro-batch's backward (DDP, FSDP2) ≤ the last one's
    (Megatron --overlap-grad-reduce) ≤ none; async TP takes tp traffic off the critical path; Megatron's
    fp32 main grads: 2 + 4 + 12 = 18 bytes per parameter."""
    model = plan.Model(16, 4096, 32, 32000, 2048)
    lay = plan.Layout(dp=16, tp=4, microbatches=8, sp=True)
    step = {o: plan.predict(model, lay, plan.Cluster.preset("h100", 64, overlap=o), 512).time["step"]
            for o in plan.OVERLAPS}
    assert step["backward"] <= step["last"] < step["none"]
    # hidden traffic is not free: its kernels take Calculon's 2 % of the compute over the NIC while they run
    free = plan.predict(model, lay, plan.Cluster.preset("h100", 64, overlap_cost=(0, 0)), 512).time
    assert step["backward"] > free["step"] and free["exposed_data"] == 0
    base = plan.Cluster.preset("h100", 64)
    assert plan.predict(model, lay, replace(base, tp_overlap=True), 512).time["step"] < \
        plan.predict(model, lay, base, 512).time["step"]
    one = plan.Layout()
    st = plan.state(model, one, 0, 2, precision="mixed-fp32-grads")
    assert sum(st.values()) == 18 * sum(plan.stage_params(model, one, 0)[k] for k in ("units", "vectors"))
    # fp32 main grads are reduced in fp32: the gradient group's all-reduce carries twice the bf16 bytes
    fp32 = plan.predict(model, replace(lay, microbatches=1), plan.Cluster.preset("h100", 64, overlap="none"), 512,
                        precision="mixed-fp32-grads")
    bf16 = plan.predict(model, replace(lay, microbatches=1), plan.Cluster.preset("h100", 64, overlap="none"), 512)
    assert fp32.time["comm_dp"] == pytest.approx(2 * bf16.time["comm_dp"], rel=0.01)
    # ZeRO-3 prefetches the forward's gathers too: its traffic hides behind forward and backward, not the
    # backward alone (so with traffic between 2/3 and all of the compute, less is exposed than ZeRO-2's would)
    z3 = plan.predict(model, replace(lay, zero=3), base, 512).time
    assert z3["exposed_data"] < max(0.0, z3["comm_fsdp"] - 2 / 3 * z3["compute"]) + 0.02 * z3["comm_fsdp"] + 1e-9
    from parallel_twins.planner import parse_pins

    assert parse_pins("overlap=last") == {"overlap": "last"}


def test_profile_load_refuses_what_it_cannot_use(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"peaks": {"fp64": 1e9}, "matmul": [[32, 1.0]], "hbm_copy": 1e9}))
    with pytest.raises(ValueError, match="missing intra, inter"):
        efficiency.load(str(path))
    # held-out: /dev/zero was read forever; /etc/passwd and a folder were json's / the OS's words, no path
    for bad, says in (("/dev/zero", "a device or socket, not a file"), (str(tmp_path), "a folder, not a bench")):
        if os.path.exists(bad):
            with pytest.raises(ValueError, match=says):
                efficiency.load(bad)
    (tmp_path / "text").write_text("root:x:0:0")
    with pytest.raises(ValueError, match="not JSON"):
        efficiency.load(str(tmp_path / "text"))
    good = {"peaks": {"fp64": 1e9}, "matmul": [[32, 0.5], [64, 1.0]], "hbm_copy": 1e9,
            "intra": {"all_reduce": [1e-4, 1e8]}, "inter": {"all_reduce": [1e-4, 1e8]}}
    efficiency.save(str(path), good)
    c = plan.Cluster.preset("h100", 2, "float64", efficiency.load(str(path)))
    assert (c.flops, c.efficiency, c.size_table, c.hbm) == (1e9, 1.0, ((32, 0.5), (64, 1.0)), 1e9)
    assert c.memory == efficiency.TABLES["h100"]["memory"]  # no memory in the profile: the preset's
    assert c.hbm_at(1) == c.hbm_at(1e12) == 1e9  # no hbm_table: one bandwidth at every size
    # from bench's measurements: peaks per dtype, the size table over the fastest, busbw = algbw fit × bus
    # factor (all-reduce on 4 ranks: 1.5); a fit with no size dependence takes its largest message's busbw
    bench = {"world_size": 4, "compute": {"float32": {"32": 1e9, "64": 4e9}},
             "fits": [{"framework": "torch", "op": "all_reduce", "alpha_s": 1e-4, "beta_bytes_per_s": 2e8},
                      {"framework": "torch", "op": "all_gather", "alpha_s": 2e-4, "beta_bytes_per_s": float("inf")}],
             "results": [{"framework": "torch", "op": "all_gather", "size_bytes": s, "busbw": s / 1e4}
                         for s in (4096, 16384)]}
    prof = efficiency.from_bench(bench, memcpy=5e9)
    assert prof["peaks"] == {"tf32": 4e9} and prof["matmul"] == ((32, 0.25), (64, 1.0)) and prof["hbm_copy"] == 5e9
    assert prof["intra"] == {"all_reduce": (1e-4, 3e8), "all_gather": (2e-4, 16384 / 1e4)} == prof["inter"]
    a = plan.Cluster.preset("a100", 8)  # Calculon's steps: 0.3, 0.6, 0.75, 0.9 of the datasheet's 2.039 TB/s
    assert [a.hbm_at(n) / 2039e9 for n in (1e3, 1e6, 5e7, 1e9)] == pytest.approx([0.3, 0.6, 0.75, 0.9])
    h = plan.Cluster.preset("h100", 8)  # the same steps below the H100's measured copy (gpu-h100: 2.817 TB/s)
    assert [h.hbm_at(n) / 2.817e12 for n in (1e3, 1e6, 5e7, 1e9)] == pytest.approx([0.3 / 0.9, 0.6 / 0.9,
                                                                                     0.75 / 0.9, 1.0])


@pytest.mark.parametrize("args,message", [
    (["--gpu", "b200"], "known: a100-40gb, a100-80gb, h100, h200"),
    (["--layers", "8", "--pin", "v=2", "--framework", "deepspeed"], "runs 1F1B only"),
    (["--preset", "llama9"], "known: llama3-8b"),
    (["--gpus", "256", "--layout", "fsdp=128,tp=8,pp=16"], "multiply to 16384 GPUs, not --gpus 256"),
    (["--gpus", "256", "--layout", "tp=8,pp=3"], "does not divide --gpus 256"),
    (["--layout", "pp=4", "--pin", "v=3"], "80 layers do not split into pp=4 × v=3"),
    (["--preset", "llama3-405b", "--layout", "pp=16"], "126 layers do not split into 16 equal stages"),
    (["--pin", "zero=5"], "ZeRO stage"),
    (["--pin", "color=red"], "key one of zero"),
    (["--pin", "sp=maybe"], "on or off"),
    (["--kv-heads", "5"], "kv_heads must divide"),
])
def test_cli_plan_refuses_what_it_cannot_plan(args, message, capsys):
    from parallel_twins.planner import plan_main

    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_plan_preset_gpu_and_pins(tmp_path):
    """A named model on a named GPU with pinned settings: every row has them."""
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "compare.py", "plan", "--preset", "llama3-8b", "--gpu", "a100-40gb",
                          "--gpus", "64", "--global-batch", "256", "--dtype", "float16",
                          "--pin", "zero=1,recompute=full,sp=off,v=2", "--framework", "megatron", "--json", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "KV=8" in run.stdout and "SwiGLU F=14336" in run.stdout and "312 TFLOP/s" in run.stdout
    assert "as megatron runs it" in run.stdout
    data = json.loads(out.read_text())
    assert data["n_fit"] > 0
    assert all((p["zero"], p["recompute"], p["sp"], p["virtual"]) == (1, "full", False, 2) for p in data["fit"])


def test_scatter_gather_pipeline_sends():
    """Narayanan et al. 2021 §4.1: with tp (and no sp) each tp rank sends 1/t of the stage's output across
    nodes and the receiving tp group all-gathers it over NVLink: pp bytes ÷ t, + one all-gather per message."""
    model = plan.Model(8, 1024, 16, 32000, 1024)
    lay = plan.Layout(dp=2, tp=8, pp=2, microbatches=4)
    plain, sg = plan.comm(model, lay, 0, 8, 2), plan.comm(model, replace(lay, pp_scatter=True), 0, 8, 2)
    assert sg["pp"]["send"] == (plain["pp"]["send"][0], plain["pp"]["send"][1] // 8)
    assert sg["tp"]["all_gather"] == plain["pp"]["send"] and "all_gather" not in plain["tp"]
    from parallel_twins.planner import parse_pins

    assert parse_pins("scatter=on") == {"pp_scatter": True}


def test_allgather_context_parallelism_moves_only_the_kv_heads():
    """Llama 3's context parallelism (arXiv:2407.21783 §3.3.2): every block all-gathers K and V of the whole
    sequence (forward, and again for backward) and reduce-scatters dK, dV: with GQA's 8 K/V heads and tp 8,
    one head of 128 per rank, 2·T·128·b per sequence each time — 16× less than 128 heads' K|V would be."""
    model = plan.Model(4, 16384, 128, 1000, 131072, kv_heads=8)
    lay = plan.Layout(dp=2, tp=8, cp=16, sp=True, microbatches=2, cp_style="allgather")
    cp = plan.comm(model, lay, 0, 4, 2)["cp"]
    whole = 1 * 131072 * 2 * 128 * 2  # m = 1 sequence, K|V of one head, bf16
    assert cp == {"all_gather": (2 * 2 * 4, 2 * 2 * 4 * whole), "reduce_scatter": (2 * 4, 2 * 4 * whole)}
    mha = plan.comm(replace(model, kv_heads=0), lay, 0, 4, 2)["cp"]
    assert mha["all_gather"][1] == 16 * cp["all_gather"][1]
    from parallel_twins.planner import parse_pins

    assert parse_pins("cp=allgather") == {"cp_style": "allgather"}


def test_uneven_stages_as_llama3_splits_126_layers_over_16():
    """Llama 3 405B (arXiv:2407.21783 §3.3.2): 126 layers over 16 stages, one fewer on the first and the
    last (7 + 14·8 + 7). trim=1: the stages hold exactly the model (Σ of every stage's parameters = Φ),
    the middle stages' 8 blocks set the pace, and without trim 16 stages are refused with the reason."""
    model = plan.Model(126, 1024, 16, 1000, 256, kv_heads=4, ffn_dim=3584, gated=True, rope=True)
    lay = plan.Layout(dp=2, pp=16, microbatches=16, trim=1)
    assert [lay.stage_layers(126, s) for s in range(16)] == [7] + [8] * 14 + [7]
    held = sum(plan.stage_params(model, lay, s)["units"] + plan.stage_params(model, lay, s)["vectors"]
               for s in range(16))
    assert held == model.params
    assert plan.invalid(model, lay, 64) is None
    assert "126 % pp 16" in plan.invalid(model, replace(lay, trim=0), 64)
    pp = [plan.comm(model, lay, s, 64, 2)["pp"]["send"] for s in (0, 1)]
    assert pp[0][0] * 2 == pp[1][0]  # the first stage sends forward only; a middle one both ways
    found = list(plan.layouts(model, plan.Cluster(32), 64, pins={"trim": 1, "microbatches": 16}))
    assert found and all(l.trim == 1 and l.pp > 1 and (126 + 2) % l.pp == 0 for l in found)


def test_frameworks_send_what_their_source_sends():
    """shared/plan_framework.py: Megatron's sp all-gathers each column-parallel linear's input again in the
    backward (2 more all-gathers of A per block and micro-batch), which brings sp's gain on Korthikanti et
    al.'s 22B layer (t = 8, micro-batch 4, their Table 4: 3 %, 19.6 → 19.0 ms) from the ~10 % the
    repository's sp would save to a few %; DeepSpeed's blocking pipeline receives wait on the critical path
    (a middle stage's pp time doubles) and its BF16_Optimizer all-reduces fp32 gradients whole, after adding
    each micro-batch's bf16 ones into them; an unknown framework is refused."""
    from shared.published import _gpt

    m, cl = _gpt(48, 6144, 64), plan.Cluster.preset("a100-80gb", 8)
    step = lambda sp, fw: plan.predict(m, plan.Layout(tp=8, sp=sp, microbatches=1), replace(cl, framework=fw), 4,
                                       attention="math").time["step"]
    gain = {fw: 1 - step(True, fw) / step(False, fw) for fw in ("torchtitan", "megatron")}
    # the paper's 3 %: 5.4 % here, the planner's layer without sp being 20.4 ms against their 19.6 (with sp 19.2
    # against 19.0); the repository's sp (no re-gather) would save 9.5 %
    assert gain["torchtitan"] > 0.08 and 0.01 < gain["megatron"] < 0.06
    lay = plan.Layout(tp=8, sp=True, microbatches=2)
    base, meg = (plan.framework_view(plan.comm(m, lay, 0, 4, 2), m, lay, 0, 4, 2, fw, "mixed")
                 for fw in ("torchtitan", "megatron"))
    act = 2 * 2048 * 6144 * 2  # m = 2 sequences × T × D × bf16
    assert meg["tp"]["all_gather"] == (base["tp"]["all_gather"][0] + 2 * 48 * 2,
                                       base["tp"]["all_gather"][1] + 2 * 48 * 2 * act)
    pp = plan.Layout(dp=2, pp=4, microbatches=8)
    middle = plan.comm(m, pp, 1, 16, 2)  # stage 1 of 4: sends and receives both ways
    ds, tt = (plan.comm_time(middle, pp, plan.Cluster.preset("a100-80gb", 8, framework=fw))["pp"]
              for fw in ("deepspeed", "torchtitan"))
    assert ds == pytest.approx(2 * tt, rel=1e-9)
    # its partitioned sends: a stage but the last all-gathers its own output again before each backward
    part = plan.Layout(tp=2, pp=4, microbatches=8, pp_scatter=True)
    for s_, extra in ((0, 8), (3, 0)):
        ours = plan.comm(m, part, s_, 16, 2)
        theirs = plan.framework_view(ours, m, part, s_, 16, 2, "deepspeed", "mixed")
        assert theirs["tp"]["all_gather"][0] == ours["tp"]["all_gather"][0] + extra
    z1 = plan.Layout(dp=8, zero=1)
    view = plan.fp32_grads(plan.comm(m, z1, 0, 8, 2), z1)
    ds_view = plan.framework_view(view, m, z1, 0, 8, 2, "deepspeed", "mixed-fp32-grads")
    assert ds_view["dp"]["all_reduce"] == view["dp"]["reduce_scatter"] and "reduce_scatter" not in ds_view["dp"]
    # its bf16 pipeline adds each micro-batch's bf16 gradients into fp32 ones on every stage but the last
    two = plan.Layout(pp=2, microbatches=4)
    acc = lambda s, prec: plan.accumulate_seconds(m, two, s, "deepspeed", prec, 1e12)
    first = plan.stage_params(m, two, 0)
    assert acc(0, "mixed-fp32-grads") == 18 * (first["units"] + first["vectors"]) / 1e12
    assert acc(1, "mixed-fp32-grads") == 0 == acc(0, "mixed")
    with pytest.raises(ValueError, match="unknown framework"):
        plan.Cluster.preset("h100", 8, framework="jax")


def test_trimmed_chunks_are_counted_one_by_one():
    """Llama 3's 126 layers over pp = 16, v = 8 (trim = 1): the first stage's first chunk holds only the embedding
    and the last stage's last chunk only the head (§3.3.2), so along Megatron's order stage 0 holds at most 112
    blocks' activations (31 of its 143 alive chunks are the empty one), not 143 × 7/8; an untrimmed stage's
    peak is in_flight × its chunk; the memory's binding stage stays stage 1 (141 one-block chunks)."""
    from shared.theory.pp import chunk_layers, in_flight, peak_blocks

    lay = plan.Layout(dp=64, tp=8, pp=16, zero=3, microbatches=32, sp=True, virtual=8, trim=1)
    assert chunk_layers(lay, 126, 0) == [0] + [1] * 7 and chunk_layers(lay, 126, 15) == [1] * 7 + [0]
    assert (peak_blocks(lay, 126, 0), peak_blocks(lay, 126, 1), peak_blocks(lay, 126, 15)) == (112, 141, 113)
    assert peak_blocks(lay, 126, 1) == in_flight(lay, 1) * 1
    alive = peak = 0  # brute force over stage 0's order: blocks of each chunk from its F until its B
    for op in schedule.order("interleaved", 16, 32, 8)[0]:
        alive += (op.chunk > 0) * ((op.kind == "F") - (op.kind == "B"))
        peak = max(peak, alive)
    assert peak == 112
    assert chunk_layers(plan.Layout(pp=4, microbatches=8, virtual=2, trim=3), 14, 0) == [0, 2]  # spills over


def test_the_documented_plan_commands_run(capsys):
    """Every complete `compare.py plan` command of docs/plan.md's usage block and of the planner's docstring runs
    (exit 0): a refusal there is a stale example (a 126-layer preset without its trim=1 was one). Commands with
    "..." or a file they need (--calibrate, --profile, --measured) are left out."""
    import re
    import shlex

    from parallel_twins import planner

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    usage = open(os.path.join(root, "docs", "plan.md")).read().split("```bash\n", 1)[1].split("```", 1)[0]
    texts = [usage, planner.__doc__.replace("\\\\\n", "\\\n")]
    commands = [c for text in texts for c in re.sub(r"\\\n\s*", " ", text).splitlines()
                if c.strip().startswith("python compare.py plan") and "..." not in c
                and not re.search(r"--(calibrate|profile|measured)", c)]
    assert len(commands) >= 4, commands
    for command in commands:
        argv = shlex.split(command.split("#")[0])[3:]  # after "python compare.py plan"
        capsys.readouterr()
        try:
            status = planner.plan_main(argv)
        except SystemExit as e:
            status = e.code
        assert status in (0, None), (command, capsys.readouterr().err[-500:])
