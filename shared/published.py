"""Published training runs the planner is checked against (``compare.py plan`` at full size), and named model
presets. Every figure is the paper's; ``published_rows`` predicts each run with the planner and reports
the error (tests/test_plan.py prints the table; docs/plan.md shows it).

Model presets (``compare.py plan --preset NAME``):
  llama3-8b / 70b / 405b  Grattafiori et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 3:
      layers 32 / 80 / 126, model dim 4096 / 8192 / 16384, FFN 14336 / 28672 / 53248 (SwiGLU), attention
      heads 32 / 64 / 128, key/value heads 8 (GQA), vocabulary 128 000 (Table 3; the released tokenizer
      has 128 256, used here), RoPE; sequence 8192 (§3.2, the pre-training context).
  gpt3-2.7b / 6.7b / 175b  Brown et al. 2020, "Language Models are Few-Shot Learners",
      arXiv:2005.14165, Table 2.1: n_layers 32 / 32 / 96, d_model 2560 / 4096 / 12288, n_heads 32 / 32 / 96,
      context 2048 (GPT-3 XL and 13B are left out: their d_model is not n_heads × d_head in the table),
      FFN 4·d_model (§2.1: "the same model and architecture as GPT-2"); vocabulary 50 257 (GPT-2's BPE)
      padded to 51 200 as Megatron-LM pads it (Narayanan et al. 2021, §5.1: "a vocabulary size of
      51,200"); learned positions, dropout, biases, LayerNorm, the head tied to the token embedding
      (GPT-2's, Radford et al. 2019).
"""

from __future__ import annotations

from dataclasses import replace

from shared.theory.layout import Model

PRESETS = {
    "llama3-8b": Model(32, 4096, 32, 128256, 8192, kv_heads=8, ffn_dim=14336, gated=True, rope=True),
    "llama3-70b": Model(80, 8192, 64, 128256, 8192, kv_heads=8, ffn_dim=28672, gated=True, rope=True),
    "llama3-405b": Model(126, 16384, 128, 128256, 8192, kv_heads=8, ffn_dim=53248, gated=True, rope=True),
    "gpt3-2.7b": Model(32, 2560, 32, 51200, 2048, dropout=True, bias=True, tied=True),
    "gpt3-6.7b": Model(32, 4096, 32, 51200, 2048, dropout=True, bias=True, tied=True),
    "gpt3-175b": Model(96, 12288, 96, 51200, 2048, dropout=True, bias=True, tied=True),
}


def preset(name: str) -> Model:
    if name.lower() not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name.lower()]


# Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
# arXiv:2104.04473), Table 1 (weak scaling, Selene: A100 80 GB, 312 TFLOP/s peak): GPT with V = 51 200,
# s = 2048, mixed precision; (params B, heads, hidden, layers, t, p, GPUs, batch, reported TFLOP/s per GPU).
# Their TFLOP/s count the recomputed forward: F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per step (§5.1, eq. 3).
MEGATRON_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

# Llama 3 paper (arXiv:2407.21783) Table 4: 405B on H100 80 GB (989 TFLOP/s dense BF16); (GPUs, TP, CP, PP,
# DP, sequence, batch per DP rank, reported TFLOP/s per GPU, reported BF16 MFU). FSDP over DP (§3.3.2).
LLAMA3_TABLE4 = (
    (8192, 8, 1, 16, 64, 8192, 32, 430, 0.43),
    (16384, 8, 1, 16, 128, 8192, 16, 400, 0.41),
    (16384, 8, 16, 16, 8, 131072, 16, 380, 0.38),
)


def megatron_flops(model: Model, batch: int) -> float:
    """Narayanan et al. 2021 eq. 3: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), the FLOPs their TFLOP/s count."""
    s, l, h, V = model.seq, model.layers, model.dim, model.vocab
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def best(model: Model, cluster, batch: int, axes: dict, pins: dict, attention: str, vs, precision="mixed"):
    """The fastest fitting layout with these axis sizes and pins, over micro-batch counts and the v in ``vs``
    (the planner's own choice where the paper does not say)."""
    from shared import plan

    found = []
    for v in vs:
        for lay in plan.layouts(model, cluster, batch, pins.get("recompute_options", plan.RECOMPUTE),
                                pins=dict({k: x for k, x in pins.items() if k != "recompute_options"}, virtual=v)):
            if all(getattr(lay, k) == x for k, x in axes.items()):
                p = plan.predict(model, lay, cluster, batch, 2, precision, "builtin", attention, time_if_over=False)
                if p.fits:
                    found.append(p)
    return min(found, key=lambda p: p.time["step"]) if found else None


def cluster(name: str, gpus: int, datasheet: bool = False, **kw):
    """The preset with the cited achieved figures (shared/efficiency.py), or ``datasheet``: the planner
    before them (every link and HBM at its datasheet figure, decimal GB, the largest GEMMs at 0.8)."""
    from shared import plan

    if not datasheet:
        return plan.Cluster.preset(name, gpus, **kw)
    g = plan.gpu(name)
    return plan.Cluster(gpus, **{"memory": g["memory"], "flops": g["flops"], "intra": g["intra"], "inter": g["inter"],
                                 "hbm": g["hbm"], **kw})


