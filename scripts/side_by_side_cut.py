"""The cutting behind docs/side_by_side/ (scripts/side_by_side.py): excerpts of the running code,
never copied by hand, and the pages' model (Excerpt, Row, Page).

A ``Cut`` names a file and a qualified name there (``Class.method``, ``function.inner``, or a module-level
assignment, found with ``ast``), optionally narrowed to the lines from the one containing ``start`` (which
must be unique in the definition) to the first at or after it containing ``end``; or, for a function too
long to narrow by its text, marker comments in the source (``# side-by-side: NAME`` … ``# end
side-by-side``, named ``marker:NAME``). Its lines and its link (``#L<start>-L<end>``) are computed when the
pages are generated. A cut that no longer matches the code raises ``CutError`` with the cut and what is
missing. NumPy-free, torch-free, JAX-free: the sources are only parsed.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
from dataclasses import dataclass, field
from functools import cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = 150  # code lines per framework per page (the bound: a page a reader can hold)
STYLES = {"torch": ("explicit", "builtin", "compiled"), "jax": ("shard_map", "jit", "typed")}
# the calls that ARE a pattern: a collective, a layout stated, a builtin wrapper
CALLS = re.compile(r"\bdist\.(all_reduce|all_gather_single|reduce_scatter_single|all_to_all_single|broadcast|"
                   r"batch_isend_irecv)\(|\blax\.(psum|pmean|pmax|psum_scatter|all_gather|all_to_all|ppermute|pcast)\(|"
                   r"\breshard\(|with_sharding_constraint\(|\bfully_shard\(|\bparallelize_module\(|"
                   r"DistributedDataParallel\(|PipelineStage\(|\bcontext_parallel\(")


class CutError(ValueError):
    """A cut that no longer matches the code: which page, which cut, what is missing."""


# --- cutting ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """Lines of ``path``: the definition ``name`` (``marker:NAME`` for marker comments), narrowed to
    [first line containing ``start``, first line at or after it containing ``end``]."""

    path: str
    name: str
    start: str | None = None
    end: str | None = None

    def __str__(self) -> str:
        narrowed = f" [{self.start!r} .. {self.end!r}]" if self.start or self.end else ""
        return f"{self.path}::{self.name}{narrowed}"


@cache
def _source(path: str) -> tuple[list[str], ast.Module]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    return text.splitlines(), ast.parse(text, filename=path)


def _find(body: list[ast.stmt], parts: list[str]) -> ast.AST | None:
    """The definition ``parts[0]`` among ``body``'s statements, then ``parts[1:]`` inside it."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == parts[0]:
            return node if len(parts) == 1 else _find(node.body, parts[1:])
        if len(parts) == 1 and isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == parts[0] for t in targets):
                return node
    return None


def span(cut: Cut) -> tuple[int, int]:
    """(first, last) line of the cut, 1-based and inclusive, in the file as it is now."""
    lines, tree = _source(cut.path)
    if cut.name.startswith("marker:"):
        tag = f"# side-by-side: {cut.name.removeprefix('marker:')}"
        opens = [i for i, line in enumerate(lines, 1) if line.strip() == tag]
        if len(opens) != 1:
            raise CutError(f"{cut}: {len(opens)} lines read {tag!r} (want exactly one)")
        close = next((i for i in range(opens[0] + 1, len(lines) + 1) if lines[i - 1].strip() == "# end side-by-side"),
                     None)
        if close is None:
            raise CutError(f"{cut}: no '# end side-by-side' after line {opens[0]}")
        first, last = opens[0] + 1, close - 1
    else:
        node = _find(tree.body, cut.name.split("."))
        if node is None:
            raise CutError(f"{cut}: no definition {cut.name!r} in {cut.path} (moved or renamed? update the cut in "
                           "scripts/side_by_side.py)")
        first, last = node.lineno, node.end_lineno
    if cut.start is not None:
        hits = [i for i in range(first, last + 1) if cut.start in lines[i - 1]]
        if len(hits) != 1:
            raise CutError(f"{cut}: {len(hits)} lines of {cut.name} (lines {first}-{last}) contain {cut.start!r} "
                           "(want exactly one)")
        first = hits[0]
    if cut.end is not None:
        last = next((i for i in range(first, last + 1) if cut.end in lines[i - 1]), None)
        if last is None:
            raise CutError(f"{cut}: no line of {cut.name} at or after line {first} contains {cut.end!r}")
    return first, last


def excerpt_text(cut: Cut) -> str:
    """The cut's lines, dedented: what the page shows."""
    first, last = span(cut)
    return textwrap.dedent("\n".join(_source(cut.path)[0][first - 1:last]))


def lines_anchor(cut: Cut) -> str:
    """GitHub's anchor of the cut's lines: ``L7`` or ``L7-L9``."""
    first, last = span(cut)
    return f"L{first}" if first == last else f"L{first}-L{last}"


def link(cut: Cut) -> str:
    """The page's relative link to the cut's lines."""
    return f"../../{cut.path}#{lines_anchor(cut)}"


# --- pages ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Excerpt:
    style: str  # explicit / builtin / compiled (torch); shard_map / jit / typed (JAX)
    cut: Cut
    says: str  # one sentence: what the lines do, which collective they issue
    key: str | None = None  # the line the page's table shows (a substring; None: the first CALLS line, "": none)

    def key_line(self) -> int | None:
        """The line (1-based, in the file) the overview table shows: the one containing ``key``, else the
        first that issues a collective or states a layout (CALLS); None: the excerpt has none."""
        first, last = span(self.cut)
        lines = _source(self.cut.path)[0]
        if self.key == "":
            return None
        hit = (lambda line: self.key in line) if self.key else CALLS.search
        found = next((i for i in range(first, last + 1) if hit(lines[i - 1])), None)
        if found is None and self.key:
            raise CutError(f"{self.cut}: no line contains the key {self.key!r}")
        return found

    @property
    def framework(self) -> str:
        return "torch" if self.style in STYLES["torch"] else "jax"


@dataclass(frozen=True)
class Row:
    idea: str
    bytes: str  # the formula's bytes per step and rank, computed from shared.theory
    excerpts: tuple[Excerpt, ...]


@dataclass(frozen=True)
class Page:
    slug: str
    title: str
    intro: str
    config: str  # the configuration the bytes are computed at, in words
    rows: tuple[Row, ...] = field(default_factory=tuple)
    bytes_from: str = "Bytes per step and rank (op count× payload) from `shared.theory`"


def kib(nbytes: float) -> str:
    return f"{nbytes:,.0f} B" if nbytes < 1024 else f"{nbytes / 1024:,.1f} KiB"


def ops(comm: dict[str, tuple[int | None, int]]) -> str:
    """{op: (count, bytes)} -> 'all_gather 7× 56.0 KiB + reduce_scatter 4× 32.0 KiB = 88.0 KiB'."""
    comm = {op: kb for op, kb in comm.items() if op != "recv"}  # a message counts once, on its sender
    parts = [f"{op} {'' if k is None else f'{k}× '}{kib(b)}" for op, (k, b) in comm.items() if b]
    total = sum(b for _, b in comm.values())
    return " + ".join(parts) + (f" = {kib(total)}" if len(parts) > 1 else "")


def ex(style, path, name, says, start=None, end=None, key=None) -> Excerpt:
    """An excerpt: ``style``'s lines of ``path``'s ``name`` (narrowed, see Cut), what they do, their key line."""
    return Excerpt(style, Cut(path, name, start, end), says, key)
