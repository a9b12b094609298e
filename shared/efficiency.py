"""What each GPU preset achieves, as data with its source: the planner's (shared/plan.py) defaults, and the
profile ``compare.py bench --profile`` measures on this machine in the same form (``load``/``save``).

Every default comes from a public microbenchmark or a vendor figure, cited beside it; none is fitted to
the published training runs shared/published.py compares against. Where no source was found the entry
says so and reuses the nearest cited one.

A table (one per GPU preset, or a measured profile) holds:
  peaks       dense tensor-core FLOP/s by dtype (bf16 = fp16, fp8, tf32, fp64), the datasheets'
  memory      bytes per GPU as the device reports them (nvidia-smi's memory.total in MiB)
  matmul      ((smallest side, fraction of peak), ...) ascending: the GEMM efficiency by shape
  hbm_copy    achieved device-to-device copy bandwidth, bytes/s (of large transfers)
  hbm_table   ((bytes per transfer, fraction of hbm_copy), ...) ascending: smaller tensors stream slower
  intra       {op: (α s, busbw bytes/s)} inside a node (NVLink/NVSwitch), nccl-tests' busbw
  inter       {op: (α s, busbw bytes/s)} across nodes, per GPU (one NIC per GPU)
  overlap_cost  (intra, inter): the compute rate an overlapped collective takes while it runs
"""

from __future__ import annotations

import json

MiB = 2 ** 20

