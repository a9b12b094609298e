"""compare.py diff OLD.json NEW.json: what changed between two runs, by severity (docs/regression.md).

    python compare.py diff baseline.json candidate.json                 # text, the terminal's width
    python compare.py diff baseline.json candidate.json --json d.json --markdown d.md --time-factor 3
    python compare.py --baseline baseline.json --json candidate.json    # run, then diff (report_baseline)

Exit status: 0 nothing regressed, 1 something did (with --fail-on changed: or anything changed), 2 bad
input (one line naming the file and what is wrong: a file docs/results-schema.json does not describe, a
schema version this does not read, a device, a file too large or too deep). The comparison itself is
shared/diff.py; this file parses the command line and formats: the two provenance blocks side by
side ('*' where they differ), then the findings grouped by severity.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import sys
import textwrap

from parallel_twins.args import check_output_path, prog, write_output
from shared.diff import SEVERITIES, BadInput, diff, load

TITLES = {"regression": "REGRESSIONS", "changed": "CHANGED", "improved": "IMPROVED"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{prog()} diff", description="Compare two compare.py --json result files: parity, "
                "collectives, bytes vs theory, memory, step-time ratios, rows only in one file.")
    p.add_argument("old", metavar="OLD.json", help="the baseline")
    p.add_argument("new", metavar="NEW.json", help="the candidate")
    p.add_argument("--json", metavar="PATH", help="write the findings here as JSON ('-': standard output, the text "
                   "report then on standard error) (default: none)")
    p.add_argument("--markdown", metavar="PATH", help="write the report here as Markdown ('-': standard output) "
                   "(default: none)")
    p.add_argument("--time-factor", type=float, default=2.0, metavar="F",
                   help="a step-time ratio (row / its framework's builtin or jit run) that moved by more than "
                        "this factor is reported; 0: times are not compared (default: 2.0, shared CPUs)")
    p.add_argument("--fail-on", choices=("regression", "changed"), default="regression",
                   help="exit 1 on regressions only, or on any regression or change (collectives, config, new "
                        "rows) (default: regression)")
    p.add_argument("--all", action="store_true", help="print every provenance field, not only those that differ "
                   "and the versions")
    return p


def exit_status(result: dict, fail_on: str = "regression") -> int:
    counts = result["counts"]
    return 1 if counts["regression"] or (fail_on == "changed" and counts["changed"]) else 0


def _table(columns, rows, width: int | None) -> list[str]:
    """Plain text columns; over ``width`` the widest columns narrow and their cells wrap (never cut)."""
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    while width is not None and sum(widths) + 2 * (len(widths) - 1) > width and max(widths) > 12:
        widths[widths.index(max(widths))] -= 1
    join = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [join(columns), "─" * (sum(widths) + 2 * (len(widths) - 1))]
    for r in rows:
        cells = [textwrap.wrap(c, max(w, 1), break_long_words=True, break_on_hyphens=False) or [""]
                 for c, w in zip(r, widths)]
        out += [join(line) for line in itertools.zip_longest(*cells, fillvalue="")]
    return out


def _shown(result: dict, every: bool) -> list[dict]:
    keep = ("packages.", "python", "gpu.", "cuda.", "git.", "platform.cpu", "world_size")
    return [p for p in result["provenance"] if every or p["differs"] or p["field"].startswith(keep)]


def _cell(x) -> str:
    return "-" if x is None else str(x)


def text_lines(result: dict, old_name: str, new_name: str, width: int | None, every: bool = False) -> list[str]:
    prov = _shown(result, every)
    lines = [f"diff {old_name} -> {new_name}: {result['rows']['matched']} rows matched "
             f"({result['rows']['old']} in OLD, {result['rows']['new']} in NEW)", ""]
    if prov:
        lines += _table(("", "provenance", "OLD", "NEW"), [("*" if p["differs"] else "", p["field"],
                        _cell(p["old"]), _cell(p["new"])) for p in prov], width) + [""]
    else:
        lines += ["provenance: neither file has one (written before results schema 1)", ""]
    for sev in SEVERITIES:
        mine = [f for f in result["findings"] if f["severity"] == sev]
        if mine:
            lines.append(f"{TITLES[sev]} ({len(mine)})")
            lines += _table(("kind", "row", "what"), [(f["kind"], f["row"] or "(file)", f["what"]) for f in mine],
                            width) + [""]
    c = result["counts"]
    lines.append(f"verdict: {c['regression']} regression(s), {c['changed']} change(s), {c['improved']} "
                 f"improvement(s)" + ("" if c["regression"] else "; nothing regressed"))
    return lines


def markdown(result: dict, old_name: str, new_name: str, every: bool = False) -> str:
    esc = lambda s: _cell(s).replace("|", "\\|")
    out = [f"# diff `{old_name}` → `{new_name}`", "",
           f"{result['rows']['matched']} rows matched ({result['rows']['old']} in OLD, {result['rows']['new']} "
           f"in NEW); thresholds: {json.dumps(result['thresholds'])}", ""]
    prov = _shown(result, every)
    out += ["| provenance | OLD | NEW |", "|---|---|---|"] if prov else \
        ["provenance: neither file has one (written before results schema 1)"]
    for p in prov:
        mark = "**" if p["differs"] else ""
        out.append(f"| {mark}{p['field']}{mark} | {esc(p['old'])} | {esc(p['new'])} |")
    for sev in SEVERITIES:
        mine = [f for f in result["findings"] if f["severity"] == sev]
        if mine:
            out += ["", f"## {TITLES[sev].capitalize()} ({len(mine)})", "", "| kind | row | what |", "|---|---|---|"]
            out += [f"| {f['kind']} | {esc(f['row'] or '(file)')} | {esc(f['what'])} |" for f in mine]
    c = result["counts"]
    out += ["", f"**verdict**: {c['regression']} regression(s), {c['changed']} change(s), {c['improved']} "
                f"improvement(s)"]
    return "\n".join(out) + "\n"


def report(result: dict, old_name: str, new_name: str, json_path=None, markdown_path=None, every=False,
           out=None) -> None:
    """Print the text report (the terminal's width; piped: no limit) and write the requested files
    (args.write_output: '-' is standard output, a file is complete or absent, nothing left beside it).
    When a file goes to standard output, the text report goes to standard error."""
    out = out or (sys.stderr if "-" in (json_path, markdown_path) else sys.stdout)
    width = shutil.get_terminal_size().columns if out.isatty() else None
    print("\n".join(text_lines(result, old_name, new_name, width, every)), file=out)
    if json_path:
        write_output(json_path, json.dumps({"old": old_name, "new": new_name, **result}, indent=1) + "\n")
    if markdown_path:
        write_output(markdown_path, markdown(result, old_name, new_name, every))


def report_baseline(baseline: dict, data: dict, old_name: str, new_name: str = "this run",
                    time_factor: float = 2.0) -> int:
    """compare.py --baseline: ``baseline`` (shared.diff.load'ed before the runs) against this run's
    ``data`` (the dict --json writes); prints the report, returns 0 / 1 like diff_main."""
    result = diff(baseline, json.loads(json.dumps(data)), time_factor=time_factor or None)
    report(result, old_name, new_name)
    return exit_status(result)


def diff_main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.json == args.markdown == "-":
            raise ValueError("--json - and --markdown -: only one of them can go to standard output")
        check_output_path("--json", args.json)  # a folder, a missing folder: refused before anything is read
        check_output_path("--markdown", args.markdown)
        if not math.isfinite(args.time_factor) or args.time_factor < 0 or 0 < args.time_factor <= 1:
            raise ValueError(f"--time-factor {args.time_factor}: 0 (off) or a finite factor > 1")
        old, new = load(args.old), load(args.new)
    except (BadInput, ValueError) as exc:
        print(f"{prog()} diff: error: {exc}", file=sys.stderr)
        return 2
    result = diff(old, new, time_factor=args.time_factor or None)
    try:
        report(result, args.old, args.new, args.json, args.markdown, args.all)
    except OSError as exc:
        print(f"{prog()} diff: error: could not write: {exc}", file=sys.stderr)
        return 2
    return exit_status(result, args.fail_on)


if __name__ == "__main__":
    sys.exit(diff_main(sys.argv[1:]))
