"""Checkpoints of a training run: parameters, optimizer state and a JSON ``meta`` dict, with orbax.

A step is written into ``<directory>/<step>.orbax-checkpoint-tmp`` and renamed to ``<directory>/<step>``
only once every file is written, so a process killed mid-save (SIGKILL, preemption, a second Ctrl-C)
leaves the previous steps as they were. Steps beyond ``keep`` are likewise renamed into
``<directory>/.deleted`` (by orbax, once the newer step is renamed into place) before they are
deleted, so no step is ever listed half-deleted either; the deleting is done by a thread of its own
(see :mod:`meshkit.train.background`), never by the training loop, and the next save's writer waits
for it before orbax renames more steps there.

Saves run in the background (orbax's asynchronous checkpointing): ``save(..., wait=False)`` returns
once the arrays are copied off the devices and orbax has started the write; the files are written,
checksummed and renamed into place by orbax's threads while the caller goes on, at low priority
(:mod:`meshkit.train.background`), so that the steps taken meanwhile keep the cores. The next ``save``
(or ``wait``, ``restore``, ``close``) waits for the one in flight. Until a ``wait`` has confirmed it,
a step in flight is not listed (``all_steps``, ``latest_step``), and on disk it is only a temporary
directory, which no reader lists: a process killed mid-save leaves it invisible, never half-visible.

Only a ``Checkpointer`` that saves changes the directory: it creates it and removes unfinished steps
(left by a killed save) before its first save. One that only lists and restores never deletes
anything, so opening a directory that a live run is writing cannot destroy that run's save in flight
(``meshkit train`` also refuses a second run on a directory before it opens it: see ``lock``).

Before the rename, the sha256 and size of every file of the step go into ``<step>/meshkit-checksums.json``;
a restore checks them first, so a file changed on disk (flipped bytes that keep its size included)
makes the step unreadable instead of training on garbage. A step without the file is unreadable too:
every step meshkit saves has one, so its absence means the step was changed since.

A save that fails (disk full, file-size limit, permission denied) raises one line naming the
directory and its free space, and leaves the earlier steps as they were. Restoring the latest step
skips a step that cannot be read (corrupt or partial files, a checksum that does not match): it is
named in one warning line, moved aside into ``<directory>/.unreadable/`` (kept, not deleted) and the
newest intact step is restored. In a job of several processes each process checks its share of the
checksums (the files its own index wrote; process 0 the shared ones) and reads its shards of a step
on its own first, and all agree on the result, so that they all restore the same step (at the cost
of reading it twice).

Arrays are saved as global, sharded ``jax.Array``s and restored onto any layout: the targets'
shardings (another mesh, another plan) decide where the shards land. Every process of a multi-host
job calls the same methods; orbax writes each shard once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import LatestN

from meshkit._errors import MeshkitError, gist
from meshkit.files import free_space
from meshkit.train import background
from meshkit.train._orbax_noise import quiet_orbax_noise
from meshkit.train.checksums import CHECKSUMS as CHECKSUMS  # where the digests are: named here for callers
from meshkit.train.checksums import Unreadable as _Unreadable
from meshkit.train.checksums import check_checksums, write_checksums

_ARRAY_ITEMS = ("params", "opt_state")
_TRASH = ".deleted"
#: Where unreadable steps are moved (kept for inspection), inside the checkpoint directory.
UNREADABLE = ".unreadable"


def held(directory: Path) -> list[str]:
    """What a checkpoint directory holds besides an interrupted save's leftovers (a step directory
    still named ``<step>.orbax-checkpoint-tmp...``, never listed or restored): an empty list means no
    run's checkpoints are there."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if ocp.path.atomicity.TMP_DIR_SUFFIX not in p.name)


class CheckpointError(MeshkitError):
    """A checkpoint cannot be saved or restored as asked."""


