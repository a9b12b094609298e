"""The training recipe of compare.py's own runs (issue 34, item 5): what one optimizer step does beyond
plain AdamW, written once for both frameworks. Stdlib only (and shared.config).

    clip          global-norm clipping, torch's clip_grad_norm_ formula: g · min(1, c / (‖g‖ + 1e-6))
    accumulate    K micro-batches per optimizer step (each rank's rows cut in K equal parts, loss / K)
    schedule      "constant" or "warmup-cosine": lr · lr_factors(...)[k] at optimizer step k
    decay_mask    weight decay on matrices only (every parameter with >= 2 dims); vectors (norm gains) none
    freeze        parameter-name globs (the fixture's names, shared.problem.param_names): not trained

``llama`` names the preset of a Llama-style run (clip 1.0, warmup-cosine, decay mask). The ledger
prices it: clipping adds one all-reduce of one scalar per sharded group (none where the gradient is
whole on every rank); accumulation keeps ONE gradient reduction per optimizer step where the pattern
can skip it (DDP no_sync, FSDP2 set_requires_gradient_sync, JAX: the sum of the K parts' gradients is
reduced once).
"""

from __future__ import annotations

import fnmatch
import math

from shared.config import SCHEDULES  # noqa: F401  (re-exported: the CLI's choices)

PRESETS = {"llama": {"clip": 1.0, "schedule": "warmup-cosine", "decay_mask": True}}
MIN_LR_RATIO = 0.1  # the cosine ends at 10% of the peak learning rate (Llama 2, Touvron et al. 2023)
# Dynamic loss scaling for float16 (Micikevicius et al. 2018, "Mixed Precision Training"): the loss is
# multiplied by ``scale`` before backward and the gradients divided by it before the optimizer; a step
# whose gradients hold an inf or NaN anywhere (on ANY rank / device: the flag is reduced with max) is
# skipped (no optimizer step, no schedule step) and the scale multiplied by ``backoff``; after
# ``interval`` finite steps in a row it is multiplied by ``growth``. torch.amp.GradScaler's defaults.
LOSS_SCALE = {"init": 2.0**16, "growth": 2.0, "backoff": 0.5, "interval": 2000}


def warmup_steps(steps: int) -> int:
    """A quarter of the run, at least one step (compare.py's runs are short: the warm-up must show)."""
    return max(1, steps // 4)


def lr_factors(schedule: str, steps: int) -> list[float]:
    """The learning-rate multiplier of each optimizer step 0 … steps-1 (torch: LambdaLR's lambda; JAX:
    the optax schedule indexes the same table, so both frameworks use bitwise the same float64 numbers).
    warmup-cosine: linear warm-up (k+1)/(W+1) for k < W, then a cosine from 1 down to MIN_LR_RATIO."""
    if schedule == "constant":
        return [1.0] * steps
    w = warmup_steps(steps)
    out = []
    for k in range(steps):
        if k < w:
            out.append((k + 1) / (w + 1))
        else:
            progress = (k - w) / max(1, steps - w)
            out.append(MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))
    return out


def decays(shape) -> bool:
    """With the decay mask: does a parameter of this (fixture) shape get weight decay? Matrices and
    embeddings (>= 2 dims) yes, vectors (norm gains) no."""
    return len(shape) >= 2


def is_frozen(name: str, globs) -> bool:
    """Is the fixture parameter ``name`` frozen by one of the ``globs`` (fnmatch: ``blocks.0.*``)?"""
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def parse_globs(text: str) -> tuple[str, ...]:
    """"wte.*,blocks.0.*" -> ("wte.*", "blocks.0.*")."""
    return tuple(g.strip() for g in text.split(",") if g.strip())


def check_freeze(cfg) -> None:
    """Refuse (ValueError, one line) a --freeze glob that names no parameter of cfg's model, or globs that
    freeze every parameter (nothing would train)."""
    if not cfg.freeze:
        return
    from shared.problem import param_names

    names = param_names(cfg)
    for glob in cfg.freeze:
        if not any(is_frozen(n, (glob,)) for n in names):
            shown = ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:4])}, …, {names[-1]}"
            raise ValueError(f"freeze: {glob!r} matches no parameter of the {cfg.model} (its names: {shown})")
    if all(is_frozen(n, cfg.freeze) for n in names):
        raise ValueError(f"freeze: {','.join(cfg.freeze)} freezes every parameter of the {cfg.model}: nothing would "
                         "train")


