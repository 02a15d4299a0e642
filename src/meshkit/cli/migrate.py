"""``meshkit migrate``: registered here; implemented by meshkit.migrate (issue 6)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    del app  # not yet built
