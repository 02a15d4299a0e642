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
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from meshkit._errors import MeshkitError

LOCK_NAME = ".lock"
_TRIES = 1000
"""Names tried before giving up: ``-2`` ... ``-1000`` for a run directory, random ones for a link."""


class RunDirError(MeshkitError):
    """The run directory, or a file meshkit writes in it, cannot be used as asked."""


class RunDirLockedError(RunDirError):
    """Another live run holds the run directory."""


def free_space(path: Path) -> str:
    """Free space on the disk holding ``path`` (or its nearest existing parent), for error lines."""
    for p in (path, *path.absolute().parents):
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(p).free
            for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
                if free >= size:
                    return f"{free / size:.1f} {unit} free"
            return f"{free} bytes free"
    return "free space unknown"


def file_kind(path: Path, *, follow: bool = False) -> str:
    """What is at ``path``, for error lines: 'missing', 'a regular file', 'a directory', 'a FIFO (named
    pipe)', 'a symbolic link (to ...)'...; a link is followed only when ``follow``."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except OSError:
        return "missing"
    if stat.S_ISLNK(mode):
        with contextlib.suppress(OSError):
            return f"a symbolic link (to '{os.readlink(path)}')"
        return "a symbolic link"
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")]  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "a regular file")


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


def _open_lock_file(path: Path) -> int:
    """The lock file, opened for reading and writing; never through a link, never anything but a file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        what = file_kind(path)
        if what not in ("missing", "a regular file"):
            raise RunDirError(
                f"'{path}' is {what}, not the run's lock file: meshkit never writes through it; "
                "remove it, or pass another --run-dir"
            ) from None
        raise RunDirError(
            f"cannot open the lock file '{path}' ({e.strerror or e}): fix permissions, or pass another --run-dir"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunDirError(
            f"'{path}' is {file_kind(path)}, not the run's lock file: remove it, or pass another --run-dir"
        )
    return fd


def lock_run_dir(run_dir: str | Path) -> RunDirLock:
    """Lock ``run_dir`` (which must exist) for this process, or raise :class:`RunDirLockedError`."""
    path = Path(run_dir) / LOCK_NAME
    fd = _open_lock_file(path)
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
            f"'{link}' is {file_kind(link)}, not the link meshkit keeps to the newest run: move it away "
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


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, racing other threads)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    return 0o022


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` by ``data`` whole: a reader (or a crash) sees the old file or the new one.

    The data goes to a new temporary file in the same directory (``O_EXCL``: never an existing file,
    never through a link), is flushed to disk, then renamed over ``path`` (a link at ``path`` is
    replaced, not written through). A failure is one line naming the file and the free space; the
    temporary file is removed and ``path`` is left as it was."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o666 & ~_umask())  # as open() would create it (mkstemp makes it private)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if path.is_dir() and not path.is_symlink():
            raise RunDirError(
                f"cannot write '{path}': it is a directory; move it away, or pass another --run-dir"
            ) from None
        raise RunDirError(
            f"cannot write '{path}' ({e.strerror or e}); {free_space(path.parent)} there: free space or fix "
            "permissions, or pass another --run-dir"
        ) from None
