"""The planner's vocabulary: a parallel layout by its degrees, and the ``ParallelSpec`` that runs it.

A ``Layout`` is what the planner enumerates and prices on a cluster far larger than this machine:
the data part's degree (dp) and ZeRO stage, a degree for every axis of ``meshkit.spec.AXIS_RULES``
(today tensor tp, pipeline pp, context cp and expert ep parallelism, named by their rows' tokens), the
micro-batch size, and the spec's pipeline schedule and remat policy (their allowed values are
``meshkit.spec``'s). ``to_spec`` is the one conversion into the ``ParallelSpec`` meshkit trains
and compiles with; a layout meshkit has no plan for (ZeRO-1 combined with tensor parallelism) can
still be predicted, and converting it is refused in one line.

The device count is ``dp x tp x pp x cp x ep``: the expert axis doubles as a data axis for the
layers that are not experts (the batch splits over ``dp x ep``, as MaxText's and torchtitan's expert
axis and meshkit's plans ``ep`` / ``dp+ep`` split it), and holds ``experts / ep`` of each layer's
experts; the context axis splits every sequence (the batch splits over dp and ep only). Mesh order,
outermost first: stage, data, expert, context, model (Megatron's: tensor innermost, then context,
expert, data, pipeline).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

from meshkit._errors import MeshkitError
from meshkit.models.shape import ModelShape
from meshkit.spec import (
    AXES,
    DATA,
    REPLICA,
    STAGE,
    ParallelSpec,
    check_remat,
    check_schedule,
    data_part,
    plan_for,
    refusal,
)
from meshkit.spec import plans as spec_plans


def _rules() -> tuple:
    """``meshkit.spec.AXIS_RULES`` as it is now (read at each use: a row added is a degree)."""
    return spec_plans.AXIS_RULES


def degree_names() -> tuple[str, ...]:
    """The degrees ``--layout`` names: data parallelism's and one per axis of ``meshkit.spec.AXIS_RULES``
    (by the axis's token)."""
    return ("dp", *(rule.token for rule in _rules()))


def mesh_order() -> tuple[str, ...]:
    """Every axis in mesh order, outermost first: ``meshkit.spec.AXES``, after any axis of a row that
    list does not name (outermost)."""
    return (*(r.axis for r in _rules() if r.axis not in AXES), *AXES)


_LABELLED = ("dp", "tp", "pp")
"""The degrees a label always names (the classic 3D layout); the others where they are more than 1."""

__all__ = ["Layout", "ModelShape"]


def _tokens() -> dict[str, str]:
    """Each axis by the name ``--layout`` gives its degree (``tp``: the model axis)."""
    return _token_map(_rules())


@functools.lru_cache(maxsize=8)  # the search reads degrees of every layout it prices
def _token_map(rules: tuple) -> dict[str, str]:
    return {rule.token: rule.axis for rule in rules}


@dataclass(frozen=True, slots=True, init=False)
class Layout:
    """One parallel layout: the data part's degree (dp) and ZeRO stage, a degree per axis of
    ``meshkit.spec.AXIS_RULES`` (keyword arguments by the axis's token: ``Layout(dp=8, tp=4, pp=2)``;
    ``layout.tp`` reads one, ``degree(axis)`` by mesh axis), micro-batch size and pipeline schedule, and
    activation checkpointing. A new axis's row gives it a degree here without a line of this module."""

    dp: int
    degrees: tuple[tuple[str, int], ...]
    """The degree of every axis of ``AXIS_RULES``, by mesh axis, in their order."""
    zero: int
    """0 (replicated, plain data parallel), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters, FSDP)."""
    microbatch_size: int
    """Sequences per micro-batch per data-parallel replica (pipeline: per micro-batch in flight)."""
    schedule: str
    """The pipeline schedule (``meshkit.spec.PIPELINE_SCHEDULES``)."""
    virtual_stages: int
    remat: str
    """Activation checkpointing (``meshkit.spec.REMAT_POLICIES``, or an alias other tools use)."""
    shard_group: int
    """ZeRO-3 over groups of this many data-parallel devices, replicated across the dp / shard_group
    groups (hybrid sharding: meshkit's plan hsdp on mesh ``replica=dp/g,data=g``); 0: all of dp."""

    def __init__(self, *, dp: int = 1, zero: int = 0, microbatch_size: int = 1, schedule: str = "1f1b",
                 virtual_stages: int = 1, remat: str = "none", shard_group: int = 0, **axes: int) -> None:  # fmt: skip
        unknown = sorted(set(axes) - set(_tokens()))
        if unknown:
            raise MeshkitError(f"layout has no degree {unknown[0]}: give {', '.join(degree_names())}")
        for name, value in (("dp", dp), *axes.items(), ("microbatch_size", microbatch_size),
                            ("virtual_stages", virtual_stages), ("zero", zero), ("shard_group", shard_group)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # int(2.5) would be 2
                raise MeshkitError(f"layout {name}={value!r}: give a whole number")
            if value < 1 and name not in ("zero", "shard_group"):
                raise MeshkitError(f"layout {name}={value}: must be at least 1")
        degrees = tuple((axis, int(axes.get(token, 1))) for token, axis in _tokens().items())
        if shard_group < 0:
            raise MeshkitError(f"layout shard_group={shard_group}: give 0 (all of dp) or a group size")
        if zero not in (0, 1, 2, 3):
            raise MeshkitError(f"layout zero={zero}: choose 0, 1, 2 or 3")
        check_schedule(schedule, virtual_stages)
        fields = dict(dp=dp, degrees=degrees, zero=zero, microbatch_size=microbatch_size, schedule=schedule,
                      virtual_stages=virtual_stages, remat=check_remat(remat), shard_group=shard_group)  # fmt: skip
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> int:
        """An axis's degree by its token (``layout.tp``, ``layout.ep``)."""
        axis = _tokens().get(name)
        if axis is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.degree(axis)

    def degree(self, axis: str) -> int:
        """Devices on mesh ``axis`` (``data``: dp, the replicas of hybrid sharding with it; 1 where unused)."""
        if axis == DATA:
            return self.dp
        return dict(self.degrees).get(axis, 1)

    def inner(self, axis: str) -> int:
        """Devices between two neighbours on ``axis``: the product of the degrees of the axes inside it
        in mesh order (``meshkit.spec.AXES``, outermost first; the replica axis is inside dp)."""
        order = mesh_order()
        after = order[order.index(axis) + 1 :]
        return math.prod(self.degree(a) for a in after if a != REPLICA)

    def options(self) -> dict:
        """The keyword arguments that build this layout again (``Layout(**layout.options())``)."""
        tokens = {rule.token: self.degree(rule.axis) for rule in _rules()}
        return dict(dp=self.dp, **tokens, zero=self.zero, microbatch_size=self.microbatch_size,
                    schedule=self.schedule, virtual_stages=self.virtual_stages, remat=self.remat,
                    shard_group=self.shard_group)  # fmt: skip

    @property
    def hybrid(self) -> bool:
        """Whether ZeRO-3 shards over groups smaller than dp (and replicates across them)."""
        return self.zero == 3 and 0 < self.shard_group < self.dp

    @property
    def devices(self) -> int:
        return self.dp * math.prod(n for _, n in self.degrees)

    @property
    def batch_ways(self) -> int:
        """Devices the batch splits over: dp and every axis whose row splits rows (``AxisRule.splits``: the
        expert axis, a data axis outside the experts)."""
        return self.dp * math.prod(self.degree(r.axis) for r in _rules() if r.splits == "rows")

    @property
    def sequence_ways(self) -> int:
        """Devices every sequence splits over: the axes whose row splits sequences (the context axis)."""
        return math.prod(self.degree(r.axis) for r in _rules() if r.splits == "sequence")

    @property
    def batch_group(self) -> int:
        """Devices holding the same dense parameters, whose gradients are summed over all of them: dp and
        every axis that splits rows or sequences (dp x ep x cp)."""
        return self.batch_ways * self.sequence_ways

    @classmethod
    def parse(cls, text: str, **options) -> Layout:
        """``"dp=24,tp=8,pp=8"`` or ``"dp=4,tp=8,pp=16,cp=16"`` (any order; a missing degree is 1),
        plus keyword ``options``."""
        degrees: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in degree_names() or not value.strip().isdigit():
                raise MeshkitError(
                    f"bad layout part {part!r}: write e.g. dp=24,tp=8,pp=8 (degrees {', '.join(degree_names())})"
                )
            if key in degrees:
                raise MeshkitError(f"layout {text!r} gives {key} twice")
            degrees[key] = int(value)
        return cls(**degrees, **options)

    @classmethod
    def from_spec(cls, spec: ParallelSpec, devices: int, global_batch: int) -> Layout:
        """The layout ``spec`` runs over ``devices`` for a global batch of ``global_batch`` sequences
        (``to_spec``'s inverse); raises where the batch does not divide over its devices and steps."""
        sizes, plan = spec.degrees(devices), spec.plan_info
        group, replicas = sizes[DATA], sizes[REPLICA]  # hsdp: the batch over replica x data
        steps = (spec.microbatches or sizes[STAGE]) if plan.pipeline else spec.accumulate
        degrees = {rule.token: sizes[rule.axis] for rule in _rules()}
        rows = math.prod(sizes[r.axis] for r in _rules() if r.splits == "rows")  # the expert axis's
        unit = group * replicas * rows * steps
        if global_batch % unit:
            raise MeshkitError(f"global batch {global_batch} does not divide over {unit} rows of {spec.plan}")
        return cls(dp=group * replicas, zero=plan.level, microbatch_size=global_batch // unit,
                   schedule=spec.schedule_name, virtual_stages=spec.virtual_stages, remat=spec.remat,
                   shard_group=group if replicas > 1 else 0, **degrees)  # fmt: skip

    def replace(self, **changes) -> Layout:
        return Layout(**{**self.options(), **changes})

    @property
    def axis_degrees(self) -> dict[str, int]:
        """The degree of every axis of ``meshkit.spec.AXIS_RULES``, by mesh axis (``{"model": tp, ...}``)."""
        return dict(self.degrees)

    def plan_name(self) -> str:
        """The name meshkit's plan for this layout has or would have (``dp+cp``, ``fsdp+cp``, ``ep``,
        ``dp+ep``...: the data part, then the axes in ``AXIS_RULES``'s order), whether or not
        ``meshkit.spec.PLANS`` has it."""
        plan = self.meshkit_plan()
        if plan is not None:
            return plan
        data = data_part(self.zero, hybrid=self.hybrid) or f"zero{self.zero}"
        if self.zero and self.dp == 1:  # the stage asked for, over no data axis
            data = f"zero{self.zero}"
        axes = [r.token for r in _rules() if self.axis_degrees[r.axis] > 1]
        parts = [data] * (self.dp > 1 or self.zero > 0) + axes
        return "+".join(parts or ["dp"])

    def meshkit_plan(self) -> str | None:
        """The meshkit plan that executes this layout, or None where meshkit has none."""
        axes = [axis for axis, n in self.axis_degrees.items() if n > 1]
        return plan_for(self.zero, data=self.dp > 1, hybrid=self.hybrid, axes=axes)

    def mesh_spec(self) -> str:
        """meshkit's mesh string for this layout, axes named as the plans name them."""
        g = self.shard_group if self.hybrid else self.dp
        sizes = {REPLICA: self.dp // g, DATA: g, **self.axis_degrees}
        kept = [f"{axis}={sizes[axis]}" for axis in mesh_order() if sizes.get(axis, 1) > 1] or ["data=1"]
        return ",".join(kept)

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step: ``global_batch / (dp x ep x microbatch_size)`` (pipeline
        micro-batches, or gradient accumulation without a pipeline); raises where it does not divide."""
        unit = self.batch_ways * self.microbatch_size
        if global_batch % unit:
            rows = "".join(f" x {r.token}={self.degree(r.axis)}" for r in _rules()
                           if r.splits == "rows" and self.degree(r.axis) > 1)  # fmt: skip
            raise MeshkitError(
                f"global batch {global_batch} does not divide over dp={self.dp}{rows} x microbatch size "
                f"{self.microbatch_size}: use a multiple of {unit}"
            )
        return global_batch // unit

    def to_spec(
        self, global_batch: int, precision: str = "fp32", *, sequence_parallel: bool = False
    ) -> ParallelSpec:
        """The ``ParallelSpec`` that runs this layout for a global batch of ``global_batch`` sequences
        (``sequence_parallel``: Megatron's, under its model axis)."""
        plan = self.meshkit_plan()
        if plan is None:
            name = self.plan_name()
            one = self.zero and self.dp == 1
            why = (
                f"zero{self.zero} over a data axis of one device shards nothing (use zero=0)"
                if one
                else refusal(name)
            )
            raise MeshkitError(
                f"meshkit has no plan {name} for {self.label()}: {why or 'no such plan'}; price it with meshkit "
                f"plan, run a layout one of meshkit's plans covers"
            )
        m = self.microbatches(global_batch)
        pipe = self.pp > 1
        return ParallelSpec(plan=plan, mesh=self.mesh_spec(), remat=self.remat, precision=precision,
                            accumulate=1 if pipe else m, microbatches=m if pipe else None,
                            pipeline_schedule=self.schedule if pipe else None,
                            virtual_stages=self.virtual_stages if pipe else 1,
                            sequence_parallel=sequence_parallel)  # fmt: skip

    def label(self) -> str:
        text = ",".join(
            f"{k}={getattr(self, k)}" for k in degree_names() if k in _LABELLED or getattr(self, k) > 1
        )
        if self.zero:
            text += f" zero{self.zero}"
        text += f" mb={self.microbatch_size}"
        if self.pp > 1:
            text += f" {self.schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if self.remat != "none":
            text += f" remat={self.remat}"
        if self.hybrid:
            text += f" hsdp={self.shard_group}"
        return text

    def to_json(self) -> dict:
        return self.options()
