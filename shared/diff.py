"""What changed between two compare.py --json result files (NumPy/stdlib only; docs/regression.md).

    old, new = load("before.json"), load("after.json")     # BadInput: one line naming the file and the fault
    result = diff(old, new, time_factor=2.0)                # {"provenance": [...], "findings": [...], ...}

Rows are matched by KEY_FIELDS (a key a row lacks counts as None). Each finding has a severity:
"regression" (a row that was ok and is not; a parity error grown more than PARITY_FACTOR; bytes that
matched shared/theory and no longer do; more state or peak memory; a step time ratio slower beyond the
noise factor; a row that no longer runs; a new error), "changed" (collectives by kind, count, bytes per
op or mesh axis; the config; a new row) or "improved" (the reverse of a regression). Step times are
compared as ratios within each file (a row's time over its framework's builtin / jit run of the same
pattern and model, and JAX's over torch's), so that files from two machines compare.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from shared.bounded import BadFile, read_json
from shared.provenance import flat
from shared.tolerances import TOLERANCE

KEY_FIELDS = ("pattern", "model", "framework", "style", "variant", "layout", "precision")
NEEDED = ("pattern", "framework", "style", "variant", "ok")  # what a run entry must have to be compared
SEVERITIES = ("regression", "changed", "improved")
PARITY_FACTOR = 10.0
# Errors below this fraction of the dtype's tolerance are round-off (a few ulps of a reordered sum):
# a move among them is not a finding (float64: 1e-15, float32: 5e-8).
PARITY_FLOOR = 1e-3
ANCHOR_STYLES = ("builtin", "jit")  # the time each row is divided by: its framework's library-built run
PARITY_FIELDS = {"max_rel_err_loss": "loss error", "max_rel_err_grad": "step-0 gradient error",
                 "max_rel_err_param": "final parameter error", "xfw_max_rel_err": "error vs the other framework"}
MEMORY_EXTRA = {"activation_bytes": "activations saved (torch)", "temp_bytes": "XLA temp buffer",
                "peak_bytes": "peak allocated (CUDA)"}


class BadInput(ValueError):
    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")


@dataclass
class Finding:
    severity: str  # SEVERITIES
    kind: str  # status | parity | collectives | theory | memory | time | rows | errors | config
    row: str  # the row's key as text ("dp mlp torch/explicit/naive"), "" for the file
    what: str  # one line
    old: Any = None
    new: Any = None


MAX_RESULT_BYTES = 256 * 2**20  # a result file of thousands of rows is a few MB; /dev/zero would never end


class Result(dict):
    """A loaded result: the dict, and ``row_texts``, each run's JSON text (validate's; diff reuses them)."""

    row_texts: list[str] | None = None


def load(path: str) -> dict:
    """A compare.py --json file, bounded (shared.bounded: a regular file or a pipe of at most
    MAX_RESULT_BYTES, at most MAX_DEPTH deep; a device refused at once) and validated against
    docs/results-schema.json (``validate``) before anything compares it; BadInput (one line) otherwise."""
    try:
        data = read_json(path, "a compare.py --json result", MAX_RESULT_BYTES)
    except BadFile as exc:
        raise BadInput(path, str(exc).removeprefix(f"{path}: ")) from None
    out = Result(data) if isinstance(data, dict) else data
    texts = validate(data, path)
    out.row_texts = texts
    return out


SCHEMA_VERSIONS = (1,)  # docs/results-schema.json's "version"s this reads (shared.provenance.SCHEMA_VERSION)


def validate(data, path: str) -> list[str]:
    """Refuse (BadInput, one line naming the file and the first problem) a result that
    docs/results-schema.json does not describe: its schema_version (an integer this reads), every
    type, and (from schema 1 on) every required key. A file written before schema 1 (no
    schema_version, no provenance) is still compared: its types are checked, and the keys a row is
    matched by. NaN and ±inf pass here: the comparison reports them (``_nonfinite``). Returns each
    run's JSON text (a repeated row is validated once: keyed by its text)."""
    from shared.schema import check

    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise BadInput(path, "not a compare.py --json result (no list 'runs' at the top level)")
    for i, run in enumerate(data["runs"]):
        missing = [k for k in NEEDED if not isinstance(run, dict) or k not in run]
        if missing:
            raise BadInput(path, f"runs[{i}] lacks {', '.join(missing)}")
    versioned = "schema_version" in data
    version = data.get("schema_version")
    if versioned and (not isinstance(version, int) or isinstance(version, bool) or version not in SCHEMA_VERSIONS):
        raise BadInput(path, f"results schema version {version!r}: this version of compare.py reads "
                             f"{', '.join(map(str, SCHEMA_VERSIONS))} (docs/results-schema.json)")
    rows = data["runs"]
    row_texts = [json.dumps(run) for run in rows]
    texts: dict[str, int] = {}
    for i, text in enumerate(row_texts):  # a row repeated is checked once (20 000 copies: keyed, not walked)
        texts.setdefault(text, i)
    first = list(texts.values())
    problems = check({**data, "runs": [rows[i] for i in first]}, required=versioned, limit=2)
    problems = [re.sub(r"^runs\[(\d+)\]", lambda m: f"runs[{first[int(m.group(1))]}]", p) for p in problems]
    if problems:
        more = " (and more)" if len(problems) > 1 else ""
        raise BadInput(path, f"not a result of docs/results-schema.json: {problems[0]}{more}")
    return row_texts


