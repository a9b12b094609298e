"""The names a run is built from, and which patterns build which: the patterns, dtypes, models, mesh
axes, precisions and schedules that shared/config.py's ``Config`` checks against (NumPy-free, no imports).

Kept apart from the dataclass so a reader finds "what can I ask for" on one page; shared.config re-exports
every name.
"""

from __future__ import annotations

DTYPES = ("float32", "float64", "bfloat16", "float16")
PATTERNS = ("collectives", "dp", "fsdp", "tp", "pp", "cp", "ep", "mesh")
SEQUENCE_PATTERNS = ("cp",)  # patterns that split the sequence: the transformer only
# Expert parallelism runs the mixture-of-experts transformer (Config.experts > 0), and only it does:
# the other patterns' plans (TP's module table, FSDP's units, the pipeline's stages) name the dense MLP.
EXPERT_PATTERNS = ("ep",)
# N-D parallelism (the "mesh" pattern): the axes a layout may name. dp and fsdp are the data axis
# (replicated / ZeRO-3-sharded weights; both: HSDP); ep splits the batch too (a data axis for the dense
# weights, which it replicates) and the experts' stacked weights (the MoE transformer: --experts E).
MESH_AXES = ("dp", "fsdp", "ep", "pp", "cp", "tp")
DATA_AXES = ("dp", "fsdp", "ep")
MODELS = ("mlp", "transformer")
# compare.py's default run (no --patterns, --styles or --all): every pattern in both frameworks, in the four
# styles of the README's table (torch explicit and builtin, JAX shard_map and jit), each by ONE variant, its
# main one, so that a fresh clone's first run takes ~2 minutes on 2 cores, not ~5 (issue 46). JAX's typed
# style and torch's compiled one, and every other variant, run under --all (or --patterns / --styles).
TOUR = {
    "dp": {"explicit": "bucketed", "builtin": "ddp", "shard_map": "dp", "jit": "dp"},
    "fsdp": {"explicit": "zero3", "builtin": "fsdp2", "shard_map": "zero3", "jit": "zero3"},
    "tp": {"explicit": "megatron", "builtin": "dtensor", "shard_map": "megatron", "jit": "megatron"},
    "pp": {"explicit": "1f1b", "builtin": "1f1b", "shard_map": "1f1b", "jit": "circular"},
    "cp": {"explicit": "ring", "shard_map": "ring", "jit": "seq_sharded"},
    "ep": {"explicit": "dropless", "builtin": "dropless", "shard_map": "capacity", "jit": "gshard"},
}


def in_tour(pattern: str, style: str, variant: str) -> bool:
    """Is (style, variant) of ``pattern`` in the default run (TOUR)? A pattern not in TOUR: every one."""
    return pattern not in TOUR or TOUR[pattern].get(style) == variant
# Activation recomputation (the transformer): keep every activation, keep only each block's input and
# recompute the block in backward, or recompute only the attention core (Korthikanti et al. 2022).
RECOMPUTE = ("none", "full", "selective")
BYTES_PER_ELEMENT = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
# Precision: "pure" trains everything in ``dtype``; "mixed" keeps parameters, gradients, optimizer state
# and gradient reductions in float32 (master weights) and computes in ``dtype`` (bfloat16): torch's
# autocast / FSDP2's MixedPrecisionPolicy, Flax's dtype= with param_dtype=float32.
PRECISIONS = ("pure", "mixed")
# float16 (5 exponent bits: gradients below 6e-8 flush to zero) trains only under mixed precision, with
# dynamic loss scaling (shared/recipe.py LOSS_SCALE: torch's GradScaler defaults; the skip decision agreed
# by every rank / device); a pure float16 run is refused.
MIXED_DTYPES = ("bfloat16", "float16")
# The patterns whose runs (every style) build mixed precision, per framework; the others refuse it in
# Config.check (which names the framework, or without one takes what every framework builds).
MIXED_PATTERNS = {"torch": ("dp", "fsdp", "tp", "pp", "cp", "ep", "mesh"),
                  "jax": ("dp", "fsdp", "tp", "pp", "cp", "ep", "mesh")}
# The patterns whose runs build --dtype float16 (mixed, with dynamic loss scaling), per framework. Not ep:
# its loss scaling (the skip agreed over the ep ranks, the experts' float16 gradients on their owners) is not
# built; --precision mixed --dtype float16 is refused there (use --dtype bfloat16).
FLOAT16_PATTERNS = {
    "torch": ("dp", "fsdp", "cp", "tp", "pp"),
    "jax": ("dp", "fsdp", "cp", "tp", "pp"),
}
# Why float16 is refused where it is (the refusal says it): what is missing there.
FLOAT16_WHY = {"ep": "ep's loss scaling — the skip agreed over the ranks, the experts' float16 gradients on their "
                     "owners — is not built"}
# The training recipe (shared/recipe.py: --clip, --accumulate, --schedule, --decay-mask, --freeze, --recipe):
# the patterns whose runs (every style, both frameworks) apply it exactly; the others refuse it in Config.check.
RECIPE_PATTERNS = ("dp", "fsdp", "tp", "cp", "mesh", "pp", "ep")
# the recipe under --precision mixed (bfloat16; float16 is refused under mesh and ep)
MIXED_RECIPE_PATTERNS = ("mesh", "pp", "ep")
SCHEDULES = ("constant", "warmup-cosine")  # the lr schedules (shared.recipe.lr_factors)


def mixed_patterns(framework: str | None = None, dtype: str = "bfloat16") -> tuple[str, ...]:
    """The patterns ``framework`` runs under --precision mixed in ``dtype`` (None: those every framework runs)."""
    table = FLOAT16_PATTERNS if dtype == "float16" else MIXED_PATTERNS
    if framework is not None:
        return table[framework]
    return tuple(p for p in PATTERNS if all(p in built for built in table.values()))


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """"dp=2,tp=2,pp=2" -> (("dp", 2), ("tp", 2), ("pp", 2)); ValueError with one clear line."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        name, eq, size = part.partition("=")
        if not eq or not size.strip().isdigit():
            raise ValueError(f"mesh {text!r}: write axis=size pairs, e.g. dp=2,tp=2,pp=2 (got {part!r})")
        if name.strip() in dict(out):
            raise ValueError(f"mesh {text!r}: axis {name.strip()} given twice (one size per axis)")
        if int(size) < 1 or int(size) > 1 << 24:
            raise ValueError(f"mesh {text!r}: {part}: a size from 1 to {1 << 24}")
        out.append((name.strip(), int(size)))
    return tuple(out)


def format_mesh(mesh) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh)
