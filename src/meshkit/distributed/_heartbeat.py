"""Peer liveness of a multi-process job: one line naming a stalled or dead process, within the
heartbeat timeout, instead of a hang or JAX's abort.

JAX's coordination service ends a job whose process stops sending heartbeats, but from C++: every
survivor is aborted (SIGABRT) with a stack trace, and JAX offers no Python hook (its
``missed_heartbeat_callback`` cannot take a Python function: the status argument has no
conversion). So each process of a meshkit job also beats through the coordination service's
key-value store, and a judge thread ends the process with one ``error:`` line when

- a peer's beat has not changed for ``timeout_s`` (it stalled: SIGSTOP, swapping, stuck in I/O;
  or it died),
- no beat went through for ``timeout_s`` (the coordinator, in process 0, stalled or died),
- this process itself was stopped for longer than ``timeout_s`` (after SIGCONT: the job went on
  without it, so it leaves instead of waiting).

JAX's own heartbeat timeout is set to twice this one and 10 s more (JAX beats every half of its
timeout, so its abort can come half a timeout after a stall: see
:func:`meshkit.distributed.jax_heartbeat_timeout`), so this line comes first. One race is left: a
process resumed (SIGCONT) after the job ended wakes this judge and JAX's C++ error-poll thread at
once, and the poll thread, finding the coordinator's connection closed, may print JAX's
"Terminating process" before the judge's line (CI saw it once). A process that finishes writes
``done``, so peers do not mistake an orderly exit for a stall.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

PREFIX = "meshkit/beat/"
DONE = "done"


class PeerWatch:
    """Beat and judge in two daemon threads; ``fail(message, lost)`` is called (and must not return)
    on a stall. ``client`` is JAX's ``DistributedRuntimeClient``."""

    def __init__(
        self,
        client,
        *,
        process_index: int,
        process_count: int,
        timeout_s: float,
        coordinator: str | None,
        fail: Callable[[str, tuple[int, ...]], None],
    ) -> None:
        self._client = client
        self._me, self._n = process_index, process_count
        self._timeout = float(timeout_s)
        self._interval = max(0.1, min(1.0, self._timeout / 10))
        self._coordinator = coordinator
        self._fail = fail
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ok_at = time.monotonic()
        self._seen: dict[int, str] = {}
        self._changed_at: dict[int, float] = {}
        self._threads = (
            threading.Thread(target=self._beat, name="meshkit-beat", daemon=True),
            threading.Thread(target=self._judge, name="meshkit-judge", daemon=True),
        )

    def start(self) -> PeerWatch:
        for t in self._threads:
            t.start()
        return self

    def stop(self, *, done: bool = True, wait_s: float = 2.0) -> None:
        """Stop watching; with ``done`` tell the peers this process finished (best effort, bounded)."""
        self._stop.set()
        if done:
            t = threading.Thread(target=self._set, args=(DONE,), daemon=True)
            t.start()
            t.join(wait_s)

    def _set(self, value: str) -> None:
        with contextlib.suppress(Exception):  # the coordinator is gone: nothing to tell
            self._client.key_value_set(f"{PREFIX}{self._me}", value, allow_overwrite=True)

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            try:
                self._client.key_value_set(f"{PREFIX}{self._me}", str(count), allow_overwrite=True)
                beats = self._client.key_value_dir_get(PREFIX)
            except Exception:  # judged by the silence that follows
                beats = None
            count += 1
            now = time.monotonic()
            if beats is not None:
                with self._lock:
                    self._ok_at = now
                    for key, value in beats:
                        rank = int(key.rstrip("/").rpartition("/")[2])
                        if self._seen.get(rank) != value:
                            self._seen[rank] = value
                            self._changed_at[rank] = now
            self._stop.wait(self._interval)

    def _judge(self) -> None:
        start = last = time.monotonic()
        h = self._timeout
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            gap, last = now - last, now
            me, n = self._me, self._n
            if gap > h:
                self._fail(
                    f"process {me} of {n} was stopped for {gap:.0f} s, past the job's heartbeat timeout of "
                    f"{h:g} s: the job went on without it, so it exits (resume the job from its checkpoint)",
                    (me,),
                )
                return
            with self._lock:
                ok_at, seen, changed = self._ok_at, dict(self._seen), dict(self._changed_at)
            if now - ok_at > h and me != 0:
                self._fail(
                    f"lost process 0 of {n}, the coordinator at {self._coordinator}: no answer for "
                    f"{now - ok_at:.0f} s (heartbeat timeout {h:g} s; it stalled or died); process {me} "
                    f"stops: check process 0's log and host",
                    (0,),
                )
                return
            stale = [
                r for r in range(n) if r != me and seen.get(r) != DONE and now - changed.get(r, start) > h
            ]
            if stale == [0] and me != 0:  # process 0 holds the coordination service: say so
                self._fail(
                    f"lost process 0 of {n}, the coordinator at {self._coordinator}: no heartbeat for {h:g} s "
                    f"(stalled - stopped, swapping or stuck in I/O - or dead); process {me} stops: check process "
                    f"0's log and host",
                    (0,),
                )
                return
            if stale:
                names = ", ".join(map(str, stale))
                self._fail(
                    f"lost process {names} of {n}: no heartbeat for {h:g} s (stalled - stopped, swapping or "
                    f"stuck in I/O - or dead); process {me} stops: check process {stale[0]}'s log and host",
                    tuple(stale),
                )
                return
