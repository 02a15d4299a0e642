"""Profiles of training steps: a ``jax.profiler`` trace of chosen steps and where their time went.

``Trainer.profile(batches, directory)`` and ``meshkit train --profile 5-7`` trace those steps into
``directory`` (``<run_dir>/profile`` for a run) in TensorBoard's layout, ``plugins/profile/<time>/``:
``<host>.xplane.pb`` (TensorBoard / XProf), ``<host>.trace.json.gz`` and ``perfetto_trace.json.gz``
(Perfetto, chrome://tracing). The trace is read back by :func:`meshkit.analysis.trace.summarize`
beside the communication ledger of the very executable the steps ran: time in compute, in each
collective, exposed communication and achieved bandwidth, as JSON (``report.json``'s ``profile``,
``profile/summary.json``) and as a table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.table import Table

from meshkit.analysis import communication
from meshkit.analysis.trace import TraceSummary, find_trace, summarize
from meshkit.fmt import fmt_bytes, table, to_json
from meshkit.train.config import ConfigError
from meshkit.train.lock import write_atomic

PROFILE_DIR = "profile"
"""A run's profile directory, under its run directory (TensorBoard: ``--logdir <run_dir>``)."""
SUMMARY_NAME = "summary.json"

_STEPS = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_steps(text: str) -> tuple[int, int]:
    """``--profile`` as (first, last) step, counted from 1 as ``metrics.jsonl`` counts them: '5' or '5-7'."""
    m = _STEPS.match(text or "")
    first, last = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or first < 1 or last < first:
        raise ConfigError(
            f"--profile {text!r}: give a step or a range of steps, such as 5 or 5-7 (counted from 1, first <= last)"
        )
    return first, last


def check_steps(steps: tuple[int, int], total: int, done: int = 0) -> None:
    """The profiled steps lie within the run (``total`` steps) and after the ``done`` ones (a resumed run)."""
    first, last = steps
    said = f"--profile {first}" + (f"-{last}" if last != first else "")
    if last > total:
        raise ConfigError(f"{said}: the run has {total} steps: profile steps 1 to {total}, or raise --steps")
    if last <= done:
        raise ConfigError(f"{said}: the run is at step {done} already: profile a step after it")


class Tracing:
    """``jax.profiler`` tracing into ``directory``; ``stop()`` returns the trace file it wrote."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)

    def stop(self) -> Path:
        jax.profiler.stop_trace()
        return find_trace(self.directory)


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """What ``Trainer.profile`` returns: the trace written, where its time went, the steps' metrics."""

    trace: Path
    summary: TraceSummary
    metrics: list[dict[str, Any]]


def summary_of(trainer: Any, trace: Path) -> TraceSummary:
    """The trace beside the ledger of the executable the trainer's last step ran."""
    return summarize(trace, communication(trainer.last_compiled, mesh=trainer.mesh))


class StepProfiler:
    """Traces the steps ``steps`` (first, last) of a training loop: ``before(n)`` ahead of step n,
    ``after(n)`` once it is done; ``close()`` ends a trace a stopped run left open. Off when None."""

    def __init__(
        self, trainer: Any, steps: tuple[int, int] | None, directory: Path, console: Console
    ) -> None:
        self.trainer, self.steps, self.console = trainer, steps, console
        self.tracing = Tracing(directory)
        self.active = False
        self.summary: dict[str, Any] | None = None
        """The summary as JSON once the steps are traced (``{"error": ...}`` if the trace could not be read)."""

    def before(self, step: int, done: int) -> None:
        if (
            self.steps is not None
            and not self.active
            and max(self.steps[0], done + 1) == step <= self.steps[1]
        ):
            self.tracing.start()
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step == self.steps[1]:
            self.close()

    def close(self) -> None:
        if not self.active:
            return
        self.active = False
        try:
            trace = self.tracing.stop()
            result = summary_of(self.trainer, trace)
            self.summary = result.to_json()
        except Exception as e:  # a profile never costs the run: one line, and training goes on
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self.summary = {"error": f"{type(e).__name__}: {first}"}
            self.console.print(
                f"[yellow]warning:[/] the profile failed ({self.summary['error']})", soft_wrap=True
            )
        write_atomic(self.tracing.directory / SUMMARY_NAME, to_json(self.summary, indent=2))


def summary_table(summary: dict[str, Any]) -> Table:
    """The profile summary (``TraceSummary.to_json()``) as a table: per step, averaged over devices."""
    wall = summary["wall_s"] or 1.0
    rows = [
        ["wall", _ms(summary["wall_s"]), "100%", "", ""],
        ["compute", _ms(summary["compute_s"]), f"{summary['compute_s'] / wall:.0%}", "", ""],
    ]
    for kind, k in summary["kinds"].items():
        gbps = "-" if k["achieved_gbps"] is None else f"{k['achieved_gbps']:.3g}"
        rows.append(
            [kind, _ms(k["time_s"]), f"{k['time_s'] / wall:.0%}", fmt_bytes(k["traffic_bytes"]), gbps]
        )
    rows.append(
        ["exposed communication", _ms(summary["exposed_s"]), f"{summary['exposed_fraction']:.0%}", "", ""]
    )
    title = f"profile: {summary['steps']} step(s) of {summary['module']}, per step and device"
    return table(title, ["", "time", "of wall", "ledger bytes", "achieved GB/s"], rows)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
