"""``meshkit migrate``: find legacy (pmap-era) JAX and rewrite it into JAX 0.12 idioms.

Each rule (``RULES``, by id) reports a finding with a message and either a fix that ``--fix``
applies with libcst, keeping formatting and comments, or a recipe to follow by hand.

>>> fix_source("import jax\\nk = jax.random.PRNGKey(0)\\n")
'import jax\\nk = jax.random.key(0)\\n'
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from meshkit.migrate import rules_api, rules_misuse, rules_pmap, rules_removed
from meshkit.migrate._engine import run
from meshkit.migrate._files import MigratePathError, python_files
from meshkit.migrate._model import PARSE_ERROR, REGISTRY, Finding, Rule

RULES: dict[str, Rule] = {PARSE_ERROR.id: PARSE_ERROR, **dict(sorted(REGISTRY.items()))}


@dataclass(frozen=True, kw_only=True, slots=True)
class FileResult:
    """One file: its findings, its text before and after every safe fix, and what the fixes leave.

    ``stable`` says a second ``--fix`` changes nothing (the fixes are idempotent on this file).
    """

    path: str
    source: str
    fixed: str
    findings: tuple[Finding, ...]
    remaining: tuple[Finding, ...]
    stable: bool = True

    @property
    def changed(self) -> bool:
        return self.fixed != self.source


def lint_source(text: str, path: str = "<string>", select: Iterable[str] | None = None) -> list[Finding]:
    """The findings in Python source ``text`` (only rules in ``select`` when given)."""
    return run(text, path, select=select)[0]


def fix_source(text: str, select: Iterable[str] | None = None) -> str:
    """``text`` with every safe fix applied (only rules in ``select`` when given)."""
    return run(text, fix=True, select=select)[1]


def migrate_file(path: str | Path) -> FileResult:
    """Lint and fix one file in memory; nothing is written."""
    name = str(path)
    try:
        source = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        finding = Finding(
            path=name, line=1, col=1, rule=PARSE_ERROR.id, message=f"cannot read as UTF-8: {e.reason}",
            fix="by hand: save the file as UTF-8", fixable=False,
        )  # fmt: skip
        return FileResult(path=name, source="", fixed="", findings=(finding,), remaining=(finding,))
    findings, fixed = run(source, name, fix=True)
    remaining, again = (findings, fixed) if fixed == source else run(fixed, name, fix=True)
    return FileResult(
        path=name,
        source=source,
        fixed=fixed,
        findings=tuple(findings),
        remaining=tuple(remaining),
        stable=again == fixed,
    )


def migrate(paths: Iterable[str | Path], exclude: Iterable[str] = ()) -> list[FileResult]:
    """Every Python file under ``paths`` (directories recurse, ``exclude`` globs skip), linted and fixed in memory."""
    return [migrate_file(p) for p in python_files(paths, exclude)]


def lint(paths: Iterable[str | Path], exclude: Iterable[str] = ()) -> list[Finding]:
    """The findings in every Python file under ``paths``."""
    return [f for r in migrate(paths, exclude) for f in r.findings]


def counts(findings: Iterable[Finding]) -> dict[str, int]:
    """Findings per rule id, in rule order."""
    return dict(sorted(Counter(f.rule for f in findings).items()))


__all__ = [
    "RULES",
    "FileResult",
    "Finding",
    "MigratePathError",
    "Rule",
    "counts",
    "fix_source",
    "lint",
    "lint_source",
    "migrate",
    "migrate_file",
    "rules_api",
    "rules_misuse",
    "rules_pmap",
    "rules_removed",
]