# --- sources ------------------------------------------------------------------------------------------
SOURCES = {
    "a100-datasheet": "NVIDIA A100 Tensor Core GPU datasheet (2021), specifications table: BF16/FP16 312, TF32 156, "
                      "FP64 tensor 19.5 TFLOP/s dense; HBM2e 2 039 GB/s (80 GB), HBM2 1 555 GB/s (40 GB); NVLink "
                      "600 GB/s (300 each way)",
    "h100-datasheet": "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column: BF16/FP16 989, FP8 1 979, TF32 "
                      "494.5 (989 with sparsity), FP64 tensor 67 TFLOP/s dense; HBM3 3.35 TB/s; NVLink 900 GB/s",
    "h200-datasheet": "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column: the H100 SXM's tensor rates; "
                      "141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s",
    "smi-h100": "nvidia-smi on an H100 80GB HBM3: memory.total 81559MiB (= 79.6 GiB; public nvidia-smi logs, e.g. "
                "github.com/NVIDIA/nccl-tests issues)",
    "smi-h200": "nvidia-smi on an H200: memory.total 143771MiB (= 140.4 GiB)",
    "smi-a100-80": "nvidia-smi on an A100-SXM4-80GB: memory.total 81920MiB (= 80.0 GiB)",
    "smi-a100-40": "no nvidia-smi log found for the A100-SXM4-40GB: 40960MiB assumed, as the 80 GB part's 81920",
    "nccl-212": "github.com/NVIDIA/nccl-tests/issues/212 (S. Jeaugey, NVIDIA, 2024): on H100 'with the protocol "
                "overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s' (busbw of non-all-reduce "
                "ops, or NCCL_ALGO=RING); all-reduce with NVLink SHARP: 'a peak busBw of ~480GB/s' on 8 GPUs",
    "nccl-290": "github.com/NVIDIA/nccl-tests/issues/290 (D. Addison, NVIDIA, 2025): 476 GB/s single-node H100 "
                "all-reduce 'in the expected range'; 'For NDR @ 400Gbps you should see 46-48GB/s per NIC'",
    "nccl-149": "github.com/NVIDIA/nccl-tests/issues/149 (2023): 8 × A100-SXM4-80GB over NVSwitch, all_reduce_perf "
                "busbw ~200 GB/s; github.com/NVIDIA/nccl-tests/issues/178: 208 GB/s on A100",
    "nccl-119": "github.com/NVIDIA/nccl-tests/issues/119 (2022): 3 nodes of 8 × A100 with 4 HDR 200 Gb/s HCAs, "
                "all_reduce_perf busbw peak ~96 GB/s of the 100 GB/s line rate (0.96)",
    "fa2": "Dao 2023, FlashAttention-2, arXiv:2307.08691 §1: optimized GEMMs reach 'up to 80-90% of the "
           "theoretical maximum device throughput' on A100",
    "h100-gemm": "gist.github.com/jeromeku/e03df32cb86e89f7cb5f3485c93f99f1: H100 bf16 GEMM 4224×8192×2048, "
                 "780 TFLOP/s (0.79 of 989) at best (max-autotune)",
    "xla-sm90": "OpenXLA's measured GEMM table for sm_90 (H100), xla/service/gpu/model/matmul_interpolator_data.h "
                "(2025): bf16 4096×4096×4096 at 783.3 TFLOP/s (0.79 of 989), 2048³ at 632, and thin shapes far "
                "lower (4096×256×2048: 305); its grid stops at 4096 and its small calls carry ~6 µs each, so it "
                "is not yet the size table (a per-call cost + rate model would be)",
    "size-assumed": "no public GEMM sweep by shape for training-sized GEMMs (M of 8 K–64 K tokens) found: the step "
                    "table on the smallest side (tile and wave quantization, NVIDIA 'Matrix Multiplication "
                    "Background' guide §3) is an assumption; xla-sm90 measures thin GEMMs at 4096 lower still",
    "calculon-mem": "Calculon's system files (Isaev et al. 2023, SC'23; github.com/calculon-ai/calculon "
                    "systems/a100_80g.json and h100_80g_nvl8.json, mem1.MB_efficiency): HBM at 0.90 of the "
                    "datasheet for transfers of 100 MB and more, 0.75 from 10 MB, 0.6 from 1 MB, 0.3 below",
    "calculon-net": "Calculon's system files (a100_80g.json, h100_80g_nvl8.json, networks[].processor_usage): "
                    "a collective overlapped with compute takes 0.15 of the compute's rate over NVLink, 0.02 over "
                    "the NIC, while it runs",
    "gpu-h200": "this project's measurement on a lent H200 (docs/gpu/h200_bench.json, h200_profile.json, "
                "h200_check_3.txt; compare.py bench --world-size 1 --device gpu --profile, provenance inside: torch "
                "2.11, CUDA 13.0, 2026-11-26), as gpu-h100 measures: under products on end the SM clock falls from "
                "1980 to about 1470 MHz at the 700 W limit; after 8 s of them, bf16 GEMMs with one side s and two "
                "of 8192 (the three places) average 0.54 / 0.63 / 0.69 / 0.70 / 0.69 / 0.66 of 989 at s = 256 … "
                "8192 (the short squares' burst: 0.81; an earlier call the same day 0.56 … 0.73: ±4 % between "
                "calls); a device copy at 3.78 TB/s read + write (0.79 of 4.8); SDPA's FlashAttention causal "
                "forward + backward, one sequence of 16 heads of 128, at 0.12 / 0.23 / 0.28 of 989 in the "
                "planner's FLOP count at T = 2 048 / 8 192 / 32 768, of 64 heads at 0.18 / 0.26 / 0.28 (cuDNN's, "
                "16 heads: 0.22 / 0.43 / 0.49). The first lent H200 (2026-11-25) measured squares only: 811 "
                "TFLOP/s at 4096 (0.82), 3.82 TB/s",
    "gpu-h100": "this project's measurement on a lent H100 80GB HBM3 (docs/gpu/h100_bench.json, h100_profile.json, "
                "h100_smi_log.csv; compare.py bench --world-size 1 --device gpu --profile, provenance inside: torch "
                "2.11, CUDA 13.0, 2026-11-26): under products on end the SM clock falls from 1980 to 1300–1440 MHz "
                "at the 700 W limit; after 8 s of them, bf16 GEMMs with one side s and two of 8192, in the three "
                "places a step puts s (forward, dX, dW), average 0.54 / 0.67 / 0.74 / 0.74 / 0.74 / 0.70 of 989 at "
                "s = 256 … 8192 (Llama 3 405B's own tp = 8 GEMMs: 0.73–0.78, docs/gpu/h100_real_shapes.txt, "
                "scripts/gpu_shapes.py); a device copy at 2.82 TB/s read + write (0.84 of 3.35); SDPA's "
                "FlashAttention (torch's default backend) causal forward + backward, 16 heads of 128, at 0.12 / "
                "0.23 / 0.28 of 989 in the planner's FLOP count at T = 2 048 / 8 192 / 32 768 (cuDNN's, opt-in: "
                "0.21 / 0.42 / 0.48), within 2 % of the H200's (one die, one clock limit): the preset takes its "
                "64-head rows from gpu-h200",
    "fa3": "Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, abstract: 'FlashAttention-2 achieves only 35% "
           "utilization on H100 GPUs' (its forward; gpu-h100 measures forward + backward lower still)",
    "alpha-assumed": "α (per-call latency) has no vendor figure: 5 µs inside a node, 10 µs across, an assumption "
                     "of the order of nccl-tests' small-message times",
}

