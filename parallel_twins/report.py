"""What compare.py prints and writes: the parity table (compact by default, every column with --wide),
the Markdown and JSON files, the ``--show-collectives`` tables, the pipeline and recompute lines, and
the progress line while the runs go.

    console = make_console()                        # a terminal: its width; piped: plain text, no limit
    print_table(rows, cfgs, console, wide=False)    # nothing is ever cut: long names wrap at '/'
    lines = table_lines(rows, width=80)             # what print_table prints (tests render 80/100/120)

compare.py runs; this module only formats what the runs returned (shared.results.RunResult rows).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from rich.markup import escape

from parallel_twins.args import write_output
from shared.config import RECOMPUTE


def make_console(quiet: bool = False, json_to_stdout: bool = False):
    """A terminal: rich at the terminal's real width. Piped (CI logs, ``| tee``, a file): plain text
    without colour codes or any width limit, so no table is wrapped or cut. ``json_to_stdout`` (``--json -``):
    standard output carries the JSON alone, so everything for people goes to standard error."""
    from rich.console import Console

    stream = sys.stderr if json_to_stdout else sys.stdout
    tty = stream.isatty()
    return Console(file=stream, quiet=quiet, width=None if tty else 100_000, soft_wrap=not tty)


def write_json(path: str, data) -> None:
    """Strict JSON (no NaN / Infinity), through args.write_output: a regular file written aside and
    renamed (complete or absent), a FIFO or device written in place, ``-`` standard output."""
    from shared.results import _jsonable

    write_output(path, json.dumps(_jsonable(data), indent=1))


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_err(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def _fmt_ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"


def row_ok(r) -> bool:
    return bool(r.ok) and r.xfw_ok is not False


def all_ok(rows, xfw, errors) -> bool:
    """The verdict: no error, every run within tolerance of both references, every cross-framework check."""
    return not errors and all(row_ok(r) for r in rows) and all(x["ok"] is not False for x in xfw)  # None: n/a


# --- the parity table ---------------------------------------------------------------------------

# --wide, --markdown (and --json, which has everything): one column per quantity.
TABLE_COLUMNS = ("pattern", "model", "framework", "style", "variant", "ok", "rel err loss", "rel err grad",
                 "vs other fw", "step ms", "× plain", "comm/step", "theory", "state/rank")
# The default: one table, a section per (pattern, model); the columns a reader checks first.
COMPACT_COLUMNS = ("implementation", "ok", "vs ref", "vs other", "step ms", "× plain", "comm/step", "theory")
_RIGHT = {"rel err loss", "rel err grad", "vs other fw", "step ms", "comm/step", "theory", "state/rank", "vs ref",
          "vs other", "× plain", "harness ms", "bare ms", "harness/bare", "plain ms"}
# A step the host bounds: the device waited on the dispatch (the host was still issuing work for at least this
# share of the step, extra["host_fraction"]); on the CPU the host is the device, so nothing is marked there.
HOST_BOUND = 0.9


def host_bound(r) -> bool:
    return r.platform not in (None, "cpu") and (r.extra or {}).get("host_fraction", 0.0) >= HOST_BOUND


def fmt_plain(r) -> str:
    """The step against the same model's plain single-device step: "2.4x" (" host": the host bounds it)."""
    if r.step_time_s is None or not r.plain_step_time_s:
        return "-"
    return f"{r.step_time_s / r.plain_step_time_s:.1f}x" + (" host" if host_bound(r) else "")


def table_rows(rows):
    """The --wide / Markdown cells, one tuple per run (TABLE_COLUMNS)."""
    out = []
    for r in rows:
        is_coll = r.pattern == "collectives"
        out.append((
            r.pattern, r.model or "-", r.framework, r.style, r.variant,
            "ok" if row_ok(r) else "FAIL",
            "-" if is_coll else fmt_err(r.max_rel_err_loss),
            "-" if is_coll else fmt_err(max(r.max_rel_err_grad, r.max_rel_err_param)),
            fmt_err(r.xfw_max_rel_err),
            _fmt_ms(r.step_time_s),
            fmt_plain(r),
            fmt_bytes(r.comm_bytes),
            fmt_bytes(r.comm_bytes_theory),
            "-" if not r.state_bytes else fmt_bytes(sum(r.state_bytes.values())),
        ))
    return out


