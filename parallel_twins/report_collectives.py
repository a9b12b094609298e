"""``compare.py --show-collectives PATTERN``: what one training step communicates in each style,
side by side with theory — per op (count × / payload bytes), per mesh axis for N-D layouts (torch by
process group, JAX by HLO replica groups), and ep's data-dependent side (the routing, the all-to-all
bytes against the routing-count formula, the static-shape styles' padding). Where XLA (jit) chose
other collectives than the hand-written shard_map step, one line says which.
"""

from __future__ import annotations

from parallel_twins.report import fmt_bytes
from shared.config import parse_mesh


def collectives_table(rows, pattern, console) -> None:
    """The SPMD-vs-explicit contrast: what one training step communicates in each style, per model:
    the five styles side by side (``five_styles``), then every row with theory."""
    rows = [r for r in rows if r.pattern == pattern]
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        five_styles(mine, pattern, model, console)
        _collectives_table(mine, pattern, model, console)


# The five ways of writing one layout, as columns: (framework, style) -> heading.
STYLE_COLUMNS = {("torch", "explicit"): "torch dist.*", ("torch", "builtin"): "DTensor/builtin",
                 ("torch", "compiled"): "torch compiled", ("jax", "shard_map"): "shard_map", ("jax", "typed"): "typed",
                 ("jax", "jit"): "jit"}
# Variants that are one idea under another name: torch's builtin twins and the bucketed DDP.
IDEA = {"ddp": "dp", "bucketed": "dp", "fsdp2": "zero3", "dtensor": "megatron", "dtensor_sp": "megatron_sp",
        "circular": "gpipe"}
# What a layout change stated in types needs (typed.moves) and the collective that does it.
MOVE_OP = {"gather": "all_gather", "reduce": "all_reduce", "reduce-scatter": "reduce_scatter",
           "all-to-all": "all_to_all"}


def five_styles(rows, pattern, model, console) -> None:
    """One table per model: a row per (idea, collective), a column per way of writing it — torch's
    hand-written dist.* calls, DTensor (torch's builtin), shard_map, sharding in types, jit — and
    under it, for the typed style, the layout changes the program stated next to what XLA issued."""
    from rich.table import Table

    cell = {}
    for r in rows:
        col = STYLE_COLUMNS.get((r.framework, r.style))
        if col:
            cell.setdefault((IDEA.get(r.variant, r.variant), col), r)
    ideas = list(dict.fromkeys(idea for idea, _ in cell))
    cols = [c for c in STYLE_COLUMNS.values() if any(k[1] == c for k in cell)]
    if not ideas:
        return
    ways = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}.get(len(cols), str(len(cols)))
    table = Table(title=f"one {pattern} step on the {model}, {ways} ways of writing it (per rank: count × payload)")
    table.add_column("idea", no_wrap=True)
    table.add_column("collective", no_wrap=True)
    for c in cols:
        table.add_column(c, justify="right", no_wrap=True)
    for idea in ideas:
        here = {c: cell.get((idea, c)) for c in cols}
        ops = sorted({op for r in here.values() if r for op in r.comm})
        for i, op in enumerate([*ops, "total"]):
            cells = []
            for c in cols:
                r = here[c]
                if r is None:
                    cells.append("")
                elif op == "total":
                    cells.append(fmt_bytes(r.comm_bytes))
                else:
                    v = r.comm.get(op)
                    cells.append(f"{v['count']}× {fmt_bytes(v['bytes'])}" if v else "·")
            table.add_row(idea if i == 0 else "", op, *cells, end_section=op == "total")
    console.print(table)
    for r in rows:
        if r.style == "typed" and r.framework == "jax":
            for line in stated_lines(r):
                console.print(line, highlight=False)
    for line in compiled_lines(rows):
        console.print(line, highlight=False)


