"""The plan table, derived from the axes: what each plan shards over which mesh axis, its default mesh,
its kind, and why a name meshkit has no plan for is refused (``AXIS_RULES``, ``COMBINE``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from meshkit.spec.values import (
    AXES,
    CONTEXT,
    DATA,
    EXPERT,
    FIRST_SHARDED,
    MODEL,
    PIPELINE_REMAT,
    REMAT_ALIASES,
    REMAT_POLICIES,
    REPLICA,
    STAGE,
    ZERO_STAGES,
    PlanError,
    _one_of,
    one_of,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """One parallel plan: its data part (ZeRO stage over ``data``, hybrid sharding over ``replica``) and
    the axes of ``AXIS_RULES`` it adds; everything else about it is read from those rows."""

    name: str
    data: bool
    """Whether the plan splits the batch over a data axis."""
    zero: str
    """ZeRO stage on the data axis: 'dp' (replicate everything), 'zero1' (shard optimizer state),
    'zero2' (also reduce-scatter gradients per micro-batch), 'zero3' (also shard parameters)."""
    hybrid: bool = False
    """Whether the batch is split over a ``replica`` axis too, across which the data axis's shards
    are replicated (HSDP): gradients reduce-scattered over ``data``, then their shards all-reduced
    over ``replica``."""
    axes: tuple[str, ...] = ()
    """The mesh axes of ``AXIS_RULES`` the plan uses, in the rows' order."""
    default_mesh: str

    def uses(self, field: str) -> bool:
        """Whether the plan uses the axis of the row whose ``AxisRule.field`` (or mesh axis) is ``field``."""
        return any(field in (rule.field, rule.axis) for rule in self.rules)

    @property
    def rules(self) -> tuple[AxisRule, ...]:
        """The rows of ``AXIS_RULES`` of the plan's axes."""
        return tuple(rule for rule in AXIS_RULES if rule.axis in self.axes)

    @property
    def tensor(self) -> bool:
        """Whether tensor-parallel rules shard leaves on the model axis (Megatron column/row)."""
        return MODEL in self.axes

    @property
    def pipeline(self) -> bool:
        """Whether the stacked layers of a ``meshkit.Stages`` model are split over the stage axis."""
        return STAGE in self.axes

    @property
    def context(self) -> bool:
        """Whether every sequence is split over the context axis (context parallelism, ``plans._context``)."""
        return CONTEXT in self.axes

    @property
    def expert(self) -> bool:
        """Whether a mixture of experts' experts are split over the expert axis, the batch over it as well
        (expert parallelism, ``plans._experts``)."""
        return EXPERT in self.axes

    @property
    def needs(self) -> tuple[str, ...]:
        """Mesh axes the plan requires."""
        return (REPLICA,) * self.hybrid + (DATA,) * self.data + self.axes

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch's rows are split over (outermost first): the data axis, and under hybrid
        sharding the replica axis before it; then every axis whose row splits rows (``AxisRule.splits``:
        the expert axis)."""
        return (REPLICA,) * self.hybrid + (DATA,) * self.data + self.split_axes("rows")

    def split_axes(self, splits: str) -> tuple[str, ...]:
        """The plan's axes of ``AXIS_RULES`` that split the batch that way (``AxisRule.splits``)."""
        return tuple(rule.axis for rule in self.rules if rule.splits == splits)

    @property
    def region_axes(self) -> tuple[str, ...]:
        """The axes the step's gradient region is manual over: the batch axes, then those that split
        every sequence (the context axis); the others (model, stage) are the compiler's or the pipeline's."""
        return self.batch_axes + self.split_axes("sequence")

    @property
    def level(self) -> int:
        """The ZeRO stage as a number: 0 (dp) to 3."""
        return ZERO_STAGES.index(self.zero)

    @property
    def shards_optimizer(self) -> bool:
        return self.level >= FIRST_SHARDED["optimizer"]

    @property
    def shards_gradients(self) -> bool:
        """Whether gradients are reduce-scattered per micro-batch (ZeRO-2 and ZeRO-3)."""
        return self.level >= FIRST_SHARDED["grads"]

    @property
    def shards_params(self) -> bool:
        return self.level >= FIRST_SHARDED["params"]

    @property
    def gathers_in_compute_dtype(self) -> bool:
        """Whether, under mixed precision, ZeRO-3's data-axis gathers and reduce-scatters move the
        parameters cast to the compute dtype (half the bytes for bf16). Not under tensor parallelism:
        XLA:CPU (JAX 0.12) aborts compiling low-precision shards gathered on data while the model axis
        is the partitioner's ("Invalid binary instruction opcode copy"), so fsdp+tp gathers in the
        parameters' dtype and the model casts them; nor in pipelines, which gather in their own way."""
        return self.shards_params and not self.tensor and not self.pipeline


