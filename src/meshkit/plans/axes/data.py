"""The data axis: the batch's rows split over it, and the ZeRO stage's collectives on it.

The ZeRO rule (what each stage shards and moves) is ``plans.memory.zero_stage``'s; where each leaf is
split is the placement's (``_zero_split.data_dim``); the step writes the collectives out (``_gradients``,
per layer ``_fsdp``). Here: those collectives in the ledger's model, one row per kind, the per-layer
gathers of ZeRO-3 counted as the loss's layers run them (``_fsdp.gather_rows``). The sum over data of
the leaves a stage keeps whole is every axis's (``_expected._sum_rows``).
"""

from __future__ import annotations

from meshkit.plans._fsdp import PerLayer, gather_rows
from meshkit.plans.axes._base import Add, AxisPlan, LedgerInputs
from meshkit.plans.memory import zero_stage
from meshkit.plans.placement import LeafPlacement, Placement
from meshkit.spec import DATA


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


PLAN = DataAxis()
