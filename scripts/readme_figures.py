"""Regenerate the measured blocks of docs/ (and README.md) from fresh runs here: no figure is copied by hand.

    python scripts/readme_figures.py                 # every block (about 6 min on 2 cores)
    python scripts/readme_figures.py --only fsdp,plan
    python scripts/readme_figures.py --check         # every block in README.md and docs/ has a recipe here (no run)

Each block sits between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->`` in the page IN_FILE
names (README.md for a block not in IN_FILE) and is replaced whole: the command's output as printed when
piped (plain text), under a line naming the command, the date, the machine and the versions it came from. The
``run`` block re-renders an excerpt of the default run's table from its ``--json`` with parallel_twins/report.py, and
keeps its closing lines.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
sys.path.insert(0, ROOT)

PLAN = ["plan", "--layers", "80", "--dim", "8192", "--heads", "64", "--vocab", "128256", "--seq", "8192",
        "--global-batch", "1024", "--gpus", "256", "--top", "3"]
BLOCKS = {  # name: the compare.py arguments it shows
    "run": ["--all", "--json", "{tmp}/run.json"],  # the whole matrix (the plain run is its tour: shared.vocab.TOUR)
    "fsdp": ["--show-collectives", "fsdp"],
    "mesh": ["--model", "transformer", "--mesh", "dp=2,tp=2,pp=2", "--show-collectives", "mesh"],
    "ep": ["--model", "transformer", "--show-collectives", "ep", "--experts", "8", "--topk", "2"],
    "plan": PLAN,
    # docs/plan.md's worked examples: Llama 3 405B's layout (the repository's model at 128 layers), an MoE model
    "planbig": ["plan", "--layers", "128", "--dim", "16384", "--heads", "128", "--vocab", "128256", "--seq", "8192",
                "--global-batch", "2048", "--gpus", "16384", "--layout", "fsdp=128,tp=8,pp=16", "--top", "3"],
    "planmoe": ["plan", "--layers", "32", "--dim", "4096", "--heads", "32", "--vocab", "32000", "--seq", "4096",
                "--global-batch", "1024", "--gpus", "256", "--experts", "8", "--topk", "2", "--top", "3"],
    "checkpoint": ["checkpoint", "--model", "transformer"],
    "modes": ["--model", "transformer", "--mesh", "fsdp=2,tp=2", "--show-collectives", "mesh"],
    # torch's compiler beside the others: tp, where the compiled programs hold the collectives (issue 49)
    "compiled": ["--model", "transformer", "--show-collectives", "tp",
                 "--styles", "explicit,builtin,compiled,shard_map,typed,jit"],
    "gpu": None,  # no run here: rendered from what scripts/gpu_check.sh brought back from a GPU (GPU_DIR)
}
# A lent GPU's results, copied from scripts/gpu_check.sh's output folder: the profile, the bench JSON, the log.
GPU_DIR, GPU_NAME, GPU_CHECK = os.path.join(ROOT, "docs", "gpu"), "h200", 3  # NAME_check_N.txt: the latest log
# float32 with TF32 off runs on the FP32 units, not the tensor cores: H100/H200 SXM datasheets, FP32 67 TFLOP/s;
# the A100's, 19.5 (a100-datasheet): the block renders whichever preset's GPU gpu_check.sh ran on.
FP32_DATASHEET = {"h100": 67e12, "h200": 67e12, "a100-80gb": 19.5e12, "a100-40gb": 19.5e12}
# The page each block lives in (README.md for a block not named here).
IN_FILE = {"run": "docs/cli.md", "fsdp": "docs/sharding_modes.md", "mesh": "docs/mesh.md", "ep": "docs/ep.md",
           "plan": "docs/plan.md", "planbig": "docs/plan.md", "planmoe": "docs/plan.md",
           "checkpoint": "docs/checkpoint.md", "modes": "docs/sharding_modes.md", "compiled": "docs/sharding_modes.md"}
# The default run's rows docs/cli.md shows (pattern, model, framework, style, variant); the rest: --json.
EXCERPT = [
    ("dp", "mlp", "torch", "explicit", "bucketed"), ("dp", "transformer", "torch", "builtin", "ddp"),
    ("dp", "transformer", "jax", "shard_map", "zero1"), ("fsdp", "transformer", "torch", "explicit", "zero3"),
    ("fsdp", "transformer", "torch", "builtin", "fsdp2"), ("fsdp", "transformer", "jax", "jit", "zero3"),
    ("tp", "mlp", "torch", "explicit", "megatron"), ("tp", "transformer", "torch", "explicit", "megatron"),
    ("tp", "transformer", "torch", "builtin", "dtensor"), ("tp", "transformer", "jax", "shard_map", "megatron"),
    ("tp", "transformer", "torch", "explicit", "megatron_sp"), ("tp", "transformer", "jax", "jit", "megatron_sp"),
    ("pp", "transformer", "torch", "explicit", "1f1b"), ("pp", "transformer", "jax", "shard_map", "circular"),
    ("cp", "transformer", "torch", "explicit", "ring"), ("cp", "transformer", "jax", "shard_map", "ring_zigzag"),
    ("cp", "transformer", "torch", "explicit", "ulysses"), ("cp", "transformer", "jax", "jit", "seq_sharded"),
    ("ep", "transformer", "torch", "explicit", "dropless"), ("ep", "transformer", "jax", "shard_map", "capacity"),
]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import jax  # noqa: F401 - versions only (no backend is started)
    import torch

    return (f"{os.cpu_count()} cores ({cpu}), torch {torch.__version__}, jax {sys.modules['jax'].__version__}, "
            f"Python {platform.python_version()}")


def run(args: list[str]) -> tuple[str, float]:
    """compare.py's stdout when piped (plain text, nothing cut) and the seconds it took; fails loudly."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "compare.py", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"compare.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout.rstrip("\n"), time.perf_counter() - t0


