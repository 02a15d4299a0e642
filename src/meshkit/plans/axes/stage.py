"""The stage axis (plans ``pp``, ``dp+pp``, ``fsdp+pp``, ``tp+pp``...): the layers split into pipeline
stages.

The technique is ``plans._pipeline`` (with ``_schedule`` and ``_stages``): it builds its own gradient
path, which replaces the step's region, and its ledger rows are its own (``_pipeline_report``). Here:
what the planner prices on the axis, the pipeline's sends per step, and the layouts it refuses.
"""

from __future__ import annotations

from typing import Any

from meshkit.analysis.cost import ring_traffic
from meshkit.plans.axes._base import AxisPlan, Flow, divisors
from meshkit.spec import STAGE, STEADY_SCHEDULES


class StageAxis(AxisPlan):
    axis = STAGE

    def flows(self, step: Any) -> list[Flow]:
        """The pipeline's sends per step, exposed, through one NIC where stages span hosts. Megatron:
        each activation and its gradient sent once per chunk (split over tp); meshkit's programs: the
        activation and the cotangent permuted on every tick, the replicated top's gradients all-reduced
        over the stages, and under an interleaved schedule the chunks permuted into schedule order at the
        start and their gradients back."""
        s, lay, conv = step, step.layout, step.job.convention
        pp, v, m = lay.pp, lay.virtual_stages, s.m
        if pp == 1:
            return []
        act = s.tokens_mb * s.shape.width * s.job.act_bytes
        if s.meshkit:
            sends = 4 * (v * m + pp - 1)
            nbytes = sends * act + ring_traffic("all-reduce", s.top_params * conv.grad, pp)
            if v > 1:
                nbytes += s.stage_layers * (conv.param + conv.grad)
        else:
            nbytes, sends = 2 * v * m * act / lay.tp, 2 * v * m
        return [Flow(axis=STAGE, op="collective-permute", nbytes=nbytes, count=sends, stride=s.inner(STAGE),
                     size=pp, one_nic=True)]  # fmt: skip

    def search_degrees(self, shape: Any, cluster: Any, job: Any, devices: int) -> list[int]:
        """pp up to the layers (where it does not divide them the busiest stage holds the rounded-up share)."""
        return [p for p in divisors(devices) if p <= shape.layers]

    def check_layout(self, shape: Any, layout: Any, job: Any) -> str | None:
        p, v = layout.pp, layout.virtual_stages
        if p == 1:
            return "virtual stages need pp > 1" if v > 1 else None
        if shape.layers < p * v:
            return f"pp*virtual_stages={p * v} exceeds layers={shape.layers}"
        m = job.global_batch // (layout.batch_ways * layout.microbatch_size)
        if layout.schedule in STEADY_SCHEDULES and m < p:
            return f"{layout.schedule} needs micro-batches >= pp: {m} < {p}"
        if layout.schedule == "interleaved" and m % p:
            return f"interleaved runs micro-batches in groups of pp={p}: {m} is not a multiple"
        return None


PLAN = StageAxis()