def compact_cells(r) -> tuple[str, ...]:
    """COMPACT_COLUMNS of one run: the worst error against its own reference (loss, step-0 gradient,
    final parameters), against the other framework's, and "=" where the bytes equal theory."""
    own = None if r.pattern == "collectives" else max(r.max_rel_err_loss, r.max_rel_err_grad, r.max_rel_err_param)
    theory = "-" if r.comm_bytes_theory is None else "=" if r.comm_bytes == r.comm_bytes_theory \
        else fmt_bytes(r.comm_bytes_theory)
    return (f"{r.framework}/{r.style}/{r.variant}", "ok" if row_ok(r) else "FAIL", fmt_err(own),
            fmt_err(r.xfw_max_rel_err), _fmt_ms(r.step_time_s), fmt_plain(r), fmt_bytes(r.comm_bytes), theory)


def _wrap_at_slashes(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``, broken after a '/' where it can be, else folded: every
    character kept (never cut)."""
    parts = [p + "/" for p in text.split("/")[:-1]] + [text.split("/")[-1]]
    lines, line = [], ""
    for part in parts:
        if line and len(line) + len(part) > width:
            lines.append(line)
            line = ""
        line += part
        while len(line) > width:
            lines.append(line[:width])
            line = line[width:]
    return lines + [line] if line else lines


@dataclass(frozen=True)
class Line:
    text: str
    kind: str = "row"  # "header" | "rule" | "section" | "row" | "fail"


def grid(columns, sections, width: int | None, wrap: int = 0) -> list[Line]:
    """A plain-text table: ``sections`` = [(title, [cells, …]), …]. It takes its natural width; where that
    exceeds ``width`` the gaps narrow to one space, then column ``wrap`` breaks at '/' onto more lines.
    No cell is ever truncated (``width`` None: no limit, one line per row)."""
    rows = [cells for _, body in sections for cells in body]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    gap = 2
    if width is not None and sum(widths) + gap * (len(columns) - 1) > width:
        gap = 1
        spare = width - (sum(widths) - widths[wrap]) - gap * (len(columns) - 1)
        widths[wrap] = max(min(widths[wrap], spare), 8)

    def join(cells) -> str:
        out = [c.rjust(w) if columns[i] in _RIGHT else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (" " * gap).join(out).rstrip()

    total = sum(widths) + gap * (len(columns) - 1)
    lines = [Line(join(columns), "header"), Line("─" * total, "rule")]
    for title, body in sections:
        if title:
            lines.append(Line(f"── {title} " + "─" * max(0, total - len(title) - 4), "section"))
        for cells in body:
            kind = "fail" if "FAIL" in cells else "row"
            wrapped = _wrap_at_slashes(cells[wrap], widths[wrap])
            lines.append(Line(join([wrapped[0] if i == wrap else c for i, c in enumerate(cells)]), kind))
            for more in wrapped[1:]:
                lines.append(Line(join([more if i == wrap else "" for i in range(len(cells))]), kind))
    return lines


def _sections(rows):
    """[(title, [run, …]), …]: one section per pattern and model, in the order the runs came."""
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(r.pattern if r.model is None else f"{r.pattern} · {r.model}", []).append(r)
    return list(out.items())


def table_lines(rows, width: int | None, wide: bool = False) -> list[Line]:
    """The parity table as lines: compact (a section per pattern and model) or, ``wide``, every column."""
    if wide:
        return grid(TABLE_COLUMNS, [("", table_rows(rows))], None, wrap=TABLE_COLUMNS.index("variant"))
    return grid(COMPACT_COLUMNS, [(title, [compact_cells(r) for r in runs]) for title, runs in _sections(rows)],
                width, wrap=0)


def describe_sizes(cfgs) -> str:
    """The sizes each model runs at, e.g. 'mlp L=4 D=32 B=32 | transformer L=4 D=32 H=4 T=16 V=64 B=32'."""
    parts = []
    for c in {(c.model, c.moe_name): c for c in cfgs}.values():  # mesh layouts share their model's sizes
        extra = f" H={c.heads} T={c.seq} V={c.vocab}" if c.model == "transformer" else ""
        moe = f" MoE E={c.experts} k={c.topk}" if c.moe else ""
        recompute = f" recompute={c.recompute}" if c.recompute != "none" else ""
        parts.append(f"{c.model}{moe} L={c.layers} D={c.dim}{extra} B={c.batch}{recompute} (Φ={c.n_params:,})")
    return " | ".join(parts)


_STYLES = {"header": "bold", "rule": "dim", "section": "bold cyan", "row": None, "fail": "bold red"}


def print_table(rows, cfgs, console, wide: bool = False, preset: str | None = None) -> None:
    from rich.text import Text

    from shared.results import where_line

    cfg, where = cfgs[0], where_line(rows)
    dtype = f"{cfg.dtype} compute, float32 master weights (mixed; vs ref: the measured floor)" \
        if getattr(cfg, "precision", "pure") == "mixed" else cfg.dtype
    console.print(f"parallel-twins: world size {cfg.world_size}, {dtype}, M={cfg.microbatches}, "
                  f"{cfg.steps} steps{f'; {where}' if where else ''}; {f'--size {preset}: ' if preset else ''}"
                  f"{describe_sizes(cfgs)}", style="bold",
                  highlight=False)
    if not wide:
        console.print("vs ref: worst relative error (loss, step-0 gradient, final parameters) against the same "
                      "framework's single-device run; vs other: against the other framework's; step ms: the "
                      "median step timed alone (its one sync included); × plain: that over the same model's "
                      "step on one device" + ("; host: the host bounds the step (the device waited on the "
                                              "dispatch)" if any(host_bound(r) for r in rows) else "")
                      + "; theory: '=' where the bytes per step equal shared/theory's (--wide: every column)",
                      style="dim", highlight=False)
    width = console.width if console.is_terminal else None
    for line in table_lines(rows, width, wide):
        console.print(Text(line.text, style=_STYLES[line.kind] or ""), no_wrap=True, crop=False, soft_wrap=True)


def markdown_table(rows) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    return "\n".join(lines) + "\n"


# --- progress -----------------------------------------------------------------------------------


class Progress:
    """One live line on a terminal while the runs go: runs done / total, the run in flight, elapsed
    and an estimate of what is left. ``event(framework, ("start", label) | ("done", n))`` is what the
    harnesses report; a label starts with the run's kind, "pattern model" (e.g. "tp transformer …").

    ``planned``: {framework: runs} or {framework: {(pattern, model): runs}} (runs.planned_kinds): then what is
    left is weighed by kind — each kind's measured seconds per run so far (a transformer's pp run is not an MLP's
    dp run), else its framework's, else the other framework's. ``parallel``: the frameworks run at the same
    time (runs.collect), so what is left is the longer of theirs, not their sum."""

    def __init__(self, planned: dict, parallel: bool = False):
        self.kinds = {fw: dict(v) if isinstance(v, dict) else {None: v} for fw, v in planned.items()}
        self.planned = {fw: sum(k.values()) for fw, k in self.kinds.items()}
        self.done, self.spent = dict.fromkeys(planned, 0), dict.fromkeys(planned, 0.0)
        self.kind_done: dict[tuple, int] = {}
        self.kind_spent: dict[tuple, float] = {}
        self.t0 = time.perf_counter()
        self.mark = dict.fromkeys(planned, self.t0)
        self.now_running: dict[str, str] = {}  # framework -> the label in flight
        self.kind_of: dict[str, object] = {}  # framework -> the kind in flight
        self.current = "starting"
        self.parallel = parallel

    def _kind(self, framework: str, label: str):
        words = label.replace(":", " ").split()
        kind = tuple(words[:2]) if len(words) >= 2 else None
        return kind if kind in self.kinds.get(framework, {}) else None

    def event(self, framework: str, event) -> None:
        kind, value = event
        now = time.perf_counter()
        if kind == "start":
            self.now_running[framework] = f"{framework}: {value}"
            self.kind_of[framework] = self._kind(framework, value)
            self.current = " | ".join(self.now_running.values()) if self.parallel else self.now_running[framework]
        elif kind == "done":
            key = (framework, self.kind_of.get(framework))
            self.done[framework] += value
            self.spent[framework] += now - self.mark[framework]
            self.kind_done[key] = self.kind_done.get(key, 0) + value
            self.kind_spent[key] = self.kind_spent.get(key, 0.0) + now - self.mark[framework]
            self.mark[framework] = now
        elif kind == "framework":  # a framework starts: its launch / compile time counts towards its runs
            self.mark[framework] = now

    def estimate(self) -> float | None:
        rates = {fw: self.spent[fw] / self.done[fw] for fw in self.done if self.done[fw]}
        if not rates:
            return None
        fallback = sum(rates.values()) / len(rates)
        left = {}
        for fw, kinds in self.kinds.items():
            rate = rates.get(fw, fallback)
            left[fw] = sum(max(0, n - self.kind_done.get((fw, k), 0)) *
                           (self.kind_spent[fw, k] / self.kind_done[fw, k] if self.kind_done.get((fw, k)) else rate)
                           for k, n in kinds.items())
        return max(left.values()) if self.parallel else sum(left.values())

    def text(self) -> str:
        done, total = sum(self.done.values()), sum(self.planned.values())
        left = self.estimate()
        eta = "estimating" if left is None else f"about {_clock(left)} left"
        return f"[{min(done, total)}/{total} runs] {self.current} · {_clock(time.perf_counter() - self.t0)} · {eta}"

    def logger(self, stream, every_s: float):
        """An ``event`` that also writes ``text()`` to ``stream`` when a run finishes ``every_s`` or more after
        the last line (a log has no live line: a long run is not silent, a short one prints nothing)."""
        last = [time.perf_counter()]

        def event(framework: str, ev) -> None:
            self.event(framework, ev)
            if ev[0] == "done" and time.perf_counter() - last[0] >= every_s:
                last[0] = time.perf_counter()
                print(self.text(), file=stream, flush=True)
        return event

    def __rich__(self):
        from rich.text import Text

        return Text(self.text(), no_wrap=True, overflow="ellipsis")  # a transient status line, not a result


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def pp_bubble_lines(rows, console) -> None:
    """pp: each torch explicit schedule's bubble (last step): theory (the closed form at F = B = W),
    the simulator's at the run's measured mean F / B / W times, and measured (idle / (stages · span)).
    JAX's hand-written schedules run in lock-step ticks inside one compiled program (no per-op clock):
    theory beside the tick grid's idle fraction."""
    for r in rows:
        x = r.extra
        if r.pattern == "pp" and r.framework == "jax" and "bubble_ticks" in x:
            v = x.get("virtual_stages", 1)
            console.print(f"pp bubble {r.model} {r.framework} {r.style}/{r.variant}{f' (v={v})' if v > 1 else ''}: "
                          f"theory {x['bubble_theory']:.3f}, tick grid {x['bubble_ticks']:.3f} (one program: "
                          "no per-op time to measure)")
        if r.pattern == "pp" and "bubble_measured" in x:
            v = x.get("virtual_stages", 1)
            console.print(f"pp bubble {r.model} {r.framework} {r.style}/{r.variant}{f' (v={v})' if v > 1 else ''}: "
                          f"theory {x['bubble_theory']:.3f}, simulated at measured costs "
                          f"{x.get('bubble_simulated', float('nan')):.3f}, measured {x['bubble_measured']:.3f}")