@dataclass(frozen=True, kw_only=True, slots=True)
class AxisRule:
    """One mesh axis beyond ``data`` as a plan uses it: the part of a plan's name that turns it on, how it
    splits the batch and the leaves, its size in a default mesh, and whether deterministic mode fixes its
    bits. A new axis is a row of ``AXIS_RULES`` (and its pairs in ``COMBINE``) plus its module in
    ``meshkit/plans/axes/``: the plan table, help texts, default meshes, refusals, the step's gradient
    region and the sums over it follow from here."""

    token: str
    """Its part of a plan name (``fsdp+tp``: tp)."""
    axis: str
    field: str
    """The word ``Plan.uses`` and ``PLAN_KINDS`` know it by."""
    words: str
    """What help texts call its kind of plans."""
    splits: str = ""
    """How it splits the batch: "rows" (each device its own rows, as the data axis: gradients summed
    over it), "sequence" (each device a part of every sequence: gradients summed over it too), or ""
    (the compiler's matmul split, a pipeline's stages). A "rows" or "sequence" axis is manual in the
    step's gradient region (``Plan.region_axes``)."""
    logical: str | None = None
    """The logical dim name whose dims it splits in every leaf that has one (``expert``), beside the
    tensor-parallel rules' own (the model axis)."""
    model_needs: str = ""
    """What a model needs for a ``logical`` split, said where it has no such dim."""
    default: int = 2
    """Its size in a default mesh beside the axis that takes every device left (``-1``)."""
    fills: int = 9
    """Which axis takes every device left in a default mesh: the lowest ``fills`` of the plan's axes
    (the data axis is ``DATA_FILLS``)."""
    leads: int = 9
    """Which axis names a combination's kind: the lowest ``leads`` (a pipeline with tp is a pipeline)."""
    nondeterministic: str = ""
    """Why deterministic mode cannot fix its bits across meshes (empty: it can)."""


DATA_FILLS = 1
"""The data axis's ``AxisRule.fills``: it takes every device left unless the expert axis is in the plan."""

AXIS_RULES = (
    AxisRule(
        token="tp",
        axis=MODEL,
        field="tensor",
        words="tensor parallelism",
        fills=4,
        leads=3,
        nondeterministic="splits matmuls over the model axis, whose partial sums XLA orders by that axis's size",
    ),
    AxisRule(token="pp", axis=STAGE, field="pipeline", words="pipelines", fills=2, leads=0),
    AxisRule(
        token="cp",
        axis=CONTEXT,
        field="context",
        splits="sequence",
        fills=3,
        leads=1,
        words="context parallelism (the sequence split over a context axis)",
        nondeterministic="sums attention and gradients over the context axis in an order set by its size",
    ),
    AxisRule(
        token="ep",
        axis=EXPERT,
        field="expert",
        splits="rows",
        logical="expert",
        fills=0,
        leads=2,
        model_needs="a mixture-of-experts model: set experts (e.g. --experts 8)",
        words="expert parallelism (a mixture of experts, --experts, split over an expert axis)",
        nondeterministic="all-reduces the dense leaves' gradients over the expert axis in an order set by its size",
    ),
)
"""The axes a plan adds to its data part, in the order their parts are written in a plan's name."""

COMBINE = {
    frozenset({"tp", "pp"}): "",
    frozenset({"tp", "cp"}): "",
    frozenset({"tp", "ep"}): "",
    frozenset({"cp", "ep"}): "a mixture of experts routes whole sequences (an expert's capacity is per "
    "sequence) and the context axis splits them; use an expert plan without cp, or a context plan for "
    "a dense model",
    frozenset(
        {"pp", "cp"}
    ): "a pipeline stage runs whole sequences: the context split is not written for stages",
    frozenset({"pp", "ep"}): "a pipeline stage's layers are not a mixture of experts' layers",
}
"""Pairs of axes: "" where their plans combine (every axis of a plan must combine with every other),
else why a plan with both is refused."""

DATA_PARTS = {
    "dp": "dp",
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3": "zero3",
    "fsdp": "zero3",
    "hsdp": "zero3",
}
"""A plan name's data part -> its ZeRO stage (``fsdp`` is ``zero3``; ``hsdp``: ZeRO-3 within the data
axis, replicated over a replica axis)."""
COMBINING_DATA = ("dp", "fsdp")
"""The data parts that combine with other axes (zero1/zero2 and hsdp run alone)."""
RUN_EVERYWHERE = -1