SIZE_TABLE = ((64, 0.5), (128, 0.7), (256, 0.8), (512, 0.9), (1024, 0.95), (2048, 1.0))  # "size-assumed"
HBM_COPY = 0.9  # "calculon-mem": of the datasheet, transfers >= 100 MB
OVERLAP_COST = (0.15, 0.02)  # "calculon-net": (intra, inter)
HBM_TABLE = ((0, 0.3 / 0.9), (10 ** 6, 0.6 / 0.9), (10 ** 7, 0.75 / 0.9), (10 ** 8, 1.0))  # "calculon-mem"
ALPHA_INTRA, ALPHA_INTER = 5e-6, 10e-6  # "alpha-assumed"
# "gpu-h200" (docs/gpu/h200_bench.json, as gpu-h100 below)
H200_MATMUL = ((256, 0.537), (512, 0.631), (1024, 0.688), (2048, 0.699), (4096, 0.685), (8192, 0.661))
H200_ATTENTION = ((16, 2048, 0.121), (16, 8192, 0.231), (16, 32768, 0.281),
                  (64, 2048, 0.176), (64, 8192, 0.256), (64, 32768, 0.276))
H200_COPY = 3.7766e12
# "gpu-h100" (docs/gpu/h100_bench.json, of the datasheet's 989; tests/test_plan.py re-derives them from it):
# the shapes' mean per smallest side, and FlashAttention's forward + backward per sequence length
H100_MATMUL = ((256, 0.538), (512, 0.666), (1024, 0.742), (2048, 0.735), (4096, 0.736), (8192, 0.697))
# the H100 measured one sequence of 16 heads (0.12 / 0.23 / 0.28, the H200's within 2 %: one die, one clock
# limit); its 64-head rows are the H200's ("gpu-h200")
H100_ATTENTION = ((16, 2048, 0.121), (16, 8192, 0.23), (16, 32768, 0.284)) + H200_ATTENTION[3:]
H100_COPY = 2.817e12


def _scaled(table, top):
    return tuple((side, round(top * f, 4)) for side, f in table)


def _links(ring, all_reduce, net):
    intra = {op: (ALPHA_INTRA, ring) for op in ("all_gather", "reduce_scatter", "all_to_all", "sendrecv", "send")}
    return dict(intra, all_reduce=(ALPHA_INTRA, all_reduce)), \
        {op: (ALPHA_INTER, net) for op in (*intra, "all_reduce")}


_A100_LINKS = _links(205e9, 205e9, 0.96 * 25e9)  # nccl-149 (200–208), nccl-119 (0.96 of HDR 200 Gb/s)
_H100_LINKS = _links(370e9, 480e9, 47e9)  # nccl-212 (ring 370, NVLS all-reduce 480), nccl-290 (46–48 per NIC)

