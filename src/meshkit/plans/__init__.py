"""Parallel plans: data parallel, ZeRO-1/2/3 (FSDP), tensor parallel, and their 2D combinations.

A plan is data (``Plan``); ``make_layout`` decides where every leaf lives; ``build_step`` makes the
jitted step; ``expected_collectives`` and ``memory_formula`` say what it should cost.
"""

from meshkit.plans._layout import (
    DEFAULT_TP_RULES,
    PLANS,
    Layout,
    LeafLayout,
    Plan,
    PlanError,
    get_plan,
    make_layout,
)
from meshkit.plans._model import (
    CommRow,
    Expected,
    MemoryRow,
    compare_communication,
    device_bytes,
    expected_collectives,
    memory_formula,
)
from meshkit.plans._step import StepShardings, build_step, state_shardings

__all__ = [
    "DEFAULT_TP_RULES",
    "PLANS",
    "CommRow",
    "Expected",
    "Layout",
    "LeafLayout",
    "MemoryRow",
    "Plan",
    "PlanError",
    "StepShardings",
    "build_step",
    "compare_communication",
    "device_bytes",
    "expected_collectives",
    "get_plan",
    "make_layout",
    "memory_formula",
    "state_shardings",
]