def describe(cfg) -> dict | None:
    """What a row records (``--json``: the run's ``recipe``), None for the textbook step."""
    if not getattr(cfg, "recipe_active", False):
        return None
    return {"clip": cfg.clip, "accumulate": cfg.accumulate, "schedule": cfg.schedule, "decay_mask": cfg.decay_mask,
            "freeze": list(cfg.freeze)}


def refusal(framework: str, pattern: str, style: str, variant: str, cfg) -> str | None:
    """Why one (style, variant) cannot apply ``cfg``'s recipe exactly (one line), or None. Those runs are
    left out (the pattern's ``variants(cfg)``) and compare.py says so before anything starts."""
    if framework == "jax" and (style, variant) == ("shard_map", "zero1") and (cfg.decay_mask or cfg.freeze):
        return (f"{pattern}: jax shard_map/zero1 left out: with --decay-mask / --freeze each device's optax sees ONE "
                "flat 1-D piece of all the parameters (no names, no dims), so the mask cannot be applied exactly "
                "(jax_impl.parallel.recipe refuses it); jit/zero1, typed/zero1 and shard_map zero2/zero3 apply it")
    if framework == "jax" and (style, variant) == ("shard_map", "zero3") and cfg.freeze:
        return (f"{pattern}: jax shard_map/zero3 left out: with --freeze the loss stops the frozen Params' gradient "
                "over the model's state, where zero3/shard_map's gathering units stand in as objects (not arrays); "
                "jit/zero3, typed/zero3 and shard_map zero2 apply it")
    if framework == "jax" and pattern == "pp" and variant in ("1f1b", "zb", "interleaved") and cfg.dtype == "float16":
        return (f"{pattern}: jax {style}/{variant} left out under --dtype float16: the schedule sums each "
                "micro-batch's float16 weight gradient into float32, where the reference's float16 backward sums "
                "the whole batch, so they overflow at other loss scales and skip other steps (measured: steps 0-2,4 "
                "against 0-3); "
                "the circular pipeline (shard_map, jit) sums as the reference does and runs")
    if framework == "jax" and pattern == "mesh" and (style == "shard_map" or (style == "jit" and cfg.moe)) and \
            (partial := partly_frozen(cfg)):
        return (f"{pattern}: jax {style} left out: --freeze {','.join(cfg.freeze)} freezes {partial} in some layers "
                "only, and compose (which runs this layout) stacks the blocks' Params (S, L/S, …), one leaf per name "
                "for every layer: freeze a block Param in every layer (blocks.*.NAME) or in none"
                + ("" if cfg.moe else "; jit and typed apply it"))
    # (tp and ep: their typed steps stop the frozen entries of a {name: array} tree, not the model's state)
    if framework == "jax" and style == "typed" and cfg.freeze and cfg.model == "transformer" and \
            pattern not in ("tp", "ep"):
        return (f"{pattern}: jax typed left out: with --freeze the loss stops the frozen Params' gradient over the "
                "model's state, where typed's stated embedding lookup stands in as an object (not arrays); "
                "jit and shard_map apply it")
    return None


def partly_frozen(cfg) -> str | None:
    """The first block parameter (``blocks.*.NAME``) that --freeze freezes in some layers but not all, or None."""
    if not cfg.freeze:
        return None
    from shared.problem import param_names

    by_name: dict[str, set[bool]] = {}
    for n in param_names(cfg):
        head, _, rest = n.partition(".")
        if head == "blocks":
            by_name.setdefault(rest.partition(".")[2], set()).add(is_frozen(n, cfg.freeze))
    return next((f"blocks.*.{k}" for k, seen in by_name.items() if len(seen) > 1), None)


def refusals(cfgs, patterns, frameworks, variants_of) -> list[str]:
    """Every refusal of the runs compare.py was asked for; ``variants_of(fw, pattern, cfg)``: all of them."""
    return [r for fw in frameworks for p in patterns if p != "collectives" for c in cfgs
            for s, v in variants_of(fw, p, c) if (r := refusal(fw, p, s, v, c))]