def _default_mesh(data: str | None, rules: tuple[AxisRule, ...]) -> str:
    """The plan's mesh when none is given: every device left on one axis (the expert axis if the plan
    has one, else data, else the first of its others), each other at its rule's default size."""
    sizes: dict[str, int] = {}
    if data == "hsdp":
        sizes[REPLICA] = 2
    if data is not None:
        sizes[DATA] = 2
    fills = {DATA: DATA_FILLS} if data is not None else {}
    for rule in rules:
        sizes[rule.axis] = rule.default
        fills[rule.axis] = rule.fills
    sizes[min(fills, key=fills.__getitem__)] = RUN_EVERYWHERE
    return ",".join(f"{a}={sizes[a]}" for a in AXES if a in sizes)


def _plan(data: str | None, rules: tuple[AxisRule, ...]) -> Plan:
    name = "+".join(([data] if data else []) + [r.token for r in rules])
    return Plan(
        name=name,
        data=data is not None,
        zero=DATA_PARTS[data or "dp"],
        hybrid=data == "hsdp",
        axes=tuple(r.axis for r in rules),
        default_mesh=_default_mesh(data, rules),
    )


def _plans() -> dict[str, Plan]:
    """Every plan: each data part alone, then each set of axes whose pairs all combine, alone and with
    each combining data part; ordered by kind, as help texts list them."""
    plans = {name: _plan(name, ()) for name in DATA_PARTS}
    combos = [
        rules
        for k in range(1, len(AXIS_RULES) + 1)
        for rules in itertools.combinations(AXIS_RULES, k)
        if all(COMBINE.get(frozenset({a.token, b.token})) == "" for a, b in itertools.combinations(rules, 2))
    ]
    rank = {rule.field: i for i, rule in enumerate(AXIS_RULES)}
    # a combination's kind: a pipeline with tp is a pipeline (``AxisRule.leads``), listed by that kind
    lead = lambda rules: min(rules, key=lambda r: r.leads)  # noqa: E731
    for rules in sorted(combos, key=lambda rules: (rank[lead(rules).field], len(rules))):
        for data in (None, *COMBINING_DATA):
            plan = _plan(data, rules)
            plans[plan.name] = plan
    return plans


def refusal(name: str) -> str | None:
    """Why a well-formed plan name meshkit has no plan for is refused (None: the name is malformed or known)."""
    parts = name.split("+")
    data = [p for p in parts if p in DATA_PARTS]
    tokens = [p for p in parts if p not in DATA_PARTS]
    known = {r.token for r in AXIS_RULES}
    if len(data) > 1 or not set(tokens) <= known or len(set(tokens)) != len(tokens) or not parts:
        return None
    if data and tokens and data[0] not in COMBINING_DATA:
        return f"{data[0]} runs alone; with other axes use {one_of(COMBINING_DATA)} as the data part"
    for a in tokens:
        for b in tokens:
            why = COMBINE.get(frozenset({a, b})) if a < b else None
            if why:
                return f"{a} and {b} do not combine: {why}"
    return None


def canonical(name: str) -> str:
    """A plan name with its parts in the table's order (``cp+tp`` -> ``tp+cp``; data part first)."""
    parts = name.split("+")
    order = {**{d: -1 for d in DATA_PARTS}, **{r.token: i for i, r in enumerate(AXIS_RULES)}}
    return (
        "+".join(sorted(parts, key=lambda p: order.get(p, len(order)))) if set(parts) <= set(order) else name
    )


PLANS: dict[str, Plan] = _plans()
"""Every plan meshkit runs, by name (``fsdp`` is ``zero3``)."""
PIPELINE_PLANS = tuple(name for name, p in PLANS.items() if p.pipeline)
SEQUENCE_PARALLEL_PLANS = tuple(
    name for name, p in PLANS.items() if p.tensor and not p.pipeline and not p.expert
)
"""Plans ``ParallelSpec.sequence_parallel`` applies to: a model axis, no pipeline (whose stages run their
blocks in ``_pipeline``'s own loop) and no expert axis (its dispatch of a sequence split is not
modelled: fsdp+tp+ep on a GPT of 2 layers moved 1.25x the model's all-gathers and 1.53x its
all-reduces over ``model``)."""