def compiled_lines(rows) -> list[str]:
    """For each torch compiled row: which collectives its compiled programs issued and which ran eagerly (the
    profiler's split, torch_impl/parallel/compiled_ledger.py), and what the compiler changed against the same
    variant run eagerly (builtin, else explicit): counts and bytes per op, and inductor's collective passes."""
    out = []
    eager_twin = {(r.style, r.variant): r for r in rows if r.framework == "torch" and r.style != "compiled"}
    for r in rows:
        if r.framework != "torch" or r.style != "compiled" or "comm_compiled" not in r.extra:
            continue
        inside, eager = r.extra["comm_compiled"], r.extra.get("comm_eager", {})
        progs = r.extra.get("programs", [])
        per_run = lambda p: _describe({op: {"count": p["collectives"].count(op)} for op in p["collectives"]})  # noqa: E731
        said = "; ".join(f"{p.get('pass', 'program')}: {per_run(p)} per run, {p['runs']} runs" for p in progs)
        head = f"compiled/{r.variant}: "
        line = head + (f"{_describe(inside)} ({fmt_bytes(sum(v['bytes'] for v in inside.values()))}) inside the "
                       f"compiled programs ({said})" if inside else "no collective inside the compiled programs")
        line += f"; eager beside them: {_describe(eager)}" if eager else "; none eager"
        twin = eager_twin.get(("builtin", r.variant)) or eager_twin.get(("explicit", r.variant))
        passes = r.extra.get("compiled", {}).get("comm_passes") or []
        if twin is not None:
            same = _counts(twin.comm) == _counts(r.comm) and twin.comm_bytes == r.comm_bytes
            name = f"{twin.style}/{twin.variant} (eager) issues"
            line += (f"; {name} the same {_describe(twin.comm)}, {fmt_bytes(twin.comm_bytes)}" if same else
                     f"; {name} {_describe(twin.comm)}, {fmt_bytes(twin.comm_bytes)}: the compiler changed "
                     f"{_change(twin.comm, r.comm)}")
        line += (f" (inductor's collective passes on: {', '.join(passes)})" if passes else
                 ": no bucketing or reordering (inductor's collective passes are off)")
        out.append(line)
    return out


def _change(before: dict, after: dict) -> str:
    """Per op: count and bytes after minus before, e.g. 'all_gather −6 calls, +0 B'."""
    parts = []
    for op in sorted(set(before) | set(after)):
        b, a = before.get(op, {"count": 0, "bytes": 0}), after.get(op, {"count": 0, "bytes": 0})
        dc, db = a["count"] - b["count"], a["bytes"] - b["bytes"]
        if dc or db:
            parts.append(f"{op} {dc:+d} calls, {'+' if db >= 0 else '−'}{fmt_bytes(abs(db))}")
    return "; ".join(parts) or "nothing"


def stated_lines(r) -> list[str]:
    """What the typed program stated (Trained.extra["stated"], read from the types at trace time), per
    kind of move, against the collectives XLA issued for it."""
    stated = r.extra.get("stated") or []
    kinds: dict[str, list] = {}
    for e in stated:
        kinds.setdefault(e["moves"], []).append(e)
    head = f"typed/{r.variant}: "
    if not stated:
        return [head + f"states no layout change; XLA issued {_describe(r.comm)} (the types imply them: "
                       "a contraction over a split dim, autodiff's transposes)"]
    out = []
    for kind, entries in kinds.items():
        op = MOVE_OP.get(kind)
        n, issued = len(entries), (r.comm.get(op, {}).get("count", 0) if op else 0)
        size = fmt_bytes(sum(e["bytes"] for e in entries))
        said = f"{head}{kind}: {n} stated ({size}; e.g. {entries[0]['what']})"
        if op is None:
            out.append(f"{said}: no communication needed")
        elif issued == n:
            out.append(f"{said}: each became one {op}")
        elif issued == 0:
            out.append(f"{said}: XLA issued no {op}; it chose {_describe(r.comm)}")
        elif issued > n:
            out.append(f"{said}: XLA issued {issued}× {op}, {issued - n} more than stated (the backward's "
                       "transposes of stated changes, sums the types imply)")
        else:
            out.append(f"{said}: XLA issued {issued}× {op}, fewer than stated (it merged or moved some)")
    unstated = {op: v["count"] for op, v in r.comm.items() if op not in {MOVE_OP.get(k) for k in kinds}}
    if unstated:
        out.append(f"{head}XLA also issued {', '.join(f'{n}× {op}' for op, n in unstated.items())}, which the "
                   "program did not state (implied by the types: autodiff's transposes, sums over split dims)")
    return out


