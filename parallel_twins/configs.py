"""compare.py's arguments turned into checked runs: the Configs of one invocation (sizes, presets, layouts,
styles, the recipe's notes), the checkpoint plan and its locks, multi-process JAX's join. Everything here runs
before any process, rank or device starts; a bad argument is a ValueError (one line, exit 2 in cli.py).

Imports only args.py, the standard library and NumPy-only ``shared`` at the top (torch ranks re-import the
entry point, which imports this); runs.py and JAX lazily, inside the functions that need them.
"""

from __future__ import annotations

import os
import sys

from parallel_twins.args import (
    MICROBATCHES,
    PRESET_DTYPE,
    SIZE_PRESETS,
    _belongs,
    cfgs_for,
    check_output_path,
    given_sizes,
    prog,
    recipe_fields,
    round_up,
    run_key,
)
from shared.config import PATTERNS, format_mesh

# torch's three (compiled: torch.compile over the builtins, run when asked for or on a GPU node), JAX's three
STYLES = ("explicit", "builtin", "compiled", "shard_map", "typed", "jit")


def check_styles(args, cfgs) -> None:
    """--styles: refuse (ValueError, one line) a pattern that none of the styles asked for can run —
    for the typed style, JAX's reason (a layout that cannot be written in types)."""
    if not args.styles:
        return
    from parallel_twins.runs import chosen_variants, compiled_notes, compiled_refusal, typed_refusal

    compiled = "compiled" in args.styles and "torch" in args.frameworks
    if compiled and compiled_unbuilt(args, cfgs):
        raise ValueError(f"--styles compiled: not built with {compiled_unbuilt(args, cfgs)} (untested under "
                         "torch.compile: no row is reported that was not checked); drop it, or the compiled style")
    for pattern in (p for p in args.patterns if p != "collectives"):
        if compiled and compiled_notes(pattern):  # a variant torch cannot compile: said once, the rest run
            print(f"compare.py: note: {compiled_notes(pattern)}", file=sys.stderr)
        for cfg in cfgs_for(cfgs, pattern):
            refused = compiled_refusal(pattern, cfg) if compiled else None
            if any(chosen_variants(fw, pattern, cfg, args.styles) for fw in args.frameworks):
                if refused:  # the other styles asked for run it: say once why torch compiled does not
                    print(f"compare.py: note: {refused}", file=sys.stderr)
                continue
            reason = typed_refusal(pattern, cfg) if "typed" in args.styles and "jax" in args.frameworks else None
            if refused:
                raise ValueError(f"--styles compiled: {refused}")
            if reason:
                raise ValueError(f"--styles typed: {reason}")
            have = sorted({s for fw in args.frameworks for s, _ in chosen_variants(fw, pattern, cfg)})
            raise ValueError(f"--styles {','.join(args.styles)}: {pattern} ({run_key(cfg)}) has none of them "
                             f"under {','.join(args.frameworks)} (it has {', '.join(have)})")
    runs_any = lambda fw: any(chosen_variants(fw, p, c, args.styles) for p in args.patterns if p != "collectives"
                              for c in cfgs_for(cfgs, p))
    args.frameworks = [fw for fw in args.frameworks if runs_any(fw)]  # --styles typed: JAX alone


def compiled_unbuilt(args, cfgs) -> str | None:
    """What the compiled style is not built for (the recipe flags, float16's loss scaling, checkpoints), or None."""
    cfg = cfgs[0] if cfgs else None
    if cfg is not None and cfg.recipe_active:
        return "the recipe flags (--clip, --accumulate, --schedule, --decay-mask, --freeze, --recipe)"
    if cfg is not None and cfg.dtype == "float16":
        return "--dtype float16 (dynamic loss scaling)"
    return "--checkpoint-dir" if args.checkpoint_dir is not None else None


def default_styles(args, cfgs=()) -> None:
    """--styles not given: every style but torch's compiled one on CPU (torch.compile of every pattern costs
    minutes on a few shared cores: compare.py --styles compiled asks for it), every style on a GPU node
    (where torch runs on CUDA: the compiled rows belong beside JAX's jit there)."""
    if args.styles is not None or "torch" not in args.frameworks or args.device == "cpu" or \
            compiled_unbuilt(args, cfgs):
        return
    from shared.env import local_gpu_count  # the driver's count: loads neither framework's CUDA libraries

    if local_gpu_count() > 0:
        args.styles = list(STYLES)


