"""``compare.py plan``: rank the layouts of a model on a cluster (shared/plan.py), and check the plan
against runs (--measured: parallel_twins/plan_measured.py).

    python compare.py plan --layers 80 --dim 8192 --heads 64 --vocab 128256 --seq 8192 \\
        --global-batch 1024 --gpus 256 --gpus-per-node 8 --gpu-memory 80GiB --dtype bfloat16
    python compare.py plan --experts 64 --topk 8 ... --gpus 1024          # an MoE model: dp × ep × pp
    python compare.py plan ... --layout fsdp=128,tp=8,pp=16               # only layouts with these axes
    python compare.py plan --preset llama3-405b --gpu h100 --gpus 16384 --global-batch 2048 \
        --layout fsdp=128,tp=8,pp=16 --pin v=8,trim=1,recompute=none  # a named model, settings pinned
    python compare.py bench --frameworks torch --json bench.json          # this machine's α–β and FLOP/s
    python compare.py --model transformer --mesh "dp=2,pp=2;fsdp=2,tp=2" --frameworks torch --json run.json
    python compare.py plan --calibrate bench.json --measured run.json     # predicted vs measured, per rank

Exit status 0; 2 for bad arguments or input files (one line on stderr); 3 when the table was printed but
--json could not be written.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import replace

from parallel_twins.args import (
    ArgumentError,
    HelpFormatter,
    Parser,
    add_json,
    check_output_path,
    prog,
    write_output,
)
from parallel_twins.plan_inputs import check_args, read_bench, read_measured
from parallel_twins.plan_measured import measured_main
from shared import efficiency, plan
from shared.config import BYTES_PER_ELEMENT, parse_mesh
from shared.published import PRESETS, preset


def parse_bytes(text: str) -> float:
    """"80GiB", "80 GB", "141e9" -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: write a size like 80GiB or 141GB")
    scale = {None: 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2 ** 10, "MiB": 2 ** 20,
             "GiB": 2 ** 30, "TiB": 2 ** 40}[m.group(2)]
    return float(m.group(1)) * scale


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=f"{prog()} plan", formatter_class=HelpFormatter,
                description="Rank the layouts of a transformer on a GPU cluster: memory per GPU, bytes per step per\n"
                            "axis, bubble, step time and MFU (docs/plan.md).")
    p.add_argument("--model", choices=("transformer",), default="transformer", help="the model family")
    p.add_argument("--preset", metavar="NAME",
                   help=f"a published model shape ({', '.join(PRESETS)}); the size flags below override it "
                        "(default: none)")
    p.add_argument("--layers", type=int, metavar="L", help="transformer blocks (default 80)")
    p.add_argument("--dim", type=int, metavar="D", help="model width (default 8192)")
    p.add_argument("--heads", type=int, metavar="H", help="attention heads (default 64)")
    p.add_argument("--kv-heads", type=int, metavar="G", help="key/value heads, grouped-query attention (default: H)")
    p.add_argument("--vocab", type=int, metavar="V", help="vocabulary size (default 128256)")
    p.add_argument("--seq", type=int, metavar="T", help="sequence length (default 8192)")
    p.add_argument("--mlp-ratio", type=int, metavar="R", help="MLP width as a multiple of D (default 4)")
    p.add_argument("--ffn", type=int, metavar="F", help="MLP width in elements (default R·D)")
    p.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=None,
                   help="SwiGLU MLP: three D×F matrices (default: GELU, two)")
    p.add_argument("--rope", action=argparse.BooleanOptionalAction, default=None,
                   help="rotary positions: no learned position table (default: learned)")
    p.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                   help="dropout after attention and MLP (its masks, its memory-bound time; default: none)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="biases on the linear layers and LayerNorm (GPT-2/3; default: none, RMSNorm gains)")
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                   help="the head shares the token embedding (default: untied)")
    p.add_argument("--experts", type=int, metavar="E", help="experts per MoE layer (default 0: dense)")
    p.add_argument("--topk", type=int, metavar="K", help="experts per token (MoE; default 1)")
    p.add_argument("--global-batch", type=int, default=1024, metavar="B", help="sequences per step")
    p.add_argument("--gpus", type=int, default=256, metavar="N", help="GPUs in the cluster")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="G", help="GPUs per node (tp stays inside one)")
    p.add_argument("--gpu", default="h100", metavar="NAME",
                   help=f"preset for memory, FLOP/s, HBM bandwidth, links: {', '.join(plan.GPUS)}")
    p.add_argument("--gpu-memory", type=parse_bytes, metavar="BYTES",
                   help="bytes per GPU, e.g. 80GiB (default: the --gpu's, as the device reports it: H100 79.6 GiB)")
    p.add_argument("--profile", metavar="PATH",
                   help="what this machine achieves, from compare.py bench --profile (default: the --gpu's cited "
                        "figures, shared/efficiency.py)")
    p.add_argument("--fp8", action="store_true",
                   help="matmuls at the GPU's dense FP8 peak (Transformer Engine; states and activations as --dtype)")
    p.add_argument("--tp-overlap", action="store_true",
                   help="tensor-parallel traffic hidden behind the matmuls (async TP; default: on the critical path)")
    p.add_argument("--framework", choices=plan.FRAMEWORKS, default="torchtitan",
                   help="what the training framework sends and waits for beyond this repository's runs "
                        "(shared/plan_framework.py): torchtitan (these runs' DTensor), megatron (sp all-gathers "
                        "again in the backward), deepspeed (blocking pipeline p2p, partitioned sends, bf16 grads "
                        "all-reduced in fp32) (default: torchtitan)")
    p.add_argument("--flops", choices=plan.FLOPS, default="causal",
                   help="MFU's model FLOPs: causal attention (this planner's default), full attention "
                        "(PaLM, Korthikanti eq. 7, torchtitan), megatron (full + the recomputed forward, Narayanan "
                        "eq. 3)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"), default="bfloat16",
                   help="parameters and activations")
    p.add_argument("--precision", choices=plan.PRECISIONS, default="mixed",
                   help="mixed: bf16 params/grads + fp32 master, m, v (16 bytes/param); mixed-fp32-grads: Megatron's "
                        "fp32 main grads (18), reduced in fp32 (twice the bytes); pure: one dtype (the runs)")
    p.add_argument("--style", choices=("builtin", "explicit"), default="builtin",
                   help="torch style whose calls are counted")
    p.add_argument("--attention", choices=("flash", "math"), default="flash",
                   help="flash keeps no T×T scores; math does (selective recompute drops them)")
    p.add_argument("--peak-flops", type=float, metavar="FLOPS",
                   help="FLOP/s per GPU (default: the --gpu's dense tensor-core peak in --dtype; float32: TF32)")
    p.add_argument("--efficiency", type=float, metavar="F",
                   help="fraction of peak the largest matmuls reach (default: the --gpu's cited table, "
                        "shared/efficiency.py: 0.8 A100, 0.79 H100/H200; --matmul flat: 0.6, every FLOP)")
    p.add_argument("--matmul", choices=("shapes", "flat"),
                   help="shapes: each matmul timed from its sharded shape (roofline; with --calibrate, the bench's "
                        "measured size table); flat: FLOPs at one efficiency (default: shapes, flat with --calibrate)")
    p.add_argument("--hbm-bandwidth", type=float, metavar="B/S",
                   help="HBM bytes/s of large copies (default: the --gpu's achieved, 0.9 of its datasheet)")
    p.add_argument("--headroom", type=float, default=0.1, metavar="F", help="fraction of GPU memory kept free")
    for where in ("intra", "inter"):
        p.add_argument(f"--alpha-{where}", type=float, metavar="S",
                       help=f"{where}-node latency per call, seconds (default: the --gpu's)")
        p.add_argument(f"--beta-{where}", type=float, metavar="B/S",
                       help=f"{where}-node bus bandwidth, bytes/s, every op (default: the --gpu's nccl-tests "
                            "busbw per op)")
    p.add_argument("--layout", metavar="LAYOUT",
                   help="only layouts with these axis sizes, e.g. fsdp=128,tp=8,pp=16 (default: every layout)")
    p.add_argument("--pin", metavar="K=V,...",
                   help="fix settings: zero=0..3, recompute=none|selective|full, sp=on|off, microbatches=M (or M=), "
                        "v=chunks per rank (any that divides), trim=K (K blocks fewer on the first and last stage), "
                        "cp=ring|allgather (context parallelism's K|V exchange), scatter=on|off (Megatron's "
                        "scatter/gather pp sends), "
                        "overlap=on|off|backward|last|none (the data axis' traffic under the whole backward: DDP "
                        "buckets, FSDP2 prefetch; under the last micro-batch's: Megatron --overlap-grad-reduce; "
                        "none) (default: none pinned: all searched, overlap backward)")
    p.add_argument("--top", type=int, default=8, metavar="K", help="layouts shown")
    add_json(p, "the ranked layouts")
    p.add_argument("--calibrate", metavar="BENCH_JSON",
                   help="α–β per op and FLOP/s from compare.py bench --json (default: the --gpu's figures)")
    p.add_argument("--measured", metavar="RUN_JSON",
                   help="compare the plan with a compare.py --json run, per rank (default: none)")
    return p


