"""Numbers and tables for people, as every layer prints them (reports, tables, plots, errors)."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def fmt_bytes(n: float | None, decimal: bool = False) -> str:
    """``1.50 KiB`` (binary units), or ``1.50 kB`` with ``decimal=True`` (as model sizes are quoted)."""
    if n is None:
        return "-"
    units = (
        (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
        if decimal
        else (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
    )
    for unit, scale in units:
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def table(title: str, columns: list[str], rows: list[list[Any]], justify_right: int = 1) -> Table:
    """A rich table: the first ``justify_right`` columns left-aligned, the rest right-aligned."""
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i >= justify_right else "left")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t
