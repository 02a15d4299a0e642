"""One run per run directory: a second run (``--resume`` beside a live one, or a new run into it)
would write the same checkpoints and metrics as the first.

:func:`lock_run_dir` takes an exclusive ``fcntl.flock`` on ``<run_dir>/.lock`` and writes the
holder's pid into it. The kernel releases the lock when the holder ends in any way (exit, crash,
SIGKILL), so a stale file never blocks a later run; a run that finds it held is refused in one
line naming the holder's pid. (flock is advisory and per host: on a shared file system seen from
several hosts, only runs of one host exclude each other.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from meshkit._errors import MeshkitError

LOCK_NAME = ".lock"


class RunDirLockedError(MeshkitError):
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


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode().split()[0])
        with contextlib.suppress(OSError):
            cmd = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
                .strip()
            )
            if cmd:
                return f"pid {pid}: {cmd[:120]}"
        return f"pid {pid}"
    return "pid unknown"


def lock_run_dir(run_dir: str | Path) -> RunDirLock:
    """Lock ``run_dir`` (which must exist) for this process, or raise :class:`RunDirLockedError`."""
    path = Path(run_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunDirLockedError(
            f"run directory '{run_dir}' is in use by another run ({holder}): wait for it to finish or stop it, "
            f"or pass another --run-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunDirLock(path, fd)
