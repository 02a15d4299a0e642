"""``meshkit selftest``: registered here; implemented by meshkit.selftest (issue 5)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    del app  # not yet built
