"""``compare.py bench``: an nccl-tests-style sweep of the collectives in both frameworks.

    python compare.py bench --frameworks torch,jax --world-size 4 --json bench.json

For each op (all-reduce, all-gather, reduce-scatter, all-to-all) and size: warm-up, then the timed
iterations (torch on CPU: the median of calls timed alone, gloo's calls block; torch on CUDA and JAX:
back to back between two blocks, divided by their number); ``algbw`` = size / time and ``busbw`` =
algbw × nccl-tests' bus factor (shared.plan.bus_factor); then a latency/bandwidth fit ``t = α + n/β``
per op. With torch it also measures the matmul FLOP/s each rank gets while every rank multiplies
(what ``plan --calibrate`` reads). Torch ranks import this module (``_torch_bench``): its top level imports no JAX.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from parallel_twins.args import (
    ArgumentError,
    HelpFormatter,
    Parser,
    add_device,
    add_frameworks,
    add_json,
    add_quiet,
    add_resource_check,
    add_world_size,
    check_devices,
    check_output_path,
    csv_list,
    launched,
    prog,
)
from shared.collectives import BENCH_OPS  # NumPy only: safe before JAX starts
from shared.env import simulate_host_devices


def build_bench_parser() -> argparse.ArgumentParser:
    p = Parser(prog=f"{prog()} bench", formatter_class=HelpFormatter,
               description="nccl-tests-style bandwidth sweep of the collectives (time per call, algbw, busbw, "
                           "an α–β fit per op) and each torch rank's matmul FLOP/s. `bench --overhead [run options]`: "
                           "instead, the harness's own cost: every row's timed step against the same step bare "
                           "(taken in turns) and the plain single-device step (docs/cli.md).")
    add_frameworks(p)
    add_world_size(p, 4, "ranks / devices (1: one device's matmuls and copy only, no collective)")
    p.add_argument("--ops", type=csv_list(BENCH_OPS), default=list(BENCH_OPS), metavar="LIST",
                   help=f"comma list of {', '.join(BENCH_OPS)}")
    p.add_argument("--min-bytes", type=int, default=4 * 1024, help="smallest message (bytes)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="largest message, bytes; sizes step ×4 (default: 16 MiB on CPU, 256 MiB on GPUs)")
    p.add_argument("--iters", type=int, default=10,
                   help="timed iterations per size (gloo: their median; CUDA and JAX: back to back, their mean)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per size first")
    add_device(p)
    add_json(p, "{world_size, results, fits, compute, memcpy}")
    p.add_argument("--profile", metavar="PATH", default=None,
                   help="write what this machine achieves (matmul rates by size, busbw per op, memcpy) as the "
                        "table compare.py plan --profile reads (shared/efficiency.py) (default: none)")
    add_quiet(p, "print nothing (with --json: the measurements go there only)")
    add_resource_check(p)
    return p


def bench_main(argv) -> int:
    try:
        args = build_bench_parser().parse_args(argv)
        if args.world_size < 1:
            raise ValueError(f"bench needs world_size >= 1, got {args.world_size}")
        from torch_impl.launch import resolve_device

        if args.world_size == 1:  # one device (a one-GPU node): nothing to time between devices
            args.ops, args.frameworks = [], ["torch"]
            if args.profile and resolve_device(args.device, 1) == "cpu":
                raise ValueError("--profile at world size 1 needs a GPU (its links come from the GPU's preset); "
                                 "on CPU give --world-size >= 2 so the collectives are timed")
        if args.max_bytes is None:  # GPUs: up to where the bus bandwidth is reached, as nccl-tests sweeps
            gpu = "torch" in args.frameworks and resolve_device(args.device, args.world_size) == "cuda"
            args.max_bytes = (256 if gpu else 16) * 1024 * 1024
        if not 0 < args.min_bytes <= args.max_bytes:
            raise ValueError(f"need 0 < --min-bytes <= --max-bytes, got {args.min_bytes}, {args.max_bytes}")
        if args.iters < 1 or args.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
        check_output_path("--json", args.json)
        check_output_path("--profile", args.profile)
        if args.profile and "torch" not in args.frameworks:
            raise ValueError("--profile needs the torch framework (it measures the matmuls and the copies)")
        if "jax" in args.frameworks:
            from parallel_twins.preflight import check_jax_environment

            check_jax_environment(os.environ)
        if not args.no_resource_check:  # before any rank, process or device exists (parallel_twins/preflight.py)
            from parallel_twins.preflight import check_bench_resources
            from shared.env import local_gpu_count

            check_bench_resources(args.frameworks, args.world_size, args.max_bytes, args.iters,
                                  on_gpu=args.device != "cpu" and local_gpu_count() > 0, launched=launched())
        simulate_host_devices(args.world_size)  # before JAX starts
        check_devices(args.frameworks, args.world_size, args.device)
    except (ArgumentError, ValueError) as exc:
        print(f"{prog()} bench: error: {exc}", file=sys.stderr)
        return 2
    from rich.table import Table

    from parallel_twins.report import fmt_bytes, make_console, write_json
    from shared.collectives import fit_per_op

    sizes, s = [], args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 4
    results, matmul = run_bench(args.frameworks, args.world_size, args.ops, sizes, args.iters, args.warmup,
                                args.device, matmul=True)
    fits = [{"framework": fw, "op": op, **fit} for fw in args.frameworks
            for op, fit in fit_per_op([r for r in results if r["framework"] == fw]).items()]
    compute = {}  # every torch rank multiplying at once: the FLOP/s a rank of a run gets (plan --calibrate)
    extras = ("memcpy", "memory", "name", "shapes", "sustained", "attention")  # one device's, not per dtype
    for dtype in [k for k in matmul[0] if k not in extras] if matmul else ():
        compute[dtype] = {n: sorted(r[dtype][n] for r in matmul)[len(matmul) // 2] for n in matmul[0][dtype]}
    memcpy = sorted(r["memcpy"] for r in matmul)[len(matmul) // 2] if matmul else 0.0
    failed = None  # a result file that could not be written (full disk, read-only): one line, exit 1, table kept
    try:
        if args.json:  # first: nothing printed below can lose the measurements
            from shared.provenance import process_layout, provenance, stamp

            block = provenance([prog(), "bench", *argv], world_size=args.world_size,
                               layout=process_layout(args.frameworks, args.world_size, args.device))
            write_json(args.json, stamp({"world_size": args.world_size, "results": results, "fits": fits,
                                         "compute": compute, "memcpy": memcpy,
                                         **{k: matmul[0][k] for k in extras[3:] if matmul and k in matmul[0]}},
                                        block))
        if args.profile:
            from shared import efficiency

            efficiency.save(args.profile, efficiency.from_bench(
                {"world_size": args.world_size, "fits": fits, "compute": compute, "results": results,
                 **{k: matmul[0][k] for k in extras[3:] if k in matmul[0]}}, memcpy,
                matmul[0].get("memory"), device_name=matmul[0].get("name", "")))
    except OSError as exc:
        failed = f"{prog()} bench: could not write the results: {exc}"
    console = make_console(quiet=args.quiet, json_to_stdout=args.json == "-")  # --json -: JSON alone on stdout
    table = Table(title=f"collective bandwidth, world size {args.world_size} ({args.iters} timed calls per size)")
    for col in ("framework", "op", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(col, justify="left" if col in ("framework", "op") else "right", overflow="fold")
    for r in results:
        table.add_row(r["framework"], r["op"], fmt_bytes(r["size_bytes"]), f"{1e6 * r['time_s']:.1f}",
                      f"{r['algbw'] / 1e9:.3f}", f"{r['busbw'] / 1e9:.3f}")
    if results:
        console.print(table)
    else:
        console.print("world size 1: no collective timed (one device); the matmuls and the device copy only")
    for fit in fits:
        beta = fit["beta_bytes_per_s"]
        beta_text = f"{beta / 1e9:7.3f} GB/s" if beta != float("inf") else "   n/a (no size dependence measured)"
        console.print(f"{fit['framework']:5s} {fit['op']:15s} t = α + n/β:  α = {1e6 * fit['alpha_s']:8.1f} us,  "
                      f"β = {beta_text}")
    for dtype, rates in compute.items():
        console.print(f"torch matmul {dtype:8s} FLOP/s per rank, {args.world_size} at once (median rank): " + ", ".join(
            f"n={n}: {rate / 1e9:.2f} G" for n, rate in rates.items()))
    console.print(f"device copy (read + write): {memcpy / 1e9:.1f} GB/s")
    one = matmul[0] if matmul else {}
    if one.get("shapes"):
        console.print("torch bfloat16 GEMMs m×n×k, TFLOP/s: " + ", ".join(
            f"{k}: {r / 1e12:.0f}" for k, r in one["shapes"].items()))
    if one.get("sustained"):
        s = one["sustained"]
        console.print(f"8192³ bfloat16 for {s['seconds']:.0f} s: {s['first'] / 1e12:.0f} TFLOP/s over the first "
                      f"0.5 s, {s['last'] / 1e12:.0f} over the last 2 s")
    for backend, rates in one.get("attention", {}).items():
        console.print(f"SDPA {backend} causal forward + backward (planner's FLOPs), TFLOP/s: " + ", ".join(
            f"{k.replace('x', ' heads, T=')}: {r / 1e12:.0f}" for k, r in rates.items()))
    if failed:
        print(failed, file=sys.stderr)
        return 1
    return 0


def run_bench(frameworks, world_size, ops, sizes, iters, warmup, device, matmul=False) -> tuple[list[dict], list]:
    """The nccl-tests-style sweep in each framework: dicts {framework, op, size_bytes, time_s, algbw, busbw};
    with ``matmul`` also every torch rank's matmul rates, in the same launch (_torch_matmul)."""
    results, rates = [], []
    for fw in frameworks:
        if fw == "torch":
            from torch_impl.launch import launch

            per_rank = launch(_torch_bench, world_size, tuple(ops), tuple(sizes), iters, warmup, matmul, device=device)
            results += per_rank[0]["rows"]
            rates = [r["matmul"] for r in per_rank] if matmul else []  # {dtype: {n: FLOP/s}, "memcpy", "memory"}
        else:
            from jax_impl.collectives import bench
            from jax_impl.devices import make_mesh

            results += [dict(r, framework="jax") for r in
                        bench(make_mesh(world_size, "x", device), tuple(ops), tuple(sizes), iters, warmup)]
    return results, rates