PLAN_KINDS = {
    "data": "",
    "hybrid": "hybrid sharding (mesh replica=R,data=G)",
    **{rule.field: rule.words for rule in AXIS_RULES},
}
"""The kinds of plans, by the axis beyond ``data`` that sets each apart, with the words help texts
use for them (``data``: the plain data-axis plans, dp and the ZeRO stages)."""


def plan_kind(plan: Plan) -> str:
    """The kind of ``PLAN_KINDS`` a plan belongs to (a pipeline with tp is a pipeline)."""
    if plan.rules:
        return min(plan.rules, key=lambda r: r.leads).field
    return "hybrid" if plan.hybrid else "data"


def plans_of(name: str) -> tuple[str, ...]:
    """The plans of one kind of ``PLAN_KINDS``, in ``PLANS``'s order."""
    return tuple(n for n, p in PLANS.items() if plan_kind(p) == name)


def describe_plans() -> str:
    """Every plan, by kind, for help texts (``meshkit train --plan``, ``meshkit verify --plan``)."""
    parts = []
    for name, words in PLAN_KINDS.items():
        names = ", ".join(plans_of(name)).replace("zero3, fsdp", "zero3 (= fsdp)")
        parts.append(f"{words}: {names}" if words else names)
    return "; ".join(parts)


def get_plan(name: str | Plan) -> Plan:
    if isinstance(name, Plan):
        return name
    plan = PLANS.get(name) or PLANS.get(canonical(name))
    if plan is None:
        why = refusal(canonical(name))
        if why:
            raise PlanError(f"meshkit has no plan {name}: {why}")
        raise PlanError(f"unknown plan {name!r}: choose one of {', '.join(PLANS)}")
    return plan


def data_part(zero: int, *, hybrid: bool = False) -> str | None:
    """The data part of a plan name for a ZeRO stage (0-3): dp, zero1, zero2 or fsdp; hsdp where ZeRO-3
    shards within groups of the data devices (``hybrid``), None for a hybrid stage below 3."""
    if hybrid:
        return "hsdp" if zero == 3 else None
    return "fsdp" if zero == 3 else ZERO_STAGES[zero]


def plan_for(zero: int, *, data: bool, hybrid: bool = False, axes: Iterable[str] = ()) -> str | None:
    """The plan of a ZeRO stage (0-3) over a data axis (or none) with the mesh ``axes`` of ``AXIS_RULES``
    of more than one device, or None where meshkit has none (ZeRO-1/2 and hybrid sharding run alone; ZeRO
    over a data axis of one device). ``hybrid``: ZeRO-3 within groups of the data-parallel devices,
    replicated across them (hsdp)."""
    axes = set(axes)
    if unknown := axes - {rule.axis for rule in AXIS_RULES}:
        raise PlanError(
            f"unknown plan axis {sorted(unknown)}: the axes are {one_of([r.axis for r in AXIS_RULES])}"
        )
    part = data_part(zero, hybrid=hybrid)
    if (not data and zero) or part is None:
        return None
    tokens = [rule.token for rule in AXIS_RULES if rule.axis in axes]
    name = "+".join(([part] if data else []) + tokens) or "dp"
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


DETERMINISTIC_AXES = (DATA, *(rule.axis for rule in AXIS_RULES if not rule.nondeterministic))
"""The axes deterministic mode fixes the bits across (its micro-shards over ``data``, the stages'
fixed order over ``stage``); the others split a sum whose order XLA sets by the axis's size."""
DETERMINISTIC_PLANS = tuple(name for name, p in PLANS.items() if set(p.needs) <= set(DETERMINISTIC_AXES))
"""The plans deterministic mode covers: those on its axes alone (``check_deterministic_plan`` says why
the others are refused)."""


def check_deterministic_plan(plan: Plan, accumulate: int) -> None:
    """Refuse, in one line naming why, a plan whose bits deterministic mode cannot fix across meshes."""
    why = {rule.field: rule.nondeterministic for rule in AXIS_RULES if rule.nondeterministic}
    if plan.hybrid:
        why = {"hybrid": "all-reduces gradient shards over the replica axis in an order set by its size"}
    for attr, reason in why.items():
        if attr == "hybrid" or plan.uses(attr):
            raise PlanError(
                f"deterministic mode cannot fix plan {plan.name}'s bits across meshes: it {reason}; use one of "
                f"{', '.join(DETERMINISTIC_PLANS)}"
            )
    if accumulate != 1:
        raise PlanError(
            "deterministic mode cuts the batch into its own micro-shards (deterministic=N): drop accumulate"
        )


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
