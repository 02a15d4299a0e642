"""What each mesh axis moves per step and the seconds the step waits for it: the tensor-parallel
all-reduces, the pipeline's sends, context parallelism's K/V blocks or all-to-alls, expert
parallelism's all-to-alls, and the data-parallel flows by ZeRO stage (``plans.memory.zero_stage``),
each at the bandwidth and latency of the group it spans (``planner.network``; conventions:
``planner.predict``'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from meshkit.analysis.cost import ring_traffic
from meshkit.planner.network import collective_latency, crosses_hosts, group_bandwidth
from meshkit.planner.sizes import attention_core_flops, attention_widths, routed
from meshkit.planner.stacks import STACKS, Calibration
from meshkit.planner.step import Step
from meshkit.plans.memory import zero_stage


def model_axis(s: Step) -> tuple[float, float]:
    """(bytes, seconds) of one micro-batch's tensor-parallel all-reduces on one device."""
    tp, pp = s.layout.tp, s.layout.pp
    if tp == 1:
        return 0.0, 0.0
    if s.meshkit and pp > 1:  # a forward tick's 2 reduces per layer, a backward tick's 2 again + 4,
        # and under layer remat the block recomputed inside it redoes one (8 devices: 0.89 -> 1.00)
        count = (8 + s.recompute) * s.per_stage
    else:
        per_layer = 2 + (4 if s.meshkit else 2) + (1 if s.meshkit else 2) * s.recompute
        ends = 0 if s.meshkit else 2 if pp == 1 else 1  # vocab-parallel embedding, unembedding
        count = s.per_stage * per_layer + ends
    act = s.tokens_mb * s.shape.width * s.job.act_bytes  # one micro-batch's activation, whole
    nbytes = count * ring_traffic("all-reduce", act, tp)
    if s.meshkit and pp == 1 and s.top_split > 1:  # the vocabulary on the model axis: the lookup's
        # forward and the head's backward partial sums, and the cross-entropy's three all-reduces of a
        # number per token over the split logits (max, sum, target; at least float32: ``_expected``)
        count += 2 + 3
        nbytes += 2 * ring_traffic("all-reduce", act, tp)
        nbytes += 3 * ring_traffic("all-reduce", s.tokens_mb * max(s.job.act_bytes, 4), tp)
    seconds = nbytes / group_bandwidth(s.cluster, 1, tp) + count * collective_latency(
        s.cluster, "all-reduce", 1, tp
    )
    return nbytes, seconds


def stage_axis(s: Step) -> tuple[float, float]:
    """(bytes, seconds) per step of the pipeline's sends on one device (exposed)."""
    lay, conv = s.layout, s.job.convention
    pp, v, m = lay.pp, lay.virtual_stages, s.m
    if pp == 1:
        return 0.0, 0.0
    act = s.tokens_mb * s.shape.width * s.job.act_bytes
    if s.meshkit:  # activation and cotangent permuted on every tick, the replicated top's gradients
        # all-reduced over the stages
        nbytes = 4 * (v * m + pp - 1) * act + ring_traffic("all-reduce", s.top_params * conv.grad, pp)
        sends = 4 * (v * m + pp - 1)
        if v > 1:  # interleaved: the chunks permuted into schedule order at the start, gradients back
            nbytes += s.stage_layers * (conv.param + conv.grad)
    else:  # each activation and its gradient sent once per chunk
        nbytes, sends = 2 * v * m * act / lay.tp, 2 * v * m
    stride = lay.tp * s.batch_group
    seconds = nbytes / group_bandwidth(s.cluster, stride, pp, one_nic=True)
    return nbytes, seconds + sends * collective_latency(s.cluster, "collective-permute", stride, pp)