def llama3_rows(matmul: str = "shapes", efficiency: float | None = None, vs=(1, 2, 4, 8),
                datasheet: bool = False) -> list[dict]:
    """Llama 3 Table 4's runs, each predicted at its fastest fitting layout over M and the v in ``vs``
    (FSDP: the data axis' traffic under the whole backward; Meta's TFLOP/s: causal model FLOPs)."""

    rows = []
    for gpus, t, c, p, dp, seq, per_dp, tflops, _mfu in LLAMA3_TABLE4:
        # 126 layers over 16 stages: Meta drops one layer from the first and the last stage (§3.3.2): trim=1
        model = replace(PRESETS["llama3-405b"], seq=seq)
        batch = per_dp * dp
        cl = cluster("h100", gpus, datasheet, matmul=matmul, overlap="backward",
                     **({"efficiency": efficiency} if efficiency else {}))
        # context parallelism: K|V all-gathered (Meta's, §3.3.2: "we all-gather the key (K) and value (V) tensors")
        pins = {"zero": 3, "sp": True, "trim": 1} | ({"cp_style": "allgather"} if c > 1 else {})
        pred = best(model, cl, batch, {"tp": t, "pp": p, "cp": c}, pins, "flash", list(vs))
        flops = batch * seq * model.flops_per_token("none")
        got = flops / (pred.time["step"] * gpus) / 1e12
        rows.append({"name": f"Llama 3 405B tp={t} cp={c} pp={p} dp={dp} T={seq} {gpus} H100", "reported": tflops,
                     "predicted": got, "error": got / tflops - 1, "layout": pred.layout, "prediction": pred})
    return rows


def published_rows(matmul: str = "shapes", efficiency: float | None = None, datasheet: bool = False) -> list[dict]:
    """Every published run predicted: {name, reported, predicted (TFLOP/s per GPU as the paper counts them),
    error (predicted/reported − 1), layout}. ``matmul="flat", efficiency=0.6``: the planner before shapes;
    ``datasheet``: before the cited efficiencies (cluster)."""
    rows = []
    for params, heads, hidden, layers, t, p, gpus, batch, tflops in MEGATRON_TABLE1:
        model = Model(layers, hidden, heads, 51200, 2048, dropout=True, bias=True, tied=True)
        # Megatron-LM 2021: the gradients all-reduced after the backward (overlap none)
        cl = cluster("a100-80gb", gpus, datasheet, matmul=matmul, overlap="none",
                     **({"efficiency": efficiency} if efficiency else {}))
        per = layers // p
        vs = [v for v in range(1, per + 1) if per % v == 0 and v <= 8] if p > 1 else [1]
        pred = best(model, cl, batch, {"tp": t, "pp": p, "cp": 1},
                    {"zero": 0, "recompute": "full", "sp": False, "pp_scatter": True}, "math", vs)
        got = megatron_flops(model, batch) / (pred.time["step"] * gpus) / 1e12
        rows.append({"name": f"Megatron {params}B t={t} p={p} {gpus} A100", "reported": tflops, "predicted": got,
                     "error": got / tflops - 1, "layout": pred.layout, "prediction": pred})
    return rows + llama3_rows(matmul, efficiency, datasheet=datasheet)


def markdown(before: list[dict], after: list[dict]) -> str:
    lines = ["| run | reported TFLOP/s/GPU | before (datasheet links and HBM) | error | after (cited efficiencies) "
             "| error | layout after (M, v, recompute) |", "|---|---|---|---|---|---|---|"]
    for a, b in zip(before, after):
        lay = b["layout"]
        lines.append(f"| {b['name']} | {b['reported']:.0f} | {a['predicted']:.0f} | {100 * a['error']:+.0f} % | "
                     f"{b['predicted']:.0f} | {100 * b['error']:+.0f} % | M={lay.microbatches} v={lay.virtual} "
                     f"{lay.recompute} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Median and worst absolute error, per paper and over all rows."""
    groups = {"Megatron-LM 2021 Table 1": [r for r in rows if r["name"].startswith("Megatron")],
              "Llama 3 Table 4": [r for r in rows if r["name"].startswith("Llama")], "all": rows}
    out = []
    for name, rs in groups.items():
        errs = sorted(abs(r["error"]) for r in rs)
        med = (errs[(len(errs) - 1) // 2] + errs[len(errs) // 2]) / 2
        out.append(f"{name}: median |error| {100 * med:.1f} %, worst {100 * errs[-1]:.1f} % ({len(errs)} runs)")
    return "\n".join(out)


def v_sensitivity() -> str:
    """Llama 3's rows with v pinned to each of 1, 2, 4, 8 (Meta does not publish v): the error of each."""
    per_v = {v: llama3_rows(vs=(v,)) for v in (1, 2, 4, 8)}
    lines = ["| run | reported | v = 1 | v = 2 | v = 4 | v = 8 |", "|---|---|---|---|---|---|"]
    for i, row in enumerate(per_v[1]):
        lines.append(f"| {row['name']} | {row['reported']:.0f} | " + " | ".join(
            f"{per_v[v][i]['predicted']:.0f} ({100 * per_v[v][i]['error']:+.0f} %)" for v in per_v) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(published_rows(datasheet=True), published_rows()))
    print()
    print(summary(published_rows()))
    print()
    print(v_sensitivity())
