"""Regenerate docs/plan.md's generated blocks: the constants with their sources (shared/efficiency.py), the
published comparison (shared/published.py) and the published memory readings (shared/published_memory.py),
between their <!-- name:begin --> / <!-- name:end -->
markers.

    PYTHONPATH=. python scripts/plan_docs.py            # rewrite docs/plan.md in place
    PYTHONPATH=. python scripts/plan_docs.py --check    # exit 1 if docs/plan.md is out of date
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from shared import efficiency, published_memory
from shared.published import a100_sensitivity, markdown, published_rows, summary, v_sensitivity

DOC = Path(__file__).resolve().parent.parent / "docs" / "plan.md"


def constants() -> str:
    lines = ["| GPU | dense peaks TFLOP/s | memory (reported) | largest GEMMs | FlashAttention (heads×T: of peak) "
             "| HBM copy | busbw in a node | busbw across nodes (per GPU) |", "|---|---|---|---|---|---|---|---|"]
    for name, t in efficiency.TABLES.items():
        peaks = ", ".join(f"{k} {v / 1e12:g}" for k, v in t["peaks"].items())
        intra = ", ".join(sorted({f"{op} {b / 1e9:g} GB/s" for op, (_, b) in t["intra"].items()
                                  if op in ("all_reduce", "all_gather")}))
        inter = f"{t['inter']['all_gather'][1] / 1e9:g} GB/s"
        att = ", ".join(f"{h}×{n}: {f:.2f}" for h, n, f in t["attention"]) if t.get("attention") else "fa2: 0.50"
        lines.append(f"| {name} | {peaks} | {t['memory'] / efficiency.MiB:.0f} MiB = "
                     f"{t['memory'] / 2 ** 30:.1f} GiB | {max(f for _, f in t['matmul']):.2f} of peak | "
                     f"{att} | "
                     f"{t['hbm_copy'] / 1e9:.0f} GB/s | {intra} | {inter} |")
    lines += ["", "Sources (`shared/efficiency.py` SOURCES; each preset's entries name theirs):", ""]
    lines += [f"- **{key}**: {text}" for key, text in efficiency.SOURCES.items()]
    return "\n".join(lines)


def published() -> str:
    after = published_rows()
    return "\n".join([markdown(published_rows(datasheet=True), after), "", summary(after).replace("\n", "  \n"),
                      "", "Llama 3's rows with v pinned to each (the table above: v = 8, from §3.3.2's one-layer "
                      "chunks):", "", v_sensitivity(), "",
                      "What an A100 measurement would have to show: the same comparison with the A100 rows' largest "
                      "training-shaped GEMMs at other fractions of peak (a what-if, never the planner's setting; "
                      "`shared.published.a100_sensitivity`):", "", a100_sensitivity()])


def memory() -> str:
    return published_memory.markdown(published_memory.memory_rows())


def render(text: str) -> str:
    for name, body in (("constants", constants()), ("published", published()), ("memory", memory())):
        pattern = re.compile(rf"(<!-- {name}:begin[^>]*-->\n)(?:.*?\n)?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"docs/plan.md: no <!-- {name}:begin --> … <!-- {name}:end --> block")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


if __name__ == "__main__":
    old = DOC.read_text()
    new = render(old)
    if "--check" in sys.argv:
        sys.exit(0 if new == old else 1)
    DOC.write_text(new)
