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


def check(data, definition: str | None = None, schema: dict | None = None, limit: int = 20) -> list[str]:
    """Where ``data`` departs from the schema (the whole file's, or ``$defs[definition]``): up to
    ``limit`` one-line problems, [] when it conforms."""
    schema = schema or load_schema()
    problems: list[str] = []
    _check(data, schema["$defs"][definition] if definition else schema, schema, "", problems)
    return problems[:limit]


def _where(path: str) -> str:
    return path or "(top level)"


def _check(x, s: dict, root: dict, path: str, out: list[str]) -> None:
    unknown = set(s) - KNOWN
    if unknown:
        raise ValueError(f"schema at {_where(path)}: keyword(s) {sorted(unknown)} not supported by shared/schema.py")
    if "$ref" in s:
        name = s["$ref"].removeprefix("#/$defs/")
        _check(x, root["$defs"][name], root, path, out)
    if "type" in s:
        names = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(TYPES[n](x) for n in names):
            out.append(f"{_where(path)}: expected {' or '.join(names)}, got {_short(x)}")
            return
    if "enum" in s and x not in s["enum"]:
        out.append(f"{_where(path)}: {_short(x)} is not one of {s['enum']}")
    if "minimum" in s and TYPES["number"](x) and x < s["minimum"]:
        out.append(f"{_where(path)}: {x} is below the minimum {s['minimum']}")
    if isinstance(x, dict):
        for key in s.get("required", ()):
            if key not in x:
                out.append(f"{_where(path)}: missing {key!r}")
        props = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        for key, value in x.items():
            sub = f"{path}.{key}" if path else key
            if key in props:
                _check(value, props[key], root, sub, out)
            elif extra is False:
                out.append(f"{_where(path)}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                _check(value, extra, root, sub, out)
    if isinstance(x, list) and "items" in s:
        for i, value in enumerate(x):
            _check(value, s["items"], root, f"{path}[{i}]", out)


def _short(x) -> str:
    text = json.dumps(x) if not isinstance(x, str) else repr(x)
    return text if len(text) <= 40 else text[:37] + "..."