def recipe_notes(args, cfgs) -> list[str]:
    """The runs the recipe leaves out (shared.recipe.refusal), one line each, printed before anything runs."""
    from parallel_twins.runs import chosen_variants
    from shared.recipe import refusals

    if not any(cfg.recipe_active or cfg.dtype == "float16" for cfg in cfgs):  # plain AdamW: nothing is left out
        return []
    every = lambda fw, p, c: [sv for sv in chosen_variants(fw, p, c, None, full=True)
                              if not args.styles or sv[0] in args.styles]
    notes = refusals(cfgs, args.patterns, args.frameworks, lambda fw, p, c: every(fw, p, c) if c in cfgs_for(cfgs, p)
                     else [])
    for line in notes:
        print(f"{prog()}: note: {line}", file=sys.stderr)
    left = [sv for fw in args.frameworks for p in args.patterns if p != "collectives" for c in cfgs_for(cfgs, p)
            for sv in chosen_variants(fw, p, c, args.styles)]
    if notes and not left and "collectives" not in args.patterns:  # an empty table is no answer: exit 2
        raise ValueError(f"the recipe leaves every run out ({notes[0]})")
    return notes


def checkpoint_plan(args, cfgs):
    """The runs' shared.checkpoint.Plan (None without --checkpoint-dir). Before any process starts,
    for the runs this invocation makes (and no other folder in DIR): a run folder another process is
    writing is refused (its holder named); with --resume, the checkpoint each run would start from is
    verified against that run's config: files, checksums, shapes, seed / batch / AdamW (CheckpointError,
    a ValueError: one line, exit 2)."""
    if args.checkpoint_dir is not None and cfgs and cfgs[0].precision != "pure":
        raise ValueError("--checkpoint-dir: --precision mixed is not built for checkpoints; use --precision pure")
    if args.checkpoint_dir is not None and cfgs and cfgs[0].recipe_active:
        raise ValueError("--checkpoint-dir: the recipe flags (--clip, --accumulate, --schedule, --decay-mask, "
                         "--freeze, --recipe) are not built for checkpoints (no schedule state is saved); drop them")
    if args.checkpoint_dir is None:
        if args.resume or args.checkpoint_every is not None or args.keep is not None:
            raise ValueError("--resume, --checkpoint-every and --keep need --checkpoint-dir DIR")
        return None
    from shared.checkpoint_io import checkpoint_dir

    checkpoint_dir(args.checkpoint_dir)  # a link: refused before anything is written through it
    check_output_path("--checkpoint-dir", args.checkpoint_dir, directory=True)
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every}: a number of steps >= 1")
    if args.keep is not None and args.keep < 1:
        raise ValueError(f"--keep {args.keep}: a number of checkpoints >= 1")
    from parallel_twins.runs import chosen_variants
    from shared.checkpoint import Plan, check_runs

    plan = Plan(dir=args.checkpoint_dir, every=args.checkpoint_every or 1, resume=args.resume, keep=args.keep or 0)
    steps = cfgs[0].steps if cfgs else 0
    if plan.every > steps and not args.quiet:  # legitimate (save on a signal only), but say so
        print(f"{prog()}: note: --checkpoint-every {plan.every} is more than --steps {steps}: no step is saved on "
              "the schedule, only on SIGTERM / SIGINT", file=sys.stderr)
    runs = [(fw, pattern, style, variant, cfg) for fw in args.frameworks
            for pattern in args.patterns if pattern != "collectives" for cfg in cfgs_for(cfgs, pattern)
            for style, variant in chosen_variants(fw, pattern, cfg, args.styles, tour=getattr(args, "tour", False))]
    check_runs(plan, runs)
    if plan.writes and not any(k in os.environ for k in ("RANK", "JAX_PROCESS_ID")):
        # this invocation is the writer of its run folders from now until it exits: a second compare.py on one
        # of them is refused here, before any process starts (under torchrun / multi-process JAX, rank 0 locks)
        from shared.checkpoint_io import hold_locks

        args.held_locks = hold_locks(plan.run_dir(*run) for run in runs)
    return plan


