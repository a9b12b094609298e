"""What both halves of the held-out recipe audit share (scripts/recipe_audit.py runs them, and reads the
verdicts; recipe_audit_torch.py and recipe_audit_jax.py hold the models and cases): ``NotOffered`` (the
API does not offer an ingredient: n/a) and ``classify`` (a case's verdict: exact, WRONG, refused, CRASH,
n/a; ``refused``: an error the project raised itself). Imported by the runner and the halves, it imports
neither: the audit's imports go one way.
"""

from __future__ import annotations

import linecache
import os
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-12  # recipe_audit.py's docstring: float64 sums in another order, ~1e-15 after 3 AdamW steps
PROJECT = ("torch_impl", "jax_impl", "shared")


class NotOffered(Exception):
    """Raised by the audit itself: the API does not offer this recipe ingredient (the case is n/a)."""


def classify(run) -> dict:
    """Runs ``run() -> error``; returns {"verdict", "error" | "message"}."""
    try:
        err = run()
    except NotOffered as e:
        return {"verdict": "n/a", "message": str(e)}
    except Exception as e:  # noqa: BLE001 - classified below
        return {"verdict": "refused" if refused(e) else "CRASH", "message": f"{type(e).__name__}: {e}"[:400]}
    return {"verdict": "exact" if err <= TOL else "WRONG", "error": err}


def refused(e: BaseException) -> bool:
    """The project's own refusal: an exception class of its packages, or a ``raise`` in its code."""
    if type(e).__module__.split(".")[0] in PROJECT:
        return True
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return False
    last = tb[-1]
    rel = os.path.relpath(last.filename, ROOT)
    return rel.split(os.sep)[0] in PROJECT and linecache.getline(last.filename, last.lineno).strip().startswith("raise")
