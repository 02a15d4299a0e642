"""Where a run's metrics go: one writer interface (``Tracker``: ``write(row)``, ``close()``) and its
trackers, ``metrics.jsonl`` always, TensorBoard event files and a Weights & Biases run when asked.

One row is one JSON line (``{"step": 3, "loss": ...}``); each tracker beside it records every number
of the row as a scalar of that name at that step: TensorBoard with tensorboardX, Weights & Biases
with ``wandb`` (an optional dependency, imported only then; ``WANDB_MODE`` unset means offline, so a
run never waits on a network: ``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later).

A row is never torn: it is appended with a single ``write`` to a file opened ``O_APPEND`` (and
``O_NOFOLLOW``: a ``metrics.jsonl`` that is a link is refused, not written through); a write the
disk refuses part-way (full disk, file-size limit) is cut back to the rows before it and reported in
one line. A file torn some other way (a copy cut short, a crash of an older meshkit) is still read:
:func:`read_rows` drops the lines that are not whole rows, with one warning.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from meshkit.files import free_space, path_kind
from meshkit.fmt import to_json
from meshkit.train.config import ConfigError
from meshkit.train.lock import RunDirError, make_run_dir

METRICS_NAME = "metrics.jsonl"
WANDB_PROJECT = "meshkit"
"""The Weights & Biases project of a run (``WANDB_PROJECT`` overrides it, as wandb reads it)."""


class MetricsError(RunDirError):
    """``metrics.jsonl`` cannot be written."""


def _row(line: str) -> dict[str, Any] | None:
    """The row a line holds, or None when it is not a whole row (a JSON object with an integer step)."""
    with contextlib.suppress(ValueError):
        row = json.loads(line)
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            return row
    return None


def read_rows(path: Path, *, warn: bool = True) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (none if it is absent). Lines that are not whole rows (a last
    line cut short by a full disk or a kill) are dropped, with one ``warning:`` line on stderr when
    ``warn``."""
    if not path.is_file():
        return []
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    rows, torn = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if (row := _row(line)) is not None:
            rows.append(row)
        else:
            torn.append(number)
    if torn and warn:
        which = f"line {torn[0]}" if len(torn) == 1 else f"lines {', '.join(map(str, torn[:5]))}"
        last = " (the last: a write cut short)" if torn[-1] == len(lines) and len(torn) == 1 else ""
        sys.stderr.write(
            f"warning: {path}: {which} of {len(lines)} not a whole metrics row{last}: dropped; "
            "the other rows are kept\n"
        )
        sys.stderr.flush()
    return rows


class Tracker(Protocol):
    """Where rows go besides ``metrics.jsonl``: every number of a row, as a scalar at the row's step."""

    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a row but its step (what the trackers record)."""
    return {
        k: v for k, v in row.items() if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class TensorBoardTracker:
    """TensorBoard event files in the run directory, through tensorboardX."""

    def __init__(self, run_dir: Path, first_step: int) -> None:
        from tensorboardX import SummaryWriter

        # one event file per writer, named by its first step: a resumed run adds a file, never truncates one
        self._events = SummaryWriter(logdir=str(run_dir), filename_suffix=f".from-step-{first_step}")

    def write(self, row: dict[str, Any]) -> None:
        for name, value in scalars(row).items():
            self._events.add_scalar(name, value, row["step"])

    def close(self) -> None:
        self._events.close()


class WandbTracker:
    """A Weights & Biases run under ``run_dir/wandb``; offline unless ``WANDB_MODE`` says otherwise."""

    def __init__(self, run_dir: Path, config: dict[str, Any] | None) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "--tracker wandb needs the wandb package: pip install 'meshkit[wandb]' (or drop wandb from --tracker)"
            ) from None
        mode = os.environ.get("WANDB_MODE") or "offline"
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
            dir=str(run_dir),
            name=run_dir.resolve().name,
            config=config,
            mode=mode,
            settings=wandb.Settings(console="off", silent=True),
        )

    def write(self, row: dict[str, Any]) -> None:
        self._run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() may return before wandb's service has written the run's file (seen offline: 1 in 6);
        # teardown waits for it, so the run is whole on disk when the job ends
        wandb.teardown()


class MetricsLog:
    """Append rows to ``run_dir/metrics.jsonl`` (one ``write`` per row, never torn) and to the other
    trackers named (``TRACKERS``: tensorboard, wandb)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = False,
        first_step: int = 0,
        trackers: tuple[str, ...] = ("jsonl",),
        config: dict[str, Any] | None = None,
    ) -> None:
        """``trackers``: names from ``meshkit.train.config.TRACKERS`` (``tensorboard=True`` adds tensorboard);
        ``config``: the run's options, for the Weights & Biases run."""
        self.path = run_dir / METRICS_NAME
        names = {*trackers, *(["tensorboard"] if tensorboard else [])}
        make_run_dir(run_dir)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            self._fd: int | None = os.open(self.path, flags, 0o644)
        except OSError as e:
            kind = path_kind(self.path, follow=False)
            if kind not in ("missing", "a regular file"):
                raise MetricsError(
                    f"'{self.path}' is {kind}: meshkit never writes through it; remove it, or pass another --run-dir"
                ) from None
            raise MetricsError(
                f"cannot open '{self.path}' ({e.strerror or e}): fix permissions, or pass another --run-dir"
            ) from None
        self.trackers: list[Tracker] = []
        try:
            if "tensorboard" in names:
                self.trackers.append(TensorBoardTracker(run_dir, first_step))
            if "wandb" in names:
                self.trackers.append(WandbTracker(run_dir, config))
        except BaseException:
            self.close()
            raise

    def write(self, row: dict[str, Any]) -> None:
        data = (to_json(row) + "\n").encode()
        assert self._fd is not None, "write after close"
        size = os.fstat(self._fd).st_size
        try:
            if os.write(self._fd, data) != len(data):
                raise OSError(0, "the disk took only part of the row")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)  # back to the whole rows before this one
            raise MetricsError(
                f"cannot write '{self.path}' ({e.strerror or e}); {free_space(self.path.parent)} there: free space, "
                "then continue with --resume (the rows before this one and the checkpoints are intact)"
            ) from None
        for tracker in self.trackers:
            tracker.write(row)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
