"""Is a tensor-parallel plan possible on this model (torch_impl/parallel/tp.py applies it): which modules
a plan's keys match (``matches``: ``*`` = one path segment, ``planned_modules``, ``styles_of``), the
styles and the weight dim each splits (``SHARD_DIM``), and ``check_plan``: every precondition of
``apply_plan`` checked before any change or collective, the first problem ONE ``PlanError`` (what,
module path, how to fix): a module that is not what its style splits, sizes tp does not divide, a head
cut in two, a tied parameter split two ways, an unplanned parameter under sequence parallelism
(docs/tp.md, "Bring your own model").

No JAX twin: JAX's plan check (PlanError, planned_modules, check_plan over NNX modules, with its globs
from parallel/tree.py) is part of jax_impl/parallel/tp.py, which stays one file under ~450 lines.
"""

from __future__ import annotations

import difflib
from fnmatch import fnmatch

import torch.nn as nn

# Sequence parallelism: the same splits, and the modules between the matmuls run on this rank's
# T/tp tokens. Their weights stay replicated with partial gradients.
SEQUENCE_STYLES = ("sequence", "positions")
SHARD_DIM = {"colwise": 0, "colwise_heads": 0, "colwise_vocab": 0, "colwise_out": 0, "colwise_gather": 0,
             "rowwise": 1, "vocab_embed": 0}  # dim of the torch weight that is split


def matches(path: str, pattern: str) -> bool:
    """``*`` matches one path segment (parallelize_module's rule)."""
    a, b = path.split("."), pattern.split(".")
    return len(a) == len(b) and all(fnmatch(x, y) for x, y in zip(a, b, strict=True))


