"""The seconds a step waits for what its mesh axes move. What each axis moves is its own module's
(``plans.axes``: ``AxisPlan.flows``, the ring model's bytes and collectives of the tensor-parallel
all-reduces, the pipeline's sends, context parallelism's K/V blocks or all-to-alls, expert
parallelism's all-to-alls, the data-parallel flows by ZeRO stage); here each ``Flow`` is priced at the
bandwidth and latency of the group it spans (``planner.network``) and set against the compute it may
hide behind (conventions: ``planner.predict``'s docstring)."""

from __future__ import annotations

from meshkit.planner.network import collective_latency, crosses_hosts, group_bandwidth
from meshkit.planner.stacks import STACKS, Calibration
from meshkit.planner.step import Step
from meshkit.plans.axes import AXIS_PLANS, Flow


def flows(s: Step) -> list[Flow]:
    """Every axis's flows for the step's layout, in ``AXIS_PLANS``' order."""
    return [f for axis in AXIS_PLANS.values() for f in axis.flows(s)]


def price(s: Step, flow: Flow, cal: Calibration) -> tuple[float, bool]:
    """(seconds of the flow the step waits for, whether it crosses hosts): its time at the group's
    bandwidth plus a latency per collective, of which ``edge`` is exposed and the rest hides behind
    ``window`` but for what does not fit and, where ``taxed``, the overlap tax."""
    c, stack = s.cluster, STACKS[s.job.stack]
    one_nic = flow.one_nic or (flow.by_stack and stack.one_nic)
    bandwidth = group_bandwidth(c, flow.stride, flow.size, one_nic=one_nic)
    if flow.by_stack:
        bandwidth *= cal.comm_efficiency.get(s.job.stack, 1.0)
    t = flow.nbytes / bandwidth + flow.count * collective_latency(c, flow.op, flow.stride, flow.size)
    hideable = t * (1 - flow.edge)
    tax = cal.overlap_tax * min(hideable, flow.window) if flow.taxed else 0.0
    return t * flow.edge + max(0.0, hideable - flow.window) + tax, crosses_hosts(flow.stride, flow.size, c)
