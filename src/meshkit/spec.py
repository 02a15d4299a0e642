"""The parallel spec: how a training step is laid out over devices, as data, validated once.

Everything that decides the layout lives here and nowhere else: the mesh axes a plan uses, the
plans (ZeRO stage on the ``data`` axis, tensor parallelism on ``model``, pipeline stages on
``stage``) with their default meshes, and every set of allowed values (remat policies, pipeline
schedules, precisions). ``ParallelSpec`` holds one choice of each and checks it when it is made;
``meshkit train``'s config holds one, the Trainer takes one (its keyword arguments build it), the
planner's layouts convert to one (``planner.layout.Layout.to_spec``), and ``plans.assemble`` turns
one into a compiled step. A new mesh axis is a name here, fields of ``Plan``, its rows in
``PLANS``, and the module in ``plans/`` that implements it.

Errors are ``PlanError``, one line naming the option to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshkit._errors import MeshkitError

DATA, MODEL, STAGE, REPLICA, CONTEXT = "data", "model", "stage", "replica", "context"
"""The mesh axes plans use: ZeRO/data parallelism, tensor parallelism, pipeline stages, the
replicas of hybrid sharding (HSDP: the batch split over ``replica`` x ``data``, ZeRO-3 within
``data``, replicated across ``replica``), and the sequence split of context parallelism."""
EXPERT = "expert"
"""Expert parallelism's axis: a mixture of experts' experts split over it, the batch split over it as
well (``data`` x ``expert``), its tokens sent to their experts' devices by ``all_to_all`` (``plans._experts``)."""
AXES = (STAGE, REPLICA, DATA, EXPERT, CONTEXT, MODEL)
"""Every axis a plan may use, in the order meshes are written (outermost first)."""

ZERO_STAGES = ("dp", "zero1", "zero2", "zero3")
"""What a plan shards over the data axis: nothing, optimizer state, + gradients, + parameters."""
REMAT_POLICIES = ("none", "layer", "dots", "regather")
"""Activation checkpointing per layer: keep everything, recompute the layer from its input, keep
matmul outputs, or (ZeRO-3) keep everything but the gathered weights, which are gathered again."""
REMAT_ALIASES = {"full": "layer", "selective": "dots"}
"""Names other tools use: Megatron's full recompute is per-layer remat, its selective one saves matmuls."""
PIPELINE_REMAT = ("none", "dots", "layer")
"""The policies every plan takes (pipelines gather a stage's parameters once per step, so there is
nothing to re-gather), from the least recomputed to the most."""
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
STEADY_SCHEDULES = PIPELINE_SCHEDULES[1:]
"""The schedules with a one-forward-one-backward steady state: at most p micro-batches in flight, so
they need at least p micro-batches (GPipe runs every forward first)."""
CONTEXT_ATTENTION = {"ring": "K/V passed round the ring by ppermute", "all-to-all": "Ulysses; heads divide"}
"""Context plans' attention: K/V blocks passed round the ring by ppermute (online softmax), or
Ulysses' all_to_all from a sequence split to a head split and back (heads must divide)."""
PRECISIONS = {"fp32": None, "bf16": "bfloat16"}
"""Compute precision -> the compute dtype (None: the parameters' own); parameters and optimizer
state stay in their dtype (float32 master weights)."""


