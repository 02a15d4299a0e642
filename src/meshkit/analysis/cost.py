"""The cost model of the reference chapter, as functions.

- Ring-algorithm traffic per device (``analysis.ring``, re-exported here).
- Per-device memory and traffic of data parallelism and the ZeRO stages by the ZeRO rule
  (``analysis.zero``), under a declared convention of bytes per parameter for parameters,
  gradients and optimizer state (the chapter's mixed precision Adam: 2 + 2 + 12 = 16 bytes).
- The GPipe pipeline bubble (p-1)/(m+p-1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshkit._errors import MeshkitError
from meshkit.analysis.ring import RING_FACTORS as RING_FACTORS  # re-exported: the formulas' first home
from meshkit.analysis.ring import ring_traffic as ring_traffic
from meshkit.analysis.zero import zero_stage


@dataclass(frozen=True, kw_only=True, slots=True)
class Convention:
    """Bytes per parameter of each persistent component."""

    name: str
    param: float
    """Bytes of the parameter copy used for compute."""
    grad: float
    """Bytes of its gradient."""
    optimizer: float
    """Bytes of optimizer state (including any fp32 master copy)."""
    description: str = ""

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


CONVENTIONS = {
    "mixed-adam": Convention(
        name="mixed-adam",
        param=2,
        grad=2,
        optimizer=12,
        description="fp16/bf16 params and grads, fp32 master + Adam m + v (ZeRO paper, 16 B/param)",
    ),
    "fp32-adam": Convention(
        name="fp32-adam", param=4, grad=4, optimizer=8, description="fp32 params, grads, Adam m + v"
    ),
    "fp32-sgd-momentum": Convention(
        name="fp32-sgd-momentum", param=4, grad=4, optimizer=4, description="fp32 params, grads, momentum"
    ),
    "fp32-sgd": Convention(
        name="fp32-sgd", param=4, grad=4, optimizer=0, description="fp32 params and grads"
    ),
}


def convention(spec: str | Convention) -> Convention:
    """A named convention, or ``"P,G,O"`` bytes per parameter (e.g. ``"2,2,12"``)."""
    if isinstance(spec, Convention):
        return spec
    if spec in CONVENTIONS:
        return CONVENTIONS[spec]
    parts = spec.split(",")
    try:
        p, g, o = (float(x) for x in parts)
    except ValueError:
        raise MeshkitError(
            f"unknown convention {spec!r}: use one of {', '.join(CONVENTIONS)} or bytes per parameter "
            f"as 'param,grad,optimizer', e.g. 2,2,12"
        ) from None
    if min(p, g, o) < 0:
        raise MeshkitError(f"convention {spec!r} has a negative byte count: bytes per parameter are >= 0")
    return Convention(name=spec, param=p, grad=g, optimizer=o, description="user-defined")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """Per-device persistent bytes of one layout."""

    stage: str
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def to_json(self) -> dict:
        return {**asdict(self), "total": self.total}


def zero_memory(
    num_params: float, num_devices: int, stage: str, conv: str | Convention = "mixed-adam"
) -> MemoryModel:
    """Per-device memory of DP / ZeRO-1 / ZeRO-2 / ZeRO-3 (= FSDP), by the ZeRO rule (``analysis.zero``).

    With the 16-byte convention: DP 16Φ, ZeRO-1 4Φ + 12Φ/N, ZeRO-2 2Φ + 14Φ/N, ZeRO-3 16Φ/N.
    """
    c = convention(conv)
    _check(num_params, num_devices)
    rule = zero_stage(stage)
    bytes_of = {"params": c.param, "grads": c.grad, "optimizer": c.optimizer}
    at_rest = {part: rule.at_rest(part, b * num_params, num_devices) for part, b in bytes_of.items()}
    return MemoryModel(stage=stage, **at_rest)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommModel:
    """Per-device bytes sent per step by one layout, and the collectives that carry them."""

    stage: str
    traffic_bytes: float
    collectives: tuple[str, ...]


def zero_communication(
    num_params: float,
    num_devices: int,
    stage: str,
    conv: str | Convention = "mixed-adam",
    regather_in_backward: bool = True,
) -> CommModel:
    """Per-device gradient-sync traffic per step under the ring model.

    DP all-reduces the gradients: 2(N-1)/N * S. ZeRO-1/2 reduce-scatter the gradients and
    all-gather the updated parameters: the same total. ZeRO-3 all-gathers the parameters for the
    forward pass, again for the backward pass (unless kept), and reduce-scatters the gradients:
    3(N-1)/N * S (2(N-1)/N * S when the gathered parameters are kept).
    """
    c = convention(conv)
    _check(num_params, num_devices)
    rule = zero_stage(stage)
    rows = rule.collectives(
        c.grad * num_params, c.param * num_params, gathers=2 if regather_in_backward else 1
    )
    return CommModel(
        stage=stage,
        traffic_bytes=sum(r.traffic(num_devices) for r in rows),
        collectives=tuple(r.op for r in rows),
    )


def bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe schedule with ``stages`` stages and ``microbatches`` micro-batches."""
    if stages < 1 or microbatches < 1:
        raise MeshkitError(
            f"pipeline needs at least 1 stage and 1 micro-batch, got p={stages}, m={microbatches}"
        )
    return (stages - 1) / (microbatches + stages - 1)


def _check(num_params: float, num_devices: int) -> None:
    if num_params <= 0:
        raise MeshkitError(f"parameter count must be positive, got {num_params}")
    if num_devices < 1 or int(num_devices) != num_devices:
        raise MeshkitError(f"device count must be a positive whole number, got {num_devices}")
