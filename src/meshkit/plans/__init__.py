"""Parallel plans: data parallel, ZeRO-1/2/3 (FSDP), tensor parallel, pipelines, context parallel, and their
combinations.

What a plan is, and every allowed value, is ``meshkit.spec``'s. Here: ``place`` decides where every
leaf lives, ``assemble`` builds a spec's jitted step (the one assembly the Trainer, the peak model
and the planner's compile check share), ``expected_collectives`` and ``memory_formula`` say what it
should cost and ``peak`` what it should hold at its peak. One module per technique: ``_gradients`` (the
data axis, ZeRO stages; ``_step`` assembles the step around them), ``_fsdp`` (per-layer gathers and remat), ``_buckets`` (bucketed data-axis
collectives), ``_pipeline`` and ``_schedule`` (pipelines), ``_context`` (context parallelism: the
sequence split, and the causal attention the reference models call, ring or all-to-all), ``attention``
(each device's attention, fused or written out, and which runs), ``_experts``
(mixture of experts: routing, capacity, and the MoE MLP the reference models call, its tokens sent to
their experts by all_to_all under an expert split); tensor
parallelism is the placement's rules (``tp_rules``), partitioned by XLA.
"""

from meshkit.plans._context import causal_attention, check_context, exchange_segments, position_rows
from meshkit.plans._context import positions as sequence_positions
from meshkit.plans._dataflow import Dataflow, dataflow
from meshkit.plans._expected import (
    CommRow,
    Expected,
    MemoryRow,
    compare_communication,
    device_bytes,
    expected_collectives,
    memory_formula,
)
from meshkit.plans._experts import EXPERT_DIM, check_whole_sequences, expert_bias, expert_dot, moe
from meshkit.plans._frozen import Trainable
from meshkit.plans._gradients import in_region
from meshkit.plans._hook import layer
from meshkit.plans._loss import LossFn, step_loss
from meshkit.plans._manual import manual_data_axis, micro_batches
from meshkit.plans._pipeline import Pipeline
from meshkit.plans._remat import INT8_RESULT, keeps_forward, remat_policy
from meshkit.plans._schedule import Schedule, bubble_model
from meshkit.plans._schedule import build as build_schedule
from meshkit.plans._schedule import plot as plot_schedule
from meshkit.plans._stages import Stages
from meshkit.plans._step import StepShardings, build_step, state_shardings
from meshkit.plans.assemble import Assembled, assemble, spec_mesh
from meshkit.plans.attention import Attention, sink_softmax, use_attention
from meshkit.plans.placement import LeafPlacement, Placement, place
from meshkit.plans.tp_rules import DEFAULT_TP_RULES, Rules

__all__ = [
    "DEFAULT_TP_RULES",
    "EXPERT_DIM",
    "INT8_RESULT",
    "Assembled",
    "Attention",
    "CommRow",
    "Dataflow",
    "Expected",
    "LeafPlacement",
    "LossFn",
    "MemoryRow",
    "Pipeline",
    "Placement",
    "Rules",
    "Schedule",
    "Stages",
    "StepShardings",
    "Trainable",
    "assemble",
    "bubble_model",
    "build_schedule",
    "build_step",
    "causal_attention",
    "check_context",
    "check_whole_sequences",
    "compare_communication",
    "dataflow",
    "device_bytes",
    "exchange_segments",
    "expected_collectives",
    "expert_bias",
    "expert_dot",
    "in_region",
    "keeps_forward",
    "layer",
    "manual_data_axis",
    "memory_formula",
    "micro_batches",
    "moe",
    "place",
    "plot_schedule",
    "position_rows",
    "remat_policy",
    "sequence_positions",
    "sink_softmax",
    "spec_mesh",
    "state_shardings",
    "step_loss",
    "use_attention",
]