def context_axis(s: Step, cal: Calibration) -> tuple[float, float]:
    """(bytes, exposed seconds) of one micro-batch's context-parallel traffic on one device.

    Ring: every layer passes its K/V block ``cp - 1`` times forward (``collective-permute``, S each)
    and K/V with their gradients dK/dV backward (twice S), again per recomputed forward; each pass hides
    behind the attention it feeds (``attention_core_flops``), less the overlap tax. All-to-all: Q, K
    and V to a head split, the output back, ``(cp - 1) / cp`` of each, forward and twice backward."""
    lay, cp, e = s.layout, s.layout.cp, s.job.act_bytes
    if cp == 1:
        return 0.0, 0.0
    q, kv = attention_widths(s.shape)
    kv_local = max(kv / lay.tp, s.shape.head_dim)  # kv heads split over tp (whole heads: repeated below one)
    passes = (3 + s.recompute) * s.per_stage
    stride, c = lay.tp, s.cluster
    if s.job.context_attention == "all-to-all":
        size = s.tokens_mb * (2 * q / lay.tp + 2 * kv_local) * e
        nbytes = passes * ring_traffic("all-to-all", size, cp)
        t = nbytes / group_bandwidth(c, stride, cp) + 4 * passes * collective_latency(
            c, "all-to-all", stride, cp
        )
        return nbytes, t
    block = s.tokens_mb * 2 * kv_local * e  # K and V of this device's chunk
    nbytes = passes * (cp - 1) * ring_traffic("collective-permute", block, cp)
    steps = passes * (cp - 1)
    t = nbytes / group_bandwidth(c, stride, cp, one_nic=True) + steps * collective_latency(
        c, "collective-permute", stride, cp
    )
    attention = passes * attention_core_flops(s.shape) * s.tokens_mb / lay.tp / (s.peak_flops * s.eff)
    return nbytes, max(0.0, t - attention) + cal.overlap_tax * min(t, attention)


def expert_axis(s: Step) -> tuple[float, float]:
    """(bytes, seconds) of one micro-batch's expert-parallel all-to-alls on one device (exposed):
    per MoE layer, the tokens dispatched to their experts and combined back (``k x capacity_factor``
    copies of each token's activation, ``(ep - 1) / ep`` of them leaving the device), forward, their
    gradients backward, again per recomputed forward; dropless (``capacity_factor`` 0) the group's tokens
    gathered and the outputs reduce-scattered (the same bytes in a ring), as often."""
    lay, ep = s.layout, s.layout.ep
    if ep == 1:
        return 0.0, 0.0
    split = lay.tp if s.job.sequence_parallel else 1  # the tokens a tensor-parallel rank dispatches
    count = 2 * (2 + s.recompute) * s.per_stage  # dispatch and combine: forward, backward, recomputed forward
    tokens = s.tokens_mb * s.shape.width * s.job.act_bytes / split
    if s.shape.capacity_factor:
        op, size = "all-to-all", tokens * routed(s.shape) * s.shape.capacity_factor
    else:  # dropless: the expert group's tokens gathered, the outputs reduce-scattered back (``_experts``)
        op, size = "all-gather", tokens * ep
    nbytes = count * ring_traffic(op, size, ep)
    stride = lay.tp * lay.cp
    t = nbytes / group_bandwidth(s.cluster, stride, ep) + count * collective_latency(
        s.cluster, op, stride, ep
    )
    return nbytes, t


@dataclass(frozen=True, kw_only=True, slots=True)
class Flow:
    """Data-parallel traffic of one kind per step: bytes per device over a group, in ``count``
    collectives, hidden behind ``window`` seconds of compute but for the ``edge`` fraction."""

    nbytes: float
    count: int
    op: str
    stride: int
    size: int
    window: float
    edge: float
    axis: str = "data"
    """The mesh axis it runs over: data, or hybrid sharding's replica (across the shard groups)."""


