"""Helpers of the tests that check nothing outside a folder is touched (issue 47)."""

from __future__ import annotations

import hashlib
import os


def tree_hash(root) -> str:
    """Every path below ``root`` (links as links, never followed), its kind and its bytes: one digest."""
    h = hashlib.sha256()
    for here, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(here, name)
            h.update(os.path.relpath(path, root).encode())
            if os.path.islink(path):
                h.update(b"L" + os.readlink(path).encode())
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    h.update(b"F" + f.read())
            else:
                h.update(b"D")
    return h.hexdigest()
