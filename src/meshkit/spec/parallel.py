"""``ParallelSpec``: one choice of plan, mesh and every option a plan runs with, checked when it is made."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshkit.spec.plans import (
    PIPELINE_PLANS,
    Plan,
    check_axes,
    check_deterministic_plan,
    check_remat,
    get_plan,
)
from meshkit.spec.values import (
    ATTENTION_IMPLEMENTATIONS,
    AUTO,
    AXES,
    CONTEXT_ATTENTION,
    DATA,
    PRECISIONS,
    PlanError,
    _one_of,
    _positive,
    check_deterministic,
    check_schedule,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelSpec:
    """How a step is laid out: the plan, the mesh, and what the plan is run with."""

    plan: str = "dp"
    """A name of ``PLANS``, or 'auto' (the planner chooses, before the step is built)."""
    mesh: str | None = None
    """Mesh axes and sizes such as 'data=4,model=2' (-1 for one axis: every device left);
    None: the plan's default mesh over all devices."""
    remat: str = "none"
    """Activation checkpointing per layer: one of ``REMAT_POLICIES`` (aliases ``REMAT_ALIASES``)."""
    precision: str | None = None
    """Compute precision: one of ``PRECISIONS``; ZeRO-3 then gathers in the compute dtype. None: the
    parameters' own dtype in the Trainer; ``meshkit train`` resolves it by platform (``PLATFORM_PRECISION``)."""
    accumulate: int = 1
    """Micro-batches accumulated per optimizer step (plans without a pipeline)."""
    microbatches: int | None = None
    """Pipeline plans: micro-batches per step; None: one per stage."""
    pipeline_schedule: str | None = None
    """Pipeline plans: one of ``PIPELINE_SCHEDULES``; None: 1f1b."""
    virtual_stages: int = 1
    """Interleaved schedule: chunks of layers per device."""
    context_attention: str = "ring"
    """Context plans: one of ``CONTEXT_ATTENTION``."""
    attention: str = "auto"
    """How each device attends: one of ``ATTENTION_IMPLEMENTATIONS`` (``plans.attention``)."""
    deterministic: bool | int | None = None
    """Deterministic mode (``plans._deterministic``): the global batch cut into this many micro-shards
    (a power of two, at least the batch devices), their gradients summed in one fixed tree whatever the
    mesh, so that the step's bits do not depend on the device count; True means ``DETERMINISTIC_SHARDS``;
    None (or False): off."""

    def __post_init__(self) -> None:
        plan = None if self.plan == AUTO else get_plan(self.plan)
        object.__setattr__(self, "remat", check_remat(self.remat, plan))
        _one_of("precision", self.precision, PRECISIONS) if self.precision is not None else None
        _positive("accumulate", self.accumulate)
        _positive("microbatches", self.microbatches, none_ok=True)
        _positive("virtual_stages", self.virtual_stages)
        check_schedule(self.schedule_name, self.virtual_stages)
        _one_of("context_attention", self.context_attention, CONTEXT_ATTENTION)
        _one_of("attention", self.attention, ATTENTION_IMPLEMENTATIONS)
        object.__setattr__(self, "deterministic", check_deterministic(self.deterministic))
        if self.mesh is not None:
            from meshkit.mesh import parse_mesh_spec

            text = ",".join(f"{n}={s}" for n, s in parse_mesh_spec(self.mesh))
            object.__setattr__(self, "mesh", text)
        if plan is not None:
            self._check_plan(plan)

    def _check_plan(self, plan: Plan) -> None:
        if plan.pipeline:
            if self.accumulate != 1:
                raise PlanError(
                    f"plan {plan.name} takes microbatches, not accumulate: set microbatches "
                    f"{self.accumulate * (self.microbatches or 1)} and accumulate 1"
                )
        elif self.microbatches is not None or self.pipeline_schedule is not None or self.virtual_stages != 1:
            raise PlanError(
                f"microbatches, schedule and virtual_stages are for pipeline plans ({', '.join(PIPELINE_PLANS)}), "
                f"not {plan.name}; use accumulate for micro-batches"
            )
        if self.mesh is not None:
            from meshkit.mesh import parse_mesh_spec

            check_axes(plan, dict(parse_mesh_spec(self.mesh)))
        if self.deterministic is not None:
            check_deterministic_plan(plan, self.accumulate)

    @classmethod
    def of(cls, spec: ParallelSpec | None = None, **options: Any) -> ParallelSpec:
        """``spec``, or the spec the keyword ``options`` make (those given as None are left to their
        defaults); giving both is refused."""
        given = {k: v for k, v in options.items() if v is not None}
        if spec is None:
            return cls(**given)
        if given:
            raise PlanError(f"give spec= or the options it holds ({', '.join(sorted(given))}), not both")
        if not isinstance(spec, ParallelSpec):
            raise PlanError(f"spec must be a meshkit.ParallelSpec, got {type(spec).__name__}")
        return spec

    # -- what the spec means ------------------------------------------------------------------
    @property
    def plan_info(self) -> Plan:
        if self.plan == AUTO:
            raise PlanError("plan 'auto' is chosen by the planner before a step is built: resolve it first")
        return get_plan(self.plan)  # (a name in another order, cp+tp, is its canonical plan's)

    @property
    def mesh_text(self) -> str:
        """The mesh as given, or the plan's default."""
        return self.mesh if self.mesh is not None else self.plan_info.default_mesh

    @property
    def compute_dtype(self) -> str | None:
        return PRECISIONS.get(self.precision)

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule that runs (1f1b unless given)."""
        return self.pipeline_schedule or "1f1b"

    def mesh_sizes(self, device_count: int) -> dict[str, int]:
        """Axis -> size over ``device_count`` devices (the -1 axis filled in)."""
        from meshkit.mesh import resolve_mesh_shape

        return dict(resolve_mesh_shape(self.mesh_text, device_count))

    def degrees(self, device_count: int) -> dict[str, int]:
        """Devices per axis, every plan axis named (1 where the mesh lacks it)."""
        sizes = self.mesh_sizes(device_count)
        return {axis: int(sizes.get(axis, 1)) for axis in AXES}

    def check_examples(self, examples: int, data: int, microbatches: int) -> None:
        """A global batch of ``examples`` must split over the data axis (``data``: the devices the batch
        is split over, replica x data under hybrid sharding), then into micro-batches: the one place the
        rule is checked, for a library step and ``meshkit train``'s ``--batch-size`` alike (named by the
        spec's own option, ``accumulate`` or ``microbatches``)."""
        what = "microbatches" if self.plan_info.pipeline else "accumulate"
        axes = " x ".join(self.plan_info.batch_axes) or DATA
        unit = data * microbatches
        if examples % unit:
            fit = max(unit, examples // unit * unit)
            fewer = f" or a smaller {what}" if microbatches > 1 else ""
            raise PlanError(
                f"a global batch of {examples} examples does not divide over {axes}={data} x {what}={microbatches}: "
                f"use a batch of {fit} (a multiple of {unit}){fewer}"
            )

    def replace(self, **changes: Any) -> ParallelSpec:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParallelSpec:
        unknown = sorted(set(data) - set(cls.fields()))
        if unknown:
            raise PlanError(
                f"unknown parallel option(s) {unknown}: the options are {', '.join(cls.fields())}"
            )
        return cls(**data)
