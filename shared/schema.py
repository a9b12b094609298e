"""A minimal checker for the subset of JSON Schema that docs/results-schema.json uses (stdlib only).

    problems = check(json.load(f))                    # a compare.py --json file: [] when it conforms
    problems = check(data, "stamped")                 # bench / plan / checkpoint --json: version + provenance

Keywords understood: type (a name or a list; "integer" excludes booleans, "number" takes integers),
properties, required, additionalProperties (false or a schema), items, enum, minimum, and $ref to
"#/$defs/NAME". Any other keyword raises, so the schema cannot silently use one this does not check.
Each problem is one line naming where it is, e.g. "runs[3].ok: expected boolean, got 'yes'".
"""

from __future__ import annotations

import json
import math
import os

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results-schema.json")
KNOWN = {"type", "properties", "required", "additionalProperties", "items", "enum", "minimum", "$ref",
         "description", "title", "$schema", "$id", "$defs", "version"}
TYPES = {
    "object": lambda x: isinstance(x, dict),
    "array": lambda x: isinstance(x, list),
    "string": lambda x: isinstance(x, str),
    "boolean": lambda x: isinstance(x, bool),
    "integer": lambda x: isinstance(x, int) and not isinstance(x, bool),
    "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
    "null": lambda x: x is None,
}


def load_schema(path: str = SCHEMA_PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def check(data, definition: str | None = None, schema: dict | None = None, limit: int = 20,
          required: bool = True) -> list[str]:
    """Where ``data`` departs from the schema (the whole file's, or ``$defs[definition]``): up to
    ``limit`` one-line problems, [] when it conforms. ``required=False``: types only, absent keys
    allowed (a file written before the schema). A NaN or ±inf passes ``minimum``: a non-finite number is
    its reader's finding (shared/diff.py), not a type error."""
    schema = schema or load_schema()
    _vet(schema, [])
    problems: list[str] = []
    _check(data, schema["$defs"][definition] if definition else schema, schema, [], problems, required, limit)
    return problems[:limit]


def _where(path) -> str:
    """["runs", 3, "ok"] -> "runs[3].ok" (built only for a problem: the walk keeps a list)."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "(top level)"


_TYPE_NAME = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
              type(None): "null"}


def _is(x, names) -> bool:
    name = _TYPE_NAME.get(type(x))
    if name is None:
        return any(TYPES[n](x) for n in names)
    return name in names or (name == "integer" and "number" in names)


def _vet(s, path: list) -> None:
    """Every keyword of the schema is one this checks (else ValueError): once per check, not per row."""
    if not isinstance(s, dict):
        return
    unknown = set(s) - KNOWN
    if unknown:
        raise ValueError(f"schema at {_where(path)}: keyword(s) {sorted(unknown)} not supported by shared/schema.py")
    for key in ("items", "additionalProperties"):
        _vet(s.get(key), [*path, key])
    for group in ("properties", "$defs"):
        for name, sub in (s.get(group) or {}).items():
            _vet(sub, [*path, name])


def _check(x, s: dict, root: dict, path: list, out: list[str], required: bool = True, limit: int = 20) -> None:
    if len(out) >= limit:  # enough said: a file of 20 000 bad rows is not walked to its end
        return
    if "$ref" in s:
        _check(x, root["$defs"][s["$ref"].removeprefix("#/$defs/")], root, path, out, required, limit)
    if "type" in s:
        names = s["type"] if isinstance(s["type"], list) else (s["type"],)
        if not _is(x, names):
            out.append(f"{_where(path)}: expected {' or '.join(names)}, got {_short(x)}")
            return
    if "enum" in s and x not in s["enum"]:
        out.append(f"{_where(path)}: {_short(x)} is not one of {s['enum']}")
    if "minimum" in s and TYPES["number"](x) and math.isfinite(x) and x < s["minimum"]:
        out.append(f"{_where(path)}: {x} is below the minimum {s['minimum']}")
    if isinstance(x, dict):
        for key in s.get("required", ()) if required else ():
            if key not in x:
                out.append(f"{_where(path)}: missing {key!r}")
        props = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        for key, value in x.items():
            sub = props.get(key)
            if sub is None and extra is False:
                out.append(f"{_where(path)}: unexpected key {key!r}")
                continue
            sub = sub if sub is not None else extra if isinstance(extra, dict) else None
            if sub:
                path.append(key)
                _check(value, sub, root, path, out, required, limit)
                path.pop()
    if isinstance(x, list) and "items" in s:
        for i, value in enumerate(x):
            path.append(i)
            _check(value, s["items"], root, path, out, required, limit)
            path.pop()


def _short(x) -> str:
    text = json.dumps(x) if not isinstance(x, str) else repr(x)
    return text if len(text) <= 40 else text[:37] + "..."