def _xfw_status(ok) -> str:
    """A cross-framework check's status: ok, FAIL, or (None: float16 references that skipped different
    steps) not comparable."""
    return "ok" if ok else "FAIL" if ok is False else "not comparable"


_SCALARS = (str, int, float, bool, type(None))


def row_key(run: dict) -> tuple:
    """The row's KEY_FIELDS; precision "pure" (the default every row now states) keys as a file that
    predates the field does: None. A value that is not a scalar (a hand-edited list) keys as its JSON."""
    key = [run.get(k) for k in KEY_FIELDS]
    if key[-1] == "pure":
        key[-1] = None
    return tuple(v if type(v) in _SCALARS else json.dumps(v, sort_keys=True) for v in key)


def key_name(key: tuple) -> str:
    """("dp", "mlp", "torch", "explicit", "naive", None, None) -> "dp mlp torch/explicit/naive"."""
    named = dict(zip(KEY_FIELDS, key))
    head = " ".join(str(named[k]) for k in ("pattern", "model", "layout", "precision") if named[k] is not None)
    return f"{head} {named['framework']}/{named['style']}/{named['variant']}"


def _index(runs: list[dict]) -> dict[tuple, dict]:
    """Rows by key; a key seen twice in one file gets its occurrence number appended (counted per key:
    linear in the rows, however many repeat)."""
    out: dict[tuple, dict] = {}
    seen: dict[tuple, int] = {}
    for run in runs:
        key = row_key(run)
        n = seen[key] = seen.get(key, 0) + 1
        out[key if n == 1 else key + (n,)] = run
    return out


def _ok(run: dict) -> bool:
    return bool(run.get("ok")) and run.get("xfw_ok") is not False


def _err(x) -> float:
    """An error as a number: None (the writer's "not finite") and NaN or ±inf (a file written by hand or
    by another writer) are infinite, never better than a finite one."""
    return math.inf if x is None or not math.isfinite(x) else float(x)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _time(r: dict) -> float | None:
    """A row's step time when it is one (finite and > 0); else None (no time comparison; a non-finite
    one is a finding of its own: ``_nonfinite``)."""
    t = r.get("step_time_s")
    return float(t) if _finite(t) and t > 0 else None


def nonfinite_paths(x, path: str = "", skip=()) -> list[str]:
    """Where ``x`` (a row) holds NaN or ±inf: ["step_time_s", "losses[3]", …]."""
    if isinstance(x, float) and not math.isfinite(x):
        return [path]
    if isinstance(x, dict):
        return [p for k, v in x.items() if k not in skip for p in nonfinite_paths(v, f"{path}.{k}" if path else k)]
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in nonfinite_paths(v, f"{path}[{i}]")]
    return []


