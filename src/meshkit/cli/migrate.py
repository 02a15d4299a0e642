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


def _write(results) -> tuple[set[str], str | None]:
    """Write every changed file, atomically; stop at the first that cannot be written.

    Returns the paths written and the error line, if any (that file and the rest are left as they were).
    """
    from meshkit.migrate import MigrateWriteError, write

    written: set[str] = set()
    changed = [r for r in results if r.changed]
    for i, r in enumerate(changed):
        try:
            write(r)
        except MigrateWriteError as e:
            rest = len(changed) - i - 1
            return written, f"{e}" + (f" ({rest} more file(s) not written)" if rest else "")
        written.add(r.path)
    return written, None


def migrate(
    paths: Annotated[
        list[Path] | None, typer.Argument(help="Python files or directories (recursing into *.py).")
    ] = None,
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
    """Find legacy JAX (pmap-era) code and rewrite it into JAX 0.12 idioms: jax.shard_map over a mesh.

    Exit 1 if a file cannot be read, parsed or written (with --check: if findings remain); 2 on bad input.
    """
    from meshkit.migrate import MigratePathError, counts
    from meshkit.migrate import migrate as run

    if not paths:  # bad input, reported by meshkit.cli.main (with --json, as a JSON object on stdout)
        raise MigratePathError("no paths given: name Python files or directories, e.g. meshkit migrate src/")
    results = run(paths, exclude or ())
    write = fix and not diff
    written, error = _write(results) if write else (set(), None)
    for r in results:
        if r.changed and not r.stable:
            print(f"warning: {r.path}: a second --fix would change it again; check the diff", file=sys.stderr)
    findings = [f for r in results for f in (r.remaining if r.path in written else r.findings)]
    fixed = sum(len(r.findings) - len(r.remaining) for r in results if r.path in written)
    diffs = {r.path: _diff(r) for r in results if diff and r.changed}
    if json:
        report = {"findings": [f.to_json() for f in findings], "counts": counts(findings)}
        extra = ({"diffs": diffs} if diff else {}) | ({"error": error} if error else {})
        print_json({**report, "files": len(results), "fixed": fixed} | extra)
    else:
        sys.stdout.write("".join(diffs.values()))
        sys.stdout.write("".join(f"{f}\n" for f in findings))
        _summary(findings, fixed, len(results))
    if error:
        print(f"error: {error}", file=sys.stderr)
    unread = any(f.rule == "MK000" for f in findings)
    if error or unread or (check and findings):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(migrate)