MODEL_DEFAULTS = {"layers": 80, "dim": 8192, "heads": 64, "vocab": 128256, "seq": 8192, "mlp_ratio": 4, "experts": 0,
                  "topk": 1, "kv_heads": 0, "ffn": 0, "swiglu": False, "rope": False, "dropout": False, "bias": False,
                  "tied": False}
_FIELDS = {"ffn": "ffn_dim", "swiglu": "gated"}
_ON = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}


def make_model(args) -> plan.Model:
    """--preset's model (or the defaults), with every size flag given on top."""
    base = preset(args.preset) if args.preset else plan.Model(
        **{_FIELDS.get(k, k): v for k, v in MODEL_DEFAULTS.items()})
    given = {_FIELDS.get(k, k): getattr(args, k) for k in MODEL_DEFAULTS if getattr(args, k) is not None}
    return replace(base, **given)


def parse_pins(text: str | None) -> dict:
    """"zero=0,recompute=full,sp=off,microbatches=8,v=3,overlap=off" -> {name: value}; one line if wrong."""
    pins = {}
    for item in filter(None, (text or "").split(",")):
        key, eq, value = item.partition("=")
        key = {"M": "microbatches", "v": "virtual", "m": "microbatches", "cp": "cp_style",
               "scatter": "pp_scatter"}.get(key.strip(), key.strip())
        value = value.strip()
        if not eq or key not in (*plan.PINS, "overlap"):
            raise ValueError(f"--pin: {item!r}: write key=value with key one of zero, recompute, sp, microbatches, "
                             f"v, trim, cp, scatter, overlap")
        if key == "overlap" and value in plan.OVERLAPS:
            pins[key] = value
        elif key in ("sp", "overlap", "pp_scatter"):
            if value.lower() not in _ON:
                raise ValueError(f"--pin {key}={value}: write on or off")
            pins[key] = _ON[value.lower()]
        elif key == "cp_style":
            if value not in ("ring", "allgather"):
                raise ValueError(f"--pin cp={value}: choose ring or allgather")
            pins[key] = value
        elif key == "recompute":
            if value not in plan.RECOMPUTE:
                raise ValueError(f"--pin recompute={value}: choose from {', '.join(plan.RECOMPUTE)}")
            pins[key] = value
        else:
            if not value.isdigit() or (key not in ("zero", "trim") and int(value) < 1) or \
                    (key == "zero" and int(value) > 3):
                raise ValueError(f"--pin {key}={value}: " + ("a ZeRO stage 0-3" if key == "zero" else
                                                             "a positive integer"))
            pins[key] = int(value)
    return pins


