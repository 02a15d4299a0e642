"""Where a run's metrics go: ``metrics.jsonl`` always, TensorBoard event files beside it when asked.

One row is one JSON line (``{"step": 3, "loss": ...}``); with TensorBoard on, each number of the row
is also a scalar of that name at that step, written with tensorboardX (imported only then).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append rows to ``run_dir/metrics.jsonl`` (flushed per row) and, optionally, TensorBoard events."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False, first_step: int = 0) -> None:
        self._file = (run_dir / "metrics.jsonl").open("a")
        self._events = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # one event file per writer, named by its first step: a resumed run adds a file, never truncates one
            self._events = SummaryWriter(logdir=str(run_dir), filename_suffix=f".from-step-{first_step}")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._events is not None:
            for name, value in row.items():
                if name != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self._events.add_scalar(name, value, row["step"])

    def close(self) -> None:
        self._file.close()
        if self._events is not None:
            self._events.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
