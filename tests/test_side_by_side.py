"""docs/side_by_side/: the pages are what scripts/side_by_side.py makes of the code as it is now, each
within its line budget, and every link points at exactly the lines its excerpt shows. No training, no
torch or JAX: the generator reads the sources with ast (well under a second)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("side_by_side", ROOT / "scripts" / "side_by_side.py")
sbs = importlib.util.module_from_spec(_spec)
sys.modules["side_by_side"] = sbs  # dataclasses look their module up there
_spec.loader.exec_module(sbs)

# a link to a file's lines, then the excerpt's code block (render's layout)
EXCERPT = re.compile(r"\]\(\.\./\.\./([^)#]+)#L(\d+)(?:-L(\d+))?\)[^\n]*\n\n```python\n(.*?)\n```", re.S)
GLANCE = re.compile(r"\[`([^`]+)`\]\(\.\./\.\./([^)#]+)#L(\d+)\)")  # the overview's key line, linked
PAGES = ("collectives", "dp", "fsdp", "tp", "pp", "cp", "ep", "mesh")


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return sbs.generate()


def test_pages_are_current(generated):
    assert sorted(generated) == sorted([f"docs/side_by_side/{p}.md" for p in PAGES] + ["docs/side_by_side/README.md"])
    stale = sbs.stale(generated)
    assert not stale, f"stale: {', '.join(stale)}; run `python scripts/side_by_side.py`"


def test_line_budget_per_framework():
    """Each page's excerpts together: at most BUDGET (150) lines of code per framework, and every
    style of the framework shown where the project has it (torch: no typed style; collectives: no builtin)."""
    for make in sbs.PAGES:
        page = make()
        for framework in ("torch", "jax"):
            n = sbs.code_lines(page, framework)
            assert 0 < n <= sbs.BUDGET, f"{page.slug}: {n} lines of {framework} (budget {sbs.BUDGET})"
        styles = {e.style for r in page.rows for e in r.excerpts}
        want = {"explicit", "shard_map", "jit"} | ({"builtin"} if page.slug != "collectives" else set()) | \
            ({"typed"} if page.slug != "collectives" else set())
        assert want <= styles, f"{page.slug}: no excerpt of {sorted(want - styles)}"


def test_every_link_shows_its_lines():
    """Read from the committed pages: each link's line range, dedented, is exactly the code block under it."""
    seen = 0
    for p in PAGES:
        text = (ROOT / "docs" / "side_by_side" / f"{p}.md").read_text(encoding="utf-8")
        found = EXCERPT.findall(text)
        assert found and len(found) == text.count("```python"), f"{p}: an excerpt without its link"
        for path, first, last, code in found:
            lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
            first, last = int(first), int(last or first)
            want = textwrap.dedent("\n".join(lines[first - 1:last]))
            assert code == want, f"{p}: {path}#L{first}-L{last} does not show the excerpt's lines"
            seen += 1
        table = "\n".join(line for line in text.splitlines() if line.startswith("| "))
        keys = GLANCE.findall(table)
        assert keys, f"{p}: no key lines in the overview"
        for code, path, line in keys:  # the overview's key lines: the start of the line linked
            got = (ROOT / path).read_text(encoding="utf-8").splitlines()[int(line) - 1].strip()
            assert got.startswith(code.replace("\\|", "|")), f"{p}: {path}#L{line} is not `{code}`"
    assert seen >= 40


def test_every_relative_link_resolves():
    """The pages' other links (docs/X.md, the index, the overview's headings) land where they point."""
    broken = []
    for page in sorted((ROOT / "docs" / "side_by_side").glob("*.md")):
        prose = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)  # code: no links
        for target in re.findall(r"\]\(([^)\s#]+)[^)]*\)", prose):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
        headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")  # GitHub's anchors
                    for h in re.findall(r"^#{1,6} +(.+?) *$", prose, flags=re.M)}
        broken += [f"{page.name}: #{a}" for a in re.findall(r"\]\(#([^)]+)\)", prose) if a not in headings]
    assert not broken, broken


def test_cuts_by_name_narrowing_and_markers(tmp_path, monkeypatch):
    """Qualified names (nested too), start/end narrowing, marker comments, and the refusals' messages."""
    src = tmp_path / "m.py"
    src.write_text(textwrap.dedent('''\
        X = 1


        class A:
            def f(self):
                a = 1
                b = 2  # the start
                c = 3  # the end
                return a

            def g(self):
                def inner():
                    # side-by-side: ring
                    hop = 1
                    # end side-by-side
                    return hop
                return inner
        '''))
    monkeypatch.setattr(sbs.cut, "ROOT", str(tmp_path))
    sbs._source.cache_clear()
    try:
        assert sbs.span(sbs.Cut("m.py", "X")) == (1, 1)
        assert sbs.span(sbs.Cut("m.py", "A.f")) == (5, 9)
        assert sbs.span(sbs.Cut("m.py", "A.f", start="the start", end="the end")) == (7, 8)
        assert sbs.span(sbs.Cut("m.py", "A.g.inner")) == (12, 16)
        assert sbs.excerpt_text(sbs.Cut("m.py", "marker:ring")) == "hop = 1"
        assert sbs.link(sbs.Cut("m.py", "A.f", start="a = 1", end="a = 1")) == "../../m.py#L6"
        with pytest.raises(sbs.CutError, match="no definition 'A.h'"):
            sbs.span(sbs.Cut("m.py", "A.h"))
        with pytest.raises(sbs.CutError, match="want exactly one"):
            sbs.span(sbs.Cut("m.py", "A.f", start=" = "))
        with pytest.raises(sbs.CutError, match="contains 'nowhere'"):
            sbs.span(sbs.Cut("m.py", "A.f", start="a = 1", end="nowhere"))
    finally:
        sbs._source.cache_clear()


def test_check_flag_lists_stale_pages(tmp_path, monkeypatch, capsys):
    """--check exits 1 naming each stale page (here: all, against an empty tree) and writes nothing."""
    real = sbs.generate()
    monkeypatch.setattr(sbs, "generate", lambda: real)
    monkeypatch.setattr(sbs.cut, "ROOT", str(tmp_path))
    assert sbs.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert all(f"stale: {path}" in out for path in real) and "run `python scripts/side_by_side.py`" in out
    assert not os.listdir(tmp_path)