def default_world_size(device: str) -> int:
    """torchrun's WORLD_SIZE; else one rank per local GPU (NCCL); else 4 simulated CPU ranks."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if device != "cpu":
        from shared.env import local_gpu_count  # the driver's count: loads neither framework's CUDA libraries

        gpus = local_gpu_count()
        if gpus > 0:
            return gpus
    return 4


def join_jax_processes(args, cfgs):
    """Multi-controller JAX: this process is one of JAX_NUM_PROCESSES (process JAX_PROCESS_ID,
    coordinator at JAX_COORDINATOR_ADDRESS), every one running this same command. Joins
    jax.distributed before any JAX use; the world size is the global device count (CPU: each
    process simulates world_size / processes devices; GPU: a world size not given is every GPU of
    every process); only process 0 prints and writes files, every process exits with the status
    of the same (gathered) results. Returns the configs, rebuilt when the world size changed."""
    from jax_impl.launch import host_device_flags

    n = int(os.environ["JAX_NUM_PROCESSES"])
    if args.frameworks != ["jax"]:
        raise ValueError("a multi-process JAX launch (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                         "JAX_PROCESS_ID set) runs JAX only: use --frameworks jax (torch: torchrun)")
    if args.plots:
        raise ValueError("--plots is not available under a multi-process JAX launch")
    if cfgs[0].world_size % n:
        raise ValueError(f"world_size={cfgs[0].world_size} is not divisible by JAX_NUM_PROCESSES={n}")
    os.environ["XLA_FLAGS"] = host_device_flags(cfgs[0].world_size // n, os.environ.get("XLA_FLAGS", ""))
    from jax_impl.devices import init_distributed

    init_distributed()
    import jax

    if args.world_size is None and not args.mesh and jax.device_count() != cfgs[0].world_size:
        args.world_size = jax.device_count()  # GPU nodes: every GPU of every process
        cfgs = make_configs(args)
    if jax.device_count() != cfgs[0].world_size:
        raise ValueError(f"world_size={cfgs[0].world_size} but the {n} JAX processes hold "
                         f"{jax.device_count()} devices")
    if jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w")  # for the rest of this process: only process 0 prints
        args.json = args.markdown = None
    return cfgs


def make_configs(args):
    """The run's Configs, one per model (plus one per mesh layout, and the MoE transformer for ep),
    checked for every requested pattern (ValueError on a bad one)."""
    from shared.config import Config

    defaulted = args.patterns is None
    if defaulted:  # the mesh pattern runs when layouts are given, and only then by default
        args.patterns = ["mesh"] if args.mesh else [p for p in PATTERNS if p != "mesh"]
    elif args.mesh and "mesh" not in args.patterns:
        args.patterns = [*args.patterns, "mesh"]
    if args.show_collectives:
        args.patterns = [args.show_collectives]
        defaulted = False
    layouts = args.mesh or []
    sizes = sorted({_product(layout) for layout in layouts})
    if len(sizes) > 1:
        raise ValueError(f"--mesh: every layout of one run needs the same world size, got "
                         f"{', '.join(f'{format_mesh(m)} ({_product(m)})' for m in layouts)}")
    world = args.world_size if args.world_size is not None else \
        sizes[0] if sizes and "WORLD_SIZE" not in os.environ else default_world_size(args.device)
    # sizes not given: the small defaults, rounded up to what the 1-D patterns split at this world size (a
    # --mesh layout checks its own axes against the defaults as they are)
    recipe = recipe_fields(args)
    microbatches = args.microbatches if args.microbatches is not None else \
        MICROBATCHES if layouts else round_up(MICROBATCHES, max(1, world))
    preset = size_preset(args, world)
    sizes = given_sizes(args, None if layouts else world, microbatches, args.virtual_stages,
                        recipe.get("accumulate", 1), base=SIZE_PRESETS[preset])
    base = Config(world_size=world, microbatches=microbatches, steps=args.steps, seed=args.seed,
                  dtype=args.dtype or PRESET_DTYPE[preset], precision=args.precision,
                  lr=args.lr, weight_decay=args.weight_decay, bucket_mb=args.bucket_mb,
                  virtual_stages=args.virtual_stages, **sizes, **recipe)
    ep_layouts = "mesh" in args.patterns and any(a == "ep" for layout in layouts for a, _ in layout)
    if args.experts is not None and "ep" not in args.patterns and not ep_layouts:
        raise ValueError("--experts/--topk build the mixture-of-experts transformer, which runs under "
                         "--patterns ep, or --mesh with an ep axis, only")
    cfgs = [base.replace(model=m) for m in args.model]
    if "mesh" in args.patterns:  # one config per (model, layout); the 1-D patterns ignore cfg.mesh
        cfgs += [base.replace(model=m, mesh=layout, **_mesh_experts(args, m, layout)) for m in args.model
                 for layout in layouts]
    if "ep" in args.patterns and "transformer" in args.model:  # the MoE transformer: ep's own config
        experts = args.experts if args.experts is not None else default_experts(world)
        cfgs.append(base.replace(model="transformer", experts=experts, topk=args.topk))
    cfgs = [c.replace(recompute=args.recompute) for c in cfgs]  # the MLP refuses all but "none"
    from shared.recipe import check_freeze

    taken = [c for c in cfgs if any(_belongs(c, p) for p in args.patterns if p != "collectives")]
    for c in taken or cfgs:  # the models the patterns run (--patterns ep alone: the MoE transformer's experts)
        check_freeze(c)  # --freeze: every glob names a parameter of each model, and something still trains
    if "RANK" in os.environ and "jax" in args.frameworks:
        raise ValueError("under torchrun every rank runs this script: use --frameworks torch "
                         "(run the JAX side once, without torchrun)")
    if defaulted and not args.mesh:  # every 1-D pattern by default: those a requested model has (no cp on the MLP)
        args.patterns = [p for p in args.patterns if p == "collectives" or cfgs_for(cfgs, p)]
    for pattern in args.patterns:
        mine = [cfg for cfg in cfgs if _belongs(cfg, pattern)] or \
            [base.replace(model=m) for m in args.model]  # --patterns mesh without --mesh: its one-line reason
        applying = [cfg for cfg in mine if cfg.applies(pattern)]
        for cfg in applying or mine:  # a pattern no requested model has (cp on the MLP): its one-line reason
            for fw in args.frameworks:  # what --precision mixed is built for differs per framework
                cfg.check(pattern, fw)
    moe_mesh = [c for c in cfgs if c.mesh and c.moe and c.applies("mesh")]
    missing = [fw for fw in args.frameworks if fw not in MOE_MESH_FRAMEWORKS]
    if moe_mesh and missing:
        raise ValueError(f"mesh {moe_mesh[0].mesh_name}: the mixture-of-experts transformer under --mesh is built in "
                         f"{', '.join(MOE_MESH_FRAMEWORKS) or 'no framework yet'}, not in {', '.join(missing)}; "
                         f"use --frameworks {','.join(MOE_MESH_FRAMEWORKS)}, or --patterns ep for the experts alone")
    return [c for c in cfgs if not c.mesh or c.applies("mesh")]  # the mesh runs the transformer only


def on_gpus(device: str, world: int) -> bool:
    """Whether the runs take GPUs: --device gpu, or auto with a GPU per rank (the driver's count: loads
    neither framework's CUDA libraries)."""
    if device != "auto":
        return device == "gpu"
    from shared.env import local_gpu_count

    return local_gpu_count() >= max(1, world)


def jax_on_cpu(device: str, world: int) -> bool:
    """Whether JAX runs on the CPU alone: --device cpu, JAX_PLATFORMS=cpu, or auto on a machine whose driver
    shows no GPU (a machine with too few GPUs falls back to the CPU too, but is left as XLA has it)."""
    if device != "auto":
        return device == "cpu"
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    from shared.env import local_gpu_count

    return local_gpu_count() == 0


def size_preset(args, world: int) -> str:
    """--size, else "gpu" where the runs take GPUs, else "cpu"; recorded as args.size (the table's title
    says it)."""
    if args.size is None:
        args.size = "gpu" if on_gpus(args.device, world) else "cpu"
    return args.size


# The frameworks whose mesh runner takes the MoE transformer (an ep axis beside dp / fsdp / tp).
MOE_MESH_FRAMEWORKS: tuple[str, ...] = ("torch", "jax")


def _mesh_experts(args, model: str, layout) -> dict:
    """A layout's experts: with an ep axis the MoE transformer (--experts, else the smallest multiple of
    ep that is >= 4); without one, --experts is its refusal (Config's mesh check says why)."""
    ep = dict(layout).get("ep", 1)
    if model != "transformer" or (ep == 1 and args.experts is None):
        return {}
    return {"experts": args.experts if args.experts is not None else default_experts(ep), "topk": args.topk}


def default_experts(world: int) -> int:
    """ep's E when --experts is not given: the smallest multiple of the world size that is >= 4
    (ep = world size needs E % N == 0; 4 experts on 1, 2 or 4 ranks, 8 on 8)."""
    return world * -(-4 // world)


def _product(layout) -> int:
    out = 1
    for _, n in layout:
        out *= n
    return out