def styles_of(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{parameter name: style} for every parameter the plan splits (the rest are replicated)."""
    out = {}
    for path, _ in model.named_modules():
        for pattern, style in plan.items():
            if matches(path, pattern):
                out[f"{path}.weight"] = style
    return out


# --- checking a plan against the model it is applied to ---------------------------------------------

LINEAR_STYLES = ("colwise", "colwise_heads", "rowwise", "colwise_vocab", "colwise_out", "colwise_gather")
EMBEDDING_STYLES = ("vocab_embed", "positions")
STYLES = LINEAR_STYLES + ("vocab_embed",) + SEQUENCE_STYLES
ENTER_STYLES = ("colwise", "colwise_heads", "colwise_vocab", "colwise_out")  # f (SP: all-gather) before
PADDED_STYLES = ("vocab_embed", "colwise_vocab")  # rows padded to a multiple of tp: any vocabulary
HEAD_COUNT_ATTRS = ("heads", "n_heads", "num_heads", "num_attention_heads")


class PlanError(ValueError):
    """A plan ``apply_plan`` cannot carry out exactly on this model: what, where (module path), how
    to fix. Raised by ``check_plan`` before anything is changed or communicated."""


def _refuse(path: str, module: nn.Module, style: str, what: str, fix: str):
    raise PlanError(f"tp plan: {style!r} at {path!r} ({type(module).__name__}): {what}. Fix: {fix}")


def planned_modules(model: nn.Module, plan: dict[str, str],
                    missing_ok: bool = False) -> list[tuple[str, nn.Module, str]]:
    """[(module path, module, style)] in model order, each module once (a module reachable under
    two paths is one module). Refuses an unknown style, a key that matches no module (unless
    ``missing_ok``: a pipeline stage holds part of the model) and a module given two styles."""
    paths = [(path, m) for path, m in model.named_modules(remove_duplicate=False)]
    chosen: dict[int, tuple[str, nn.Module, str, str]] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise PlanError(f"tp plan: key {pattern!r} has unknown style {style!r}. Fix: use one of {STYLES}")
        hits = [(path, m) for path, m in paths if matches(path, pattern)]
        if not hits and not missing_ok:
            names = [path for path, m in paths if path and any(True for _ in m.parameters(recurse=False))]
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            raise PlanError(f"tp plan: key {pattern!r} ({style}) matches no module of {type(model).__name__} "
                            f"('*' matches one path segment). Fix: correct the key (close: {close or names[:6]}) or "
                            "drop it")
        for path, m in hits:
            if id(m) in chosen and chosen[id(m)][2] != style:
                first, _, other, key = chosen[id(m)]
                raise PlanError(f"tp plan: module {path!r} ({type(m).__name__}) is matched by {key!r} ({other}, as "
                                f"{first!r}) and by {pattern!r} ({style}). Fix: give each module one style")
            chosen.setdefault(id(m), (path, m, style, pattern))
    order: dict[int, int] = {}
    for k, (_, m) in enumerate(paths):
        order.setdefault(id(m), k)
    return [(path, m, style) for path, m, style, _ in sorted(chosen.values(), key=lambda c: order[id(c[1])])]


def _head_dim(model: nn.Module, path: str) -> tuple[int | None, int | None]:
    """(heads, head_dim) declared by the module that holds ``path`` (an attention module), if any."""
    parent = model.get_submodule(path.rpartition(".")[0])
    heads = next((v for a in HEAD_COUNT_ATTRS if isinstance(v := getattr(parent, a, None), int)), None)
    dim = getattr(parent, "head_dim", None)
    return heads, dim if isinstance(dim, int) else None


def split_role(style: str, attr: str, sequence_parallel: bool) -> str | None:
    """How ``apply_plan`` treats parameter ``attr`` of a planned module: a split style (sharded like
    the weight), "sequence" (replicated, gradient partial over tp: SP), or None (replicated, full)."""
    if style in SEQUENCE_STYLES:
        return style
    if attr == "weight":
        return style
    if attr == "bias" and style != "rowwise":
        return style  # colwise: the bias is split with the rows of the weight
    if attr == "bias":  # rowwise: added once after g; under SP after the reduce-scatter, on T/tp tokens
        return "sequence" if sequence_parallel else None
    return "unknown"


def _signature(role: str | None):
    """Parameters tied across modules must be split the same way everywhere (or nowhere)."""
    if role is None or role in SEQUENCE_STYLES:
        return ("replicated", role is not None)  # a partial gradient (SP) is not a full one
    return (SHARD_DIM[role], role in PADDED_STYLES, role == "colwise_heads")


def check_module_types(planned) -> None:
    """Each planned module is what its style splits (an nn.Linear, an nn.Embedding): else PlanError."""
    for path, m, style in planned:
        if style in LINEAR_STYLES and not isinstance(m, nn.Linear):
            _refuse(path, m, style, "this style splits an nn.Linear (weight (out, in), y = x·Wᵀ + b) and hooks its "
                    "input and output; this module is not one", f"plan the nn.Linear(s) inside {path!r}, or leave it "
                    "out of the plan (replicated)")
        if style in EMBEDDING_STYLES and not isinstance(m, nn.Embedding):
            _refuse(path, m, style, "this style splits an nn.Embedding's rows (a lookup table (V, D)); this module is "
                    "not one", f"plan only nn.Embedding modules with {style!r}")


def check_plan(model: nn.Module, plan: dict[str, str], world_size: int, sequence_parallel: bool = False,
               missing_ok: bool = False) -> dict[str, str]:
    """Every precondition of ``apply_plan(model, plan, group of world_size)``, checked before any
    change or collective: raises ONE ``PlanError`` (what, module path, how to fix) for the first
    problem. Returns what ``apply_plan`` returns: {parameter name: style} of every parameter the
    plan splits (weights; colwise biases) or leaves partial under sequence parallelism."""
    n, out = world_size, {}
    planned = planned_modules(model, plan, missing_ok)
    roles: dict[int, list[tuple[str, tuple]]] = {}  # id(param) -> [(owner path.attr, signature)]
    check_module_types(planned)
    for path, m, style in planned:
        if style in SEQUENCE_STYLES and not sequence_parallel:
            _refuse(path, m, style, "this style runs the module on this rank's T/tp tokens, which exist only under "
                    "sequence parallelism", "pass sequence_parallel=True, or leave the module out of the plan")
        if isinstance(m, nn.Linear):
            rows, cols = m.weight.shape  # (out, in)
            heads, hd = _head_dim(model, path)
            if style in ("colwise", "colwise_out", "colwise_gather") and rows % n:
                _refuse(path, m, style, f"out_features={rows} is not divisible by tp={n}", f"make out_features a "
                        f"multiple of {n} (e.g. {-(-rows // n) * n}), use a tp that divides it, or leave the layer "
                        "replicated (only the vocabulary styles 'vocab_embed' / 'colwise_vocab' pad)")
            if style == "rowwise" and cols % n:
                _refuse(path, m, style, f"in_features={cols} is not divisible by tp={n}", f"make in_features a "
                        f"multiple of {n} (with the column-parallel layer before it), or use a tp that divides it")
            if style == "colwise_heads" and (rows % (3 * n) or (heads is not None and heads % n)
                                             or (hd and (rows // 3) % (hd * n))):
                _refuse(path, m, style, f"it needs a fused q|k|v weight (3·H·dh, D) with whole heads per rank: "
                        f"out_features={rows}, heads={heads}, head_dim={hd}, tp={n}", "use a tp that divides the "
                        "number of heads (and a fused 3·H·dh qkv), or separate q, k, v with 'colwise'")
            split = rows if style in ("colwise", "colwise_out", "colwise_gather") else cols if style == "rowwise" else 0
            if split and hd and split % hd == 0 and (split // hd) % n:
                _refuse(path, m, style, f"it would split {split // hd} heads of head_dim={hd} over tp={n}: a rank "
                        "would hold part of a head", "use a tp that divides every head count (GQA: the k/v heads "
                        "too)")
        if isinstance(m, nn.Embedding) and style == "vocab_embed":
            if m.max_norm is not None or m.scale_grad_by_freq:
                _refuse(path, m, style, "max_norm / scale_grad_by_freq act on the looked-up rows of the local table, "
                        "where other ranks' tokens are mapped to row 0 (renormalised, counted)", "drop max_norm and "
                        "scale_grad_by_freq, or leave the embedding replicated")
        for attr, p in m.named_parameters(recurse=style in SEQUENCE_STYLES):
            role = split_role(style, attr, sequence_parallel)
            if role == "unknown":
                _refuse(path, m, style, f"it has a parameter {attr!r} this style does not know how to split",
                        "plan a plain nn.Linear / nn.Embedding (weight, bias), or leave the module replicated")
            roles.setdefault(id(p), []).append((f"{path}.{attr}" if path else attr, role or "replicated"))
            if role is not None:
                out[f"{path}.{attr}" if path else attr] = role
    planned_ids = {id(m) for _, m, _ in planned}
    for path, m in model.named_modules(remove_duplicate=False):  # the rest hold their parameters replicated
        for attr, p in m.named_parameters(recurse=False) if id(m) not in planned_ids else ():
            roles.setdefault(id(p), []).append((f"{path}.{attr}" if path else attr, "replicated"))
    for uses in roles.values():
        uses = list(dict.fromkeys(uses))
        if len({_signature(None if role == "replicated" else role) for _, role in uses}) > 1:
            where = ", ".join(f"{name!r} ({role})" for name, role in uses)
            raise PlanError(f"tp plan: one Parameter (tied) is used as {where}: a plan must split a tied parameter "
                            "the same way in every module that holds it. Fix: plan every holder alike (e.g. "
                            "'vocab_embed' embedding + 'colwise_vocab' head), or untie it")
    if sequence_parallel:
        for name, p in model.named_parameters():
            if name not in out and p.requires_grad:
                raise PlanError(f"tp plan: under sequence parallelism every replicated parameter sees only this "
                                f"rank's T/tp tokens, and {name!r} is in no plan entry (its gradient would miss the "
                                "other ranks' tokens). Fix: plan its module as 'sequence' (norms) or 'positions' "
                                "(a position embedding), or split it")
    return out