def make_inputs(args):
    check_args(args)  # every number finite and in range (parallel_twins/plan_inputs.py)
    model = make_model(args)
    plan.gpu(args.gpu)  # the known names, or ValueError
    if args.gpus < 1 or args.gpus_per_node < 1 or args.global_batch < 1:
        raise ValueError("--gpus, --gpus-per-node and --global-batch must be positive")
    shapes = args.matmul == "shapes" or (args.matmul is None and not args.calibrate)
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom must be in [0, 1), got {args.headroom}")
    pins = parse_pins(args.pin)
    if args.measured:
        args.measured_data = read_measured(args.measured)  # bounded, validated: refused before anything runs
    profile = efficiency.load(args.profile) if args.profile else None
    dtype = "float8" if args.fp8 else args.dtype
    if args.measured and profile:  # each run's own dtype is looked up per run (measured_main)
        dtype = next(dt for dt, key in efficiency.DTYPE_PEAK.items() if key in profile["peaks"])
    cluster = plan.Cluster.preset(args.gpu, args.gpus, dtype, profile, gpus_per_node=args.gpus_per_node,
                                  headroom=args.headroom, matmul="shapes" if shapes else "flat",
                                  overlap=pins.pop("overlap", True), tp_overlap=args.tp_overlap,
                                  framework=args.framework)
    if not shapes:  # flat: every FLOP at one efficiency (0.6 unless given)
        cluster = replace(cluster, efficiency=0.6)
    for where in ("intra", "inter"):  # a link given by hand: one α–β for every op
        alpha, beta = getattr(args, f"alpha_{where}"), getattr(args, f"beta_{where}")
        if alpha is not None or beta is not None:
            old = getattr(cluster, where)
            cluster = replace(cluster, **{where: plan.Link(old.alpha if alpha is None else alpha,
                                                           old.beta if beta is None else beta)})
    cluster = replace(cluster, **{k: v for k, v in (
        ("memory", args.gpu_memory), ("flops", args.peak_flops), ("efficiency", args.efficiency),
        ("hbm", args.hbm_bandwidth)) if v is not None})
    if args.calibrate:
        args.bench = read_bench(args.calibrate)  # bounded, its fits checked
        cluster = plan.calibrated(cluster, args.bench, args.dtype, shapes=args.matmul == "shapes")
    want = dict(parse_mesh(args.layout)) if args.layout else {}
    unknown = set(want) - {"dp", "fsdp", "tp", "pp", "cp", "ep"}
    if unknown:
        raise ValueError(f"--layout: unknown axis {sorted(unknown)[0]!r}; choose from dp, fsdp, tp, pp, cp, ep")
    product = 1
    for axis, size in want.items():
        product *= size if axis != "ep" else 1  # ep lies inside the data axis
    if {"dp", "fsdp"} & set(want) and product != args.gpus:
        raise ValueError(f"--layout {args.layout}: its axes multiply to {product} GPUs, not --gpus {args.gpus}")
    if args.gpus % product:
        raise ValueError(f"--layout {args.layout}: its axes multiply to {product}, which does not divide --gpus "
                         f"{args.gpus}")
    trim = pins.get("trim", 0)
    if "pp" in want and (model.layers + 2 * trim) % want["pp"]:
        raise ValueError(f"--layout pp={want['pp']}: {model.layers} layers do not split into {want['pp']} equal stages"
                         + (f" with {trim} fewer on the first and last" if trim else
                            " (--pin trim=K: K fewer on the first and the last stage)"))
    v = pins.get("virtual", 1)
    if v > 1 and "pp" in want and (model.layers + 2 * trim) % (want["pp"] * v):
        raise ValueError(f"--pin v={v}: {model.layers} layers do not split into pp={want['pp']} × v={v} equal chunks")
    if v > 1 and (model.layers + 2 * trim) % v:
        raise ValueError(f"--pin v={v}: {model.layers} layers do not split into {v} chunks per stage")
    if v > 1 and cluster.framework == "deepspeed":
        raise ValueError(f"--pin v={v} with --framework deepspeed: DeepSpeed's pipeline engine runs 1F1B only "
                         "(TrainSchedule, no interleaving); drop v or choose another --framework")
    if "sp" in pins and pins["sp"] and want.get("tp", 0) == 1:
        raise ValueError("--pin sp=on needs tp > 1, and --layout has tp=1")
    return model, cluster, want, pins


