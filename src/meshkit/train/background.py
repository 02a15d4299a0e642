"""A checkpoint save's work kept off the training step's critical path.

A background save's writers (tensorstore's shared thread pool, which copies, compresses and writes
the files; orbax's threads; the checksums) run on the host's cores beside the training step, which
on a CPU backend uses every core: at equal priority they slow each step taken during the save.
On Linux a thread's nice value is its own (``setpriority(PRIO_PROCESS, <native thread id>)``), and
a thread starts with its creator's, so :class:`Writers` lowers the save's threads to nice 19 once
the save has started (the threads orbax started for it, and tensorstore's pool: the overseer that
starts its workers, and the workers), and raises them back to the waiting thread's priority when
the loop waits for the save (a preemption's last save, the end of the run), where permitted
(CAP_SYS_NICE or ``RLIMIT_NICE``; otherwise they stay low). Elsewhere than Linux it does nothing.

:class:`Reaper` deletes the steps past ``keep`` (orbax renamed them into the trash) in a thread of
its own, at low priority, instead of the training loop.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax

LOW = 19  #: the nice value of a background save's threads
_POOL = b"ts_pool"  # tensorstore's shared pool: "ts_pool_overseer" (15 characters kept), "ts_pool_worker"
_LINUX = sys.platform.startswith("linux")
_SAVES: set[int] = set()  # every thread a save started: lowered again by the next save (see Writers)


def nice(tid: int) -> int | None:
    """The nice value of this process's thread ``tid`` (a native thread id), or None (gone, not Linux)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid) if _LINUX else None
    except OSError:
        return None


def pool_threads() -> set[int]:
    """Native ids of tensorstore's pool threads in this process (Linux; empty elsewhere)."""
    if not _LINUX:
        return set()
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", "rb") as f:
                if f.read().startswith(_POOL):
                    found.add(int(tid))
        except OSError:  # ended meanwhile
            pass
    return found


def _threads() -> set[int]:
    """Native ids of this process's threads: every one on Linux (tensorstore's and XLA's too), the
    Python ones elsewhere."""
    if _LINUX:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def set_nice(tids: Iterable[int], value: int) -> None:
    """Set the nice value of each of this process's threads ``tids``; one that ended, or a raise that
    is not permitted, is left as it is."""
    if not _LINUX:
        return
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, value)


def lower_this_thread() -> None:
    """Lower the calling thread (and the threads it will start) to :data:`LOW`."""
    set_nice([threading.get_native_id()], LOW)


class Writers:
    """The threads of the save in flight: started by ``started()`` around the call that starts the
    save, lowered by it, raised back by ``raise_back()``."""

    def __init__(self) -> None:
        self.ids: set[int] = set()

    def started(self, before: set[int]) -> None:
        """The save has started: its threads are those started since ``before`` (:func:`snapshot`:
        orbax's, and tensorstore's overseer if it was not running, whose name is too long for Linux
        to keep) and tensorstore's pool workers; lower them (the threads they start from now on
        start low). An overseer started outside a save (a restore less than its 20 s idle timeout
        before) keeps its priority, and so do the workers it starts during this save, until the
        next save lowers them by name. The threads an earlier save started that still run (raised
        back while the loop waited for it) are lowered again."""
        alive = _threads()
        _SAVES.update(alive - before)
        _SAVES.intersection_update(alive)
        self.ids = _SAVES | pool_threads()
        set_nice(self.ids, LOW)

    def raise_back(self) -> None:
        """The loop waits for the save: give its threads the waiting thread's priority back."""
        mine = nice(threading.get_native_id())
        if mine is not None and self.ids:
            set_nice(self.ids | pool_threads(), mine)


def own_copy(tree: Any) -> Any:
    """The arrays a background save reads, copied where they would be shared with the next step.

    On the CPU backend orbax's device-to-host copy of an array is a view of its buffer: the next
    step, which donates its inputs, then cannot reuse them and allocates and fills new ones inside
    the step (a step several times as long). Copied here, once, before the step, the save reads
    buffers of its own. On other backends orbax's copy off the device is a copy: as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    mine = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and _on_cpu(x)]
    if mine:  # one call: a device_put per array costs more in Python than the copies themselves
        copies = jax.device_put(
            [leaves[i] for i in mine], [leaves[i].sharding for i in mine], may_alias=False
        )
        for i, copy in zip(mine, copies, strict=True):
            leaves[i] = copy
    return jax.tree.unflatten(treedef, leaves)


def _on_cpu(x: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in x.sharding.device_set)


def snapshot() -> set[int]:
    """The threads running now (see :meth:`Writers.started`)."""
    return _threads()


class Reaper:
    """Deletes a directory in a thread of its own, at low priority.

    ``start`` while one is still deleting does nothing (it deletes the whole directory); ``join``
    before anything may write into the directory again.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, directory: Path) -> None:
        if (self._thread is not None and self._thread.is_alive()) or not directory.exists():
            return
        self._thread = threading.Thread(target=_reap, args=(directory,), name="meshkit-reaper")
        self._thread.start()

    def join(self) -> None:
        if (thread := self._thread) is not None:
            thread.join()


def _reap(directory: Path) -> None:
    lower_this_thread()
    shutil.rmtree(directory, ignore_errors=True)