def run_block(stdout: str, path: str, seconds: float) -> str:
    """The default run: its size, an excerpt of its table, its closing lines."""
    from parallel_twins import report
    from shared.results import RunResult

    data = json.load(open(path))
    rows = [RunResult(**r) for r in data["runs"]]
    key = {(r.pattern, r.model, r.framework, r.style, r.variant): r for r in rows}
    missing = [k for k in EXCERPT if k not in key]
    if missing:
        sys.exit(f"the default run has no row {missing[0]}: update EXCERPT in {__file__}")
    count = {p: sum(r.pattern == p for r in rows) for p in dict.fromkeys(r.pattern for r in rows)}
    mlp = sum(r.model == "mlp" for r in rows)
    lines = [f"{len(rows)} runs ({', '.join(f'{p} {n}' for p, n in count.items())}; {mlp} on the MLP, "
             f"{len(rows) - mlp - count.get('collectives', 0)} on the transformer), {seconds:.0f} s in all; "
             f"the excerpt below, every row with --json / --markdown:", ""]
    lines += [line.text for line in report.table_lines([key[k] for k in EXCERPT], 100)]
    tail = stdout.splitlines()
    keep = [t for t in tail if t.startswith(("cross-framework", "pp bubble transformer", "verdict"))]
    xfw = [t for t in keep if t.startswith("cross-framework")]
    lines += ["", *xfw[:2], "...", *xfw[-1:], *[t for t in keep if not t.startswith("cross-framework")]]
    return "\n".join(lines)