TABLES = {
    "a100-40gb": {"peaks": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp64": 19.5e12},
                  "memory": 40960 * MiB, "matmul": _scaled(SIZE_TABLE, 0.8), "hbm_copy": HBM_COPY * 1555e9,
                  "hbm_table": HBM_TABLE,
                  "intra": _A100_LINKS[0], "inter": _A100_LINKS[1], "overlap_cost": OVERLAP_COST,
                  "cite": {"peaks": "a100-datasheet", "memory": "smi-a100-40", "matmul": "fa2 size-assumed",
                           "hbm_copy": "a100-datasheet calculon-mem", "intra": "nccl-149 alpha-assumed",
                           "inter": "nccl-119 alpha-assumed",
                           "overlap_cost": "calculon-net"}},
    "a100-80gb": {"peaks": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp64": 19.5e12},
                  "memory": 81920 * MiB, "matmul": _scaled(SIZE_TABLE, 0.8), "hbm_copy": HBM_COPY * 2039e9,
                  "hbm_table": HBM_TABLE,
                  "intra": _A100_LINKS[0], "inter": _A100_LINKS[1], "overlap_cost": OVERLAP_COST,
                  "cite": {"peaks": "a100-datasheet", "memory": "smi-a100-80", "matmul": "fa2 size-assumed",
                           "hbm_copy": "a100-datasheet calculon-mem", "intra": "nccl-149 alpha-assumed",
                           "inter": "nccl-119 alpha-assumed",
                           "overlap_cost": "calculon-net"}},
    "h100": {"peaks": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp64": 67e12},
             "memory": 81559 * MiB, "matmul": H100_MATMUL, "hbm_copy": H100_COPY, "attention": H100_ATTENTION,
             "hbm_table": HBM_TABLE,
             "intra": _H100_LINKS[0], "inter": _H100_LINKS[1], "overlap_cost": OVERLAP_COST,
             "cite": {"peaks": "h100-datasheet", "memory": "smi-h100", "matmul": "gpu-h100 h100-gemm xla-sm90",
                      "attention": "gpu-h100 fa3", "hbm_copy": "gpu-h100", "intra": "nccl-212 alpha-assumed",
                      "inter": "nccl-290 alpha-assumed", "overlap_cost": "calculon-net"}},
    "h200": {"peaks": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp64": 67e12},
             "memory": 143771 * MiB, "matmul": H200_MATMUL, "hbm_copy": H200_COPY, "attention": H200_ATTENTION,
             "hbm_table": HBM_TABLE,
             "intra": _H100_LINKS[0], "inter": _H100_LINKS[1], "overlap_cost": OVERLAP_COST,
             # the H200's NVLink and NIC are the H100's (h200-datasheet): the H100's measured figures reused
             "cite": {"peaks": "h200-datasheet", "memory": "smi-h200", "matmul": "gpu-h200",
                      "attention": "gpu-h200 fa3", "hbm_copy": "gpu-h200", "intra": "nccl-212 alpha-assumed",
                      "inter": "nccl-290 alpha-assumed", "overlap_cost": "calculon-net"}},
}

DTYPE_PEAK = {"bfloat16": "bf16", "float16": "fp16", "float8": "fp8", "float32": "tf32", "float64": "fp64"}


def peak(table: dict, dtype: str) -> float:
    """The dense tensor-core FLOP/s of ``dtype`` (float32 runs as TF32), or ValueError naming those known."""
    key = DTYPE_PEAK.get(dtype, dtype)
    if key not in table["peaks"]:
        raise ValueError(f"no {dtype} peak for this GPU; known: {', '.join(table['peaks'])}")
    return table["peaks"][key]


def citations(name: str) -> dict[str, str]:
    """{entry: the sources' text} of the preset ``name``."""
    return {k: "; ".join(SOURCES[s] for s in v.split()) for k, v in TABLES[name]["cite"].items()}


# --- a measured profile (compare.py bench --profile) ----------------------------------------------------


def save(path: str, profile: dict) -> None:
    """Write a profile: the keys above ("cite": what measured it) as JSON."""
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)


MAX_PROFILE_BYTES = 64 << 20  # a profile is a few kB


