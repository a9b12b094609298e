"""The JAX library layer (jax_impl/parallel/) imports no runner, harness, Config/Problem/results or
project model: read from the source with ast, so the check costs no import."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_EXACT = {"shared.config", "shared.problem", "shared.results", "jax_impl.harness", "jax_impl.reference",
                   "jax_impl.launch", "jax_impl.checkpoint", "jax_impl.model", "jax_impl.transformer",
                   "jax_impl.dp", "jax_impl.fsdp", "jax_impl.tp", "jax_impl.pp", "jax_impl.cp", "jax_impl.ep",
                   "jax_impl.mesh", "jax_impl.collectives"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (``from jax_impl import x`` counts as jax_impl.x)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _forbidden(name: str) -> bool:
    """A named runner-level module, torch, or any jax_impl module outside the library (imports only go
    down: jax_impl/parallel/ sits under the runners; it once reached up for jax_impl/pp_schedules.py)."""
    return name in FORBIDDEN_EXACT or name.startswith("torch") or (
        name.startswith("jax_impl.") and name.split(".")[1] != "parallel")


def test_jax_library_imports_no_runner():
    files = sorted((ROOT / "jax_impl" / "parallel").glob("*.py"))
    assert len(files) >= 10, files
    bad = {f.name: sorted(n for n in _imports(f) if _forbidden(n)) for f in files}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}
