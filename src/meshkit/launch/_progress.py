"""Progress of a job's processes, for ``meshkit launch --stall-timeout``: each process touches its own
file in a private directory at every step boundary (:func:`report_progress`), and the launcher reads
the files' times to find a process that made no progress."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from meshkit.launch._errors import LaunchError
from meshkit.launch._tls import _TLS_PREFIX

#: Set by ``meshkit launch --stall-timeout`` for each process: the file whose time says when it last
#: reached a step boundary (see :func:`report_progress`).
MESHKIT_PROGRESS_FILE = "MESHKIT_PROGRESS_FILE"
_PROGRESS_PREFIX = "progress-"


def report_progress(*, done: bool = False) -> None:
    """Tell ``meshkit launch --stall-timeout`` that this process reached a step boundary: one
    ``utime`` of the file ``MESHKIT_PROGRESS_FILE`` names (nothing when unset); ``done``: it left
    its steps (what follows, e.g. a final evaluation, is not judged), the file is removed.
    ``meshkit train`` calls it at every step boundary after the first step; a program of your own
    may call it in its loop."""
    path = os.environ.get(MESHKIT_PROGRESS_FILE)
    if not path:
        return
    try:
        if done:
            os.unlink(path)
        else:
            os.utime(path)
    except FileNotFoundError:
        if not done:
            with contextlib.suppress(OSError):
                open(path, "a").close()
    except OSError:
        pass  # the launcher is gone, or its directory: nothing to tell


@contextlib.contextmanager
def _progress_dir(stall_timeout_s: float | None) -> Iterator[Path | None]:
    """A private directory for the processes' progress files while the job runs (None without a
    stall timeout); swept like the certificates' if the launcher is SIGKILLed."""
    if stall_timeout_s is None:
        yield None
        return
    try:
        directory = tempfile.mkdtemp(prefix=f"{_TLS_PREFIX}{os.getpid()}-progress-")
    except OSError as e:
        raise LaunchError(
            f"cannot make the job's progress directory in {tempfile.gettempdir()} ({e.strerror or e}): set TMPDIR "
            "to a writable directory, or leave out --stall-timeout"
        ) from None
    try:
        yield Path(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