def recompute_lines(rows, cfgs, console) -> None:
    """--recompute: per transformer run, rank 0's activations (torch: bytes saved for backward; JAX:
    XLA's temp buffer, a proxy) against shared.theory.activation_bytes where the formula is exact for
    the layout, beside the other policies' theory; and the extra forward FLOPs."""
    from shared.theory import activation_bytes, recompute_extra_flops

    for c in {(c.model, c.moe_name): c for c in cfgs if c.model == "transformer"}.values():
        n, dense = c.world_size, c.replace(experts=0)
        flops = recompute_extra_flops(c, sequences=c.batch // n)  # per rank of a data-parallel layout
        policies = " / ".join(f"{p} {fmt_bytes(activation_bytes(dense, p))}" for p in RECOMPUTE)
        console.print(f"recompute={c.recompute}: extra forward FLOPs per step {flops['extra'] / 1e6:.2f} M per "
                      f"rank of dp={n} ({100 * flops['fraction']:.1f}% of the step's 3×forward); single-device "
                      f"activations (theory): {policies}")
    c = next((c for c in cfgs if c.model == "transformer" and not c.mesh and not c.moe), None)
    for r in rows:
        if r.model != "transformer" or c is None:
            continue
        n, theory = c.world_size, None
        if r.framework == "torch" and (r.pattern == "dp" or (r.pattern == "fsdp" and r.variant != "zero3")):
            theory = activation_bytes(c, sequences=c.batch // n, id_sequences=c.batch)
        elif r.framework == "torch" and r.pattern == "cp" and r.variant.startswith("ring"):
            theory = activation_bytes(c.replace(seq=c.seq // n))
        if r.platform == "cuda":  # the formula models torch's CPU kernels (flash with a log-sum-exp per head);
            theory = None  # on CUDA float64 takes SDPA's math path and float32 the memory-efficient kernel
        measured = r.extra.get("activation_bytes", r.extra.get("temp_bytes"))
        kind = "saved" if "activation_bytes" in r.extra else "XLA temp"
        console.print(f"  {r.pattern} {r.framework} {r.style}/{r.variant}: {kind} {fmt_bytes(measured)}"
                      + (f" (theory {fmt_bytes(theory)}{', equal' if theory == measured else ''})" if theory else ""))


def compile_lines(rows, console) -> None:
    """One line: the seconds each compiled style spent compiling its step (RunResult.compile_s; JAX: lower +
    compile of the whole step; torch compiled: the first step minus the median step), per framework/style."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r.compile_s is not None:
            groups.setdefault(f"{r.framework} {r.style}", []).append(r.compile_s)
    if not groups:
        return
    fmt = lambda v: f"{v:.1f}" if v < 10 else f"{v:.0f}"  # noqa: E731
    parts = [f"{k} {len(v)}× {fmt(min(v))}–{fmt(max(v))} s (median {fmt(sorted(v)[len(v) // 2])})"
             if len(v) > 1 else f"{k} {fmt(v[0])} s" for k, v in groups.items()]
    console.print("compile time per run: " + " · ".join(parts) + " (JAX: lower + compile; torch compiled: the first "
                  "step minus the median step, dynamo + inductor or their cache)", highlight=False)


def verdict_lines(rows, xfw, errors, frameworks, elapsed: float, console) -> bool:
    """After the tables: each cross-framework check, any routing mismatch, errors, and the verdict.
    Returns whether everything agreed."""
    for x in xfw:
        console.print(f"cross-framework {x['pattern']} ({x['model']}): torch vs jax reference, max rel err "
                      f"{max(x['max_rel_err_loss'], x['max_rel_err_grad'], x['max_rel_err_param']):.1e} "
                      f"({'ok' if x['ok'] else 'FAIL' if x['ok'] is False else 'not comparable'})", highlight=False)
    for r in rows:  # MoE: a run that routed a token unlike its reference (a float32 near-tie) says where;
        for key in ("routing_mismatch", "skip_mismatch"):  # float16: a run that skipped other steps, too
            if r.extra.get(key):
                console.print(f"[bold red]{r.pattern} {r.framework} {r.style}/{r.variant}[/]: {r.extra[key]}")
    for x in xfw:
        if x.get("not_comparable"):
            console.print(f"[yellow]cross-framework {x['pattern']} ({x['model']})[/]: {x['not_comparable']}")
        if x.get("skip_mismatch"):
            console.print(f"[bold red]cross-framework {x['pattern']} ({x['model']})[/]: {x['skip_mismatch']}")
        if x.get("routing_mismatch"):
            console.print(f"[bold red]cross-framework {x['pattern']} ({x['model']})[/]: {x['routing_mismatch']}")
    for e in errors:
        console.print(f"[bold red]error[/] {escape(e)}", highlight=False)  # a rank's traceback may hold "[/…]"
    failed = [r for r in rows if not row_ok(r)]
    ok = all_ok(rows, xfw, errors)
    verdict = (f"verdict: all {len(rows)} runs agree with their reference"
               f"{' and across frameworks' if len(frameworks) > 1 else ''}"
               f"{' where comparable' if any(x['ok'] is None for x in xfw) else ''} ({elapsed:.0f} s)"
               if ok else f"verdict: {len(failed)} of {len(rows)} runs failed parity, {len(errors)} errors")
    console.print(verdict, style="bold green" if ok else "bold red", highlight=False)
    return ok
