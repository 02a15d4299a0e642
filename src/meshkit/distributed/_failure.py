"""How a multi-process job fails: its error types, its exit statuses, and the one ``error:`` line a
process leaves with when the job cannot go on (printed without Python's exit handlers, which would
wait for a lost peer)."""

from __future__ import annotations

import os
import sys
from contextlib import suppress
from typing import NoReturn

from meshkit._errors import MeshkitError

#: Exit status of a process stopped because a peer was lost (EX_TEMPFAIL: a restart may succeed).
PEER_LOST_EXIT_CODE = 75
#: Exit status when the job did not form within the start-up timeout.
STARTUP_FAILED_EXIT_CODE = 2


class DistributedError(MeshkitError):
    """A multi-process job cannot start or continue as asked."""


class PeerLostError(DistributedError):
    """Another process of the job died or stopped answering."""

    def __init__(self, message: str, lost: tuple[int, ...]) -> None:
        super().__init__(message)
        self.lost = lost


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _reason(e: BaseException) -> str:
    """The gist of a runtime error: its first line without XLA's source locations."""
    return _first_line(e).rpartition("] ")[2]


def _exit_now(error: MeshkitError, code: int) -> NoReturn:
    """Print ``error: ...`` and leave without Python's exit handlers: JAX's would wait in the
    shutdown barrier for the lost process until the heartbeat timeout, then abort."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os.write(2, f"error: {error}\n".encode())
    os._exit(code)