def _nonfinite(name: str, old: dict, new: dict, texts: tuple[str, str] | None = None) -> list[Finding]:
    """NaN or ±inf in a row (never written by compare.py, which writes null): a regression in NEW, a
    change when only OLD had it — never an improvement. The parity errors have their own rule.
    ``texts``: the rows as JSON, to look for NaN / Infinity before walking them."""
    texts = texts or (json.dumps(old), json.dumps(new))
    walk = lambda row, text: nonfinite_paths(row, skip=PARITY_FIELDS) if "NaN" in text or "Infinity" in text else []
    a, b = walk(old, texts[0]), walk(new, texts[1])
    out = []
    if b:
        out.append(Finding("regression", "nonfinite", name, f"not finite in NEW: {', '.join(b[:4])}"
                           + (f" (and {len(b) - 4} more)" if len(b) > 4 else "")))
    elif a:
        out.append(Finding("changed", "nonfinite", name, f"not finite in OLD, finite now: {', '.join(a[:4])}"))
    return out


def _fmt(x) -> str:
    return "inf" if x is None or x == math.inf else f"{x:.1e}"


def _parity(name: str, old: dict, new: dict, dtype, fields=PARITY_FIELDS) -> list[Finding]:
    floor = TOLERANCE.get(dtype, 1e-12) * PARITY_FLOOR
    out = []
    for field, label in fields.items():
        if field not in old or field not in new or (old[field] is None and new[field] is None):
            continue
        a, b = max(_err(old[field]), floor), max(_err(new[field]), floor)
        if b > a * PARITY_FACTOR or (b == math.inf) != (a == math.inf):
            sev = "regression" if b > a else "improved"
            ratio = f" (×{b / a:.0f})" if math.isfinite(a) and math.isfinite(b) else ""
            out.append(Finding(sev, "parity", name, f"{label} {_fmt(old[field])} -> {_fmt(new[field])}{ratio}",
                               old[field], new[field]))
        elif a > b * PARITY_FACTOR:
            out.append(Finding("improved", "parity", name, f"{label} {_fmt(old[field])} -> {_fmt(new[field])} "
                               f"(÷{a / b:.0f})", old[field], new[field]))
    return out


def _comm(name: str, old: dict, new: dict, where: str = "") -> list[Finding]:
    """Per op: added, gone, count or bytes per op changed ({op: {"count", "bytes"}} each side)."""
    out = []
    for op in sorted(set(old) | set(new)):
        a, b = old.get(op), new.get(op)
        if a == b:
            continue
        if a is None or b is None:
            side = b if a is None else a
            what = f"{where}{op} ×{side['count']} ({side['bytes']} B) {'added' if a is None else 'gone'}"
        else:
            per = lambda v: v["bytes"] // max(v["count"], 1)
            what = f"{where}{op} count {a['count']} -> {b['count']}, bytes per op {per(a)} -> {per(b)}"
        out.append(Finding("changed", "collectives", name, what, a, b))
    return out


def _memory(name: str, old: dict, new: dict) -> list[Finding]:
    out = []
    pairs = [(f"state {k}", (old.get("state_bytes") or {}).get(k), (new.get("state_bytes") or {}).get(k))
             for k in sorted(set(old.get("state_bytes") or {}) | set(new.get("state_bytes") or {}))]
    pairs += [(label, (old.get("extra") or {}).get(k), (new.get("extra") or {}).get(k))
              for k, label in MEMORY_EXTRA.items()]
    for label, a, b in pairs:
        if not _finite(a) or not _finite(b) or a == b:  # NaN / inf: a finding of its own (_nonfinite)
            continue
        out.append(Finding("regression" if b > a else "improved", "memory", name,
                           f"{label} per rank {a:,} -> {b:,} B ({(b - a) / max(a, 1):+.0%})", a, b))
    return out


def _row(key: tuple, old: dict, new: dict, seen: dict | None = None, texts=None) -> list[Finding]:
    """The findings of one matched row. ``seen``: findings by the two rows' JSON (``texts``), so a
    pair repeated (a file of duplicate rows) is compared once."""
    name = key_name(key)
    if seen is not None:
        texts = texts or (json.dumps(old), json.dumps(new))
        if (name, texts) not in seen:
            seen[name, texts] = _row_findings(name, old, new, texts)
        return list(seen[name, texts])
    return _row_findings(name, old, new)


