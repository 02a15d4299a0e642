"""Checkpoints of a training run: parameters, optimizer state and a JSON ``meta`` dict, with orbax.

A step is written into ``<directory>/<step>.orbax-checkpoint-tmp`` and renamed to ``<directory>/<step>``
only once every file is written, so a process killed mid-save (SIGKILL, preemption, a second Ctrl-C)
leaves the previous steps as they were; the unfinished directory is removed when a ``Checkpointer``
next opens the directory. Steps beyond ``keep`` are likewise renamed into ``<directory>/.deleted``
before they are deleted, so no step is ever listed half-deleted either.

Arrays are saved as global, sharded ``jax.Array``s and restored onto any layout: the targets'
shardings (another mesh, another plan) decide where the shards land. Every process of a multi-host
job calls the same methods; orbax writes each shard once.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import LatestN

from meshkit._errors import MeshkitError

_ARRAY_ITEMS = ("params", "opt_state")
_TRASH = ".deleted"


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
        self._manager = ocp.CheckpointManager(
            self.directory.absolute(),
            options=ocp.CheckpointManagerOptions(
                preservation_policy=LatestN(n=keep),
                create=True,
                cleanup_tmp_directories=True,
                todelete_subdir=_TRASH,
                enable_async_checkpointing=True,
            ),
            handler_registry=_registry(),
        )

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
        if step in self._manager.all_steps():
            if step != self._last_saved:
                raise CheckpointError(
                    f"step {step} is already saved in '{self.directory}': resume from the latest step, "
                    "or save into a fresh directory"
                )
        else:
            items = {"params": params, "opt_state": opt_state}
            args = {
                name: ocp.args.StandardSave(tree) for name, tree in items.items() if jax.tree.leaves(tree)
            }
            with _sigint_deferred():
                self._manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args))
                self._last_saved = step
        if wait:
            self.wait()

    def latest_step(self) -> int | None:
        """The newest saved step (an asynchronous save counts from its start), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Saved steps, oldest first."""
        return sorted(self._manager.all_steps())

    def restore(self, step: int | None, params_like: Any, opt_state_like: Any) -> tuple[Any, Any, dict]:
        """``(params, opt_state, meta)`` of ``step`` (None: the latest), laid out as the targets say.

        ``*_like`` are pytrees of ``jax.ShapeDtypeStruct`` with ``sharding`` (see ``abstract`` and
        ``abstract_with``); they may name another mesh or plan than the save's: orbax reshards
        (and casts to the targets' dtypes). Shapes must match the checkpoint's.
        """
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in '{self.directory}': train first, or drop --resume")
        if step not in self.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in '{self.directory}': it holds steps {self.all_steps()}"
            )
        targets = {"params": params_like, "opt_state": opt_state_like}
        saved = self._manager.item_metadata(step)
        for name, like in targets.items():
            if mismatch := _first_mismatch(saved.get(name), like):
                raise CheckpointError(
                    f"{name}/{mismatch} (step {step} in '{self.directory}'): restore with the config "
                    "the checkpoint was saved with, or train into a fresh directory"
                )
        args = {
            name: ocp.args.StandardRestore(like) for name, like in targets.items() if jax.tree.leaves(like)
        }
        got = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **args))
        params, opt_state = (got[name] if name in args else like for name, like in targets.items())
        return params, opt_state, got["meta"]

    def wait(self) -> None:
        """Block until a save in flight is on disk and the steps beyond ``keep`` are deleted."""
        self._manager.wait_until_finished()
        if jax.process_index() == 0:
            shutil.rmtree(self.directory / _TRASH, ignore_errors=True)

    def close(self) -> None:
        """Finish a save in flight and release orbax's threads."""
        self.wait()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
