"""The README and docs/ as a newcomer meets them: every relative link lands on a file (and heading) that exists,
the README stays short with its quickstart on the first screen, and its install lines are the ones .ci/run runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a link inside one is an example, not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(path.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_is_short_with_the_quickstart_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250: move the rest to docs/)"
    first = "\n".join(lines[:60])
    assert "## Quickstart" in first and "python compare.py" in first and "\npytest" in first
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 200]
    assert not long, f"README.md lines over 200 characters: {long}"


def test_readme_installs_as_ci_does():
    """.ci/run installs with the README's commands, literally (its venv, pip and test lines)."""
    readme = (ROOT / "README.md").read_text().splitlines()[:60]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    wanted = [line.strip() for line in ci if line.strip().startswith(("python3 -m venv", ". .venv", "pip install"))]
    assert len(wanted) >= 3
    for line in wanted:
        assert any(r.strip() == line for r in readme), f"the README's quickstart lacks .ci/run's line: {line}"
