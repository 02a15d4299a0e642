"""Which files ``meshkit migrate`` reads: files and directories (recursing into ``*.py``), minus excludes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from fnmatch import fnmatch
from pathlib import Path

from meshkit._errors import MeshkitError

_SKIPPED_DIRS = ("__pycache__", "node_modules")


class MigratePathError(MeshkitError):
    """A path given to ``meshkit migrate`` does not exist or is not Python."""


def _excluded(path: Path, root: Path, exclude: Iterable[str]) -> bool:
    """Whether a glob matches the path relative to ``root``, its name, or any of its directories."""
    rel = path.relative_to(root).as_posix()
    parts = path.relative_to(root).parts
    return any(fnmatch(rel, g) or any(fnmatch(p, g) for p in parts) for g in exclude)


def python_files(paths: Iterable[str | Path], exclude: Iterable[str] = ()) -> Iterator[Path]:
    """Every ``*.py`` file under ``paths`` once, in order; hidden and cache directories are skipped.

    Files named directly are always read; ``exclude`` globs apply to what directories hold.
    """
    exclude = tuple(exclude)
    seen: set[Path] = set()
    for given in map(Path, paths):
        if given.is_file():
            found = [given]
        elif given.is_dir():
            found = [
                p for p in sorted(given.rglob("*.py"))
                if p.is_file()
                and not any(part.startswith(".") or part in _SKIPPED_DIRS for part in p.relative_to(given).parts[:-1])
                and not _excluded(p, given, exclude)
            ]  # fmt: skip
        else:
            raise MigratePathError(
                f"no such file or directory {str(given)!r}: give Python files or directories"
            )
        for p in found:
            if p.resolve() not in seen:
                seen.add(p.resolve())
                yield p
