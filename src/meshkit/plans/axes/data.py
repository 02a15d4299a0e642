"""The data axis: the batch's rows split over it, and the ZeRO stage's collectives on it.

The ZeRO rule (what each stage shards and moves) is ``plans.memory.zero_stage``'s; where each leaf is
split is the placement's (``_zero_split.data_dim``); the step writes the collectives out (``_gradients``,
per layer ``_fsdp``). Here: those collectives in the ledger's model, one row per kind, the per-layer
gathers of ZeRO-3 counted as the loss's layers run them (``_fsdp.gather_rows``). The sum over data of
the leaves a stage keeps whole is every axis's (``_expected._sum_rows``).
"""

from __future__ import annotations

from typing import Any

from meshkit.analysis.cost import ring_traffic
from meshkit.plans._fsdp import PerLayer, gather_rows
from meshkit.plans.axes._base import Add, AxisPlan, Flow, LedgerInputs
from meshkit.plans.memory import zero_stage
from meshkit.plans.placement import LeafPlacement, Placement
from meshkit.spec import DATA, REPLICA


def itemsize(leaf: LeafPlacement) -> int:
    size = 1
    for s in leaf.shape:
        size *= s
    return max(leaf.nbytes // max(size, 1), 1)


def model_bytes(leaf: LeafPlacement, placement: Placement) -> int:
    """A leaf's bytes on one device of its non-data splits (a model shard)."""
    return leaf.nbytes // placement.split(leaf)


class DataAxis(AxisPlan):
    axis = DATA

    def ledger(self, add: Add, inputs: LedgerInputs) -> None:
        """The stage's collectives over data (``ZeroStage.collectives``): the reduce-scatters and
        gathers of the leaves it shards, in the compute dtype where ZeRO-3 gathers in it
        (``gather_itemsize``); zero3's parameter gathers per layer where the loss has layers."""
        placement, accumulate = inputs.placement, inputs.accumulate
        n, rule = placement.data_size, zero_stage(placement.plan.zero)
        if n <= 1 or not rule.level:  # dp: no leaf is sharded, its all-reduce is the whole leaves' sum
            return
        width = inputs.gather_itemsize
        sharded_leaves = [x for x in placement.flat() if x.data_dim is not None]

        def gathered(x: LeafPlacement) -> int:  # one leaf's all-gather (the compute dtype's under zero3)
            return model_bytes(x, placement) * (width or itemsize(x)) // itemsize(x)

        trainable = None if inputs.per_layer is None else inputs.per_layer.trainable
        trained = [  # the leaves with gradients (frozen ones have none)
            x
            for x in (placement if trainable is None else trainable.placement(placement)).flat()
            if x.data_dim is not None
        ]
        sharded = sum(model_bytes(x, placement) for x in sharded_leaves)
        grads = sum(model_bytes(x, placement) for x in trained)
        if width is not None and rule.shards("params"):
            sharded, grads = sum(gathered(x) for x in sharded_leaves), sum(gathered(x) for x in trained)
        params = sharded if rule.shards("params") else grads  # zero1/2 gather the updated (trainable) leaves
        for row in rule.collectives(grads, params, microbatches=accumulate):
            if row.part == "params" and rule.shards("params"):  # zero3: per layer (``_fsdp``)
                per = inputs.per_layer or PerLayer(placement=placement)
                for count, size, what in gather_rows(per, accumulate, gathered):
                    add("all-gather", DATA, count, size, n, what)
            else:
                add(row.op, DATA, row.count, row.size_bytes, n, row.what)

    def flows(self, step: Any) -> list[Flow]:
        """The data-parallel traffic of one step by ZeRO stage (``ZeroStage.collectives``), over the
        devices that hold the same dense parameters (dp x cp x ep; the experts' gradients over dp x cp, read
        at the larger group), run by the stack's collectives (``Flow.by_stack``)."""
        s, lay = step, step.layout
        dp = s.batch_group
        g = s.shard * dp // lay.dp  # the ZeRO group: dp's shard group and the axes that split the batch
        if dp == 1:
            return []
        rule, conv, layers, m = zero_stage(lay.zero), s.job.convention, s.per_stage, s.m

        def flow(nbytes, count, window, edge, op="all-gather", stride=lay.tp, size=dp, axis=DATA) -> Flow:
            return Flow(axis=axis, op=op, nbytes=nbytes, count=count, stride=stride, size=size, window=window,
                        edge=edge, by_stack=True)  # fmt: skip

        def per_layer(rows, n: int, extra: float = 0.0) -> tuple[float, int]:  # (bytes, collectives)
            return extra + sum(r.traffic(n) for r in rows), sum(r.count for r in rows)

        if not rule.shards("params"):  # one collective per layer and kind; the last layer's reduce
            # unhidden (ZeRO-1: its reduce-scatter and gather), the rest behind the backward of the
            # micro-batches whose gradients it reduces (ZeRO-2: each)
            nbytes, kinds = per_layer(
                rule.collectives(conv.grad * s.phi, conv.param * s.phi, microbatches=m), dp
            )
            op, behind = (
                ("all-reduce", 1) if rule.level == 0 else ("all-gather", m if rule.shards("grads") else 1)
            )
            edge = 2 / (kinds * layers) if rule.level == 1 else 1 / (kinds * layers)
            return [flow(nbytes, kinds * layers, behind * s.window, edge, op=op)]
        hidden = m * s.t_mb
        if s.meshkit and lay.pp > 1:  # fsdp+pp: one bucketed gather before the first tick, one bucketed
            # reduce-scatter after the last, both in the parameters' dtype (float32): nothing hides them
            nbytes, count = per_layer(rule.collectives(conv.param * s.phi, conv.param * s.phi), dp)
            return [flow(nbytes, count, hidden, 1.0)]
        if s.meshkit:  # the top gathered once per step, each layer per micro-batch (again under remat),
            # gradients reduce-scattered per micro-batch; in the compute dtype, in float32 under tensor
            # parallelism (``Plan.gathers_in_compute_dtype``; compiled bf16 1.3 B at 64 devices, 2.00 -> 1.00)
            e = 4 if lay.tp > 1 else s.job.act_bytes
            rows = rule.collectives(s.phi * e, (s.phi - s.top_params) * e, microbatches=m,
                                    gathers=1 if lay.remat == "none" else 2)  # fmt: skip
            nbytes, count = per_layer(rows, g, extra=ring_traffic("all-gather", s.top_params * e, g))
            flows = [flow(nbytes, 1 + count * layers, hidden, 2 / (1 + count * layers), size=g)]
            if g < dp:  # hsdp: the float32 gradient shards all-reduced across the dp / g groups once, after
                # the micro-batch loop (one all-reduce, XLA combines them): nothing hides it
                r, row = dp // g, rule.across_replicas(4 * s.phi, g)
                flows.append(flow(row.traffic(r), 1, hidden, 1.0, op="all-reduce", stride=lay.tp * g, size=r,
                                  axis=REPLICA))  # fmt: skip
            return flows
        units = (9 if s.shape.gated else 12) if s.zero3_per_tensor else 1  # tensors a layer has
        # gathered for the forward, again for the backward, gradients reduce-scattered
        grads = rule.collectives(conv.grad * s.phi, conv.param * s.phi, microbatches=m, gathers=2)
        nbytes, count = per_layer(grads, g)
        flows = [flow(nbytes, count * layers * units, hidden, 2 / (count * layers * units), size=g)]
        if g < dp:  # hybrid: each shard's gradient all-reduced across the dp / g groups
            r, row = dp // g, rule.across_replicas(conv.grad * s.phi, g)
            flows.append(flow(row.traffic(r), layers, s.window, 1 / layers, op="all-reduce", stride=lay.tp * g,
                              size=r, axis=REPLICA))  # fmt: skip
        return flows


PLAN = DataAxis()