def _row_findings(name: str, old: dict, new: dict, texts=None) -> list[Finding]:
    out = []
    if _ok(old) != _ok(new):
        out.append(Finding("regression" if _ok(old) else "improved", "status", name,
                           f"{'ok' if _ok(old) else 'FAIL'} -> {'ok' if _ok(new) else 'FAIL'}", _ok(old), _ok(new)))
    out += _parity(name, old, new, new.get("dtype"))
    by_axis = [(r.get("extra") or {}).get("comm_by_axis") for r in (old, new)]
    if all(isinstance(v, dict) for v in by_axis):  # the mesh: per axis (an op that moved axis shows)
        for axis in sorted(set(by_axis[0]) | set(by_axis[1])):
            out += _comm(name, by_axis[0].get(axis, {}), by_axis[1].get(axis, {}), f"axis {axis}: ")
    else:
        out += _comm(name, old.get("comm") or {}, new.get("comm") or {})
    a_eq, b_eq = (r.get("comm_bytes_theory") is not None and r.get("comm_bytes") == r["comm_bytes_theory"]
                  for r in (old, new))
    if a_eq != b_eq:
        out.append(Finding("regression" if a_eq else "improved", "theory", name,
                           f"bytes {old.get('comm_bytes')} vs theory {old.get('comm_bytes_theory')} -> "
                           f"{new.get('comm_bytes')} vs theory {new.get('comm_bytes_theory')}",
                           old.get("comm_bytes_theory"), new.get("comm_bytes_theory")))
    return out + _memory(name, old, new) + _nonfinite(name, old, new, texts)


def time_ratios(runs: list[dict], index: dict | None = None) -> dict[tuple, tuple[float, str]]:
    """{row key: (its step time / its anchor's, anchor name)} within one file. A row's anchor is the first
    builtin (torch) / jit (JAX) row of its pattern, model and framework; a JAX anchor's own is torch's
    anchor (("jax vs torch", pattern, model) keys), so a framework slower everywhere still shows."""
    anchors: dict[tuple, dict] = {}
    for r in runs:
        if _time(r):
            group = (r["pattern"], r.get("model"), r["framework"])
            if group not in anchors or (r["style"] in ANCHOR_STYLES
                                        and anchors[group]["style"] not in ANCHOR_STYLES):
                anchors[group] = r
    out = {}
    for key, r in (index if index is not None else _index(runs)).items():
        anchor = anchors.get((r["pattern"], r.get("model"), r["framework"]))
        if _time(r) and anchor is not None and anchor is not r:
            out[key] = (_time(r) / _time(anchor), f"{anchor['style']}/{anchor['variant']}")
    for (pattern, model, fw), r in anchors.items():
        other = anchors.get((pattern, model, "torch"))
        if fw == "jax" and other is not None:
            out[("jax vs torch", pattern, model)] = (_time(r) / _time(other),
                                                     f"torch/{other['style']}/{other['variant']}")
    return out


def _times(old_runs, new_runs, factor: float, index=(None, None)) -> list[Finding]:
    a, b, out = time_ratios(old_runs, index[0]), time_ratios(new_runs, index[1]), []
    for key in [k for k in a if k in b]:
        (ra, anchor), (rb, _) = a[key], b[key]
        if max(ra, rb) > factor * min(ra, rb):
            name = f"{key[1]} {key[2]} jax anchor" if key[0] == "jax vs torch" else key_name(key[:len(KEY_FIELDS)])
            out.append(Finding("regression" if rb > ra else "improved", "time", name,
                               f"step time / {anchor}'s {ra:.2f} -> {rb:.2f} (×{rb / ra:.2f}; noise factor "
                               f"{factor:g})", ra, rb))
    return out


# Config fields added after files were written: their value in a file that predates them.
ADDED = {"precision": "pure", "clip": None, "accumulate": 1, "schedule": "constant", "decay_mask": False, "freeze": []}