def data_flows(s: Step) -> list[Flow]:
    """The data-parallel traffic of one step (the bytes as ``analysis.cost`` and ``plans`` count them)."""
    lay, conv, m, L = s.layout, s.job.convention, s.m, s.per_stage
    # the gradients of the dense parameters reduce over dp x cp x ep, the experts' over dp x cp: one
    # group of dp x cp x ep carries both (the experts' (n - 1) / n read at the larger n)
    dp, tp, g = s.batch_group, lay.tp, s.shard * lay.cp * lay.ep
    if dp == 1:
        return []
    rule = zero_stage(lay.zero)
    grad_b, param_b = conv.grad * s.phi, conv.param * s.phi
    flow = lambda nbytes, count, window, edge, op="all-gather", stride=tp, size=dp, axis="data": Flow(  # noqa: E731
        nbytes=nbytes, count=count, op=op, stride=stride, size=size, window=window, edge=edge, axis=axis
    )

    def step(rows, n: int, extra: float = 0.0) -> tuple[float, int]:  # (bytes, collectives) per layer
        return extra + sum(r.traffic(n) for r in rows), sum(r.count for r in rows)

    if not rule.shards("params"):  # one collective per layer and kind; the last layer's reduce unhidden
        # (ZeRO-1: its reduce-scatter and gather), the rest behind the backward of the micro-batches
        # whose gradients it reduces (ZeRO-2: each)
        nbytes, kinds = step(rule.collectives(grad_b, param_b, microbatches=m), dp)
        op, behind = (
            ("all-reduce", 1) if rule.level == 0 else ("all-gather", m if rule.shards("grads") else 1)
        )
        edge = 2 / (kinds * L) if rule.level == 1 else 1 / (kinds * L)
        return [flow(nbytes, kinds * L, behind * s.window, edge, op=op)]
    hidden = m * s.t_mb
    if s.meshkit and lay.pp > 1:  # fsdp+pp: one bucketed gather before the first tick, one bucketed
        # reduce-scatter after the last, both in the parameters' dtype (float32): nothing hides them
        nbytes, count = step(rule.collectives(param_b, param_b), dp)
        return [flow(nbytes, count, hidden, 1.0)]
    if s.meshkit:  # the top gathered once per step, each layer per micro-batch (again under remat),
        # gradients reduce-scattered per micro-batch; gathers and reduce-scatters in the compute dtype,
        # in float32 under tensor parallelism (``Plan.gathers_in_compute_dtype``: fsdp+tp gathers the
        # parameters' dtype; compiled bf16 1.3 B at 64 devices, data axis 2.00 -> 1.00)
        e = 4 if tp > 1 else s.job.act_bytes
        rows = rule.collectives(s.phi * e, (s.phi - s.top_params) * e, microbatches=m,
                                gathers=1 if lay.remat == "none" else 2)  # fmt: skip
        nbytes, count = step(rows, g, extra=ring_traffic("all-gather", s.top_params * e, g))
        flows = [flow(nbytes, 1 + count * L, hidden, 2 / (1 + count * L), size=g)]
        if g < dp:  # hsdp: the float32 gradient shards all-reduced across the dp / g groups once, after
            # the micro-batch loop (one all-reduce, XLA combines them): nothing hides it
            r, row = dp // g, rule.across_replicas(4 * s.phi, g)
            flows.append(
                flow(row.traffic(r), 1, hidden, 1.0, op="all-reduce", stride=tp * g, size=r, axis="replica")
            )
        return flows
    units = (9 if s.shape.gated else 12) if STACKS[s.job.stack].zero3_per_tensor else 1  # tensors a layer has
    # gathered for the forward, again for the backward, gradients reduce-scattered
    nbytes, count = step(rule.collectives(grad_b, param_b, microbatches=m, gathers=2), g)
    flows = [flow(nbytes, count * L * units, hidden, 2 / (count * L * units), size=g)]
    if g < dp:  # hybrid: each shard's gradient all-reduced across the dp / g groups
        r, row = dp // g, rule.across_replicas(grad_b, g)
        flows.append(
            flow(row.traffic(r), L, s.window, 1 / L, op="all-reduce", stride=tp * g, size=r, axis="replica")
        )
    return flows


def exposed(s: Step, flow: Flow, cal: Calibration) -> tuple[float, bool]:
    """(seconds of the flow the step waits for, whether it crosses hosts)."""
    c, tax = s.cluster, cal.overlap_tax
    bandwidth = group_bandwidth(c, flow.stride, flow.size, one_nic=STACKS[s.job.stack].one_nic)
    t = flow.nbytes / (bandwidth * cal.comm_efficiency.get(s.job.stack, 1.0))
    t += flow.count * collective_latency(c, flow.op, flow.stride, flow.size)
    hideable = t * (1 - flow.edge)
    exposed = t * flow.edge + max(0.0, hideable - flow.window) + tax * min(hideable, flow.window)
    return exposed, crosses_hosts(flow.stride, flow.size, c)
