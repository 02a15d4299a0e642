"""A user's files, read and written only as what they claim to be: the one owner, for every layer, of what a
path is (for error lines), names kept inside the directory that gives them, files that must be regular,
whole-file replacement, free space, and exclusive locks on a file.

- **What is there** (``path_kind``): 'missing', 'a regular file', 'a directory', 'a FIFO (named pipe)', 'a
  symbolic link (to ...)'..., so that a refusal names it.
- **Names inside their directory** (``inside``): a manifest's shard, a checkpoint index's ``weight_map``,
  a datasets ``state.json`` name files; a name that leaves the directory once every link is resolved
  (``../other``, an absolute path, a link out) would have meshkit read another directory's files under
  this one's name, and is refused.
- **Regular files only** (``regular``): a FIFO would block a read forever, a device or directory fail
  somewhere deeper; each is named instead.
- **Whole-file replacement** (``write_atomic``): a reader, or a crash, sees the old file or the new one.
- **Locks** (``try_lock``): an exclusive ``fcntl.flock`` on a file opened without following a link, the
  holder's pid written into it; the kernel releases it when the holder ends in any way.

Every refusal is one line of the caller's error type (``error=``), ending in the caller's fix.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from meshkit._errors import MeshkitError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def path_kind(path: Path, *, follow: bool = True) -> str:
    """What is at ``path``, for error lines: 'missing', 'a regular file', 'a directory', 'a FIFO (named
    pipe)', 'a socket', 'a character device', 'a block device'; without ``follow``, a link is 'a
    symbolic link (to ...)'."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except OSError:
        return "missing"
    if stat.S_ISLNK(mode):
        with contextlib.suppress(OSError):
            return f"a symbolic link (to '{os.readlink(path)}')"
        return "a symbolic link"
    return next((name for test, name in _KINDS if test(mode)), "a regular file")


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


def inside(
    directory: Path,
    name: Any,
    *,
    named_by: Any,
    fix: str,
    error: type[MeshkitError] = MeshkitError,
    roots: tuple[Path, ...] = (),
) -> Path:
    """``directory / name``, where ``name`` is a file name read from ``named_by`` (a manifest, an index):
    refused in one line unless it is a relative path that stays inside ``directory`` (or one of the
    other ``roots`` its files may lie in) once every symbolic link on the way is resolved."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise error(f"'{named_by}' names the file {name!r}, which is not a file name: {fix}")
    path = directory / name
    try:
        real = path.resolve()
        allowed = [directory.resolve(), *(r.resolve() for r in roots)]
    except (OSError, RuntimeError) as e:  # a loop of links
        raise error(f"'{named_by}' names '{name}', which cannot be resolved ({e}): {fix}") from None
    if Path(name).is_absolute() or not any(real != root and real.is_relative_to(root) for root in allowed):
        raise error(f"'{named_by}' names '{name}', which leads outside '{directory}' (to '{real}'): {fix}")
    return path


def regular(path: Path, *, fix: str, error: type[MeshkitError] = MeshkitError) -> bool:
    """Whether a file is at ``path`` (False: nothing there); anything there but a regular file (through
    links) is refused in one line naming what it is, never opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as e:
        raise error(f"cannot read '{path}' ({e.strerror or e}): {fix}") from None
    if not stat.S_ISREG(mode):
        raise error(f"'{path}' is {path_kind(path)}, not a file: {fix}")
    return True


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, racing other threads)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    return 0o022


def write_atomic(
    path: Path,
    data: str | bytes,
    *,
    fix: str = "free space or fix permissions",
    error: type[MeshkitError] = MeshkitError,
) -> None:
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
            raise error(f"cannot write '{path}': it is a directory; move it away, or {fix}") from None
        raise error(
            f"cannot write '{path}' ({e.strerror or e}); {free_space(path.parent)} there: {fix}"
        ) from None


def holder(fd: int) -> str:
    """Who holds the lock on the open lock file ``fd``: 'pid N: its command line', for error lines."""
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


def try_lock(
    path: Path, *, what: str, fix: str, error: type[MeshkitError] = MeshkitError
) -> tuple[int | None, str]:
    """Open the lock file ``path`` (created if missing; never through a link, never anything but a regular
    file: ``what`` names it in the refusal) and take an exclusive ``flock`` without waiting. ``(fd, "")``
    when this process now holds it (its pid written into the file: ``holder``), ``(None, holder)`` when
    another process does. An ``OSError`` opening it (a read-only or full disk) is the caller's to name."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        there = path_kind(path, follow=False)
        if there not in ("missing", "a regular file"):
            raise error(
                f"'{path}' is {there}, not {what}: meshkit never writes through it; remove it, or {fix}"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"'{path}' is {path_kind(path)}, not {what}: remove it, or {fix}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held_by = holder(fd)
        os.close(fd)
        return None, held_by
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd, ""