def _torch_matmul(ctx, sizes=None, iters=20) -> dict:
    """{dtype: {n: FLOP/s}} of an (n, n) @ (n, n) product on this rank. CPU: n = 32 … 256, the median of
    ``iters`` timed products. CUDA: n = 128 … 8192 (float64 to 4096: flat by then), ``iters`` products
    captured in one CUDA graph and replayed between two CUDA events: the kernels' rate (launched one by
    one from Python, the host's ~10 µs per launch capped a 1024² bf16 product near 0.2 of an H200's peak)."""
    import torch

    cuda = ctx.device.type == "cuda"
    sizes = sizes or ((128, 256, 512, 1024, 2048, 4096, 8192) if cuda else (32, 64, 128, 256))
    out = {}
    for dtype in ("float64", "float32") + (("bfloat16",) if cuda else ()):  # a GPU's tensor-core dtype too
        out[dtype] = {}
        for n in sizes:
            if cuda and dtype == "float64" and n > 4096:
                continue
            a = torch.randn(n, n, dtype=getattr(torch, dtype), device=ctx.device)
            for _ in range(2):  # warm-up
                a @ a
            if cuda:  # the kernels alone: ``iters`` products captured in a CUDA graph, replayed between events
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(iters):
                        a @ a
                graph.replay()  # warm-up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(ctx.device)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3 / iters
            else:
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    a @ a
                    times.append(time.perf_counter() - t0)
                seconds = sorted(times)[iters // 2]
            out[dtype][str(n)] = 2 * n ** 3 / seconds
    src = torch.empty(2 ** 22 if not cuda else 2 ** 28, dtype=torch.uint8, device=ctx.device)  # 4 MiB / 256 MiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):  # a device copy reads and writes every byte: 2·size per copy
        if cuda:
            torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(ctx.device)
        times.append(time.perf_counter() - t0)
    out["memcpy"] = 2 * src.numel() / sorted(times)[2]
    if cuda:  # the capacity as the device reports it (the planner's memory), and its name (the nearest preset)
        out["memory"] = torch.cuda.get_device_properties(ctx.device).total_memory
        out["name"] = torch.cuda.get_device_name(ctx.device)
        # first seconds of products on end: the card settles at its power limit's clock (an H200's SM clock
        # fell from 1980 to about 1470 MHz at 700 W), as in a training step; the shapes are timed after it
        out["sustained"] = _cuda_sustained(ctx.device)
        out["shapes"] = _cuda_shapes(ctx.device, iters)
        out["attention"] = _cuda_attention(ctx.device)
    return out


# A GPU's training-shaped GEMMs (bfloat16): one side s, the other two L = 8192, in each of the three places a
# training step puts the small side (Y = X·W: (m, n, k) = (tokens, out, in); dX = dY·Wᵀ; dW = Xᵀ·dY): the
# planner's size table by the smallest side, measured (shared/efficiency.py from_bench)
SHAPE_SIDES, SHAPE_LARGE = (256, 512, 1024, 2048, 4096, 8192), 8192


def _graph_seconds(fn, iters, device) -> float:
    """Seconds per call of ``fn``: ``iters`` calls captured in one CUDA graph, replayed between two events (CPU,
    where tests run these functions at toy sizes: the calls timed back to back)."""
    import torch

    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_shapes(device, iters, sides=SHAPE_SIDES, large=SHAPE_LARGE, dtype="bfloat16") -> dict[str, float]:
    """{"m×n×k": FLOP/s} of (m×k)·(k×n) products over ``sides`` × the three places of the small side."""
    import torch

    out, L = {}, large
    for s in sides:
        for m, n, k in sorted({(s, L, L), (L, s, L), (L, L, s)}):
            a = torch.randn(m, k, dtype=getattr(torch, dtype), device=device)
            b = torch.randn(k, n, dtype=getattr(torch, dtype), device=device)
            out[f"{m}x{n}x{k}"] = 2 * m * n * k / _graph_seconds(lambda a=a, b=b: a @ b, iters, device)
    return out


def _cuda_sustained(device, seconds: float = 8.0, n: int = 8192, dtype="bfloat16") -> dict[str, float]:
    """A training step multiplies for seconds on end, under the card's power limit: an n³ product replayed
    for ``seconds``; {"first": FLOP/s over the first 0.5 s, "last": over the last 2 s, "seconds"}."""
    import torch

    a = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
    reps = 10
    a @ a
    run = lambda: [a @ a for _ in range(reps)]
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    _sync(device)
    marks, t0 = [], time.perf_counter()
    while len(marks) < 3 or marks[-1] < seconds:  # by the marks themselves: the last one is >= seconds
        run()
        _sync(device)
        marks.append(time.perf_counter() - t0)
    flop = 2 * n ** 3 * reps

    def rate(lo, hi):  # replays that ended in [lo, hi], each timed from the end of the one before
        inside = [i for i, t in enumerate(marks) if lo <= t <= hi and i > 0] or [len(marks) - 1]
        return flop * len(inside) / (marks[inside[-1]] - marks[inside[0] - 1])

    return {"first": rate(0.0, 0.5), "last": rate(marks[-1] - 2.0, marks[-1]), "seconds": marks[-1]}


# FlashAttention as torch runs it (SDPA), causal, bfloat16, heads of 128 for one sequence: 16 (a tp = 8 rank of
# a 128-head model) and 64 (wider: more heads per rank, or sequences × heads; the kernel's grid is
# batch × heads × T/block, so a narrow one leaves SMs idle at short T): forward + backward, as FLOP/s in the
# planner's count ((2 + 1) · 2·T·T·heads·hd: each query meets T/2 keys; the backward counted as two
# forwards, shared/plan.py block_seconds)
ATTENTION_T, ATTENTION_HEADS, ATTENTION_HD = (2048, 8192, 32768), (16, 64), 128


def _cuda_attention(device, lengths=ATTENTION_T, heads=ATTENTION_HEADS, hd=ATTENTION_HD,
                    backends=("FLASH_ATTENTION", "CUDNN_ATTENTION"), dtype="bfloat16",
                    reps: int | None = None) -> dict[str, dict[str, float]]:
    """{backend: {"heads×T": FLOP/s}} for torch's SDPA ``backends`` (one that refuses here: left out);
    ``reps`` timed steps per shape (None: ~2e13 FLOP's worth, 3 to 200)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out, reps_given = {}, reps
    for name in backends:
        rates = {}
        for h in heads:
            for T in lengths:
                q, k, v = (torch.randn(1, h, T, hd, dtype=getattr(torch, dtype), device=device,
                                       requires_grad=True) for _ in range(3))
                g = torch.randn(1, h, T, hd, dtype=getattr(torch, dtype), device=device)
                flop = 3 * 2 * T * T * h * hd

                def step(q=q, k=k, v=v, g=g):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

                try:
                    with sdpa_kernel(getattr(SDPBackend, name)):
                        for _ in range(2):
                            step()
                        reps = reps_given or max(3, min(200, int(2e13 / flop)))
                        _sync(device)
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            step()
                        _sync(device)
                except RuntimeError:  # this backend does not run here
                    break
                rates[f"{h}x{T}"] = flop * reps / (time.perf_counter() - t0)
        if rates:
            out[name.split("_")[0].lower()] = rates
    return out


def _torch_bench(ctx, ops, sizes, iters, warmup, matmul=False):
    from torch_impl.collectives import bench

    rows = [dict(r, framework="torch") for r in bench(ctx, ops, sizes, iters, warmup)]
    return {"rows": rows, "matmul": _torch_matmul(ctx) if matmul else None}

