"""The run directory: one run owns it, and what meshkit writes there is never half-written, never
written through a link.

:func:`lock_run_dir` takes an exclusive ``fcntl.flock`` on ``<run_dir>/.lock`` and writes the
holder's pid into it. ``meshkit train`` takes it before anything reads, lists or cleans the
directory, so a second run (``--resume`` beside a live one, or a new run pointed at it) is refused
in one line naming the holder before it can touch the live run's files. The kernel releases the
lock when the holder ends in any way (exit, crash, SIGKILL), so a stale file never blocks a later
run. (flock is advisory and per host: on a shared file system seen from several hosts, only runs of
one host exclude each other.)

:func:`new_run_dir` creates a directory no other run has (``mkdir`` is atomic: a name taken by a run
started in the same second gets ``-2``, ``-3``...). :func:`write_atomic` replaces a file whole: the
text goes to a fresh temporary file beside it (created with ``O_EXCL``, so never an existing file or
a link planted there), is flushed to disk and renamed over the target; :func:`point_link` replaces a
symlink the same way. The lock file is opened with ``O_NOFOLLOW``: a ``.lock`` that is a link is
refused, never written through.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from meshkit import files
from meshkit._errors import MeshkitError
from meshkit.files import path_kind, try_lock

LOCK_NAME = ".lock"
_TRIES = 1000
"""Names tried before giving up: ``-2`` ... ``-1000`` for a run directory, random ones for a link."""


class RunDirError(MeshkitError):
    """The run directory, or a file meshkit writes in it, cannot be used as asked."""


class RunDirLockedError(RunDirError):
    """Another live run holds the run directory."""


class RunDirLock:
    """A held lock on a run directory; released by :meth:`release`, by garbage collection, or when
    the process ends."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def lock_run_dir(run_dir: str | Path) -> RunDirLock:
    """Lock ``run_dir`` (which must exist) for this process, or raise :class:`RunDirLockedError`."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd, holder = try_lock(
            path, what="the run's lock file", fix="pass another --run-dir", error=RunDirError
        )
    except OSError as e:
        raise RunDirError(
            f"cannot open the lock file '{path}' ({e.strerror or e}): fix permissions, or pass another --run-dir"
        ) from None
    if fd is None:
        raise RunDirLockedError(
            f"run directory '{run_dir}' is in use by another run ({holder}): wait for it to finish or stop it, "
            f"or pass another --run-dir"
        )
    return RunDirLock(path, fd)


def make_run_dir(path: Path) -> None:
    """Create the run directory ``path`` (and its parents) if it does not exist yet."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(
            f"cannot create the run directory '{path}' ({e.strerror or e}): fix permissions, or pass another --run-dir"
        ) from None


def new_run_dir(path: str | Path) -> Path:
    """Create a fresh directory named ``path``, or ``path-2``, ``path-3``... when that name is taken
    (another run started in the same second): ``mkdir`` fails on an existing name, so two runs never
    get the same one. Returns the directory created."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, _TRIES + 1):
            candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
            with contextlib.suppress(FileExistsError):
                candidate.mkdir()
                return candidate
    except OSError as e:
        raise RunDirError(
            f"cannot create the run directory '{path}' ({e.strerror or e}): fix permissions, or pass --run-dir"
        ) from None
    raise RunDirError(f"'{path}' and {_TRIES - 1} suffixed names are all taken: pass --run-dir")


def check_link(link: Path) -> None:
    """``link`` must be a symbolic link or absent: meshkit replaces it, and never a real file or directory."""
    if os.path.lexists(link) and not link.is_symlink():
        raise RunDirError(
            f"'{link}' is {path_kind(link, follow=False)}, not the link meshkit keeps to the newest run: move it away "
            f"(e.g. mv {link} {link}.old), or pass --run-dir"
        )


def point_link(link: Path, target: Path) -> None:
    """Make ``link`` a symbolic link to ``target``, replaced atomically (a reader sees the old link or
    the new one). A ``link`` that is a real file or directory is refused (:func:`check_link`)."""
    check_link(link)
    for _ in range(_TRIES):
        tmp = link.with_name(f".{link.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.symlink(target, tmp)
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise RunDirError(
                f"cannot create the link '{link}' ({e.strerror or e}): pass --run-dir"
            ) from None
    try:
        os.replace(tmp, link)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise RunDirError(f"cannot replace the link '{link}' ({e.strerror or e}): pass --run-dir") from None


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace a file of the run directory whole (``meshkit.files.write_atomic``): a reader, or a crash,
    sees the old file or the new one; a failure is one line naming it and the free space."""
    files.write_atomic(
        path, data, fix="free space or fix permissions, or pass another --run-dir", error=RunDirError
    )
