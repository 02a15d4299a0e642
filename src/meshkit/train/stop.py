"""Stopping a training run on SIGINT or SIGTERM: a checkpoint at a step every process agrees on.

The first SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption notice, ``kill``, ``meshkit
launch`` passing its own on) is recorded and the step in flight finishes; at the next step
boundary the loop saves a checkpoint and the run exits with 128 + the signal's number (130 for
SIGINT, 143 for SIGTERM). A second signal ends the process at once, by the signal's default
action: the checkpoints already written stay as they were (a step is renamed into place only once
every file of it is written).

In a job of several processes a signal may reach one process only (``kill`` of one rank) or every
process at a different step (``meshkit launch``, a scheduler). So at every step boundary each
process contributes its request to a gather of one number per process (the signal asked for, 0
for none): all get the same answer after the same step, and stop and save together.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np

from meshkit.launch import report_progress

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The exit status of a run stopped by ``signum`` (as a shell reports a process it ended)."""
    return 128 + signum


class StopRequest:
    """While entered (main thread only), SIGINT and SIGTERM ask the loop to stop at the next step
    boundary instead of interrupting it; on leaving, the handlers before it are put back."""

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first signal received, if any (this process's own request)."""
        self._saved: dict[int, object] = {}
        self._boundaries = 0

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        report_progress(done=True)  # what follows the steps (evaluation, report) is not judged
        for s, handler in self._saved.items():
            if handler is not None:  # None: installed outside Python, which cannot put it back
                signal.signal(s, handler)
        self._saved.clear()

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is not None:  # a second signal that still reached Python: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        for s in SIGNALS:  # the next one ends the process at once, even inside a long C++ call
            signal.signal(s, signal.SIG_DFL)
        said = f"got {signal.Signals(signum).name}: stopping after this step with a checkpoint (a second one stops at once)"
        os.write(2, f"{said}\n".encode())  # not print(): the main thread may be inside a write to stderr

    def agreed(self) -> int | None:
        """The signal the run stops for, or None to go on: this process's request, or in a job of
        several processes the largest any of them asked for (every process must call it at the
        same step boundaries)."""
        if self._boundaries:  # after the first step (start-up and compilation are not judged)
            report_progress()  # meshkit launch --stall-timeout watches these
        self._boundaries += 1
        asked = self.signum or 0
        if jax.process_count() > 1:
            asked = _largest_over_processes(asked)
        return asked or None


def _largest_over_processes(value: int) -> int:
    """The largest ``value`` any process passes (JAX's all-gather of one number per process)."""
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(value))))
