"""A pipeline step's report: the schedule it executed beside the bubble model, and its activation
memory beside the compiler's temporaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineReport:
    """The executed schedule beside the model: bubble, and activation memory beside the compiler's temporaries."""

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int
    ticks: int
    bubble_model: float
    """``(p - 1) / (v m + p - 1)``: idle ticks over all ticks of the step (see ``_schedule``)."""
    bubble_measured: float | None
    """Idle ticks over all ticks in the record the last step returned (None before a step)."""
    executed_as_planned: bool | None
    stash_slots: int
    cotangent_slots: int
    activation_bytes: int
    """One micro-batch's activation on one device."""
    activation_model_bytes: float
    """Activation memory of the schedule: (stash slots + cotangent slots + 2 scratch) x activation."""
    temp_bytes: float
    """The compiled step's temporaries (memory_analysis), which hold the stash among other buffers."""
    remat: str = "none"
    working_model_bytes: float = 0.0
    """One backward tick's residuals through its chunk under ``remat`` (``Pipeline.working_bytes``)."""
    record: Any = None

    @property
    def ok(self) -> bool:
        return (
            self.bubble_measured is not None
            and abs(self.bubble_measured - self.bubble_model) < 1e-12
            and bool(self.executed_as_planned)
        )

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "record"}
        return {**out, "ok": self.ok, "record": None if self.record is None else self.record.tolist()}

    def table(self) -> Any:
        from rich.table import Table

        from meshkit.fmt import fmt_bytes

        t = Table(
            title=f"pipeline: {self.schedule}, stage={self.stages}, microbatches={self.microbatches}, "
            f"virtual stages={self.virtual_stages}, {self.ticks} ticks",
            title_justify="left",
        )
        for c in ("quantity", "measured", "model", ""):
            t.add_column(c, justify="left" if c == "quantity" else "right")
        measured = "-" if self.bubble_measured is None else f"{self.bubble_measured:.4f}"
        t.add_row(
            "bubble (idle ticks / ticks)", measured, f"{self.bubble_model:.4f}", "ok" if self.ok else "FAIL"
        )
        t.add_row("executed record = schedule table", str(self.executed_as_planned), "True", "")
        t.add_row(
            f"activations in flight ({self.stash_slots} stash + {self.cotangent_slots} cotangent slots)",
            fmt_bytes(self.temp_bytes) + " temps",
            fmt_bytes(self.activation_model_bytes),
            "",
        )
        t.add_row(
            f"backward tick's residuals (remat {self.remat})", "", fmt_bytes(self.working_model_bytes), ""
        )
        return t