def why_none(model, cluster, batch: int, want: dict, pins: dict) -> str:
    """Why nothing was enumerated: plan.invalid's line for the layout --layout and --pin describe."""
    data = want.get("dp", want.get("fsdp"))
    rest = cluster.gpus // max(1, want.get("tp", 1) * want.get("pp", 1) * want.get("cp", 1))
    zero = pins.get("zero", 3 if "fsdp" in want else 0)
    M = pins.get("microbatches", max(want.get("pp", 1), 1))
    lay = plan.Layout(dp=data or rest, tp=want.get("tp", 1), pp=want.get("pp", 1), cp=want.get("cp", 1),
                      ep=want.get("ep", 1), zero=zero, microbatches=M, sp=pins.get("sp", want.get("tp", 1) > 1),
                      recompute=pins.get("recompute", "none"), virtual=pins.get("virtual", 1), trim=pins.get("trim", 0))
    return plan.invalid(model, lay, batch) or "the search enumerates none with these sizes (tp and cp: powers of two)"


def _matches(lay: plan.Layout, want: dict) -> bool:
    sizes = {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, lay.data_axis: lay.dp}
    return all(sizes.get(a, 1) == n for a, n in want.items())


def _gib(n) -> str:
    return f"{n / plan.GiB:.1f}"


