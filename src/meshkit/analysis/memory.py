"""The memory ledger: per-device bytes the compiler reserves for a program (``memory_analysis()``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from meshkit._errors import MeshkitError


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryLedger:
    """Per-device memory of one compiled program, in bytes."""

    argument_bytes: int
    """Inputs (parameters, optimizer state, batch) resident on each device."""
    output_bytes: int
    """Outputs allocated by the program."""
    alias_bytes: int
    """Outputs that reuse (alias) donated input buffers."""
    temp_bytes: int
    """Temporaries (activations, gathered parameters, gradients before update)."""
    generated_code_bytes: int
    """Compiled code."""
    peak_bytes: int | None = None
    """Peak the compiler reports, where the backend states one."""

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs - aliased + temporaries + code: what the program needs at once."""
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.generated_code_bytes
        )

    def to_json(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def memory(x: Any) -> MemoryLedger:
    """Read ``memory_analysis()`` of a ``jax.stages.Compiled`` (a ``Lowered`` is compiled first)."""
    import jax  # here, so that importing meshkit.analysis does not start JAX

    if isinstance(x, jax.stages.Lowered):
        x = x.compile()
    if not isinstance(x, jax.stages.Compiled):
        raise MeshkitError(
            f"cannot read memory from a {type(x).__name__}: pass jitted.lower(*args).compile() "
            f"(HLO text carries no buffer assignment)"
        )
    stats = x.memory_analysis()
    if stats is None:
        raise MeshkitError("this backend reports no memory_analysis() for the program")
    peak = getattr(stats, "peak_memory_in_bytes", None)
    return MemoryLedger(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
        peak_bytes=int(peak) if peak else None,
    )