def _collectives_table(rows, pattern, model, console) -> None:
    from rich.table import Table

    ops = sorted({op for r in rows for op in r.comm})
    table = Table(title=f"collectives of one {pattern} step on the {model}, per rank (count × / payload bytes)")
    for col in ("framework", "style", "variant", *ops, "total", "theory", "vs theory"):
        table.add_column(col, justify="left" if col in ("framework", "style", "variant") else "right",
                         overflow="fold")
    for r in rows:
        cells = [f"{r.comm[op]['count']}× {fmt_bytes(r.comm[op]['bytes'])}" if op in r.comm else "" for op in ops]
        diff = None if r.comm_bytes_theory is None else r.comm_bytes - r.comm_bytes_theory
        match = "-" if diff is None else "yes" if diff == 0 else f"{'+' if diff > 0 else '−'}{fmt_bytes(abs(diff))}"
        table.add_row(r.framework, r.style, r.variant, *cells, fmt_bytes(r.comm_bytes),
                      fmt_bytes(r.comm_bytes_theory), match)
    console.print(table)
    # Where XLA's choice (jit) differs from the hand-written shard_map step of the same variant, say so.
    by_key = {(r.framework, r.style, r.variant): r for r in rows}
    for r in rows:
        if r.framework == "jax" and r.style == "jit":
            twin = by_key.get(("jax", "shard_map", r.variant))
            if twin is None:  # nothing hand-written to mirror (cp's seq_sharded): what XLA chose
                console.print(f"[yellow]{r.variant}[/]: XLA (jit) chose {_describe(r.comm)}")
            elif _counts(twin.comm) != _counts(r.comm):
                console.print(f"[yellow]{r.variant}[/]: XLA (jit) issued {_describe(r.comm)}; "
                              f"the shard_map step issues {_describe(twin.comm)}")
    work = {(r.style, r.variant): r.extra["attention_scores"] for r in rows if r.extra.get("attention_scores")}
    for (style, variant), scores in work.items():  # cp: the causal work each rank does (zigzag balances it)
        console.print(f"attention score entries per rank per layer, {style}/{variant}: "
                      f"{', '.join(str(s) for s in scores)} (max/min {max(scores) / max(min(scores), 1):.2f})")


def ep_tables(rows, cfgs, console) -> None:
    """ep's data-dependent side: the routing of the last step (load per expert and per rank, the
    same in every style since the routing is), the torch ranks' all-to-all bytes against the
    routing-count formula, and the padding the static-shape (JAX) styles carry."""
    from rich.table import Table

    from shared.theory import ep_load

    for cfg in cfgs:
        mine = [r for r in rows if r.pattern == "ep" and r.extra.get("expert_load") is not None]
        if not mine:
            continue
        load = mine[0].extra["expert_load"][-1]  # (L, B, E): the step the ledger recorded
        table = Table(title=f"ep routing of the last step, {cfg.moe_name}, ep={cfg.world_size}: assignments "
                            f"per expert and per rank (ideal {cfg.topk * cfg.batch * cfg.seq // cfg.experts} "
                            f"per expert)")
        for col in ("layer", *(f"e{e}" for e in range(cfg.experts)), *(f"rank {r}" for r in range(cfg.world_size)),
                    "max/mean"):
            table.add_column(col, justify="right", overflow="fold")
        for layer, load_layer in enumerate(load):
            lo = ep_load(cfg, load_layer)
            ranks = lo["per_rank"]
            table.add_row(str(layer), *map(str, lo["per_expert"]), *map(str, ranks),
                          f"{max(ranks) / (sum(ranks) / len(ranks)):.2f}")
        console.print(table)
        for r in mine:
            per_rank, theory = r.extra.get("comm_per_rank"), r.extra.get("comm_theory_per_rank")
            if per_rank and theory:
                a2a = [v.get("all_to_all", {}).get("bytes", 0) for v in per_rank]
                a2a_theory = [_by_axis({"x": t})["x"].get("all_to_all", (0, 0))[1] for t in theory]
                verdict = "equal on every rank" if a2a == a2a_theory else ", ".join(map(fmt_bytes, a2a_theory))
                console.print(f"{r.framework} {r.style}/{r.variant}: all-to-all bytes per rank "
                              f"{', '.join(fmt_bytes(b) for b in a2a)} (routing-count formula: {verdict})")
            pad = r.extra.get("padding")
            if pad:
                console.print(f"{r.framework} {r.style}/{r.variant}: static buffers of {pad['buffer_rows']} rows per "
                              f"rank per all-to-all, {pad['useful_rows']} carry a token "
                              f"({100 * pad['sent_waste']:.0f}% padding); the busiest rank received "
                              f"{pad['max_received_rows']} real rows")


def _by_axis(view) -> dict[str, dict[str, tuple[int, int]]]:
    """{label: {op: (count, bytes)}} from a ledger view or a theory ({op: {count, bytes}} or (count, bytes))."""
    out = {}
    for label, ops in (view or {}).items():
        out[label] = {op: (v["count"], v["bytes"]) if isinstance(v, dict) else tuple(v) for op, v in ops.items()}
    return out


