"""``meshkit migrate``: find legacy (pmap-era) JAX and rewrite it into JAX 0.12 idioms.

Each rule (``RULES``, by id) reports a finding with a message and either a fix that ``--fix``
applies with libcst, keeping formatting and comments, or a recipe to follow by hand.

>>> fix_source("import jax\\nk = jax.random.PRNGKey(0)\\n")
'import jax\\nk = jax.random.key(0)\\n'
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from meshkit.migrate import rules_api, rules_misuse, rules_pmap, rules_removed
from meshkit.migrate._engine import run
from meshkit.migrate._files import (
    Encoding,
    MigratePathError,
    MigrateWriteError,
    encoding_of,
    python_files,
    write_atomic,
)
from meshkit.migrate._model import PARSE_ERROR, REGISTRY, Finding, Rule

RULES: dict[str, Rule] = {PARSE_ERROR.id: PARSE_ERROR, **dict(sorted(REGISTRY.items()))}


@dataclass(frozen=True, kw_only=True, slots=True)
class FileResult:
    """One file: its findings, its text before and after every safe fix, and what the fixes leave.

    ``stable`` says a second ``--fix`` changes nothing (the fixes are idempotent on this file);
    ``encoding`` is how the file stores its text (a BOM, CRLF line endings), kept on writing.
    """

    path: str
    source: str
    fixed: str
    findings: tuple[Finding, ...]
    remaining: tuple[Finding, ...]
    stable: bool = True
    encoding: Encoding = field(default_factory=Encoding)

    @property
    def changed(self) -> bool:
        return self.fixed != self.source


def lint_source(text: str, path: str = "<string>", select: Iterable[str] | None = None) -> list[Finding]:
    """The findings in Python source ``text`` (only rules in ``select`` when given)."""
    return run(text, path, select=select)[0]


def fix_source(text: str, select: Iterable[str] | None = None) -> str:
    """``text`` with every safe fix applied (only rules in ``select`` when given)."""
    return run(text, fix=True, select=select)[1]


def _unreadable(path: str, why: str, fix: str) -> FileResult:
    finding = Finding(
        path=path, line=1, col=1, rule=PARSE_ERROR.id, message=why, fix=f"by hand: {fix}", fixable=False
    )
    return FileResult(path=path, source="", fixed="", findings=(finding,), remaining=(finding,))


def migrate_file(path: str | Path) -> FileResult:
    """Lint and fix one file in memory; nothing is written (``write`` does that)."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return _unreadable(name, f"cannot read: {e.strerror or e}", "make the file readable")
    encoding = encoding_of(data)
    try:
        source = encoding.decode(data)
    except UnicodeDecodeError as e:
        return _unreadable(name, f"cannot read as UTF-8: {e.reason}", "save the file as UTF-8")
    findings, fixed = run(source, name, fix=True)
    remaining, again = (findings, fixed) if fixed == source else run(fixed, name, fix=True)
    return FileResult(
        path=name,
        source=source,
        fixed=fixed,
        findings=tuple(findings),
        remaining=tuple(remaining),
        stable=again == fixed,
        encoding=encoding,
    )


def write(result: FileResult) -> None:
    """Write ``result.fixed`` over its file in the file's own conventions (BOM, CRLF), atomically.

    Raises MigrateWriteError, the file left as it was, when it cannot be written or has changed
    since it was read.
    """
    enc = result.encoding
    write_atomic(result.path, enc.encode(result.fixed), expected=enc.encode(result.source))


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
    "MigrateWriteError",
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
    "write",
]
