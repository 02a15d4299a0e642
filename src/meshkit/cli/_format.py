"""The CLI's output: its console, JSON, and the communication ledger as a table."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

from meshkit.fmt import fmt_bytes, table, to_json

console = Console(width=None if sys.stdout.isatty() else 132)


def print_json(data: Any) -> None:
    sys.stdout.write(to_json(data, indent=2, default=str) + "\n")


_TOP = 10
_WARNINGS = 5


def _collective_row(r) -> list[Any]:
    shapes = ", ".join(f"{d}{list(s)}" for d, s in zip(r.dtypes, r.shapes, strict=True))
    flags = " ".join(
        f
        for f, on in (
            ("async", r.is_async),
            ("loop", r.in_loop),
            ("?trip", not r.exact),
            ("cond", r.in_conditional),
        )
        if on
    )
    return [
        r.op,
        r.name,
        shapes if len(shapes) < 40 else shapes[:37] + "...",
        fmt_bytes(r.size_bytes),
        r.group_size,
        r.axes_label,
        r.executions,
        fmt_bytes(r.total_traffic_bytes),
        flags,
    ]


_COLUMNS = [
    "op",
    "name",
    "operands (per device)",
    "S",
    "group",
    "axes",
    "runs",
    "ring traffic/device",
    "notes",
]


def _plain(rows: list[list[Any]], columns: list[str], right_from: int) -> str:
    """A plain aligned table (thousands of rows print in milliseconds, unlike a rich Table)."""
    cells = [columns] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]

    def line(r: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i >= right_from else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])]).rstrip() + "\n"


def print_comm(ledger, every: bool = False) -> None:
    """The communication ledger for people: totals by op and by mesh axes, the largest collectives,
    and (``every``) one line per collective."""
    mesh = ", ".join(f"{n}={s}" for n, s in ledger.mesh) if ledger.mesh else "unknown"
    n = len(ledger.records)
    console.print(
        f"module [bold]{ledger.module}[/] | {ledger.num_devices or 'unknown number of'} device(s) | mesh {mesh} | "
        f"{n:,} collective instruction(s), {ledger.count():,} run(s) per step"
    )
    for title, totals in (("By op", ledger.by_op()), ("By mesh axes", ledger.by_axes())):
        rows = [
            [
                k,
                f"{t.instructions:,}",
                f"{t.executions:,}",
                fmt_bytes(t.size_bytes),
                fmt_bytes(t.traffic_bytes),
            ]
            for k, t in sorted(totals.items(), key=lambda kv: -kv[1].traffic_bytes)
        ]
        console.print(table(title, ["", "instructions", "runs", "S total", "ring traffic/device"], rows))
    if every:
        sys.stdout.flush()
        sys.stdout.write(_plain([_collective_row(r) for r in ledger.records], _COLUMNS, right_from=3))
    elif n:
        largest = sorted(
            ledger.records, key=lambda r: -(r.total_traffic_bytes or r.size_bytes * r.executions)
        )
        title = f"Largest {min(n, _TOP)} of {n:,} collectives" + (
            " (--all lists every one)" if n > _TOP else ""
        )
        console.print(table(title, _COLUMNS, [_collective_row(r) for r in largest[:_TOP]], justify_right=3))
    besides = f" (not counting {ledger.unsized} collective(s) of unknown size)" if ledger.unsized else ""
    console.print(
        f"total ring-model traffic per device per step: [bold]{fmt_bytes(ledger.traffic_bytes)}[/]{besides}"
    )
    for w in ledger.warnings[:_WARNINGS]:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)
    if len(ledger.warnings) > _WARNINGS:
        console.print(
            f"[yellow]warning:[/] ... and {len(ledger.warnings) - _WARNINGS} more (--json lists all)"
        )
