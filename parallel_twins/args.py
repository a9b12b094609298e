"""The command line's shared parts: the parser (one-line errors), its help format, the option groups
every subcommand spells the same way, and the output paths (checked before anything runs, written
so that a regular file is complete or absent and a FIFO or a device is never replaced).

    p = Parser(prog="compare.py bench", formatter_class=HelpFormatter)
    add_frameworks(p); add_world_size(p, 4, "ranks / devices (>= 2)"); add_json(p, "the rows")
    check_output_path("--json", args.json)      # ValueError, one line: exit 2 before any run
    write_output(args.json, text)               # "-": standard output

Imports only the standard library and ``shared`` (NumPy only); everything in parallel_twins imports
this module and it imports none of them back.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import tempfile

from shared.config import DTYPES, PRECISIONS

FRAMEWORKS = ("torch", "jax")
DEVICES = ("auto", "cpu", "gpu")


class ArgumentError(Exception):
    pass


def prog() -> str:
    """The name the command was started by, for its messages, usage and provenance: ``compare.py``
    (the repository's entry point, and library callers), ``parallel-twins`` (the installed command)
    or ``python -m parallel_twins``."""
    started = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if started == "__main__.py" and os.path.basename(os.path.dirname(sys.argv[0])) == "parallel_twins":
        return "python -m parallel_twins"
    return "parallel-twins" if started == "parallel-twins" else "compare.py"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, exit 2 (argparse prints usage + error otherwise)
        raise ArgumentError(message)


def csv_list(choices):
    """An argparse type: a comma list, every item one of ``choices``."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return items

    return parse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help line ends with its default (lists as comma lists); options whose default is
    worked out at run time (None) say so in their own words."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS or not action.option_strings:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


# --- option groups: one spelling, one meaning, in every subcommand ------------------------------


def add_frameworks(p) -> None:
    p.add_argument("--frameworks", type=csv_list(FRAMEWORKS), default=list(FRAMEWORKS), metavar="LIST",
                   help=f"comma list of {', '.join(FRAMEWORKS)}")


def add_world_size(p, default, help) -> None:
    p.add_argument("--world-size", type=int, default=default, metavar="N", help=help)


# The model's default sizes; compare.py's runs round them up to what every pattern splits at the world size
# (default_sizes below): on 1, 2 or 4 ranks these, on 8 ranks 8 layers and 8 heads.
SIZES = {"layers": 4, "dim": 32, "batch": 32, "heads": 4, "seq": 16, "vocab": 64}
# compare.py's --size presets (issue 46); a size flag given beside one wins. tiny: the test suite's sizes (a
# run in seconds). cpu: SIZES, the default on CPUs (parity in float64; the time column there is dispatch and
# the simulated devices sharing the cores). gpu: the default on GPUs, in float32 (TF32 off): a transformer
# step of ~4.4e11 FLOPs (6·Φ·B·T with Φ = 16.8 M, B·T = 4096 tokens, plus attention's 12·L·B·T²·D), ~11 ms
# of an H100's 67 TFLOP/s FP32 at 60 %, so its kernels, not the launches, make the step. The MLP keeps
# the batch (one Config per run): its rows stay small, and host-bound ones are marked in the table.
SIZE_PRESETS = {
    "tiny": {"layers": 2, "dim": 16, "batch": 8, "heads": 4, "seq": 8, "vocab": 32},
    "cpu": SIZES,
    "gpu": {"layers": 4, "dim": 512, "batch": 16, "heads": 8, "seq": 256, "vocab": 4096},
}
PRESET_DTYPE = {"tiny": "float64", "cpu": "float64", "gpu": "float32"}  # a --dtype given wins


def add_sizes(p, batch=32, world_aware: bool = False) -> None:
    """The model's sizes (the MLP: layers, dim, batch; the transformer also heads, seq, vocab). ``world_aware``:
    a size not given is None, worked out from the world size later (default_sizes)."""
    def default(name, value=None):
        value = SIZES[name] if value is None else value
        return (None, f" (default: {value}, or the next multiple the world size needs: {WORLD_AWARE[name]})") \
            if world_aware else (value, "")

    for flag, name, metavar, text, value in (
            ("--layers", "layers", "L", "layers (MLP) / blocks (transformer)", None),
            ("--dim", "dim", "D", "model width", None),
            ("--batch", "batch", "B", "sequences (transformer) or rows (MLP) per step, over all ranks", batch),
            ("--heads", "heads", "H", "transformer: attention heads (D %% H == 0)", None),
            ("--seq", "seq", "T", "transformer: sequence length", None),
            ("--vocab", "vocab", "V", "transformer: vocabulary size", None)):
        value, said = default(name, value)
        p.add_argument(flag, type=int, default=value, metavar=metavar, help=text + said)


WORLD_AWARE = {"layers": "pp's stages (× --virtual-stages)", "dim": "a multiple of the heads",
               "batch": "dp's ranks (× --accumulate) and pp's --microbatches", "heads": "tp's and ulysses' ranks",
               "seq": "ring_zigzag's 2 chunks per rank", "vocab": "tp's ranks"}


MICROBATCHES = 4  # pp's default micro-batches (on 8 ranks 8: the interleaved schedule needs M % world == 0)


def round_up(x: int, m: int) -> int:
    """The smallest multiple of m that is >= x."""
    return m * -(-x // m)


def given_sizes(args, world: int | None, microbatches: int = MICROBATCHES, virtual: int = 1, accumulate: int = 1,
                base: dict | None = None) -> dict:
    """The sizes the command line gave, and default_sizes' for those it did not."""
    return {k: getattr(args, k) if getattr(args, k) is not None else v
            for k, v in default_sizes(world, microbatches, virtual, accumulate, base).items()}


def default_sizes(world: int | None, microbatches: int = MICROBATCHES, virtual: int = 1, accumulate: int = 1,
                  base: dict | None = None) -> dict:
    """The model's sizes when not given: args.SIZES, each rounded up to the next multiple of what the 1-D
    patterns split it into at ``world`` ranks (Config.divisibility): layers by pp's stages × chunks, heads by
    tp's and ulysses' ranks, the width by the heads, the batch by dp's ranks × accumulate and pp's
    micro-batches, the sequence by ring_zigzag's 2·world chunks, the vocabulary by tp's ranks. On 1, 2 or 4
    ranks (and ``world`` None: a --mesh run) these are SIZES themselves; on 8: 8 layers and 8 heads. ``base``:
    other small defaults (compare.py checkpoint's batch of 16)."""
    from math import lcm

    base = dict(SIZES, **(base or {}))
    if world is None:
        return base
    up = round_up
    # a count < 1 is refused by Config.validate with its own message: round as if it were 1
    world, microbatches, virtual, accumulate = (max(1, n) for n in (world, microbatches, virtual, accumulate))
    heads = up(base["heads"], world)
    return {"layers": up(base["layers"], world * virtual), "heads": heads, "dim": up(base["dim"], heads),
            "batch": up(base["batch"], lcm(world * accumulate, microbatches)),
            "seq": up(base["seq"], 2 * world), "vocab": up(base["vocab"], world)}


def add_size_preset(p) -> None:
    p.add_argument("--size", choices=sorted(SIZE_PRESETS), default=None,
                   help="a preset of the sizes (and dtype) below: tiny (the tests'), cpu (L=4 D=32 T=16 B=32, "
                        "float64), gpu (L=4 D=512 H=8 T=256 V=4096 B=16, float32: a transformer step an H100's "
                        "kernels fill); a size or --dtype given beside it wins (default: gpu on GPUs, else cpu)")


def add_training(p, steps=5, steps_help="optimizer steps per run", dtype="float64") -> None:
    """What a run trains with: steps, seed, dtype, AdamW's learning rate and weight decay. ``dtype`` None: worked
    out later (compare.py: its --size preset's)."""
    p.add_argument("--steps", type=int, default=steps, metavar="S", help=steps_help)
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the shared weights and data")
    p.add_argument("--dtype", choices=DTYPES, default=dtype,
                   help="parameters, activations and optimizer state (--precision mixed: the compute dtype)"
                        + ("" if dtype else " (default: float64; float32 with --size gpu)"))
    p.add_argument("--precision", choices=PRECISIONS, default="pure",
                   help="pure: everything in --dtype; mixed: float32 master weights, gradients, optimizer state "
                        "and gradient reductions, compute in --dtype bfloat16 (or float16, with dynamic loss "
                        "scaling)")
    p.add_argument("--lr", type=float, default=1e-3, metavar="LR", help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, metavar="WD",
                   help="AdamW weight decay (torch's default)")


def add_recipe(p) -> None:
    """The training recipe (shared/recipe.py, docs/recipe.md "In compare.py"; dp, fsdp, tp, cp): every flag off by
    default."""
    from shared.recipe import PRESETS, SCHEDULES

    p.add_argument("--recipe", choices=sorted(PRESETS), default=None,
                   help="a preset of the flags below; llama = --clip 1.0 --schedule warmup-cosine --decay-mask "
                        "(a flag given beside it wins) (default: none)")
    p.add_argument("--clip", type=float, default=None, metavar="NORM",
                   help="clip the gradient by its GLOBAL norm (torch's clip_grad_norm_ formula, every layout) "
                        "(default: none)")
    p.add_argument("--accumulate", type=int, default=None, metavar="K",
                   help="micro-batches per optimizer step; the gradient reduction runs once per step where the "
                        "pattern can skip it (default: 1)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="learning-rate schedule: warmup-cosine = linear warm-up over a quarter of the steps, then a "
                        "cosine down to 10%% of --lr (default: constant)")
    p.add_argument("--decay-mask", action="store_true", default=None,
                   help="weight decay on matrices only (>= 2 dims), none on the norm gains (default: every parameter)")
    p.add_argument("--freeze", default=None, metavar="GLOBS",
                   help="comma list of parameter-name globs not trained, e.g. 'wte.*,blocks.0.*' (names as "
                        "torch's named_parameters) (default: none)")


def recipe_fields(args) -> dict:
    """The Config fields of the recipe flags: the preset's, then each flag given (it wins)."""
    from shared.recipe import PRESETS, parse_globs

    out = dict(PRESETS[args.recipe]) if getattr(args, "recipe", None) else {}
    for name in ("clip", "accumulate", "schedule", "decay_mask"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    if getattr(args, "freeze", None) is not None:
        out["freeze"] = parse_globs(args.freeze)
    return out


def add_device(p) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="gpu: NCCL and JAX on GPUs, or refuse; cpu: gloo and simulated devices; auto: GPUs when "
                        "there are enough")


def add_json(p, what: str) -> None:
    p.add_argument("--json", metavar="PATH", default=None,
                   help=f"write {what} here as JSON ('-': standard output) (default: none)")


def add_resource_check(p) -> None:
    """--no-resource-check: skip the up-front ranks / memory estimate (parallel_twins/preflight.py)."""
    p.add_argument("--no-resource-check", action="store_true",
                   help="start even when --world-size exceeds max(32, 4 × cores) or the memory estimate exceeds "
                        "the available memory (parallel_twins/preflight.py) (default: refuse)")


def launched() -> bool:
    """This process is one rank / process of a launch (torchrun, a multi-process JAX launch)."""
    return "RANK" in os.environ or "JAX_NUM_PROCESSES" in os.environ


def add_quiet(p, what: str = "no progress line (it is shown on a terminal only)") -> None:
    p.add_argument("--quiet", action="store_true", help=what)


# --- output paths --------------------------------------------------------------------------------


def check_output_path(flag: str, path: str | None, directory: bool = False) -> None:
    """Refuse (ValueError, one line) an output path that could not be written, before anything runs:
    a file needs an existing, writable folder (and must not be a folder; ``-`` is standard output, a
    FIFO or a device is written in place); a folder (``--plots``) may not exist yet, but the nearest
    existing parent must be a writable folder."""
    if not path or (path == "-" and not directory):
        return
    path = os.path.abspath(path)
    if directory:
        if os.path.exists(path):
            if not os.path.isdir(path):
                raise ValueError(f"{flag} {path}: exists and is not a folder")
            try:  # os.access is not enough: root "may" write /proc, whose files cannot be created
                tempfile.TemporaryFile(dir=path).close()
            except OSError as exc:
                raise ValueError(f"{flag} {path}: the folder is not writable ({exc.strerror})") from None
            return
        parent = path
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"{flag} {path}: cannot create it: {parent} is not a writable folder")
        try:  # root "may" write /proc, where nothing can be created
            tempfile.TemporaryFile(dir=parent).close()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot create it in {parent} ({exc.strerror})") from None
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder; give a file name")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if os.path.exists(path) and not _regular(path):  # a FIFO, a device, /dev/stdout: written in place
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path}: not writable")
        return
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")


