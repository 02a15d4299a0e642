"""What the planner plans for: a cluster (devices of one kind, so many to a host) and a training
job (batch, precision, optimizer state, which runtime and software stack to model)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.analysis.cost import Convention, convention
from meshkit.planner.hardware import Hardware
from meshkit.planner.stacks import STACKS
from meshkit.spec import CONTEXT_ATTENTION, SEQUENCE_PARALLEL_PLANS, one_of
from meshkit.spec import PRECISIONS as SPEC_PRECISIONS

RUNTIMES = ("standard", "meshkit")
PRECISIONS = tuple(SPEC_PRECISIONS)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """``devices`` accelerators of one kind, ``devices_per_host`` to a host (default: the node's)."""

    hardware: Hardware
    devices: int
    devices_per_host: int = 0

    def __post_init__(self):
        if self.devices_per_host == 0:
            object.__setattr__(self, "devices_per_host", self.hardware.devices_per_host)
        if self.devices < 1 or self.devices_per_host < 1:
            raise MeshkitError(f"devices={self.devices}, devices per host={self.devices_per_host}: need >= 1")
        if self.devices > self.devices_per_host and self.devices % self.devices_per_host:
            raise MeshkitError(
                f"{self.devices} devices is not a whole number of hosts of {self.devices_per_host}: "
                f"use a multiple of {self.devices_per_host} or set --devices-per-host"
            )

    @property
    def hosts(self) -> int:
        return max(1, self.devices // self.devices_per_host)


def sequence_split(layout: Any, runtime: str = "meshkit") -> int:
    """The ways sequence parallelism splits ``layout``'s activations between tensor-parallel matmuls in
    ``runtime``: tp (Megatron's under any layout; meshkit's where its plan for the layout takes it,
    ``meshkit.spec.SEQUENCE_PARALLEL_PLANS``: no pipeline, no expert axis)."""
    if runtime == "meshkit" and layout.meshkit_plan() not in SEQUENCE_PARALLEL_PLANS:
        return 1
    return layout.tp


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """The training job: sequences per step, precision, optimizer state, and whose runtime to model."""

    global_batch: int
    precision: str = "bf16"
    optimizer_bytes: float | None = None
    """Optimizer state bytes per parameter (fp32 master + Adam moments: 12 in bf16; 8 in fp32)."""
    flash_attention: bool = True
    """Attention without a materialised S x S score matrix (no S^2 activation memory)."""
    sequence_parallel: bool = True
    """Under tensor parallelism, the activations between the tensor-parallel matmuls (norms,
    residuals, dropout) split over the sequence across tp (Megatron-LM's sequence parallelism;
    MaxText's and PaLM's sharded activations): replicated activations shrink by tp, the bytes
    moved stay (all-reduce = reduce-scatter + all-gather). meshkit's plans run it without a pipeline
    (``ParallelSpec.sequence_parallel``): ``sequence_split``."""
    tp_overlap: float = 0.0
    """Fraction of the tensor-parallel all-reduces hidden behind the matmuls (0: on the critical
    path, Megatron-LM's classic TP; 1: overlapped, Megatron-Core's --tp-comm-overlap, up to the
    compute time)."""
    dropout: bool = False
    """Dropout masks stored for the backward pass (1 byte per element after attention and MLP)."""
    runtime: str = "standard"
    """``standard`` (Megatron-style implementation) or ``meshkit`` (meshkit's compiled programs)."""
    stack: str = "maxtext-xla"
    """The software whose efficiency to assume (``STACKS``); JAX/XLA, what meshkit runs, by default."""
    context_attention: str = "ring"
    """Context parallelism's attention (``meshkit.spec.CONTEXT_ATTENTION``): K/V blocks passed round
    the ring (hidden behind the attention they feed), or all-to-all from a sequence split to a head
    split and back (exposed)."""

    def __post_init__(self):
        if self.global_batch < 1:
            raise MeshkitError(f"global batch {self.global_batch}: must be at least 1 sequence")
        if self.precision not in PRECISIONS:
            raise MeshkitError(f"unknown precision {self.precision!r}: choose {one_of(PRECISIONS)}")
        if self.optimizer_bytes is not None and not 0 <= self.optimizer_bytes < math.inf:
            raise MeshkitError(f"optimizer bytes per parameter {self.optimizer_bytes}: a finite number >= 0")
        if not 0.0 <= self.tp_overlap <= 1.0:
            raise MeshkitError(f"tp_overlap {self.tp_overlap}: a fraction between 0 and 1")
        if self.runtime not in RUNTIMES:
            raise MeshkitError(f"unknown runtime {self.runtime!r}: choose one of {', '.join(RUNTIMES)}")
        if self.context_attention not in CONTEXT_ATTENTION:
            raise MeshkitError(
                f"unknown context attention {self.context_attention!r}: choose one of {', '.join(CONTEXT_ATTENTION)}"
            )
        if self.stack not in STACKS:
            raise MeshkitError(f"unknown software stack {self.stack!r}: choose one of {', '.join(STACKS)}")

    def sequence_split(self, layout: Any) -> int:
        """The ways ``layout``'s activations between tensor-parallel matmuls split under sequence
        parallelism: ``sequence_split`` of the job's runtime where it runs it, else 1."""
        return sequence_split(layout, self.runtime) if self.sequence_parallel else 1

    @property
    def convention(self) -> Convention:
        """Bytes per parameter: mixed-precision Adam in bf16 (2 + 2 + 12), fp32 Adam (4 + 4 + 8);
        meshkit's programs keep float32 parameters and gradients in either precision."""
        bf16 = self.precision == "bf16" and self.runtime != "meshkit"
        base = convention("mixed-adam" if bf16 else "fp32-adam")
        if self.optimizer_bytes is None:
            return base
        return convention(f"{base.param:g},{base.grad:g},{self.optimizer_bytes:g}")

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element (the compute dtype)."""
        return 2 if self.precision == "bf16" else 4
