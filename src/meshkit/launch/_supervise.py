"""Watching a running start of a job until it ends: a signal to the launcher (passed on to every
process), an orderly stop on a signal, a failure, or a process that made no progress; and the
launcher's one line about a failed start (which process, why, and what happens next)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshkit.distributed import PEER_LOST_EXIT_CODE
from meshkit.launch._children import _POLL_S, _Child, _shell_status, _stop, describe_status
from meshkit.launch._progress import _PROGRESS_PREFIX

#: Exit statuses of a process that stopped in order on a signal (``meshkit train``: 128 + SIGINT or
#: SIGTERM, after its checkpoint): not a failure, the others are stopping at the same step.
ORDERLY_STOP = frozenset(128 + s for s in (signal.SIGINT, signal.SIGTERM))
#: Exit status of a process that rejected its input; the launcher never restarts it (it would again).
BAD_INPUT_EXIT_CODE = 2
#: Exit status of a job stopped because a process made no progress for ``--stall-timeout`` seconds
#: (EX_TEMPFAIL, as for a lost peer: a restart may succeed).
STALLED_EXIT_CODE = PEER_LOST_EXIT_CODE
#: How often the launcher looks at the progress files.
_STALL_CHECK_S = 1.0


class _Signals:
    """While launching (main thread only): the first SIGINT/SIGTERM is recorded in ``received`` for
    the supervising loop to act on; a second one sets ``hurry`` (skip the grace period)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.hurry = threading.Event()
        self._saved: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        else:
            self.hurry.set()

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._saved.items():
            signal.signal(s, handler)


@dataclass(frozen=True, slots=True)
class _Ended:
    """How one start of the job ended: its exit status and, for a failure that a restart may
    cure, which process and why (None: success, an orderly stop or a signal to the launcher)."""

    status: int
    rank: int | None = None
    why: str = ""


def _stalled(children: Sequence[_Child], progress: Path | None, stall_timeout_s: float | None) -> int | None:
    """The first running process whose last step boundary (its progress file's time, see
    :func:`report_progress`) is more than ``stall_timeout_s`` old; a process that has not reached
    its first step yet (start-up, compilation) is never stalled."""
    if progress is None or stall_timeout_s is None:
        return None
    now = time.time()
    for c in children:
        if c.proc.poll() is not None:  # ended: done (or judged as it exited), not stalled
            continue
        with contextlib.suppress(OSError):
            if now - (progress / f"{_PROGRESS_PREFIX}{c.rank}").stat().st_mtime > stall_timeout_s:
                return c.rank
    return None


def _supervise(
    children: Sequence[_Child],
    say: Callable[[str], None],
    grace_s: float,
    signal_grace_s: float,
    signals: _Signals,
    stall: tuple[Path | None, float | None] = (None, None),
) -> _Ended:
    """Wait for every child. On the first failure (or a process making no progress for the stall
    timeout) return it, the others still running; on a signal to the launcher pass it on to all,
    give them ``signal_grace_s`` to save and exit, and return 128+signal. A child that stopped in
    order (:data:`ORDERLY_STOP`) is not a failure: the others, stopping at the same step, get
    ``signal_grace_s`` to follow, and its status is returned."""
    orderly: tuple[float, int] | None = None  # (when, status) of the first orderly stop
    checked = time.monotonic()
    while True:
        if signals.received is not None:
            name = signal.Signals(signals.received).name
            say(
                f"got {name}; passing it on to all {len(children)} process(es), {signal_grace_s:g} s to save and exit"
            )
            _stop(children, signals.received, signal_grace_s, signals.hurry)
            return _Ended(128 + signals.received)
        running = False
        for c in children:
            rc = c.proc.poll()
            if rc is None:
                running = True
            elif rc in ORDERLY_STOP:
                orderly = orderly or (time.monotonic(), rc)
            elif rc != 0:
                return _Ended(_shell_status(rc), c.rank, f"exited with {describe_status(rc)}")
        if not running:
            return _Ended(orderly[1] if orderly else 0)
        if orderly and time.monotonic() - orderly[0] > signal_grace_s:
            late = [c.rank for c in children if c.proc.poll() is None]
            say(
                f"process(es) {', '.join(map(str, late))} still running {signal_grace_s:g} s after another stopped "
                "on a signal; stopping them"
            )
            _stop(children, signal.SIGTERM, grace_s, signals.hurry)
            return _Ended(orderly[1])
        if not orderly and time.monotonic() - checked >= _STALL_CHECK_S:
            checked = time.monotonic()
            if (rank := _stalled(children, *stall)) is not None:
                why = f"made no progress (no step) for {stall[1]:g} s (--stall-timeout)"
                return _Ended(STALLED_EXIT_CODE, rank, why)
        time.sleep(_POLL_S)


def _ended_line(ended: _Ended, alive: bool, attempt: int, max_restarts: int) -> str:
    """The launcher's one line about a failed start: which process, why, and what happens next."""
    line = f"process {ended.rank} {ended.why}"
    if ended.status == BAD_INPUT_EXIT_CODE and max_restarts:
        return line + "; not restarting: exit code 2 means bad input, which a restart repeats"
    if attempt < max_restarts:
        return (
            line
            + f"; restarting the job from its latest checkpoint (restart {attempt + 1} of {max_restarts})"
        )
    if max_restarts:
        return line + ("; stopping the others" if alive else "") + f" (no restarts left: {max_restarts} used)"
    return line + ("; stopping the others" if alive else "")
