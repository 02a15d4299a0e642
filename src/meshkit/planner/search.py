"""Every layout of a model on a cluster, predicted and ranked.

Enumerated: dp x each axis's degree = devices, the degrees each axis's module proposes
(``AxisPlan.search_degrees``: tp dividing the heads and inside a host, on a TPU slice, whose ICI joins
hosts at the bandwidth it joins chips, anywhere; pp up to the layers, where pp does not divide them the
busiest stage holding the rounded-up share, meshkit's own pipeline plans need it to divide; cp and ep
below); ZeRO stage 0-3 (1-3 only with dp > 1); micro-batch sizes dividing the per-replica batch
(up to ``MAX_MICROBATCH``);
pipeline schedules (1F1B, GPipe, interleaved with 2, 4 or 8 virtual stages, the busiest stage again
holding the rounded-up share where they do not divide its layers); remat none, dots, layer; and where ZeRO-3's data-parallel group spans hosts with more than
one of its devices on each, also hybrid sharding within a host (``predict(shard_group=...)``);
context parallelism cp where ``2 cp`` divides the sequence into chunks of at least
``plans.axes.context.CONTEXT_MIN_TOKENS`` tokens per device; expert parallelism ep, for mixtures of experts, where ep
divides the experts (the batch then splits over dp x ep).
Layouts that fit are ranked by predicted step time; every other one keeps the one line that says
why it was rejected.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from meshkit.planner.cluster import Cluster, Job
from meshkit.planner.layout import Layout, ModelShape
from meshkit.planner.network import crosses_hosts
from meshkit.planner.predict import Prediction, predict
from meshkit.planner.stacks import Calibration
from meshkit.plans.axes import AXIS_PLANS, AxisPlan, divisors
from meshkit.spec import MODEL, PIPELINE_REMAT, STAGE
from meshkit.spec import plans as spec_plans

REMATS = PIPELINE_REMAT
"""The remat policies the search tries (every plan takes them), the least recomputed first."""
MAX_MICROBATCH = 64
"""Largest micro-batch size tried (every divisor of the per-replica batch up to it)."""
VIRTUAL_STAGES = (2, 4, 8)


def layouts(shape: ModelShape, cluster: Cluster, job: Job) -> Iterator[Layout]:
    """The candidate layouts (see the module docstring): each axis's degrees as its module proposes them
    (``AxisPlan.search_degrees``), the data part on the devices left."""
    for degrees in _degrees(shape, cluster, job, list(spec_plans.AXIS_RULES), cluster.devices):
        yield from _layouts(shape, job, degrees, cluster.devices // math.prod(degrees.values()))


def _degrees(shape: ModelShape, cluster: Cluster, job: Job, rules: list, n: int) -> Iterator[dict[str, int]]:
    """Every choice of the rules' degrees on n devices, by token, each as its axis's module proposes."""
    if not rules:
        yield {}
        return
    axis = AXIS_PLANS.get(rules[0].axis, AxisPlan())
    for d in axis.search_degrees(shape, cluster, job, n):
        for rest in _degrees(shape, cluster, job, rules[1:], n // d):
            yield {rules[0].token: d, **rest}


def _layouts(shape: ModelShape, job: Job, degrees: dict[str, int], dp: int) -> Iterator[Layout]:
    """The layouts with these axis degrees and the data part over the other dp devices."""
    base = Layout(dp=dp, **degrees)
    pp = base.pp
    if job.global_batch % base.batch_ways:
        return
    per_replica = job.global_batch // base.batch_ways
    schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("gpipe", 1)]
    if pp > 1:
        schedules += [("interleaved", v) for v in VIRTUAL_STAGES if pp * v <= shape.layers]
    for b in divisors(per_replica):
        if b > MAX_MICROBATCH:
            break
        m = per_replica // b
        if pp > 1 and m < pp:
            continue
        for zero in range(4) if dp > 1 else (0,):
            for schedule, v in schedules:
                for remat in REMATS:
                    yield Layout(dp=dp, **degrees, zero=zero, microbatch_size=b, schedule=schedule,
                                 virtual_stages=v, remat=remat)  # fmt: skip


def shard_groups(layout: Layout, cluster: Cluster, job: Job) -> list[int]:
    """ZeRO-3's shard groups worth pricing: all of dp (0), and where dp spans hosts with k > 1 of its
    devices on each, the k within a host (hybrid sharding)."""
    meshkit_2d = job.runtime == "meshkit" and (layout.tp > 1 or layout.pp > 1)  # hsdp runs alone
    others = any(
        n > 1 for axis, n in layout.degrees if axis not in (MODEL, STAGE)
    )  # priced with dp x tp only
    if layout.zero != 3 or meshkit_2d or others:
        return [0]
    if not crosses_hosts(layout.tp, layout.dp, cluster):
        return [0]
    k = cluster.devices_per_host // layout.tp
    return [0, k] if 1 < k < layout.dp and layout.dp % k == 0 else [0]


@dataclass(frozen=True, kw_only=True, slots=True)
class Search:
    """Ranked layouts that fit, and the rejected ones with their reasons."""

    ranked: list[Prediction]
    """Fitting layouts, fastest first."""
    rejected: list[Prediction]
    """Layouts that do not fit or cannot run, smallest peak memory first."""

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None

    def closest(self) -> Prediction | None:
        """The valid layout needing the least memory (where nothing fits: by how much it misses)."""
        valid = [p for p in self.rejected if p.valid]
        return min(valid, key=lambda p: p.peak_bytes / p.limit_bytes) if valid else None

    def reasons(self) -> list[tuple[str, int]]:
        """Why layouts were rejected, summarised: (reason kind, how many)."""
        counts = Counter(_kind(p) for p in self.rejected)
        return counts.most_common()


def _kind(p: Prediction) -> str:
    if p.valid:  # named by its largest component
        part = max(p.memory, key=p.memory.get) if p.memory else "memory"
        return f"does not fit (largest part: {part.replace('_', ' ')})"
    why = p.why or ""
    return why.split(":")[0] if ":" in why else why


def _rank(p: Prediction) -> tuple:
    """Fastest first; among equals the least memory, then the simpler layout (less remat, lower ZeRO)."""
    lay = p.layout
    others = (n for axis, n in lay.degrees if axis != STAGE)
    return (round(p.step_time_s, 9), round(p.peak_bytes), REMATS.index(lay.remat), lay.zero, p.hybrid, lay.pp,
            *others)  # fmt: skip


def search(shape: ModelShape, cluster: Cluster, job: Job, calibration: Calibration | None = None) -> Search:
    """Predict every candidate layout (``calibration``: in place of the published runs', e.g. a chip's
    measurement, ``planner.measured``); rank those that fit by step time."""
    preds = [
        predict(shape, lay, cluster, job, shard_group=g, calibration=calibration)
        for lay in layouts(shape, cluster, job)
        for g in shard_groups(lay, cluster, job)
    ]
    ranked = sorted((p for p in preds if p.fits), key=_rank)
    rejected = sorted(
        (p for p in preds if not p.fits), key=lambda p: (not p.valid, p.peak_bytes / max(p.limit_bytes, 1))
    )
    return Search(ranked=ranked, rejected=rejected)