def abstract(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct``s (shape, dtype and sharding) of live arrays: the target to restore in place."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def abstract_with(tree: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct``s of ``tree`` (arrays or structs) placed by ``shardings``, a matching pytree.

    The target to restore onto another mesh or plan, e.g. ``abstract_with(params, trainer.shardings.params)``.
    """
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Handlers by item name, so a fresh process can read a step's metadata before restoring it."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for name in _ARRAY_ITEMS:
        registry.add(name, ocp.args.StandardSave)
        registry.add(name, ocp.args.StandardRestore)
    registry.add("meta", ocp.args.JsonSave)
    registry.add("meta", ocp.args.JsonRestore)
    return registry


def _path(keys: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys)


def _first_mismatch(saved: Any, target: Any) -> str | None:
    """The first leaf (target order, then leaves only saved) whose shape differs or is on one side only."""
    have = {_path(p): f"shape {tuple(m.shape)}" for p, m in jax.tree.leaves_with_path(saved)}
    want = {_path(p): f"shape {tuple(x.shape)}" for p, x in jax.tree.leaves_with_path(target)}
    for path in [*want, *(p for p in have if p not in want)]:
        if have.get(path) != want.get(path):
            return f"{path} is {have.get(path, 'absent')} in the checkpoint but {want.get(path, 'absent')} in the model"
    return None


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block ends, then deliver it: an interrupt cannot split orbax's bookkeeping."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _warn(message: str) -> None:
    """One ``warning:`` line on stderr (process 0 only)."""
    if jax.process_index() == 0:
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


class Checkpointer:
    """Save and restore ``(params, opt_state, meta)`` by step in ``directory``, keeping the latest ``keep``.

    ``params`` and ``opt_state`` are pytrees of global ``jax.Array``s; ``meta`` is a JSON-serializable
    dict (data-iterator state, step, config hash, metrics). Saves are asynchronous unless ``wait``:
    the device-to-host copy finishes before ``save`` returns (the next step may donate the arrays),
    the disk writes run in the background until ``wait()``, the next ``save``, or ``close()``.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be at least 1 checkpoint, got {keep}")
        self.directory = Path(directory)
        self._last_saved: int | None = None
        self._saving: int | None = None
        self._pending: int | None = None  # saved asynchronously, not yet confirmed by a wait()
        self._keep = keep
        self._writer = False
        self._writers = background.Writers()  # the threads of the save in flight
        self._reaper = background.Reaper()  # deletes the trash: the steps past keep
        self._manager = self._open(writer=False)

    def _open(self, *, writer: bool) -> ocp.CheckpointManager:
        """orbax's manager of the directory. Only a ``writer`` (opened by the first save) creates the
        directory and removes unfinished steps: a reader never deletes anything."""
        try:
            manager = ocp.CheckpointManager(
                self.directory.absolute(),
                options=ocp.CheckpointManagerOptions(
                    preservation_policy=LatestN(n=self._keep),
                    create=writer,
                    cleanup_tmp_directories=writer,
                    todelete_subdir=_TRASH,
                    enable_async_checkpointing=True,
                    async_options=ocp.AsyncOptions(post_finalization_callback=self._seal),
                ),
                handler_registry=_registry(),
            )
            # orbax removes unfinished steps in a background task that only a save waits for: finish it
            # now, so that it cannot race the save that follows
            getattr(manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        except Exception as e:
            raise CheckpointError(
                f"cannot open checkpoint directory '{self.directory}' ({gist(e)}); {free_space(self.directory)} there: "
                "fix permissions or pick another --run-dir"
            ) from e
        return manager

    def _become_writer(self) -> None:
        """Before the first save: reopen as the directory's writer (create it, remove unfinished steps
        and, in the background, the trash a killed run left)."""
        if not self._writer:
            self._manager.close()
            self._manager = self._open(writer=True)
            self._writer = True
            if jax.process_index() == 0:  # an earlier run's trash: gone before orbax moves steps there
                self._reaper.start(self.directory / _TRASH)

    def _seal(self) -> None:
        """orbax's post-finalization callback (process 0, every process's files written, before the
        step's directory is renamed into place): the step's checksums go in with it. Runs at low
        priority, and waits for the trash of the previous save to be gone: orbax moves the steps past
        ``keep`` there next."""
        background.lower_this_thread()
        # and tensorstore's pool again: workers that an overseer started before the save (at its
        # priority) started during it, before its checksums (the save's last work) compete with the step
        background.set_nice(background.pool_threads(), background.LOW)
        self._reaper.join()
        final = self.directory.absolute() / str(self._saving)
        tmp = final.with_name(final.name + ocp.path.atomicity.TMP_DIR_SUFFIX)
        write_checksums(tmp if tmp.is_dir() else final)

    def save(self, step: int, params: Any, opt_state: Any, meta: dict, *, wait: bool = True) -> None:
        """Save ``step``; with ``wait`` return only once it is on disk and restorable.

        Safe in a ``KeyboardInterrupt`` handler: a Ctrl-C is held while orbax starts a save (and
        raised once it has), a save still in flight is finished first, and saving again the step
        this ``Checkpointer`` last saved (the one the interrupt cut short) just waits for it.
        """
        try:
            json.dumps(meta)
        except TypeError as e:
            raise CheckpointError(f"meta must be JSON (convert arrays with float() or .tolist()): {e}") from e
        self.wait()
        self._become_writer()
        if step in self._manager.all_steps():
            if step != self._last_saved:
                raise CheckpointError(
                    f"step {step} is already saved in '{self.directory}': resume from the latest step, "
                    "or save into a fresh directory"
                )
        else:
            items = background.own_copy({"params": params, "opt_state": opt_state})
            args = {
                name: ocp.args.StandardSave(tree) for name, tree in items.items() if jax.tree.leaves(tree)
            }
            with _sigint_deferred(), self._failing_save(step):
                self._probe_writable()
                self._saving = step
                before = background.snapshot()
                self._manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args))
                self._writers.started(before)
                self._last_saved = self._pending = step
        if wait:
            self.wait()

    def _probe_writable(self) -> None:
        """Create and remove a file first: orbax, refused its temporary directory, leaves threads
        waiting (not daemons) for a signal that never comes, and the process could not exit."""
        fd, probe = tempfile.mkstemp(dir=self.directory, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)

    @contextlib.contextmanager
    def _failing_save(self, step: int) -> Iterator[None]:
        """Turn a failed write into one line naming the directory, its free space and what is kept."""
        quiet_orbax_noise()
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:
            kept = [s for s in self._manager.all_steps() if s != step]
            keep = f"steps {sorted(kept)} are intact" if kept else "no earlier step was saved"
            raise CheckpointError(
                f"cannot save step {step} in '{self.directory}' ({gist(e)}); {free_space(self.directory)} there: "
                f"free space, fix permissions or pick another --run-dir; {keep}"
            ) from e

    def latest_step(self) -> int | None:
        """The newest saved step, or None. A step saved asynchronously counts once a ``wait`` (or the
        next ``save``) has confirmed it is on disk: never while it may be unfinished."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Saved steps, oldest first (without a step in flight: see ``latest_step``). Every process of
        a job gets the same list: a step in flight is confirmed at the same calls everywhere."""
        return sorted(s for s in self._manager.all_steps() if s != self._pending)

    def in_flight(self) -> int | None:
        """The step saved asynchronously that no ``wait`` has confirmed yet, or None."""
        return self._pending

    def restore(self, step: int | None, params_like: Any, opt_state_like: Any) -> tuple[Any, Any, dict]:
        """``(params, opt_state, meta)`` of ``step`` (None: the newest readable step), laid out as the
        targets say.

        ``*_like`` are pytrees of ``jax.ShapeDtypeStruct`` with ``sharding`` (see ``abstract`` and
        ``abstract_with``); they may name another mesh or plan than the save's: orbax reshards
        (and casts to the targets' dtypes). Shapes must match the checkpoint's.

        With ``step=None``, a step whose files cannot be read (corrupt or partial) is named in one
        ``warning:`` line on stderr, moved into ``<directory>/.unreadable/`` and the next older step
        is tried. A given ``step`` that cannot be read raises :class:`CheckpointError`.
        """
        self.wait()
        targets = {"params": params_like, "opt_state": opt_state_like}
        if step is not None:
            if step not in self.all_steps():
                raise CheckpointError(
                    f"no checkpoint for step {step} in '{self.directory}': it holds steps {self.all_steps()}"
                )
            try:
                if failing := self._unreadable_somewhere(step, targets):
                    raise _Unreadable(failing)
                return self._restore(step, targets)
            except _Unreadable as e:
                raise CheckpointError(f"step {step} in '{self.directory}' cannot be read: {e}") from None
        candidates = sorted(self.all_steps(), reverse=True)
        if not candidates:
            raise CheckpointError(f"no checkpoint in '{self.directory}': train first, or drop --resume")
        bad: list[int] = []
        for candidate in candidates:
            try:
                if failing := self._unreadable_somewhere(candidate, targets):
                    raise _Unreadable(failing)
                got = self._restore_agreed(candidate, targets)
            except _Unreadable as e:
                bad.append(candidate)
                older = [c for c in candidates if c < candidate]
                moved = self._set_aside(candidate)
                then = f"trying step {older[0]}" if older else "no older step to try"
                _warn(
                    f"checkpoint step {candidate} in '{self.directory}' cannot be read ({e}){moved}; {then}"
                )
                continue
            if bad:
                self._manager.reload()
            return got
        self._manager.reload()
        raise CheckpointError(
            f"no readable checkpoint in '{self.directory}': steps {bad} are corrupt or partial (moved to "
            f"{UNREADABLE}/): train again without --resume, or into a fresh --run-dir"
        )

    def _unreadable_somewhere(self, step: int, targets: dict[str, Any]) -> str:
        """In a multi-process job: '' when every process can read ``step``, else why not (naming the
        processes). Each process reads the step on its own first (orbax's restore ends in a barrier
        of all processes, which one that fails never reaches: the others would go on with this step
        and it with an older one), then all agree, so that they all restore the same step.
        A single process has nothing to agree on: ''."""
        if jax.process_count() == 1:
            return ""
        from jax.experimental import multihost_utils

        me = jax.process_index()
        alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        handler = ocp.CompositeCheckpointHandler(
            handler_registry=_registry(),
            composite_options=ocp.CompositeOptions(multiprocessing_options=alone),
        )
        here = ""
        try:
            with ocp.Checkpointer(handler, multiprocessing_options=alone) as reader:
                self._restore(
                    step, targets, reader=lambda args: reader.restore(self.directory / str(step), args=args)
                )
        except _Unreadable as e:
            here = str(e)
        failed = multihost_utils.process_allgather(np.asarray([bool(here)], np.int32)).reshape(-1)
        processes = [i for i, f in enumerate(failed) if f]
        if not processes:
            return ""
        who = "process" + ("es " if len(processes) > 1 else " ") + ", ".join(map(str, processes))
        return f"{who} cannot read it" + (f": {here}" if here else "")

    def _restore_agreed(self, step: int, targets: dict[str, Any]) -> tuple[Any, Any, dict]:
        """Restore a step every process has read (one process failing now would split the job)."""
        try:
            return self._restore(step, targets, check=jax.process_count() == 1)  # checked while agreeing
        except _Unreadable as e:
            if jax.process_count() == 1:
                raise
            raise CheckpointError(
                f"step {step} in '{self.directory}' could be read by every process, then not ({e}): restart the job"
            ) from None

    def _restore(
        self, step: int, targets: dict[str, Any], reader: Any = None, *, check: bool = True
    ) -> tuple[Any, Any, dict]:
        """Restore one step (first checking this process's share of its checksums, when ``check``);
        :class:`_Unreadable` when its files cannot be read back or differ from the save's."""
        if check:
            check_checksums(
                self.directory / str(step), process=jax.process_index(), processes=jax.process_count()
            )
        quiet_orbax_noise()  # before reading: orbax closes its loop before the error reaches us
        try:
            saved = self._manager.item_metadata(step)
        except Exception as e:
            raise _Unreadable(gist(e)) from None
        for name, like in targets.items():
            if jax.tree.leaves(like) and not jax.tree.leaves(saved.get(name) if saved else None):
                raise _Unreadable(f"its {name} are missing")
            if mismatch := _first_mismatch(saved.get(name), like):
                raise CheckpointError(
                    f"{name}/{mismatch} (step {step} in '{self.directory}'): restore with the config "
                    "the checkpoint was saved with, or train into a fresh directory"
                )
        args = {
            name: ocp.args.StandardRestore(like) for name, like in targets.items() if jax.tree.leaves(like)
        }
        composite = ocp.args.Composite(meta=ocp.args.JsonRestore(), **args)
        try:
            got = reader(composite) if reader else self._manager.restore(step, args=composite)
            meta = got["meta"]
        except Exception as e:
            raise _Unreadable(gist(e)) from None
        if not isinstance(meta, dict):
            raise _Unreadable("its meta is not a JSON object")
        params, opt_state = (got[name] if name in args else like for name, like in targets.items())
        return params, opt_state, meta

    def _set_aside(self, step: int) -> str:
        """Move an unreadable step out of the way (a later save may reuse its number); kept, not
        deleted. Only process 0 moves it. Returns a note for the warning."""
        if jax.process_index() != 0:
            return ""
        source = self.directory / str(step)
        target = self.directory / UNREADABLE / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            target.parent.mkdir(exist_ok=True)
            os.replace(source, target)
        except OSError as e:
            return f"; could not move it aside ({e.strerror or e})"
        return f"; moved to {target.relative_to(self.directory)}"

    def wait(self) -> None:
        """Block until a save in flight is on disk (and the steps beyond ``keep`` are out of the
        listing; a thread of their own deletes them meanwhile: :meth:`close` waits for it)."""
        with self._failing_save(self._last_saved):
            try:
                if self._pending is not None:
                    self._writers.raise_back()  # the loop waits for them now
                self._manager.wait_until_finished()
            except Exception:  # failed: orbax no longer lists the step (a Ctrl-C leaves it in flight)
                self._pending = None
                raise
            self._pending = None
        if self._writer and jax.process_index() == 0:
            self._reaper.start(self.directory / _TRASH)

    def close(self) -> None:
        """Finish a save in flight and the deleting of old steps, and release orbax's threads."""
        self.wait()
        self._reaper.join()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