def _regular(path: str) -> bool:
    """A regular file itself (not a symlink, FIFO, device or socket): the one kind replaced by a rename."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def write_output(path: str, data: str | bytes) -> None:
    """Write ``data`` to an output path: ``-`` is standard output; a path that exists and is not a
    regular file (a FIFO, a character device, /dev/stdout, a symlink) is opened and written in place,
    never replaced; a regular file (or a new one) is written aside and renamed over, so it is complete
    or absent. A folder is refused (IsADirectoryError; check_output_path refuses it up front)."""
    binary = isinstance(data, bytes)
    if path == "-":
        if binary:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(data)
            sys.stdout.flush()
        return
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a folder; give a file name")
    if os.path.exists(path) and not _regular(path):
        with open(path, "wb" if binary else "w") as f:
            f.write(data)
        return
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb" if binary else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def check_devices(frameworks, world_size: int, device: str) -> None:
    """Refuse (ValueError) a device request that cannot be met, before any rank starts. JAX first:
    its GPU backend starts before this process loads torch's CUDA libraries (jax-ml/jax#18032)."""
    if "jax" in frameworks and "RANK" not in os.environ:
        from jax_impl.devices import devices

        try:
            devices(world_size, device)
        except RuntimeError as exc:  # JAX_PLATFORMS=bogus, or a platform this machine cannot start
            if "Unable to initialize backend" not in str(exc):
                raise
            name = f"environment variable JAX_PLATFORMS={os.environ['JAX_PLATFORMS']!r}" \
                if os.environ.get("JAX_PLATFORMS") else "JAX"
            why = str(exc).splitlines()[0].split(" (set JAX_PLATFORMS")[0].rstrip(".")
            raise ValueError(f"{name}: {why}; unset it, or set JAX_PLATFORMS=cpu") from None
    if "torch" in frameworks:
        from torch_impl.launch import resolve_device

        resolve_device(device, world_size)


# --- the run's configs, as every report names them ------------------------------------------------


def _belongs(cfg, pattern) -> bool:
    """Which of the run's configs a pattern takes: mesh those with a layout, ep the MoE transformer,
    the 1-D patterns the plain models."""
    if pattern == "mesh":  # a layout's config, dense or (an ep axis) the MoE transformer
        return bool(cfg.mesh)
    return not cfg.mesh and cfg.moe == (pattern == "ep")


def cfgs_for(cfgs, pattern):
    """The configs ``pattern`` runs (``_belongs``), only the models it applies to (cp, mesh and ep:
    the transformer)."""
    return [c for c in cfgs if _belongs(c, pattern) and c.applies(pattern)]


def run_key(cfg) -> str:
    """What one entry of a pattern is reported under: the model, and the layout (mesh) or the
    experts (ep), e.g. "transformer dp=2,tp=2" or "transformer E=4,k=2"."""
    return f"{cfg.model} {cfg.mesh_name}" if cfg.mesh else f"{cfg.model} {cfg.moe_name}" if cfg.moe else cfg.model