def _configs(old: dict, new: dict) -> list[Finding]:
    a, b = old.get("configs") or {"": old.get("config") or {}}, new.get("configs") or {"": new.get("config") or {}}
    changes: dict[tuple, list[str]] = {}
    for run in sorted(set(a) & set(b)):
        for field in sorted(set(a[run]) | set(b[run])):
            if field in ADDED and a[run].get(field, ADDED[field]) == b[run].get(field, ADDED[field]):
                continue  # a file that predates the field trained with its default (pure, plain AdamW)
            if a[run].get(field) != b[run].get(field):
                seen = (field, json.dumps(a[run].get(field)), json.dumps(b[run].get(field)))
                changes.setdefault(seen, []).append(run)
    out = [Finding("changed", "config", "", f"{f}: {x} -> {y} ({', '.join(r for r in runs if r) or 'config'})",
                   json.loads(x), json.loads(y))
           for (f, x, y), runs in changes.items()]
    out += [Finding("changed", "config", run, "config only in OLD" if run in a else "config only in NEW")
            for run in sorted(set(a) ^ set(b))]
    return out


def _row_texts(data: dict) -> list[str]:
    texts = getattr(data, "row_texts", None)
    return texts if texts is not None and len(texts) == len(data["runs"]) else [json.dumps(r) for r in data["runs"]]


def diff(old: dict, new: dict, time_factor: float | None = 2.0) -> dict:
    """Everything that changed from ``old`` to ``new`` (loaded files). ``time_factor`` None: no time findings."""
    a, b = _index(old["runs"]), _index(new["runs"])
    ta, tb = ({id(r): t for r, t in zip(d["runs"], _row_texts(d))} for d in (old, new))  # one JSON text per row
    findings, seen = _configs(old, new), {}
    for key in a:
        if key in b:
            findings += _row(key, a[key], b[key], seen, (ta[id(a[key])], tb[id(b[key])]))
        else:
            findings.append(Finding("regression", "rows", key_name(key[:len(KEY_FIELDS)]),
                                    "only in OLD: no longer runs"))
    findings += [Finding("changed", "rows", key_name(k[:len(KEY_FIELDS)]), "only in NEW: a new row")
                 for k in b if k not in a]
    xa = {(x.get("pattern"), x.get("model")): x for x in old.get("cross_framework", [])}
    for x in new.get("cross_framework", []):
        k = (x.get("pattern"), x.get("model"))
        if k in xa:
            name = f"{k[0]} {k[1]} torch vs jax reference"
            was, now = _xfw_status(xa[k].get("ok")), _xfw_status(x.get("ok"))
            if was != now:
                findings.append(Finding("regression" if now == "FAIL" else "improved" if was == "FAIL" else "changed",
                                        "status", name, f"{was} -> {now}"))
            findings += _parity(name, xa[k], x, (new.get("config") or {}).get("dtype"),
                                {f: PARITY_FIELDS[f] for f in list(PARITY_FIELDS)[:3]})
    findings += [Finding("regression", "errors", "", e) for e in new.get("errors", [])
                 if e not in old.get("errors", [])]
    findings += [Finding("improved", "errors", "", f"gone: {e}") for e in old.get("errors", [])
                 if e not in new.get("errors", [])]
    if time_factor:
        findings += _times(old["runs"], new["runs"], time_factor, (a, b))
    findings.sort(key=lambda f: SEVERITIES.index(f.severity))  # stable: within a severity, the files' order
    pa, pb = flat(old.get("provenance") or {}), flat(new.get("provenance") or {})
    return {
        "provenance": [{"field": k, "old": pa.get(k), "new": pb.get(k), "differs": pa.get(k) != pb.get(k)}
                       for k in list(pa) + [k for k in pb if k not in pa]],
        "findings": [asdict(f) for f in findings],
        "counts": {s: sum(f.severity == s for f in findings) for s in SEVERITIES},
        "rows": {"old": len(a), "new": len(b), "matched": len(set(a) & set(b))},
        "thresholds": {"parity_factor": PARITY_FACTOR, "parity_floor": PARITY_FLOOR, "time_factor": time_factor},
        "regressed": any(f.severity == "regression" for f in findings),
    }
