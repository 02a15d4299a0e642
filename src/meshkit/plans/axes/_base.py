"""What every axis module of ``meshkit.plans.axes`` may say about its axis, and what it says by default.

A plan is its data part and the axes of ``meshkit.spec.AXIS_RULES``; the rows there say how each axis
splits the batch (``AxisRule.splits``) and the leaves (``AxisRule.logical``), from which the step's
gradient region, its batch layout and each leaf's sums follow without any axis's code. An axis module
adds what cannot follow from a row: what is in force while the loss is traced on it (the sequence split
of context parallelism, the expert split), how it lays out the batch before the region, the collectives
it adds to the ledger's model, and the checks of a run's shapes against its size. The defaults do
nothing, so a module says only what its axis does.

The planner prices the same axes on clusters far larger than this machine: ``flows`` says what the
axis moves per step on the busiest device of a layout (bytes, collectives, their group, the compute
they may hide behind), the planner's network model turns each ``Flow`` into exposed seconds
(``planner.traffic.price``), and ``check_layout`` refuses, in one line, a layout the axis cannot run.
``flows`` reads a ``planner.step.Step`` (the layout, the model's shape, the job, one micro-batch's
compute), passed in: a module here never imports the planner.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from meshkit.plans.placement import Placement

Add = Callable[[str, str, int, float, int, str], None]
"""``add(op, axes, count, size_bytes, group, what)``: one row of the ledger's model (``_expected``):
``count`` executions per step of a collective of ``size_bytes`` over ``axes`` (a group of ``group``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerInputs:
    """What a ledger row is computed from: the placement, the step's micro-batches and what one device
    holds of them (``_expected.expected_collectives``' arguments)."""

    placement: Placement
    accumulate: int
    tokens_per_device: int
    """Tokens of a device's micro-batches per step, whole sequences (before a sequence split)."""
    activation_bytes: int = 4
    batch_fed: frozenset[str] = frozenset()
    gather_itemsize: int | None = None
    per_layer: Any = None
    form: str = "ring"
    segment_bytes: int = 0
    """Bytes per segment id of a batch of packed documents (0: none): a context split exchanges them."""
    quantized: frozenset[str] = frozenset()
    """Paths of the leaves multiplied in int8 (``--quantize``): the model axis all-reduces their scales."""
    norm_scales: frozenset[str] = frozenset()
    """Paths of the leaves that scale a normalised value (``_dataflow.dataflow``): one the model axis splits
    sums its norm's statistics over it."""
    normed: frozenset[str] = frozenset()
    """Paths of the matrices whose products a norm reads (``_dataflow.dataflow``): layer remat recomputes them."""

    @property
    def tokens(self) -> int:
        """A device's tokens per step: ``T / C`` of each of its rows' sequences under a sequence split."""
        return self.tokens_per_device // sequence_split(self.placement)


@dataclass(frozen=True, kw_only=True, slots=True)
class Flow:
    """What one mesh axis moves per step on one device, of one kind: ``nbytes`` in ``count``
    collectives (``op``, each paying its ring's latency) over groups of ``size`` devices ``stride``
    apart, hidden behind ``window`` seconds of compute but for the ``edge`` fraction (1: nothing hides
    it)."""

    axis: str
    """The mesh axis it is reported under (hybrid sharding's gradients across groups: ``replica``)."""
    op: str
    nbytes: float
    count: float
    stride: int
    size: int
    window: float = 0.0
    edge: float = 1.0
    one_nic: bool = False
    """A point-to-point send, through one NIC where the group spans hosts (else k members' NICs)."""
    by_stack: bool = False
    """Run by the software stack's collectives: its NIC use (``Stack.one_nic``) and fitted bandwidth
    fraction (``Calibration.comm_efficiency``) apply."""
    taxed: bool = True
    """What is hidden still costs ``Calibration.overlap_tax`` of its time."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def axis_size(placement: Placement, axis: str) -> int:
    """Devices on ``axis`` where the plan uses it, else 1."""
    return int(placement.mesh.shape.get(axis, 1)) if axis in placement.plan.needs else 1


def sequence_split(placement: Placement) -> int:
    """Devices every sequence is split over (the axes whose rows split sequences: the context axis)."""
    return math.prod(axis_size(placement, a) for a in placement.plan.split_axes("sequence"))


class AxisPlan:
    """The plan side of one mesh axis; a module's instance overrides what its axis does."""

    axis: str = ""

    def size(self, placement: Placement) -> int:
        return axis_size(placement, self.axis)

    @contextlib.contextmanager
    def tracing(self, placement: Placement, per: Any, form: str) -> Iterator[None]:
        """What is in force while the step traces the loss (``_gradients``); checks after the trace."""
        yield

    def arrange(self, batch: Any, placement: Placement) -> Any:
        """The global batch as the step's region splits it (in the global view, before the region)."""
        return batch

    def ledger(self, add: Add, inputs: LedgerInputs) -> None:
        """The collectives the axis adds to a step, per the ring model (``_expected``)."""

    def held_beyond_device(
        self, placement: Placement, sizes: list[float], found: Any, *, zero3: bool
    ) -> float:
        """Bytes the peak model's one-device compile of the loss holds that a device under the axis's split
        does not (``plans.peak``; ``sizes``: each parameter leaf's bytes, whole)."""
        return 0.0

    def flows(self, step: Any) -> list[Flow]:
        """What the axis moves per step on the busiest device of ``step.layout`` (a ``planner.step.Step``),
        by the ring model; nothing where the layout does not use the axis."""
        return []

    def search_degrees(self, shape: Any, cluster: Any, job: Any, devices: int) -> list[int]:
        """The degrees the planner's search tries on ``devices`` devices (``planner.cluster.Cluster``'s;
        each divides them); only 1 by default: a new axis is priced where ``--layout`` names it."""
        return [1]

    def check_layout(self, shape: Any, layout: Any, job: Any) -> str | None:
        """Why the planner's ``layout`` cannot run a model of ``shape`` (``models.shape.ModelShape``) for
        ``job`` (``planner.cluster.Job``) on this axis (one line), or None."""
        return None

    def check_run(self, size: int, *, seq_len: int, heads: int, experts: int, form: str) -> None:
        """Refuse, in one line, a model's shapes that cannot run over ``size`` devices of the axis
        (``meshkit train`` asks before the run directory is written)."""