def plan_main(argv) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_output_path("--json", args.json)
        model, cluster, want, pins = make_inputs(args)
    except (ArgumentError, ValueError, OSError, KeyError, argparse.ArgumentTypeError) as exc:
        print(f"{prog()} plan: error: {exc}", file=sys.stderr)
        return 2
    if args.measured:
        try:
            return measured_main(args, cluster)
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:  # schema-valid, but not
            print(f"{prog()} plan: error: --measured {args.measured}: a run the plan cannot be compared with "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr)  # a mesh or ep run it predicts
            return 2
    from rich.table import Table

    from parallel_twins.report import make_console

    t0 = time.perf_counter()
    b = {**BYTES_PER_ELEMENT, "float16": 2}[args.dtype]  # fp16: bf16's bytes and (A100, H100) its peak
    fit, over = [], []
    policies = plan.policies(args.attention)
    for lay in plan.layouts(model, cluster, args.global_batch, policies, pins=pins):
        if _matches(lay, want):
            pred = plan.predict(model, lay, cluster, args.global_batch, b, args.precision, args.style, args.attention,
                                time_if_over=False)
            (fit if pred.fits else over).append(pred)
    fit.sort(key=plan.rank_key)
    over.sort(key=lambda p: p.memory["total"])
    seconds = time.perf_counter() - t0
    console = make_console(json_to_stdout=args.json == "-")  # --json -: the JSON alone on stdout
    mfu = lambda p: plan.model_flops(model, args.global_batch, args.flops) / (
        p.time["step"] * p.layout.gpus * cluster.flops)
    moe = f", E={model.experts} k={model.topk} ({model.active_params / 1e9:.1f}B active)" if model.moe else ""
    kv = f" KV={model.kv}" if model.kv != model.heads else ""
    mlp = f"{'SwiGLU' if model.gated else 'MLP'} F={model.ffn}" + (" RoPE" if model.rope else "")
    console.print(f"[bold]{model.params / 1e9:.1f}B parameters[/] (L={model.layers} D={model.dim} H={model.heads}{kv} "
                  f"V={model.vocab} T={model.seq} {mlp}{moe}), global batch {args.global_batch} × "
                  f"{model.seq} tokens, {args.precision} {args.dtype}; {cluster.gpus} GPUs ({cluster.gpus_per_node} "
                  f"per node, {_gib(cluster.memory)} GiB, {cluster.flops / 1e12:.0f} TFLOP/s, matmuls: "
                  f"{cluster.matmul} × {cluster.efficiency}"
                  + ("" if cluster.framework == "torchtitan" else f", as {cluster.framework} runs it") + "); "
                  f"{len(fit) + len(over)} layouts in {seconds:.2f} s: {len(fit)} fit")
    table = Table(title="fastest layouts that fit (1F1B, or interleaved with v chunks per rank)")
    for col in ("#", "layout", "M×m", "v", "ZeRO", "sp", "recompute", "params/grads/opt/act GiB", "total / usable GiB",
                "GiB per step per GPU by axis", "bubble", "step s (compute + exposed comm)", f"MFU ({args.flops})",
                "HFU"):
        table.add_column(col, justify="left" if col in ("layout", "GiB per step per GPU by axis") else "right")
    seen = set()
    rows = []
    for p in fit:  # one row per layout: its fastest recompute policy
        key = (p.layout.name, p.layout.microbatches, p.layout.zero, p.layout.virtual)
        if key not in seen:
            seen.add(key)
            rows.append(p)
        if len(rows) == args.top:
            break
    for i, p in enumerate(rows, 1):
        lay, mem = p.layout, p.memory
        axes = " ".join(f"{a} {_gib(v)}" for a, v in plan.comm_bytes(p.comm).items())
        m = args.global_batch // (lay.dp * lay.microbatches)
        table.add_row(str(i), lay.name, f"{lay.microbatches}×{m}", str(lay.virtual), str(lay.zero),
                      "y" if lay.sp else "-", lay.recompute,
                      "/".join(_gib(mem[k]) for k in ("params", "grads", "optimizer", "activations")),
                      f"{_gib(mem['total'])} / {_gib(cluster.usable)}", axes, f"{p.bubble:.2f}",
                      f"{p.time['step']:.2f} ({p.time['compute']:.2f} + "
                      f"{p.time['critical'] + p.time['exposed_data']:.2f})",
                      f"{100 * mfu(p):.0f}%", f"{100 * p.hfu:.0f}%")
    if rows:
        console.print(table)
    if over:
        console.print(f"{len(over)} layouts do not fit; the closest:")
        shown = set()
        for p in over:
            key = p.layout.name
            if key in shown:
                continue
            shown.add(key)
            lay = p.layout
            console.print(f"  {lay.name} M={lay.microbatches} v={lay.virtual} ZeRO-{lay.zero} {lay.recompute}: "
                          f"{p.reason}")
            if len(shown) == 5:
                break
    if not fit and not over:
        why = why_none(model, cluster, args.global_batch, want, pins)
        console.print(f"[red]no layout has these axes and pins[/]: {why}")
    elif not fit:
        console.print("[red]no layout fits[/]: more GPUs, a smaller micro-batch or full recompute (all tried), or "
                      "more memory per GPU")
    if args.json:
        from shared.provenance import provenance, stamp

        block = provenance([prog(), "plan", *argv], world_size=None,
                           layout={"gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node})
        try:
            write_output(args.json, json.dumps(stamp(
                {"model": vars(model), "cluster": {"gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node,
                                                   "memory": cluster.memory, "flops": cluster.flops},
                 "global_batch": args.global_batch, "seconds": seconds, "fit": [p.to_json() for p in fit[:100]],
                 "over": [p.to_json() for p in over[:100]], "n_fit": len(fit), "n_over": len(over)}, block), indent=1))
        except OSError as exc:  # the table is printed; the file could not be written (a full disk, /dev/full)
            print(f"{prog()} plan: error: --json {args.json}: could not write it ({exc.strerror or exc})",
                  file=sys.stderr)
            return 3
    return 0