def load(path: str) -> dict:
    """A profile written by ``save``, checked: one clear error naming what is missing or wrong."""
    from shared.bounded import BadFile, read_json

    try:  # bounded before parsing: /dev/zero refused at once, a pipe read up to the cap
        data = read_json(path, "a bench --profile file", MAX_PROFILE_BYTES)
    except BadFile as exc:
        raise ValueError(f"profile {exc}" + (" (write it with compare.py bench --profile)" if ": not JSON" in str(exc)
                                            else "")) from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {path}: not a bench --profile file (a JSON object)")
    missing = [k for k in ("peaks", "matmul", "hbm_copy", "intra", "inter") if k not in data]
    if missing:
        raise ValueError(f"profile {path}: missing {', '.join(missing)} (write it with compare.py bench --profile)")
    data["matmul"] = tuple((int(s), float(f)) for s, f in data["matmul"])
    data["hbm_table"] = tuple((float(s), float(f)) for s, f in data.get("hbm_table", ()))
    data["attention"] = tuple((int(r[0]), int(r[1]), float(r[2])) if len(r) == 3 else  # (heads, T, fraction);
                              (LEGACY_ATTENTION_HEADS, int(r[0]), float(r[1]))  # an older profile's (T, fraction)
                              for r in data.get("attention", ()))
    if any(not 0 < f <= 1 for _, _, f in data["attention"]):
        raise ValueError(f"profile {path}: attention fractions must lie in (0, 1]")
    for where in ("intra", "inter"):
        data[where] = {op: (float(a), float(b)) for op, (a, b) in data[where].items()}
        if any(b <= 0 for _, b in data[where].values()):
            raise ValueError(f"profile {path}: {where} has a non-positive bandwidth")
    if not data["matmul"] or any(not 0 < f <= 1 for _, f in data["matmul"]):
        raise ValueError(f"profile {path}: matmul fractions must lie in (0, 1]")
    return data


def preset_of(device_name: str) -> str | None:
    """The preset a device's reported name belongs to ('NVIDIA H200' -> 'h200'), or None."""
    name = device_name.lower()
    if "a100" in name:
        return "a100-80gb" if "80" in name else "a100-40gb"
    return next((p for p in ("h200", "h100") if p in name), None)


def from_bench(bench: dict, memcpy: float | None = None, memory: int | None = None, dtype: str = "",
               device_name: str = "") -> dict:
    """A profile from ``compare.py bench``'s measurements on this machine: peaks = the fastest matmul rate
    per dtype (every rank multiplying at once), the matmul table = each size's rate over the fastest
    (``dtype``'s, default bfloat16 where measured (GPUs), else float32; square n×n×n: the smallest side
    is n), HBM copy = ``memcpy`` bytes/s (read + write), ``memory`` the device's capacity (GPUs),
    intra = inter = the α–β fit per op (β as busbw: the algbw fit × nccl-tests' bus factor; one machine;
    where the fit found no size dependence, the busbw of the op's largest message in ``results``). One device
    (world size 1) times no collective: its links are the cited ones of the preset ``device_name`` belongs to,
    and the profile's "cite" says so; a device of no preset is refused. A GPU of a preset keeps its datasheet
    peaks (what MFU is counted against), every fraction then of them (same step times)."""
    from shared.theory import BUSBW_FACTOR

    n = bench["world_size"]
    rates = {dt: {int(s): r for s, r in sizes.items()} for dt, sizes in bench.get("compute", {}).items() if sizes}
    dtype = dtype or ("bfloat16" if "bfloat16" in rates else "float32")
    if dtype not in rates:
        raise ValueError(f"bench: no {dtype} matmul rates measured (torch measures them)")
    top = max(rates[dtype].values())
    links = {}
    for f in bench["fits"]:
        if f["framework"] != "torch":
            continue
        if f["beta_bytes_per_s"] not in (None, float("inf")):
            links[f["op"]] = (f["alpha_s"], f["beta_bytes_per_s"] * BUSBW_FACTOR[f["op"]](n))
        else:  # no size dependence resolved (a short sweep): the busbw seen at its largest message, which
            rows = [r for r in bench.get("results", ()) if r["framework"] == "torch" and r["op"] == f["op"]]
            if rows:  # with α on top errs slow (at most 2× at that size), never fast
                links[f["op"]] = (f["alpha_s"], max(rows, key=lambda r: r["size_bytes"])["busbw"])
    cite = {"all": f"measured on this machine by compare.py bench ({n} ranks)"}
    intra = inter = links
    if not links and n == 1:  # one device: no collective to time; the links its preset cites
        preset = preset_of(device_name)
        if preset is None:
            raise ValueError(f"bench --profile at world size 1 measured no collective, and the device "
                             f"{device_name or 'cpu'!r} matches no GPU preset ({', '.join(TABLES)}) to take the "
                             "links from: run with --world-size >= 2")
        intra, inter = TABLES[preset]["intra"], TABLES[preset]["inter"]
        cite["intra"] = cite["inter"] = f"one device measured: the {preset} preset's cited links (" + \
            "; ".join(TABLES[preset]["cite"][k] for k in ("intra", "inter")) + ")"
    elif not links:
        raise ValueError("bench: no torch α–β fits with a finite bandwidth, and no torch rows")
    if "sendrecv" in links:
        links["send"] = links["sendrecv"]
    peaks = {DTYPE_PEAK[dt]: max(r.values()) for dt, r in rates.items()}
    table, extra = shaped_table(bench, dtype, top)
    if extra:
        peaks[DTYPE_PEAK[dtype]] = top = extra["top"]
    matmul = table or tuple((s, rates[dtype][s] / top) for s in sorted(rates[dtype]))
    attention = attention_table(bench, top) if bench.get("attention") else ()
    preset = preset_of(device_name) if device_name else None
    sheet = TABLES[preset]["peaks"].get(DTYPE_PEAK[dtype]) if preset else None
    if sheet and top <= sheet:  # a GPU of a preset: fractions of its datasheet peaks, the peaks MFU counts
        scale = top / sheet  # against (the step times are the same: fraction × peak = the measured rate)
        matmul = tuple((s, round(f * scale, 4)) for s, f in matmul)
        attention = tuple((h, t, round(f * scale, 4)) for h, t, f in attention)
        cite["peaks"] = f"the {preset} preset's datasheet peaks; measured fastest: " + ", ".join(
            f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in peaks.items())
        peaks = dict(TABLES[preset]["peaks"])
    return {"peaks": peaks, "matmul": matmul, **({"attention": attention} if attention else {}),
            "hbm_copy": memcpy or bench.get("memcpy", 0.0), "intra": intra, "inter": inter,
            **({"memory": int(memory)} if memory else {}),
            **({"device": device_name} if device_name else {}), "cite": cite}


