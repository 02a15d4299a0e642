"""The ZeRO rule, written once: for each stage, what it shards over the data axis, the bytes a device
keeps of each part at rest, and the collectives a step runs over the data axis (and, under hybrid
sharding, across the replicas of the shard group).

It is re-exported by ``meshkit.plans.memory`` (the memory model's owner) and lives here, beside the
ring formulas, so that every model of cost asks the same rule from its own layer: the chapter's
formulas (``analysis.cost.zero_memory`` and ``zero_communication``), the plan's ledger
(``plans._expected``), the peak report (``plans.peak``) and the planner (``planner.predict``,
``planner.runtime``, ``planner.auto``). Each passes byte counts per device (a leaf split on ``model``
counts its shard) and gets bytes back; how it counts the bytes (leaf by leaf, per layer, in the
compute dtype) stays with it.

The stages (``meshkit.spec.ZERO_STAGES``): dp shards nothing and all-reduces the gradients; ZeRO-1
shards the optimizer state, reduce-scatters the gradients once after the micro-batch loop and
all-gathers the updated parameters; ZeRO-2 also shards the gradients, reduce-scattered per
micro-batch; ZeRO-3 also shards the parameters, gathered for the forward pass (again for the
backward where they are not kept) and no longer gathered after the update.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshkit._errors import MeshkitError
from meshkit.analysis.ring import ring_traffic
from meshkit.spec import FIRST_SHARDED, ZERO_STAGES
from meshkit.spec import ZERO_PARTS as PARTS


def split_bytes(nbytes: float, sharded: float, ways: int) -> float:
    """Bytes a device holds of ``nbytes`` whose ``sharded`` part is divided ``ways`` ways (the rest, leaves
    a stage keeps whole, stays whole): the one arithmetic of every "at rest" (``ZeroStage.at_rest``,
    ``plans.memory.at_rest``)."""
    return nbytes - sharded + sharded / ways


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroCollective:
    """One kind of data-axis collective a stage runs per step."""

    op: str
    count: int
    """Executions per step."""
    size_bytes: float
    """S of one execution (S_in for a reduce-scatter, S_out for an all-gather)."""
    part: str
    """What it moves: ``grads`` or ``params``."""
    what: str

    def traffic(self, n: int) -> float:
        """Per-device ring traffic of every execution over a group of ``n``."""
        return self.count * ring_traffic(self.op, self.size_bytes, n)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroStage:
    """One ZeRO stage: what it shards, and what it moves (see the module docstring)."""

    name: str

    @property
    def level(self) -> int:
        return ZERO_STAGES.index(self.name)

    def shards(self, part: str) -> bool:
        """Whether the stage shards ``part`` (one of ``PARTS``) over the data axis."""
        if part not in FIRST_SHARDED:
            raise MeshkitError(f"unknown part {part!r}: use one of {', '.join(PARTS)}")
        return self.level >= FIRST_SHARDED[part]

    def split(self, part: str, n: int) -> int:
        """The ways ``part`` is divided over a data axis of ``n`` devices (1 where it stays whole)."""
        return n if self.shards(part) else 1

    def at_rest(self, part: str, nbytes: float, n: int, sharded: float | None = None) -> float:
        """Per-device bytes of ``part`` at rest: its ``sharded`` share (default all of it; leaves kept
        whole on data are the rest) divided over ``n``."""
        return split_bytes(nbytes, nbytes if sharded is None else sharded, self.split(part, n))

    def shard_group(self, dp: int, group: int = 0) -> int:
        """The devices the stage shards over: the data axis, or under hybrid sharding (HSDP, ZeRO-3
        only) the shard group of ``group`` replicas, replicated across the ``dp / group`` groups."""
        return group if group and self.shards("params") else dp

    def collectives(
        self, grads: float, params: float, *, microbatches: int = 1, gathers: int = 1
    ) -> tuple[ZeroCollective, ...]:
        """The data-axis collectives of one step for ``grads`` and ``params`` bytes (per device, as the
        collective moves them): ``microbatches`` per step; ``gathers``: ZeRO-3's parameter gathers per
        micro-batch (2 where the backward pass gathers again)."""
        m = microbatches

        def rs(count: int, what: str) -> ZeroCollective:
            return ZeroCollective(op="reduce-scatter", count=count, size_bytes=grads, part="grads", what=what)

        updated = ZeroCollective(
            op="all-gather", count=1, size_bytes=params, part="params", what="updated parameters"
        )
        if self.level == 0:
            return (
                ZeroCollective(op="all-reduce", count=1, size_bytes=grads, part="grads", what="gradients"),
            )
        if self.level == 1:
            return rs(1, "gradients, once after accumulation"), updated
        if self.level == 2:
            return rs(m, "gradients, per micro-batch"), updated
        gather = ZeroCollective(
            op="all-gather",
            count=m * gathers,
            size_bytes=params,
            part="params",
            what="parameters, per micro-batch",
        )
        return gather, rs(m, "gradients, per micro-batch")

    def across_replicas(self, grads: float, group: int, axis: str = "replica") -> ZeroCollective:
        """Hybrid sharding: each device's gradient shard (``grads / group``) all-reduced across the
        replicas of its shard group once per step, after the micro-batch loop."""
        return ZeroCollective(
            op="all-reduce",
            count=1,
            size_bytes=grads / group,
            part="grads",
            what=f"gradient shards, across {axis}",
        )


def zero_stage(stage: str | int) -> ZeroStage:
    """The stage by name (``meshkit.spec.ZERO_STAGES``) or level (0-3)."""
    if isinstance(stage, int) and 0 <= stage < len(ZERO_STAGES):
        return ZeroStage(name=ZERO_STAGES[stage])
    if stage not in ZERO_STAGES:
        raise MeshkitError(f"unknown stage {stage!r}: use one of {', '.join(ZERO_STAGES)} (or 0-3)")
    return ZeroStage(name=stage)
