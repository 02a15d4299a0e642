"""Parallel plans: data parallel, ZeRO-1/2/3 (FSDP), tensor parallel, pipelines, and their combinations.

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
from meshkit.plans._pipeline import Stages
from meshkit.plans._schedule import Schedule, bubble_model
from meshkit.plans._schedule import build as build_schedule
from meshkit.plans._schedule import plot as plot_schedule
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
    "Schedule",
    "Stages",
    "StepShardings",
    "bubble_model",
    "build_schedule",
    "build_step",
    "compare_communication",
    "device_bytes",
    "expected_collectives",
    "get_plan",
    "make_layout",
    "memory_formula",
    "plot_schedule",
    "state_shardings",
]
