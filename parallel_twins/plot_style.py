"""One style for every figure (plots.py and plots_layouts.py both import it, neither imports the
other at import time): matplotlib on the Agg backend (no display), the colours of a pipeline's kinds
(F, B, W) and its idle time, and how a figure is saved (through args.write_output: a regular file
complete or absent)."""

from __future__ import annotations

import io
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from parallel_twins.args import write_output  # noqa: E402

KIND_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
IDLE = dict(facecolor="#F2F2F2", hatch="///", edgecolor="#C8C8C8", linewidth=0)


def save(fig, path: str, dpi: int) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format=os.path.splitext(str(path))[1][1:] or "png", dpi=dpi)
    plt.close(fig)
    write_output(str(path), buf.getvalue())
