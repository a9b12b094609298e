"""Regenerate docs/regression.md's example: the same small transformer run under two recompute policies,
then ``compare.py diff`` of the two result files (a real difference: activations saved, XLA's temp buffer).

    PYTHONPATH=$PWD python scripts/regression_example.py          # ~1-2 min on 2 CPU cores

Writes the text report between the ``<!-- example:begin -->`` / ``<!-- example:end -->`` markers of
docs/regression.md (and the two JSON files and the Markdown diff to a temporary folder it names).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from parallel_twins.diff import text_lines  # noqa: E402
from shared.diff import diff, load  # noqa: E402

RUN = ["compare.py", "--model", "transformer", "--patterns", "dp", "--world-size", "2", "--layers", "2", "--dim", "16",
       "--heads", "2", "--seq", "8", "--vocab", "32", "--batch", "4", "--steps", "3",
       "--styles", "explicit,builtin,jit", "--quiet"]
DOC = os.path.join(ROOT, "docs", "regression.md")
BEGIN, END = "<!-- example:begin -->", "<!-- example:end -->"


def run(policy: str, path: str) -> list[str]:
    argv = [*RUN, "--recompute", policy, "--json", path]
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": ROOT})
    return argv


def main() -> int:
    folder = tempfile.mkdtemp(prefix="regression_example_")
    old, new = os.path.join(folder, "baseline.json"), os.path.join(folder, "candidate.json")
    commands = [run("none", old), run("full", new)]
    result = diff(load(old), load(new), time_factor=None)  # times: noise on a shared machine (see above)
    for p in result["provenance"]:  # the temporary folder is not worth showing
        p.update({k: p[k].replace(folder + os.sep, "") for k in ("old", "new") if isinstance(p[k], str)})
    commands = [[a.replace(folder + os.sep, "") for a in c] for c in commands]
    text = "\n".join(text_lines(result, "baseline.json", "candidate.json", width=120))
    block = "\n".join([BEGIN, "```console", *(f"$ python {' '.join(c)}" for c in commands),
                       "$ python compare.py diff baseline.json candidate.json --time-factor 0", text, "```", END])
    with open(DOC) as f:
        doc = f.read()
    head, rest = doc.split(BEGIN, 1)
    with open(DOC, "w") as f:
        f.write(head + block + rest.split(END, 1)[1])
    print(f"wrote {DOC} (files in {folder}); {result['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