def gpu_block() -> tuple[str, str]:
    """(body, stamp) of the GPU block: the gpu-marked tests' summary and the single-GPU matmul and copy rates,
    from GPU_DIR (the check's log, bench JSON and profile), against the preset's datasheet peaks."""
    from shared import efficiency

    bench = json.load(open(os.path.join(GPU_DIR, f"{GPU_NAME}_bench.json")))
    prov = bench["provenance"]
    log = open(os.path.join(GPU_DIR, f"{GPU_NAME}_check_{GPU_CHECK}.txt")).read()
    runs = [line for line in log.splitlines() if re.match(r"\d+ (passed|failed)", line)]
    tests = "\n  " + runs[0] + "".join(
        "\n  the failed torch test again, torch 2.13's all_gather_single / reduce_scatter_single aliased"
        f"\n  (the image's torch 2.11 lacks them: scripts/torch_compat): {r}" for r in runs[1:])
    preset = efficiency.preset_of(prov["gpu"]["names"][0])
    peaks = dict(efficiency.TABLES[preset]["peaks"], tf32=FP32_DATASHEET[preset])  # the FP32 units' rate
    sizes = sorted({int(n) for rates in bench["compute"].values() for n in rates})
    lines = [f"pytest -m gpu (compare.py at world size 1, every pattern and style, float32, TF32 off: torch on "
             f"NCCL, JAX on the GPU):{tests}", "",
             "matmul n×n×n, TFLOP/s (kernels only: a CUDA graph of 20 products between two events)",
             f"{'n':>14}" + "".join(f"{n:>8}" for n in sizes) + "   datasheet"]
    for dtype, key in (("bfloat16", "bf16"), ("float32", "tf32"), ("float64", "fp64")):
        rates = bench["compute"][dtype]
        label = {"float32": "float32 ieee"}.get(dtype, dtype)  # TF32 off: the FP32 units
        lines.append(f"{label:>14}" + "".join(f"{rates[str(n)] / 1e12:8.1f}" if str(n) in rates else f"{'-':>8}"
                                                for n in sizes) + f"   {peaks[key] / 1e12:g}")
    lines += ["", f"device copy (read + write): {bench['memcpy'] / 1e9:.0f} GB/s; best bf16 matmul "
              f"{max(bench['compute']['bfloat16'].values()) / peaks['bf16']:.2f} of the datasheet"]
    if bench.get("sustained"):  # bench's GPU additions (the planner's profile reads them): see its docstrings
        sus = bench["sustained"]
        lines += ["", f"bfloat16 8192³ on end for {sus['seconds']:.0f} s (the power limit): {sus['first'] / 1e12:.0f} "
                  f"TFLOP/s over the first 0.5 s, {sus['last'] / 1e12:.0f} over the last 2 s"]
    if bench.get("shapes"):
        sides = {}
        for key, rate in bench["shapes"].items():
            sides.setdefault(min(int(x) for x in key.split("x")), []).append(rate)
        lines += ["then bfloat16 GEMMs with one side s and two of 8192, the mean of s's three places (Y, dX, dW):",
                  f"{'s':>14}" + "".join(f"{n:>8}" for n in sorted(sides)),
                  f"{'TFLOP/s':>14}" + "".join(f"{sum(r) / len(r) / 1e12:8.0f}" for _, r in sorted(sides.items())),
                  f"{'of datasheet':>14}" + "".join(f"{sum(r) / len(r) / peaks['bf16']:8.2f}"
                                                    for _, r in sorted(sides.items()))]
    if bench.get("attention"):
        keys = sorted({k if "x" in k else f"16x{k}" for r in bench["attention"].values() for k in r},
                      key=lambda k: tuple(int(x) for x in k.split("x")))
        lines += ["", "SDPA causal forward + backward, bfloat16, one sequence of H heads of 128, TFLOP/s in the "
                  "planner's count (3 × 2·T²·H·128)", f"{'H × T':>15}" + "".join(f"{k.replace('x', '×'):>10}"
                                                                                 for k in keys)]
        for backend, rates in bench["attention"].items():
            rates = {(k if "x" in k else f"16x{k}"): r for k, r in rates.items()}
            label = {"flash": "flash (default)"}.get(backend, backend)
            lines.append(f"{label:>15}" + "".join(f"{rates[k] / 1e12:10.0f}" if k in rates else f"{'-':>10}"
                                                  for k in keys))
    step_path = os.path.join(GPU_DIR, f"{GPU_NAME}_step_check.json")
    if os.path.exists(step_path):  # scripts/gpu_step_check.py: a measured training step against the planner's
        from gpu_step_check import plan_step  # the planner as it is now, against the step measured then

        step = json.load(open(step_path))
        lines += ["", f"a training step of the repository's Transformer (bf16, AdamW, one GPU) against compare.py "
                  f"plan's ({step['preset']} preset):", f"{'L':>3} {'D':>5} {'H':>3} {'T':>5} {'B':>2}  "
                  f"{'measured ms':>11} {'planned ms':>10} {'plan/measured':>13}"]
        for r in step["rows"]:
            planned = plan_step(*(r[k] for k in ("layers", "dim", "heads", "vocab", "seq", "batch")),
                                step["preset"])["step"]
            lines.append(f"{r['layers']:>3} {r['dim']:>5} {r['heads']:>3} {r['seq']:>5} {r['batch']:>2}  "
                         f"{r['measured_s'] * 1e3:11.1f} {planned * 1e3:10.1f} {planned / r['measured_s']:13.2f}")
    stamp = (f"measured {prov['date'][:10]} on one {prov['gpu']['names'][0]} (driver {prov['gpu']['driver']}), "
             f"torch {prov['packages']['torch']} (CUDA {prov['cuda']['torch_cuda']}, NCCL {prov['cuda']['nccl']}), "
             f"jax {prov['packages']['jax']}")
    return "\n".join(lines), stamp


