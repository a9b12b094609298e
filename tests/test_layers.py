"""The library layers import no runner (issue 33): what a user applies to their own model may import
the framework, NumPy, ``shared.theory`` and its own layer, never the harness, the fixtures' Config /
Problem / results, the pattern runners or the project's models. Read with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TORCH_FORBIDDEN = ("shared.config", "shared.problem", "shared.results", "torch_impl.harness", "torch_impl.launch",
                   "torch_impl.dp", "torch_impl.fsdp", "torch_impl.tp", "torch_impl.pp", "torch_impl.cp",
                   "torch_impl.ep", "torch_impl.mesh", "torch_impl.model", "torch_impl.transformer")


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (function-level imports too);
    ``from pkg import name`` counts as both ``pkg`` and ``pkg.name`` (name may be a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_torch_library_imports_no_runner():
    files = sorted((ROOT / "torch_impl" / "parallel").glob("*.py"))
    assert len(files) >= 9, files
    bad = {}
    for path in files:
        hits = sorted(m for m in imported_modules(path)
                      if any(m == f or m.startswith(f + ".") for f in TORCH_FORBIDDEN) or m.startswith("jax")
                      or (m.startswith("torch_impl.") and m.split(".")[1] != "parallel"))  # only down
        if hits:
            bad[path.name] = hits
    assert not bad, f"torch_impl/parallel imports from above its layer: {bad}"