class PlanError(MeshkitError):
    """A plan cannot be applied to this model, mesh, optimizer or batch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """One parallel plan: what it shards over which mesh axis."""

    name: str
    data: bool
    """Whether the plan splits the batch over a data axis."""
    zero: str
    """ZeRO stage on the data axis: 'dp' (replicate everything), 'zero1' (shard optimizer state),
    'zero2' (also reduce-scatter gradients per micro-batch), 'zero3' (also shard parameters)."""
    tensor: bool = False
    """Whether tensor-parallel rules shard leaves on the model axis (Megatron column/row)."""
    pipeline: bool = False
    """Whether the stacked layers of a ``meshkit.Stages`` model are split over the stage axis."""
    hybrid: bool = False
    """Whether the batch is split over a ``replica`` axis too, across which the data axis's shards
    are replicated (HSDP): gradients reduce-scattered over ``data``, then their shards all-reduced
    over ``replica``."""
    context: bool = False
    """Whether every sequence is split over the context axis (context parallelism, ``plans._context``)."""
    expert: bool = False
    """Whether a mixture of experts' experts are split over the expert axis, the batch over it as well
    (expert parallelism, ``plans._experts``): expert leaves' gradients reduced over ``data`` only, the
    others' over ``data`` x ``expert``."""
    default_mesh: str
    """The mesh when none is given (``-1``: every device left)."""

    @property
    def needs(self) -> tuple[str, ...]:
        """Mesh axes the plan requires."""
        used = (
            (REPLICA, self.hybrid),
            (DATA, self.data),
            (MODEL, self.tensor),
            (STAGE, self.pipeline),
            (CONTEXT, self.context),
            (EXPERT, self.expert),
        )
        return tuple(axis for axis, on in used if on)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (outermost first): the data axis, and under hybrid
        sharding the replica axis before it; under expert parallelism the expert axis after it."""
        return tuple(axis for axis in (REPLICA, DATA, EXPERT) if axis in self.needs)

    @property
    def level(self) -> int:
        """The ZeRO stage as a number: 0 (dp) to 3."""
        return ZERO_STAGES.index(self.zero)

    @property
    def shards_optimizer(self) -> bool:
        return self.level >= 1

    @property
    def shards_gradients(self) -> bool:
        """Whether gradients are reduce-scattered per micro-batch (ZeRO-2 and ZeRO-3)."""
        return self.level >= 2

    @property
    def shards_params(self) -> bool:
        return self.level == 3

    @property
    def gathers_in_compute_dtype(self) -> bool:
        """Whether, under mixed precision, ZeRO-3's data-axis gathers and reduce-scatters move the
        parameters cast to the compute dtype (half the bytes for bf16). Not under tensor parallelism:
        XLA:CPU (JAX 0.12) aborts compiling low-precision shards gathered on data while the model axis
        is the partitioner's ("Invalid binary instruction opcode copy"), so fsdp+tp gathers in the
        parameters' dtype and the model casts them; nor in pipelines, which gather in their own way."""
        return self.shards_params and not self.tensor and not self.pipeline


def _plans() -> dict[str, Plan]:
    rows = [  # name, data axis, ZeRO stage, tensor, pipeline, default mesh
        ("dp", True, "dp", False, False, "data=-1"),
        ("zero1", True, "zero1", False, False, "data=-1"),
        ("zero2", True, "zero2", False, False, "data=-1"),
        ("zero3", True, "zero3", False, False, "data=-1"),
        ("fsdp", True, "zero3", False, False, "data=-1"),
        ("tp", False, "dp", True, False, "model=-1"),
        ("dp+tp", True, "dp", True, False, "data=-1,model=2"),
        ("fsdp+tp", True, "zero3", True, False, "data=-1,model=2"),
        ("pp", False, "dp", False, True, "stage=-1"),
        ("dp+pp", True, "dp", False, True, "stage=2,data=-1"),
        ("fsdp+pp", True, "zero3", False, True, "stage=2,data=-1"),
        ("tp+pp", False, "dp", True, True, "stage=-1,model=2"),
        ("dp+tp+pp", True, "dp", True, True, "stage=2,data=-1,model=2"),
        ("fsdp+tp+pp", True, "zero3", True, True, "stage=2,data=-1,model=2"),
    ]
    plans = {
        name: Plan(name=name, data=d, zero=z, tensor=t, pipeline=p, default_mesh=m)
        for name, d, z, t, p, m in rows
    }
    # hybrid sharded data parallel: ZeRO-3 within a group (data), replicated across groups (replica)
    plans["hsdp"] = Plan(name="hsdp", data=True, zero="zero3", hybrid=True, default_mesh="replica=2,data=-1")
    # context parallelism: the sequence over the context axis, alone or with a data axis
    plans["cp"] = Plan(name="cp", data=False, zero="dp", context=True, default_mesh="context=-1")
    plans["dp+cp"] = Plan(name="dp+cp", data=True, zero="dp", context=True, default_mesh="data=-1,context=2")
    # ZeRO-3 over data, replicated over context (each device T/C of every sequence)
    plans["fsdp+cp"] = Plan(
        name="fsdp+cp", data=True, zero="zero3", context=True, default_mesh="data=-1,context=2"
    )
    # expert parallelism: a mixture of experts' experts over the expert axis, the batch over data x expert
    plans["ep"] = Plan(name="ep", data=False, zero="dp", expert=True, default_mesh="expert=-1")
    plans["dp+ep"] = Plan(name="dp+ep", data=True, zero="dp", expert=True, default_mesh="data=2,expert=-1")
    # dense leaves ZeRO-3 over data (replicated over expert), expert leaves over expert (whole on data)
    plans["fsdp+ep"] = Plan(
        name="fsdp+ep", data=True, zero="zero3", expert=True, default_mesh="data=2,expert=-1"
    )
    return plans


PLANS: dict[str, Plan] = _plans()
"""Every plan meshkit runs, by name (``fsdp`` is ``zero3``)."""
PIPELINE_PLANS = tuple(name for name, p in PLANS.items() if p.pipeline)

