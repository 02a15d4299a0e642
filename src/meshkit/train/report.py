"""``PlanReport``: a compiled step's measured communication and memory beside the plan's model,
as tables for people and JSON for machines."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshkit.analysis import CommLedger, MemoryLedger
from meshkit.plans import CommRow, MemoryRow


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    """Measured communication and memory of one compiled step beside the plan's model."""

    plan: str
    mesh: dict[str, int]
    communication: list[CommRow]
    memory: list[MemoryRow]
    compiled_memory: MemoryLedger
    replicated: list[tuple[str, str]]
    ledger: CommLedger = field(repr=False)
    peak_of: Callable[[], dict | None] | None = field(default=None, repr=False, compare=False)
    """What ``peak`` is computed by, on first reading (None: no peak model, as for pipelines)."""
    pipeline: Any = None
    """Pipeline plans: the executed schedule beside the model (``_pipeline.PipelineReport``)."""
    deterministic: dict | None = None
    """Deterministic mode: its micro-shards and its price, bytes into each device per step beside the
    plan's normal collectives (``plans._deterministic.price``)."""

    _peak: list = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def peak(self) -> dict | None:
        """Measured peak (arguments + temporaries) beside ``meshkit.plans.peak``'s model, and the
        layers the plan found in the loss. Computed when first read: the model compiles the loss's
        forward and backward pass on one device (about as long as the step's own compile), which a
        caller reading only the communication or the memory formula does not wait for."""
        if not self._peak:
            self._peak.append(None if self.peak_of is None else self.peak_of())
        return self._peak[0]

    @property
    def ok(self) -> bool:
        pipeline_ok = self.pipeline is None or self.pipeline.ok
        return all(r.ok for r in self.communication) and all(r.ok for r in self.memory) and pipeline_ok

    def to_json(self) -> dict:
        return {
            "plan": self.plan,
            "mesh": self.mesh,
            "ok": self.ok,
            "communication": [r.to_json() for r in self.communication],
            "memory": [r.to_json() for r in self.memory],
            "compiled_memory": self.compiled_memory.to_json(),
            "replicated_leaves": [{"path": p, "why": w} for p, w in self.replicated],
            "peak": self.peak,
            **({} if self.pipeline is None else {"pipeline": self.pipeline.to_json()}),
            **({} if self.deterministic is None else {"deterministic": self.deterministic}),
        }

    def tables(self) -> list:
        """The report as rich tables: communication, then memory."""
        from rich.table import Table

        from meshkit.fmt import fmt_bytes

        comm = Table(
            title=f"plan {self.plan} on {_mesh_text(self.mesh)}: communication per step (ring model)",
            title_justify="left",
        )
        for c in ("op", "axes", "runs", "measured/device", "model", "ratio", ""):
            comm.add_column(c, justify="left" if c in ("op", "axes") else "right")
        for r in self.communication:
            comm.add_row(
                r.op,
                r.axes,
                str(r.measured_runs),
                fmt_bytes(r.measured_traffic_bytes),
                fmt_bytes(r.model_traffic_bytes),
                "-" if r.ratio is None else f"{r.ratio:.4f}",
                "ok" if r.ok else "FAIL",
            )
        mem = Table(title="per-device memory", title_justify="left")
        for c in ("component", "measured", "formula", "ratio", ""):
            mem.add_column(c, justify="left" if c == "component" else "right")
        for m in self.memory:
            mem.add_row(
                m.component,
                fmt_bytes(m.measured_bytes),
                fmt_bytes(m.formula_bytes),
                "-" if m.ratio is None else f"{m.ratio:.4f}",
                "ok" if m.ok else "FAIL",
            )
        cm = self.compiled_memory
        mem.add_row("compiled: arguments", fmt_bytes(cm.argument_bytes), "", "", "")
        mem.add_row("compiled: temporaries", fmt_bytes(cm.temp_bytes), "", "", "")
        return [comm, mem] + ([] if self.pipeline is None else [self.pipeline.table()])

    def __rich__(self):
        from rich.console import Group
        from rich.text import Text

        verdict = Text("ok" if self.ok else "FAIL: measured differs from the model", style="bold")
        extra = [] if self.deterministic is None else [Text(deterministic_line(self.deterministic))]
        return Group(*self.tables(), *extra, verdict)

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=110, no_color=True, force_terminal=False, record=True, file=_Null())
        console.print(self)
        return console.export_text().rstrip() + "\n"


def deterministic_line(det: Mapping[str, Any]) -> str:
    """One line: a deterministic run's micro-shards and its price in bytes beside the normal plan's."""
    from meshkit.fmt import fmt_bytes

    ratio = det.get("bytes_ratio")
    price = (
        ""
        if ratio is None
        else f" ({ratio:.2f}x the plan's normal {fmt_bytes(det['normal_bytes_per_step'])})"
    )
    return (
        f"deterministic: {det['shards']} micro-shards ({det['shards_per_device']} per device) summed in one "
        f"fixed tree; {fmt_bytes(det['bytes_per_step'])} per device per step{price}"
    )


class _Null:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())
