"""One module per mesh axis: what a plan does on it beyond what its row in ``meshkit.spec.AXIS_RULES``
says (``_base.AxisPlan``: what is in force while the loss is traced, the batch's layout, the ledger's
rows, the checks of a run).

- ``data``: the ZeRO stage's collectives (the placement splits the leaves, ``_gradients`` runs them);
- ``model``: tensor parallelism's Megatron all-reduces (XLA partitions the matmuls);
- ``context``: the sequence split and its attention (``_context``);
- ``expert``: the expert split and its all_to_alls (``_experts``);
- ``stage``: nothing in the step (pipelines build their own gradient path), the planner's price of
  its sends.

Each also says what the planner prices on it (``AxisPlan.flows``) and which layouts it refuses
(``AxisPlan.check_layout``).

The replica axis (hybrid sharding) has nothing of its own: its rows are split and its sums made as every
row-splitting axis's, from the plan's row (the data module prices its traffic). The stage axis's
pipelines build their own gradient path (``_pipeline``, ``_schedule``, ``_stages``), which replaces the
step's region. A new axis is its row in
``AXIS_RULES`` and, where it does more than split rows or sequences, a module here with its ``PLAN`` in
``AXIS_PLANS``: the step, the ledger, ``meshkit train``'s checks and the planner then find it.
"""

from __future__ import annotations

from meshkit.plans.axes import context, data, expert, model, stage
from meshkit.plans.axes._base import Add, AxisPlan, Flow, LedgerInputs, axis_size, divisors, sequence_split
from meshkit.spec import Plan

AXIS_PLANS: dict[str, AxisPlan] = {m.PLAN.axis: m.PLAN for m in (data, model, stage, context, expert)}
"""The axis modules, by mesh axis; an axis with no module has the defaults (``AxisPlan``)."""


def active(plan: Plan) -> list[AxisPlan]:
    """The plan's axes with a module, the data axis first, then in ``AXIS_RULES``' order."""
    return [AXIS_PLANS[a] for a in plan.needs if a in AXIS_PLANS]


__all__ = [
    "AXIS_PLANS",
    "Add",
    "AxisPlan",
    "Flow",
    "LedgerInputs",
    "active",
    "axis_size",
    "divisors",
    "sequence_split",
]
