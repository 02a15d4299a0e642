"""``ParallelSpec``: one choice of plan, mesh and every option a plan runs with, checked when it is made."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshkit.spec.plans import (
    DETERMINISTIC_PLANS,
    PIPELINE_PLANS,
    SEQUENCE_PARALLEL_PLANS,
    Plan,
    check_axes,
    check_deterministic_plan,
    check_remat,
    describe_plans,
    get_plan,
)
from meshkit.spec.values import (
    ATTENTION_IMPLEMENTATIONS,
    AUTO,
    AXES,
    CONTEXT_ATTENTION,
    DATA,
    PIPELINE_SCHEDULES,
    PLATFORM_PRECISION,
    PRECISIONS,
    REMAT_POLICIES,
    PlanError,
    _one_of,
    _positive,
    check_deterministic,
    check_schedule,
    one_of,
)


def option(
    default: Any,
    *,
    help: str | None = None,
    fixes: str | None = None,
    shown: str | None = None,
    flags: tuple[str, ...] = (),
    later: bool = False,
    least: float | None = None,
    above: float | None = None,
    note: str = "",
) -> Any:
    """A field of a config dataclass with what every place that lists options asks of it, so that they all
    follow from the dataclass: ``help``, what ``meshkit train --help`` says (None: no flag; a config file
    or ``--set`` gives it); ``fixes``, what a run fixes by it (``--resume`` refuses a change, naming this)
    or None (a resumed run may change it); ``shown``, the default as help shows it (None: the presets');
    ``flags``, the flags where they are not ``--name`` (``--name/--no-name`` for a bool); ``later``, added
    after configs were first written (a saved config without it ran with its default); ``least`` and
    ``above``, its bounds (a number must be at least, or above, that; a float also finite), ``note`` what
    the refusal adds ('0: full fine-tuning')."""
    meta = {
        "help": help,
        "fixes": fixes,
        "shown": shown,
        "flags": flags,
        "later": later,
        "least": least,
        "above": above,
        "note": note,
    }
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelSpec:
    """How a step is laid out: the plan, the mesh, and what the plan is run with."""

    plan: str = option(
        "dp",
        help=f"{describe_plans()}; auto: the planner's fastest predicted layout for the run's "
        "model on the devices present.",
    )
    """A name of ``PLANS``, or 'auto' (the planner chooses, before the step is built)."""
    mesh: str | None = option(
        None, help="e.g. data=8 or data=4,model=2.", shown="the plan's, over all devices"
    )
    """Mesh axes and sizes such as 'data=4,model=2' (-1 for one axis: every device left);
    None: the plan's default mesh over all devices."""
    remat: str = option("none", help=f"Activation checkpointing per block: {one_of(REMAT_POLICIES)}.")
    """Activation checkpointing per layer: one of ``REMAT_POLICIES`` (aliases ``REMAT_ALIASES``)."""
    sequence_parallel: bool = option(
        False,
        help="Tensor-parallel plans: each layer's input and output split over the model axis on the "
        "sequence (Megatron's sequence parallelism): under remat a layer keeps 1/model of its input.",
    )
    """Megatron's sequence parallelism under a model axis (``plans._sequence``): each layer's
    input and output split over ``model`` on the sequence dim, the row-parallel all-reduces turned into
    reduce-scatters and all-gathers. Plans with a model axis and no pipeline."""
    precision: str | None = option(
        None,
        help=one_of(PRECISIONS, notes={"bf16": "bf16 compute, fp32 master weights"}) + ".",
        shown="by platform: " + ", ".join(f"{p} {v}" for p, v in PLATFORM_PRECISION.items()),
        fixes="the arithmetic",
    )
    """Compute precision: one of ``PRECISIONS``; ZeRO-3 then gathers in the compute dtype. None: the
    parameters' own dtype in the Trainer; ``meshkit train`` resolves it by platform (``PLATFORM_PRECISION``)."""
    accumulate: int = option(1, help="Micro-batches per step (must divide the batch per data shard).")
    """Micro-batches accumulated per optimizer step (plans without a pipeline)."""
    microbatches: int | None = option(
        None, help="Pipeline plans: micro-batches per step.", shown="one per stage"
    )
    """Pipeline plans: micro-batches per step; None: one per stage."""
    pipeline_schedule: str | None = option(
        None,
        help=f"Pipeline plans: {one_of(PIPELINE_SCHEDULES)}.",
        shown="1f1b",
        flags=("--pipeline-schedule", "--schedule"),
    )
    """Pipeline plans: one of ``PIPELINE_SCHEDULES``; None: 1f1b."""
    virtual_stages: int = option(1, help="Interleaved: chunks of layers per device.")
    """Interleaved schedule: chunks of layers per device."""
    context_attention: str = option("ring", help=f"Context plans: {one_of(CONTEXT_ATTENTION)}.")
    """Context plans: one of ``CONTEXT_ATTENTION``."""
    attention: str = option(
        "auto",
        help=f"How each device attends: {one_of(ATTENTION_IMPLEMENTATIONS)}; report.json names the kernels.",
    )
    """How each device attends: one of ``ATTENTION_IMPLEMENTATIONS`` (``plans.attention``)."""
    deterministic: bool | int | None = option(
        None,
        fixes="the order the gradients are summed in",
        shown="off",
        flags=("--deterministic",),
        later=True,
        help="The same bits on 1, 2, 4 or 8 devices: the batch cut into 8 micro-shards (--set deterministic=N for N, a "
        "power of two) whose gradients are summed in one fixed tree; plans "
        f"{one_of(DETERMINISTIC_PLANS, 'and')}. Its price in bytes is in the report.",
    )
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
        if self.sequence_parallel and plan.name not in SEQUENCE_PARALLEL_PLANS:
            raise PlanError(
                f"sequence_parallel splits sequences over the model axis of a tensor-parallel plan without a "
                f"pipeline or an expert axis ({', '.join(SEQUENCE_PARALLEL_PLANS)}), not plan {plan.name}: drop "
                f"--sequence-parallel or choose one of those plans"
            )
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