def replace_block(text: str, name: str, body: str, command: str, stamp: str) -> str:
    pattern = re.compile(rf"(<!-- figures:{name} -->\n).*?(<!-- /figures:{name} -->)", re.S)
    if not pattern.search(text):
        sys.exit(f"no block {name} in its file (IN_FILE)")
    new = f"`{command}` ({stamp}):\n\n```\n{body}\n```\n"
    return pattern.sub(lambda m: m.group(1) + new + m.group(2), text)


def blocks_in(text: str) -> list[str]:
    return re.findall(r"<!-- figures:([a-z]+) -->", text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(BLOCKS), help="comma list of " + ", ".join(BLOCKS))
    p.add_argument("--check", action="store_true", help="only check that the pages' blocks and these recipes match")
    args = p.parse_args(argv)
    pages = {README, *glob.glob(os.path.join(ROOT, "docs", "*.md")), *[os.path.join(ROOT, f) for f in IN_FILE.values()]}
    texts = {path: open(path).read() for path in pages}
    before = dict(texts)
    where = {name: os.path.join(ROOT, IN_FILE[name]) if name in IN_FILE else README for name in BLOCKS}
    for path, text in texts.items():
        found, want = blocks_in(text), [n for n in BLOCKS if where[n] == path]
        if sorted(found) != sorted(want) or any(text.count(f"<!-- /figures:{n} -->") != 1 for n in found):
            print(f"{os.path.relpath(path, ROOT)} blocks {found} vs recipes {want}", file=sys.stderr)
            return 1
    if args.check:
        return 0
    stamp_base = f"measured {datetime.date.today().isoformat()} on {machine()}"
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            if BLOCKS[name] is None:  # the GPU block: from files, no run
                body, stamp = gpu_block()
                texts[where[name]] = replace_block(texts[where[name]], name, body,
                                                   "bash scripts/gpu_check.sh (docs/gpu/)", stamp)
                continue
            argv_ = [a.format(tmp=tmp) for a in BLOCKS[name]]
            print(f"running compare.py {' '.join(argv_)} …", file=sys.stderr, flush=True)
            out, seconds = run(argv_)
            shown = [a for a in argv_ if "{tmp}" not in a and tmp not in a]
            shown = [a for i, a in enumerate(shown) if not (a == "--json" and i == len(shown) - 1)]
            body = run_block(out, f"{tmp}/run.json", seconds) if name == "run" else out
            texts[where[name]] = replace_block(texts[where[name]], name, body, " ".join(["python compare.py", *shown]),
                                               f"{stamp_base}; {seconds:.0f} s")
    for path, text in texts.items():
        if text == before[path]:
            continue
        with open(path, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