def _axis_bytes(view) -> dict[str, int]:
    """Payload bytes per axis label, a message counted once (on the sender: recv skipped)."""
    from shared.plan import comm_bytes

    return comm_bytes(_by_axis(view))


def mesh_tables(rows, console) -> None:
    """The N-D contrast: per layout, what one step moves on each mesh axis in every style, per rank
    (torch ranks with the same view merged; JAX runs one SPMD program: every device alike), against
    shared.theory; then the memory per rank against theory."""
    from rich.table import Table

    rows = [r for r in rows if r.pattern == "mesh"]
    for layout in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == layout]
        views = []  # (framework, style, ranks, measured, theory)
        for r in mine:
            per_rank = r.extra.get("comm_by_axis_per_rank")
            theory = r.extra.get("comm_by_axis_theory_per_rank") or [r.extra.get("comm_by_axis_theory")] * len(
                per_rank or [0])
            if not per_rank:
                views.append((r, "all", r.extra.get("comm_by_axis"), r.extra.get("comm_by_axis_theory")))
                continue
            groups: dict = {}
            for rank, (view, th) in enumerate(zip(per_rank, theory, strict=True)):
                key = repr((_by_axis(view), _by_axis(th)))
                groups.setdefault(key, [rank, view, th])
                groups[key].append(rank) if groups[key][0] != rank else None
            for first, view, th, *more in groups.values():
                views.append((r, ",".join(str(x) for x in [first, *more]), view, th))
        order = [name for name, _ in parse_mesh(layout)]  # the layout's axes, outermost first
        labels = sorted({a for _, _, v, t in views for a in {**_by_axis(v), **_by_axis(t)}},
                        key=lambda a: (order.index(a.split("+")[0]) if a.split("+")[0] in order else len(order), a))
        table = Table(title=f"{layout} ({mine[0].world_size} ranks): payload per step per rank on each mesh axis "
                            "(count × / bytes; = theory unless marked)")
        for col in ("framework", "style", "ranks", *labels, "vs theory"):
            table.add_column(col, justify="left" if col in ("framework", "style", "ranks") else "right",
                             overflow="fold")
        for r, ranks, view, th in views:
            measured, expected = _by_axis(view), _axis_bytes(th) if th is not None else None
            cells = []
            for a in labels:
                ops = measured.get(a, {})
                n, nbytes = sum(c for op, (c, _) in ops.items() if op != "recv"), _axis_bytes(view).get(a, 0)
                text = f"{n}× {fmt_bytes(nbytes)}" if ops else "-"
                if expected is not None and expected.get(a, 0) != nbytes:
                    text += f" [red](theory {fmt_bytes(expected.get(a, 0))})[/]"
                cells.append(text)
            same = "-" if expected is None else "yes" if all(
                expected.get(a, 0) == _axis_bytes(view).get(a, 0) for a in labels) else "[red]no[/]"
            table.add_row(r.framework, r.style, ranks, *cells, same)
        console.print(table)
        memory = Table(title=f"{layout}: memory per rank (rank 0; params + grads + AdamW, and activations)")
        for col in ("framework", "style", "params", "grads", "optimizer", "theory", "activations"):
            memory.add_column(col, justify="left" if col in ("framework", "style") else "right", overflow="fold")
        for r in mine:
            th = r.extra.get("state_bytes_theory")
            total = sum(r.state_bytes.values()) if r.state_bytes else None
            match = "-" if not th else "yes" if all(abs(r.state_bytes.get(k, 0) - v) < 1 for k, v in th.items()) \
                else f"[red]{fmt_bytes(sum(th.values()))}[/]"
            act = r.extra.get("activation_bytes", r.extra.get("temp_bytes"))
            kind = "saved" if "activation_bytes" in r.extra else "XLA temp"
            act_text = "-" if act is None else f"{fmt_bytes(act)} ({kind})"
            state = (fmt_bytes(r.state_bytes.get(k)) for k in ("params", "grads", "optimizer"))
            memory.add_row(r.framework, r.style, *state, match if total is not None else "-", act_text)
        console.print(memory)
    refused = {r.extra.get("refused") for r in rows if r.extra.get("refused")}
    for reason in refused:
        console.print(f"[yellow]not run[/]: {reason}")


def _counts(comm) -> dict[str, int]:
    return {op: v["count"] for op, v in comm.items()}


def _describe(comm) -> str:
    return ", ".join(f"{v['count']}× {op}" for op, v in comm.items()) or "nothing"
