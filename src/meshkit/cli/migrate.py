"""``meshkit migrate``: find legacy (pmap-era) JAX and rewrite it into JAX 0.12 idioms (issue 6)."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Annotated

import typer

from meshkit.cli._format import console, print_json, table


def _diff(result) -> str:
    lines = difflib.unified_diff(
        result.source.splitlines(keepends=True),
        result.fixed.splitlines(keepends=True),
        fromfile=result.path,
        tofile=f"{result.path} (fixed)",
    )
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def _summary(findings, fixed: int, files: int) -> None:
    from meshkit.migrate import RULES, counts

    by_rule = counts(findings)
    fixable = counts(f for f in findings if f.fixable)
    rows = [[rid, RULES[rid].title, n, fixable.get(rid, 0)] for rid, n in by_rule.items()]
    if rows:
        console.print(
            table("Findings by rule", ["rule", "what", "findings", "fixable"], rows, justify_right=2)
        )
    tail = f"; fixed {fixed}" if fixed else ""
    console.print(f"{len(findings)} finding(s) in {files} file(s){tail}")


def migrate(
    paths: Annotated[list[Path], typer.Argument(help="Python files or directories (recursing into *.py).")],
    fix: Annotated[bool, typer.Option("--fix", help="Rewrite files in place where the fix is safe.")] = False,
    diff: Annotated[
        bool, typer.Option("--diff", help="Show the unified diff of the fixes; write nothing.")
    ] = False,
    check: Annotated[
        bool,
        typer.Option("--check", help="Exit 1 when findings remain, e.g. an API JAX 0.12 removed (for CI)."),
    ] = False,
    json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text and tables.")] = False,
    exclude: Annotated[
        list[str] | None,
        typer.Option("--exclude", help="Skip files matching GLOB under directories (repeatable)."),
    ] = None,
) -> None:
    """Find legacy JAX (pmap-era) code and rewrite it into JAX 0.12 idioms: jax.shard_map over a mesh."""
    from meshkit.migrate import counts
    from meshkit.migrate import migrate as run

    results = run(paths, exclude or ())
    write = fix and not diff
    for r in results:
        if write and r.changed:
            Path(r.path).write_text(r.fixed, encoding="utf-8")
        if r.changed and not r.stable:
            print(f"warning: {r.path}: a second --fix would change it again; check the diff", file=sys.stderr)
    findings = [f for r in results for f in (r.remaining if write else r.findings)]
    fixed = sum(len(r.findings) - len(r.remaining) for r in results if r.changed) if write else 0
    diffs = {r.path: _diff(r) for r in results if diff and r.changed}
    if json:
        report = {"findings": [f.to_json() for f in findings], "counts": counts(findings)}
        print_json({**report, "files": len(results), "fixed": fixed} | ({"diffs": diffs} if diff else {}))
    else:
        sys.stdout.write("".join(diffs.values()))
        sys.stdout.write("".join(f"{f}\n" for f in findings))
        _summary(findings, fixed, len(results))
    if check and findings:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(migrate)
