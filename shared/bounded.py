"""Every file the CLI reads, bounded before it is parsed (issue 47), and numbers checked before use.

    data = read_json(path, "a compare.py --json result", max_bytes=MAX_RESULT_BYTES)   # BadFile: one line
    number("--peak-flops", x, low=0, low_open=True)                                    # ValueError: one line

``read_json`` refuses, each in one line naming the file: a folder, a device or socket (/dev/zero is
read forever: refused at once), a regular file larger than ``max_bytes`` (by its size, before a byte
is read), a pipe (``<(…)``) that sends more than ``max_bytes`` (read up to the cap, then refused),
bytes that are not UTF-8, JSON nested deeper than ``max_depth`` (counted on the raw bytes before
parsing: no recursion), and text that is not JSON. NaN and Infinity are parsed (a result file that
holds them is judged by what reads it, not refused here). Stdlib and NumPy only.
"""

from __future__ import annotations

import json
import math
import os
import stat

import numpy as np

MAX_DEPTH = 64  # a compare.py result nests 8 deep (runs[i].extra.comm_by_axis_per_rank[r].axis.op.count)


class BadFile(ValueError):
    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


def _depth(raw: bytes, enough: int = 0) -> int:
    """The deepest nesting of [ and { in JSON text, outside strings; linear, vectorised, no recursion.
    When the text holds no more than ``enough`` opening brackets in all, their count (a bound) is
    returned. A quote is a string's edge unless an odd run of backslashes precedes it."""
    opening = raw.count(b"[") + raw.count(b"{")
    if opening <= enough:
        return opening
    a = np.frombuffer(raw, dtype=np.uint8)
    quotes = np.flatnonzero(a == ord('"'))
    slashes = np.flatnonzero(a == ord("\\"))
    if slashes.size and quotes.size:  # drop escaped quotes: those right after an odd run of backslashes
        cut = np.flatnonzero(np.diff(slashes) != 1)
        starts, ends = np.r_[slashes[0], slashes[cut + 1]], np.r_[slashes[cut], slashes[-1]]  # runs, inclusive
        k = np.minimum(np.searchsorted(ends, quotes - 1), ends.size - 1)
        run = np.where(ends[k] == quotes - 1, ends[k] - starts[k] + 1, 0)
        quotes = quotes[run % 2 == 0]
    brackets = np.flatnonzero((a == ord("[")) | (a == ord("{")) | (a == ord("]")) | (a == ord("}")))
    outside = np.searchsorted(quotes, brackets) % 2 == 0  # an even number of string edges before it
    kinds = a[brackets[outside]]
    if kinds.size == 0:
        return 0
    return int(np.cumsum(np.where((kinds == ord("[")) | (kinds == ord("{")), 1, -1)).max())


def read_bytes(path: str, what: str, max_bytes: int) -> bytes:
    """The bytes of ``path`` (a regular file or a pipe), at most ``max_bytes``; BadFile otherwise."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BadFile(path, "no such file") from None
    except OSError as exc:
        raise BadFile(path, f"cannot read it: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise BadFile(path, f"a folder, not {what}")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        raise BadFile(path, f"a device or socket, not a file: not {what}")
    if stat.S_ISREG(st.st_mode) and st.st_size > max_bytes:
        raise BadFile(path, f"{st.st_size} bytes, more than {_size(max_bytes)}: not {what}")
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise BadFile(path, f"cannot read it: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise BadFile(path, f"more than {_size(max_bytes)}: not {what}")
    return raw


def read_json(path: str, what: str, max_bytes: int, max_depth: int = MAX_DEPTH):
    """``path`` parsed as JSON, after the checks of the module's docstring; BadFile (one line) otherwise."""
    return parse(read_bytes(path, what, max_bytes), path, what, max_depth)


def parse(raw: bytes, path: str, what: str, max_depth: int = MAX_DEPTH):
    """JSON bytes (already size-capped) read from ``path``: UTF-8, at most ``max_depth`` deep, parsed."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadFile(path, f"not UTF-8 text (byte {exc.start}): not {what}") from None
    depth = _depth(raw, max_depth)
    if depth > max_depth:
        raise BadFile(path, f"JSON nested {depth} deep, more than {max_depth}: not {what}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadFile(path, f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:  # cannot happen below max_depth; stated anyway
        raise BadFile(path, f"JSON nested too deep: not {what}") from None


def number(flag: str, x, low: float | None = None, high: float | None = None, low_open: bool = False,
           integer: bool = False):
    """``x`` if it is a finite number within [low, high] (``low_open``: > low); ValueError naming ``flag``."""
    if x is None:
        return x
    if integer and (not isinstance(x, int) or isinstance(x, bool)):
        raise ValueError(f"{flag} {x!r}: a whole number")
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        raise ValueError(f"{flag} {x!r}: a finite number")
    if low is not None and (x <= low if low_open else x < low):
        raise ValueError(f"{flag} {_num(x)}: must be {'>' if low_open else '>='} {_num(low)}")
    if high is not None and x > high:
        raise ValueError(f"{flag} {_num(x)}: must be <= {_num(high)}")
    return x


def _num(x) -> str:
    return str(x) if isinstance(x, int) and abs(x) < 10 ** 30 else f"{x:g}"


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"