FAMILIES = {
    "data": "",
    "hybrid": "hybrid sharding (mesh replica=R,data=G)",
    "tensor": "tensor parallelism",
    "pipeline": "pipelines",
    "context": "context parallelism (the sequence split over a context axis)",
    "expert": "expert parallelism (a mixture of experts, --experts, split over an expert axis)",
}
"""The plans' families, by the axis beyond ``data`` that sets each apart, with the words help texts
use for them (``data``: the plain data-axis plans, dp and the ZeRO stages)."""


def family(plan: Plan) -> str:
    """The family of ``FAMILIES`` a plan belongs to (a pipeline with tp is a pipeline)."""
    for name in ("pipeline", "context", "expert", "tensor", "hybrid"):
        if getattr(plan, name):
            return name
    return "data"


def plans_of(name: str) -> tuple[str, ...]:
    """The plans of one family of ``FAMILIES``, in ``PLANS``'s order."""
    return tuple(n for n, p in PLANS.items() if family(p) == name)


def one_of(values, last: str = "or", notes: dict[str, str] | None = None) -> str:
    """``a, b or c``: a list of allowed values for a help text or an error line; ``notes`` (or
    ``values`` itself, a dict) adds a few words in brackets after a value."""
    notes = values if isinstance(values, dict) and notes is None else notes or {}
    values = [f"{v} ({notes[v]})" if notes.get(v) else v for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} {last} {values[-1]}"


def describe_plans() -> str:
    """Every plan, by family, for help texts (``meshkit train --plan``, ``meshkit verify --plan``)."""
    parts = []
    for name, words in FAMILIES.items():
        names = ", ".join(plans_of(name)).replace("zero3, fsdp", "zero3 (= fsdp)")
        parts.append(f"{words}: {names}" if words else names)
    return "; ".join(parts)


AUTO = "auto"
"""A plan name that asks the planner to choose (resolved before a step is assembled)."""


def get_plan(name: str | Plan) -> Plan:
    if isinstance(name, Plan):
        return name
    if name not in PLANS:
        raise PlanError(f"unknown plan {name!r}: choose one of {', '.join(PLANS)}")
    return PLANS[name]


def plan_for(zero: int, *, data: bool, tensor: bool, pipeline: bool, hybrid: bool = False) -> str | None:
    """The plan of a ZeRO stage (0-3) combined with tensor and pipeline parallelism, or None where
    meshkit has none (ZeRO-1/2 combine with neither; ZeRO over a data axis of one device). ``hybrid``:
    ZeRO-3 within groups of the data-parallel devices, replicated across them (hsdp, alone)."""
    if hybrid:
        return "hsdp" if zero == 3 and data and not tensor and not pipeline else None
    if not data and zero:
        return None
    parts = [{0: "dp", 1: "zero1", 2: "zero2", 3: "fsdp"}[zero]] if data else []
    parts += ["tp"] * tensor + ["pp"] * pipeline
    name = "+".join(parts) or "dp"
    return name if name in PLANS else None


def check_axes(plan: Plan, sizes: dict[str, int]) -> None:
    """The mesh (axis -> size) has every axis ``plan`` needs, and no other of more than one device."""
    for axis in plan.needs:
        if axis not in sizes:
            example = plan.default_mesh.replace("-1", "4")
            have = ",".join(f"{k}={v}" for k, v in sizes.items())
            raise PlanError(
                f"plan {plan.name} needs a mesh axis {axis!r}, but the mesh is {have}; add it, e.g. mesh {example}"
            )
    for axis, size in sizes.items():
        if axis not in plan.needs and size != 1:
            # the plans with this plan's axes and that one, else any plan with that axis
            wider = [n for n, p in PLANS.items() if set(p.needs) == {*plan.needs, axis}]
            wider = wider or [n for n, p in PLANS.items() if axis in p.needs]
            raise PlanError(f"plan {plan.name} does not use mesh axis {axis}={size}; use {one_of(wider)}")


def check_remat(remat: str, plan: Plan | None = None) -> str:
    """The remat policy named (an alias resolved), if ``plan`` takes it."""
    remat = REMAT_ALIASES.get(remat, remat)
    _one_of("remat", remat, REMAT_POLICIES)
    if plan is not None and plan.pipeline and remat not in PIPELINE_REMAT:
        raise PlanError(
            f"plan {plan.name} takes remat {', '.join(map(repr, PIPELINE_REMAT))}: {remat!r} re-gathers "
            f"ZeRO-3 shards per layer, and a pipeline gathers its stage once per step; use remat='layer'"
        )
    return remat


