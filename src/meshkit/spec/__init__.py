"""The parallel spec: how a training step is laid out over devices, as data, validated once.

Everything that decides the layout lives here and nowhere else: the mesh axes a plan uses, the
plans (ZeRO stage on the ``data`` axis, tensor parallelism on ``model``, pipeline stages on
``stage``) with their default meshes, and every set of allowed values (remat policies, pipeline
schedules, precisions). ``ParallelSpec`` holds one choice of each and checks it when it is made;
``meshkit train``'s config holds one, the Trainer takes one (its keyword arguments build it), the
planner's layouts convert to one (``planner.layout.Layout.to_spec``), and ``plans.assemble`` turns
one into a compiled step.

The plan table is derived, not written: a plan is a data part (``dp``, ``zero1``-``zero3``, ``fsdp``,
``hsdp``) and/or axes of ``AXIS_RULES`` (``tp``, ``pp``, ``cp``, ``ep``), named by their parts joined with
``+`` in that order (``cp+tp`` is read as ``tp+cp``). Every set of axes whose pairs combine (``COMBINE``)
is a plan, alone and with ``dp`` or ``fsdp``; a name with a pair that does not is refused in one line
with the pair's reason. Help texts, default meshes, the kinds of plans, and the plans deterministic mode
covers follow from the rows. A new mesh axis is a name here (``AXES``), a row of ``AXIS_RULES`` with its
pairs in ``COMBINE``, and its module in ``meshkit/plans/axes/`` where it does more than split rows.

Errors are ``PlanError``, one line naming the option to change.
"""

from meshkit.spec.parallel import ParallelSpec, option
from meshkit.spec.plans import (
    AXIS_RULES,
    COMBINE,
    COMBINING_DATA,
    DATA_PARTS,
    DETERMINISTIC_AXES,
    DETERMINISTIC_PLANS,
    PIPELINE_PLANS,
    PLAN_KINDS,
    PLANS,
    SEQUENCE_PARALLEL_PLANS,
    AxisRule,
    Plan,
    canonical,
    check_axes,
    check_deterministic_plan,
    check_remat,
    data_part,
    describe_plans,
    get_plan,
    plan_for,
    plan_kind,
    plans_of,
    refusal,
)
from meshkit.spec.values import (
    ADAPTER_PAIR,
    ADAPTER_RANK,
    ATTENTION_IMPLEMENTATIONS,
    AUTO,
    AXES,
    CONTEXT,
    CONTEXT_ATTENTION,
    DATA,
    DETERMINISTIC_SHARDS,
    EXPERT,
    FIRST_SHARDED,
    GRPO_LOSSES,
    MODEL,
    PIPELINE_REMAT,
    PIPELINE_SCHEDULES,
    PLATFORM_PRECISION,
    PRECISIONS,
    PREFERENCE_LOSSES,
    QUANTIZE,
    REMAT_ALIASES,
    REMAT_POLICIES,
    REPLICA,
    STAGE,
    STEADY_SCHEDULES,
    TASKS,
    ZERO_PARTS,
    ZERO_STAGES,
    PlanError,
    check_deterministic,
    check_schedule,
    one_of,
)

__all__ = [
    "ADAPTER_PAIR",
    "ADAPTER_RANK",
    "ATTENTION_IMPLEMENTATIONS",
    "AUTO",
    "AXES",
    "AXIS_RULES",
    "COMBINE",
    "COMBINING_DATA",
    "CONTEXT",
    "CONTEXT_ATTENTION",
    "DATA",
    "DATA_PARTS",
    "DETERMINISTIC_AXES",
    "DETERMINISTIC_PLANS",
    "DETERMINISTIC_SHARDS",
    "EXPERT",
    "FIRST_SHARDED",
    "GRPO_LOSSES",
    "MODEL",
    "PIPELINE_PLANS",
    "PIPELINE_REMAT",
    "PIPELINE_SCHEDULES",
    "PLANS",
    "PLAN_KINDS",
    "PLATFORM_PRECISION",
    "PRECISIONS",
    "PREFERENCE_LOSSES",
    "QUANTIZE",
    "REMAT_ALIASES",
    "REMAT_POLICIES",
    "REPLICA",
    "SEQUENCE_PARALLEL_PLANS",
    "STAGE",
    "STEADY_SCHEDULES",
    "TASKS",
    "ZERO_PARTS",
    "ZERO_STAGES",
    "AxisRule",
    "ParallelSpec",
    "Plan",
    "PlanError",
    "canonical",
    "check_axes",
    "check_deterministic",
    "check_deterministic_plan",
    "check_remat",
    "check_schedule",
    "data_part",
    "describe_plans",
    "get_plan",
    "one_of",
    "option",
    "plan_for",
    "plan_kind",
    "plans_of",
    "refusal",
]
