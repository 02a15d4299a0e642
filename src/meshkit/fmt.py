"""Numbers and tables for people, as every layer prints them (reports, tables, plots, errors)."""

from __future__ import annotations

import json
import math
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


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite (nan, inf) replaced by None, through dicts, lists
    and tuples: JSON has no such numbers (``json.dumps`` would write ``NaN``, which JSON readers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def to_json(value: Any, **options: Any) -> str:
    """JSON for machines (report.json, metrics rows, ``--json`` output): a number that is not finite is
    written as null, never as the ``NaN`` that strict JSON readers refuse."""
    return json.dumps(finite(value), allow_nan=False, **options)
