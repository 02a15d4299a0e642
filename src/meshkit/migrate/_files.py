"""The files ``meshkit migrate`` reads and writes.

Which files: files and directories (recursing into ``*.py``), minus excludes. How they are read:
as bytes, so a byte order mark and CRLF line endings are seen and given back on writing (the rules
see plain text with ``\\n``). How they are written: into a temporary file in the same folder, then
``os.replace``, keeping the file's mode, so a full disk or any other write error leaves the
original as it was, never cut short.
"""

from __future__ import annotations

import codecs
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from meshkit._errors import MeshkitError

_SKIPPED_DIRS = ("__pycache__", "node_modules")


class MigratePathError(MeshkitError):
    """A path given to ``meshkit migrate`` does not exist or is not Python."""


class MigrateWriteError(MeshkitError):
    """A fixed file could not be written; the original is left as it was."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Encoding:
    """How a file's text was stored: a UTF-8 byte order mark, and CRLF line endings throughout."""

    bom: bool = False
    crlf: bool = False

    def decode(self, data: bytes) -> str:
        """The text the rules see: no byte order mark, ``\\n`` line endings where the file used CRLF."""
        text = data.removeprefix(codecs.BOM_UTF8).decode("utf-8")
        return text.replace("\r\n", "\n") if self.crlf else text

    def encode(self, text: str) -> bytes:
        """``text`` as the file stores it (the exact inverse of ``decode``)."""
        text = text.replace("\n", "\r\n") if self.crlf else text
        return (codecs.BOM_UTF8 if self.bom else b"") + text.encode("utf-8")


def encoding_of(data: bytes) -> Encoding:
    """The file's conventions: CRLF only when every line ending is CRLF (mixed files are kept byte for byte)."""
    body = data.removeprefix(codecs.BOM_UTF8)
    lf = body.count(b"\n")
    return Encoding(bom=data.startswith(codecs.BOM_UTF8), crlf=lf > 0 and body.count(b"\r\n") == lf)


def write_atomic(path: str | Path, data: bytes, expected: bytes | None = None) -> None:
    """Replace the file at ``path`` (a link's target) with ``data``, or raise MigrateWriteError leaving it as it was.

    ``expected``: the bytes the file held when it was read; a file changed since is not overwritten.
    """
    target = Path(os.path.realpath(path))
    try:
        if expected is not None and target.read_bytes() != expected:
            raise MigrateWriteError(f"{path} changed since it was read: left as it is; run migrate again")
        mode = stat.S_IMODE(target.stat().st_mode)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".migrate")
    except OSError as e:
        raise MigrateWriteError(f"cannot write {path}: {e.strerror or e}; the file is left unchanged") from e
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise MigrateWriteError(f"cannot write {path}: {e.strerror or e}; the file is left unchanged") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
                p
                for p in sorted(given.rglob("*.py"))
                if p.is_file()
                and not any(
                    part.startswith(".") or part in _SKIPPED_DIRS for part in p.relative_to(given).parts[:-1]
                )
                and not _excluded(p, given, exclude)
            ]
        else:
            raise MigratePathError(
                f"no such file or directory {str(given)!r}: give Python files or directories"
            )
        for p in found:
            if p.resolve() not in seen:
                seen.add(p.resolve())
                yield p