def shaped_table(bench: dict, dtype: str, top: float) -> tuple[tuple, dict]:
    """The size table from bench's training-shaped GEMMs (a GPU's "shapes": {"m×n×k": FLOP/s}, bfloat16,
    timed after seconds of products on end, at the power limit's clock): per smallest side, the mean rate of
    the three places a step puts it (forward, dX, dW) over the fastest rate measured (the short squares'
    burst, the profile's peak). ((), {}) when bench measured no shapes or ``dtype`` is not theirs."""
    shapes = bench.get("shapes") or {}
    if not shapes or dtype != "bfloat16":
        return (), {}
    top = max(top, *shapes.values())
    sides = {}
    for key, rate in shapes.items():
        m, n, k = (int(x) for x in key.split("x"))
        sides.setdefault(min(m, n, k), []).append(rate)
    return tuple((side, round(sum(r) / len(r) / top, 4)) for side, r in sorted(sides.items())), {"top": top}


LEGACY_ATTENTION_HEADS = 16  # bench's attention keys before they named the heads: T alone, 16 heads


def attention_table(bench: dict, top: float) -> tuple:
    """((heads, T, fraction of ``top``), ...) ascending: SDPA's causal forward + backward rate at each width
    (sequences × heads of 128) and sequence length bench measured (the planner's FLOP count,
    parallel_twins/bench.py _cuda_attention), of the backend torch runs by default: FlashAttention, first in
    SDPA's fixed priority (cuDNN's, 1.7–2.3× faster on Hopper, is opt-in: sdpa_kernel(SDPBackend.
    CUDNN_ATTENTION)); cuDNN's where flash did not run."""
    att = bench["attention"]
    rates = att.get("flash") or next(iter(att.values()))
    rows = []
    for key, r in rates.items():
        h, t = key.split("x") if "x" in key else (LEGACY_ATTENTION_HEADS, key)
        rows.append((int(h), int(t), round(min(1.0, r / top), 4)))
    return tuple(sorted(rows))