def check_schedule(name: str, virtual_stages: int = 1) -> None:
    """A pipeline schedule's name, and whether it runs ``virtual_stages`` chunks per device."""
    _one_of("schedule", name, PIPELINE_SCHEDULES)
    _positive("virtual_stages", virtual_stages)
    if name != "interleaved" and virtual_stages != 1:
        raise PlanError(
            f"schedule {name} runs one chunk per device: use virtual_stages=1, or schedule='interleaved'"
        )


DETERMINISTIC_SHARDS = 8
"""Micro-shards per step of ``deterministic=True``: a run replays bit for bit on any mesh of up to
this many batch devices (1, 2, 4 or 8)."""
DETERMINISTIC_AXES = (DATA, STAGE)
"""The axes deterministic mode fixes the bits across (its micro-shards over ``data``, the stages'
fixed order over ``stage``); the others split a sum whose order XLA sets by the axis's size."""
DETERMINISTIC_PLANS = tuple(name for name, p in PLANS.items() if set(p.needs) <= set(DETERMINISTIC_AXES))
"""The plans deterministic mode covers: those on its axes alone (``check_deterministic_plan`` says why
the others are refused)."""


def check_deterministic(shards: Any) -> int | None:
    """Deterministic mode's micro-shard count (True: ``DETERMINISTIC_SHARDS``; None or False: off)."""
    if shards is None or shards is False:
        return None
    if shards is True:
        return DETERMINISTIC_SHARDS
    _positive("deterministic", shards)
    if shards & (shards - 1):
        raise PlanError(
            f"deterministic cuts the batch into a power-of-two number of micro-shards (summed as one binary "
            f"tree), got {shards}: use {1 << (shards.bit_length() - 1)} or {1 << shards.bit_length()}"
        )
    return shards


def check_deterministic_plan(plan: Plan, accumulate: int) -> None:
    """Refuse, in one line naming why, a plan whose bits deterministic mode cannot fix across meshes."""
    why = {
        "tensor": "splits matmuls over the model axis, whose partial sums XLA orders by that axis's size",
        "hybrid": "all-reduces gradient shards over the replica axis in an order set by its size",
        "context": "sums attention and gradients over the context axis in an order set by its size",
    }
    for attr, reason in why.items():
        if getattr(plan, attr):
            raise PlanError(
                f"deterministic mode cannot fix plan {plan.name}'s bits across meshes: it {reason}; use one of "
                f"{', '.join(DETERMINISTIC_PLANS)}"
            )
    if plan.name not in DETERMINISTIC_PLANS:
        raise PlanError(
            f"deterministic mode does not cover plan {plan.name} yet (its gradient sums are still the plan's own "
            f"collectives): use one of {', '.join(DETERMINISTIC_PLANS)}"
        )
    if accumulate != 1:
        raise PlanError(
            "deterministic mode cuts the batch into its own micro-shards (deterministic=N): drop accumulate"
        )


def _one_of(what: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise PlanError(f"unknown {what} {value!r}: choose one of {', '.join(map(str, allowed))}")


def _positive(what: str, value: Any, *, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{what} must be a whole number of at least 1, got {value!r}")


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
    precision: str = "fp32"
    """Compute precision: one of ``PRECISIONS``; ZeRO-3 then gathers in the compute dtype."""
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
    deterministic: bool | int | None = None
    """Deterministic mode (``plans._deterministic``): the global batch cut into this many micro-shards
    (a power of two, at least the batch devices), their gradients summed in one fixed tree whatever the
    mesh, so that the step's bits do not depend on the device count; True means ``DETERMINISTIC_SHARDS``;
    None (or False): off."""

    def __post_init__(self) -> None:
        plan = None if self.plan == AUTO else get_plan(self.plan)
        object.__setattr__(self, "remat", check_remat(self.remat, plan))
        _one_of("precision", self.precision, PRECISIONS)
        _positive("accumulate", self.accumulate)
        _positive("microbatches", self.microbatches, none_ok=True)
        _positive("virtual_stages", self.virtual_stages)
        check_schedule(self.schedule_name, self.virtual_stages)
        _one_of("context_attention", self.context_attention, CONTEXT_ATTENTION)
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
        return PLANS[self.plan]

    @property
    def mesh_text(self) -> str:
        """The mesh as given, or the plan's default."""
        return self.mesh if self.mesh is not None else self.plan_info.default_mesh

    @property
    def compute_dtype(self) -> str | None:
        return PRECISIONS[self.precision]

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
        is split over, replica x data under hybrid sharding), then into micro-batches."""
        what = "microbatches" if self.plan_info.pipeline else "accumulate"
        axes = " x ".join(self.plan_info.batch_axes) or DATA
        if examples % (data * microbatches):
            raise PlanError(
                f"batch of {examples} examples does not divide over {axes}={data} x {what}={microbatches}; "
                f"use a multiple of {data * microbatches}"
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
