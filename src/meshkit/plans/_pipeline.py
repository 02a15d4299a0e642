"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) as one SPMD program over a ``stage`` mesh axis.

The model is given as ``Stages``: an embedding, L identical blocks whose parameters are stacked
with a leading layer axis, a head and a loss. The layer axis is split over the ``stage`` axis (each
device holds L/p consecutive layers; under the interleaved schedule v chunks of L/(p v)); the
embedding and head parameters are replicated, used on the first and last stage only, and their
gradients are summed over the stages once per step (an all-reduce of those leaves over ``stage``).
Off a stage axis the same ``Stages`` is a plain loss (``stages(params, batch)``), so one model runs
under every plan.

The step is ``jax.shard_map`` manual over ``stage`` (and ``data``): a ``lax.scan`` over the clock
ticks of a static schedule table (``_schedule``), where each device looks up its action for the
tick (forward, backward or idle, which micro-batch, which chunk, which buffer slots) and runs it
under ``lax.switch``. After every tick two ``lax.ppermute`` move one micro-batch's activation to
the next stage and one cotangent to the previous one (every tick, idle or not: the program is the
same on every device, so the permutes per step are ``2 x ticks``, each of one micro-batch's
activation bytes). Each message carries a tag (its micro-batch and destination stage); the device
records the tag it consumed at each tick, and that record, returned from the step as
``metrics["schedule"]`` (ticks x stages x (kind, micro-batch, virtual stage)), is what the bubble
is counted from: the schedule as executed, not as planned.

Backward by recomputation: a stage keeps only its input activation per micro-batch in flight
(GPipe: up to m per device; 1F1B: at most p), and its backward re-runs the chunk's forward under
``jax.vjp`` (one extra forward per micro-batch, as full activation checkpointing costs). The
alternative, ``jax.vjp`` residuals per micro-batch in the scan carry, needs a carry of every
block's intermediates for each slot (their pytree known only after tracing the chunk), many times
the stage input; recomputation keeps the carry to arrays of one known shape, and a schedule's
activation memory to its stash: slots x one micro-batch's activation.

Activation checkpointing (``remat``): the backward tick differentiates its chunk of k layers, and
without remat keeps every block's intermediates of that micro-batch while it does (k layers of
them, for one micro-batch at a time: the stash above is what scales with the schedule).
``remat="layer"`` runs each block under ``jax.checkpoint`` inside that recomputation, so the tick
keeps one input per block (k activations) and recreates one block's intermediates at a time, at
the cost of one more forward per block (forward tick, the chunk's recomputation, the block's);
``"dots"`` keeps the blocks' matmul outputs. Megatron's "full recompute" keeps every block's input
per micro-batch in flight; here the stash keeps only the stage's input, and ``layer`` bounds the
working set of the one micro-batch being differentiated. ``Pipeline.working_bytes`` models that
working set (``benchmarks/bench_pipeline.py`` part 4 sets the temporaries saved beside it).

Interleaved: the stored layer order gives device d a contiguous slice of the layer axis (so the
parameters keep the user's order and one NamedSharding), while the schedule wants virtual stages
``c p + d``; the step moves the chunks into that order with ppermutes at its start and the
gradients back at its end (modelled, in the ledger beside the per-tick permutes). Over ``data``:
an all-reduce of the gradients (dp+pp) or ZeRO-3 per stage (fsdp+pp: one bucketed gather, one
bucketed reduce-scatter per step). Over ``model`` (tp+pp and the 3D plans): the axis is left to
XLA's partitioner inside the manual region, as the other tensor-parallel plans do.

One stage (``stage=1``, v = 1) has nothing to send and no bubble: its schedule is gradient
accumulation over the micro-batches, and it runs as such (a scan of ``jax.value_and_grad``, one call
for m = 1), without the tick loop, the permutes or the recomputing backward; with one micro-batch
and neither ZeRO-3 nor a model axis it is the plan without stages (the global-view gradient, which
XLA's partitioner all-reduces as under dp), so it costs what dp costs (``benchmarks/bench_pipeline.py``
part 3). Its record is the schedule's table.

Why one SPMD program: MaxText (issue 752) says 1F1B "requires MPMD"; it does not, once the
schedule is a table of ticks that every device reads with its own index, and the collectives
(the two permutes) are issued unconditionally by every device each tick. Known costs of that
choice: idle ticks still permute (zeros), and the last stage's forward tick computes an activation
nobody receives (its backward recomputes it).

This module holds :class:`Pipeline`, the plan's pieces for the Trainer (its checks, sizes, memory
and communication models, and report); the step is ``_pipeline_region`` (the per-device region and
its global-view wrapper, re-exported here) running ``_pipeline_ticks`` (the tick loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshkit.plans import _schedule
from meshkit.plans._dataflow import dataflow
from meshkit.plans._pipeline_region import local_pipeline as local_pipeline
from meshkit.plans._pipeline_region import pipeline_gradients
from meshkit.plans._pipeline_report import PipelineReport
from meshkit.plans._remat import keeps_forward, remat_policy
from meshkit.plans._stages import Stages, check_sizes, relayout_count, stage_placement
from meshkit.plans.axes.model import adapter_sums
from meshkit.plans.placement import Placement
from meshkit.spec import ADAPTER_RANK, DATA, MODEL, PIPELINE_SCHEDULES, STAGE, ParallelSpec, PlanError, one_of


def _nbytes(a: Any) -> int:
    return int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize


def _deterministic_microbatches(spec: ParallelSpec, p: int, v: int, data: int) -> int:
    """Deterministic mode's micro-batches per data replica: its micro-shards shared out over the data
    axis (a micro-batch is one micro-shard, the same rows on every mesh)."""
    shards = spec.deterministic
    if shards % data:
        raise PlanError(
            f"deterministic={shards} micro-shards do not share out over data={data}: use deterministic={data} "
            "or more (a power of two), or a smaller data axis"
        )
    m = shards // data
    if spec.microbatches is not None and spec.microbatches != m:
        raise PlanError(
            f"deterministic mode runs one micro-batch per micro-shard, {shards} / data={data} = {m} per data "
            f"replica, not microbatches={spec.microbatches}: drop microbatches"
        )
    if p == 1 and v > 1:
        raise PlanError(
            "deterministic mode runs an interleaved schedule over 2 or more stages (one device holding both "
            "ends of the model adds their gradients in another order): use virtual_stages=1"
        )
    return m


def _check_backward_order(sched: _schedule.Schedule) -> None:
    """Deterministic mode adds a chunk's micro-batch gradients as their backwards end
    (``TreeAdder``), which needs every chunk's backwards in micro-batch order."""
    for d in range(sched.p):
        for c in range(sched.v):
            order = sched.mb[(sched.kind[:, d] == _schedule.BWD) & (sched.chunk[:, d] == c), d]
            if not np.array_equal(order, np.arange(sched.m)):
                raise PlanError(
                    f"deterministic mode needs each chunk's backwards in micro-batch order; schedule "
                    f"{sched.name} runs device {d}'s chunk {c} in the order {order.tolist()}: use {one_of(PIPELINE_SCHEDULES[:2])}"  # one chunk per device
                )


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    """A pipeline plan's pieces for the Trainer: the model, the schedule, the staged placement."""

    stages: Stages
    schedule: _schedule.Schedule
    placement: Placement
    layers: int
    remat: str = "none"
    """Activation checkpointing per block inside a chunk's recomputing backward: 'none', 'layer', 'dots'."""
    shards: int | None = None
    """Deterministic mode's micro-shards per step (``ParallelSpec.deterministic``): m per data replica."""
    norm: bool = False
    """Whether the step takes the gradients' norm (deterministic mode gathers its blocks' squares)."""

    @classmethod
    def make(
        cls,
        loss_fn: Any,
        params: Any,
        placement: Placement,
        spec: ParallelSpec,
        extras: dict[str, bool],
        norm: bool = False,
    ) -> Pipeline:
        """Check a pipeline plan's model and sizes (naming the fix) and build its schedule and placement.

        ``extras``: Trainer options the pipeline does not take yet (name -> whether given); ``norm``:
        whether the step takes the gradients' norm.
        """
        plan = placement.plan.name
        if not isinstance(loss_fn, Stages):
            raise PlanError(
                f"plan {plan} needs the model as meshkit.Stages(embed=, block=, head=, loss=) with stacked "
                f"block parameters (for the GPT: gpt.stages(cfg) with GPTConfig(scan_layers=True))"
            )
        if given := [k for k, v in extras.items() if v]:
            raise PlanError(
                f"plan {plan} does not take {', '.join(given)} yet: drop it, or use a plan without pp"
            )
        p = int(placement.mesh.shape[STAGE])
        m = p if spec.microbatches is None else spec.microbatches
        v, name = spec.virtual_stages, spec.schedule_name
        if spec.deterministic is not None:
            m = _deterministic_microbatches(spec, p, v, placement.data_size)
        check_sizes(loss_fn, params, p, m, v, name)
        sched = _schedule.build(name, p, m, v)
        if spec.deterministic is not None:
            _check_backward_order(sched)
        return cls(
            stages=loss_fn,
            schedule=sched,
            placement=stage_placement(placement, loss_fn),
            layers=loss_fn.layers(params),
            remat=spec.remat,
            shards=spec.deterministic,
            norm=norm,
        )

    @property
    def microbatches(self) -> int:
        return self.schedule.m

    def stage_bytes(self) -> int:
        """Parameter bytes of one stage, whole over data: its slice of the blocks and the embedding and
        head (what deterministic mode's block sums move)."""
        p = self.schedule.p
        return sum(x.nbytes // p if self._is_block(x) else x.nbytes for x in self.placement.flat())

    def summed_bytes(self) -> int:
        """Bytes of a device's block sums in deterministic mode: ``stage_bytes``, and on one stage the
        embedding and head's gradients twice (the lookup's and the head's halves, summed apart)."""
        top = sum(x.nbytes for x in self.placement.flat() if not self._is_block(x))
        return self.stage_bytes() + (top if (self.schedule.p, self.schedule.v) == (1, 1) else 0)

    def _is_block(self, leaf: Any) -> bool:
        return leaf.path.startswith(self.stages.blocks + "/")

    def gradients(self) -> Callable:
        return pipeline_gradients(self.stages, self.placement, self.schedule, self.remat, self.shards)

    def activation(self, params: Any, batch: Any, data_size: int) -> jax.ShapeDtypeStruct:
        """One micro-batch's activation on one device (what each permute moves and each slot holds)."""
        rows = jax.tree.leaves(batch)[0].shape[0] // (data_size * self.microbatches)
        micro = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((rows, *np.shape(a)[1:]), np.asarray(a).dtype), batch
        )
        return jax.eval_shape(self.stages.embed, self.stages.split(params)[0], micro)

    def working_bytes(self, params: Any, batch: Any, remat: str | None = None) -> float:
        """Bytes one backward tick keeps while it differentiates one micro-batch through one chunk
        (k = L / (p v) layers), per device without a model axis, under ``remat`` (default: the plan's).

        From ``saved_residuals`` of the chunk's ``lax.scan`` under the policy (every saved residual
        is a stacked output of the loop and counts whole, parameters excluded): without remat every
        block's intermediates (k layers of them); ``layer``: each block's input (k activations),
        plus one block's matmul outputs recreated in its backward (its elementwise ops are fused
        into the backward's consumers, as ``analysis.peak`` models them); ``dots``: the matmul
        outputs of k layers, the rest recreated inside fusions."""
        from jax._src.ad_checkpoint import saved_residuals

        remat = self.remat if remat is None else remat
        blocks = self.stages.split(params)[1]
        k = self.layers // (self.schedule.p * self.schedule.v)
        chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct((k, *np.shape(a)[1:]), a.dtype), blocks)
        act = self.activation(params, batch, self.placement.data_size)

        def saved(policy: str) -> float:
            run = lambda cp, x: jnp.sum(self.stages.run_blocks(cp, x, remat_policy(policy)))  # noqa: E731
            return float(
                sum(_nbytes(a) for a, where in saved_residuals(run, chunk, act) if "argument" not in where)
            )

        return saved(remat) + (saved("dots") / k if remat == "layer" else 0.0)

    def expected(self, params: Any, batch: Any, trainable: Any = None) -> list:
        """The pipeline's own collectives per step (beside ``expected_collectives``' data-axis rows):
        over ``stage`` (``_stage_rows``) and over ``model`` (tp+pp, ``_model_rows``). ``trainable``:
        a ``_frozen.Trainable``, or None where every leaf trains.

        These collectives sit in the branches of the tick's ``switch``, and the ledger counts a branch's
        collectives once per tick (as it counts any conditional's: at most that many), so the model
        counts them per tick too; a device runs them on its own F or B ticks only, m of the ticks each.
        One stage runs without ticks: one forward and one backward per micro-batch.
        """
        from meshkit.analysis.cost import ring_traffic
        from meshkit.plans._expected import Expected, _merge

        act = self.activation(params, batch, self.placement.data_size)
        item = act.dtype.itemsize  # XLA's CPU compiler moves sub-32-bit float collectives as f32
        item = max(item, 4) if self.placement.mesh.devices.flat[0].platform == "cpu" else item
        rows = self._stage_rows(int(np.prod(act.shape)) * item, trainable) + self._model_rows(
            act, item, trainable, self._norms(params, act)
        )
        return _merge(
            [
                Expected(
                    op=op,
                    axes=axis,
                    count=n,
                    size_bytes=n * size,
                    traffic_bytes=n * ring_traffic(op, size, g),
                    what=what,
                )
                for axis, op, n, size, g, what in rows
                if n
            ]
        )

    def _stage_rows(self, act_bytes: int, trainable: Any) -> list[tuple]:
        """The rows ``(axis, op, count, bytes, group, what)`` over ``stage``: two permutes of one
        activation per tick, the all-reduce of the top gradients (the trainable leaves': a frozen leaf's
        gradient is dropped, and XLA drops its sum), the all-gather of the executed record (and,
        interleaved, the chunks' relayout). Deterministic mode gathers the top gradients with the loss
        (and, taking the norm, the blocks' squares) to add them in stage order."""
        s, p, placement = self.schedule, self.schedule.p, self.placement
        if p == 1:
            return []
        blocks = [x for x in placement.flat() if self._is_block(x)]
        mask = (True,) * len(placement.flat()) if trainable is None else trainable.mask
        top = sum(x.nbytes for x, m in zip(placement.flat(), mask, strict=True) if m and x not in blocks)
        chunk = sum(x.nbytes // placement.split(x) for x in blocks) // s.v
        per_tick = "an activation forward, a cotangent back, per tick"
        relayout = "interleaved: chunks to their devices and back"
        rows = [
            (STAGE, "collective-permute", 2 * s.ticks, act_bytes, 2, per_tick),
            (STAGE, "collective-permute", 2 * relayout_count(p, s.v), chunk, 2, relayout),
            (STAGE, "all-gather", 1, s.ticks * p * 3 * 4, p, "the executed schedule record (int32)"),
        ]
        if self.shards is None:  # (n 0 where every top leaf is frozen: nothing summed)
            what = "embedding and head gradients, summed over the stages"
            return [*rows, (STAGE, "all-reduce", int(top > 0), top, p, what)]
        what = "deterministic: embedding and head gradients and the loss of every stage"
        rows.append((STAGE, "all-gather", 1, p * (top + 4), p, what))
        if self.norm:
            what = "deterministic: each block leaf's sum of squares"
            rows.append((STAGE, "all-gather", 1, p * 4 * len(blocks), p, what))
        return rows

    def _norms(self, params: Any, act: jax.ShapeDtypeStruct) -> tuple[frozenset[str], frozenset[str]]:
        """``_dataflow.dataflow`` of the blocks, as the placement's paths: the norms' scales and the matrices
        whose products a norm reads."""
        if self.placement.model_size == 1:
            return frozenset(), frozenset()
        run = lambda blocks, x: self.stages.run_blocks(blocks, x)  # noqa: E731
        found = dataflow(run, self.stages.split(params)[1], act)
        return tuple(
            frozenset(f"{self.stages.blocks}/{p}" for p in paths)
            for paths in (found.norm_scales, found.normed)
        )

    def _model_rows(self, act: jax.ShapeDtypeStruct, item: int, trainable: Any, found: tuple) -> list[tuple]:
        """The rows over ``model`` (tp+pp), per layer of a chunk: every row-parallel matrix all-reduces
        its output in the forward branch and again in the backward branch's recomputation (under
        ``layer`` remat the backward redoes every row-parallel output all-reduce but a block's last, unless
        a norm reads it), every column-parallel one its input gradient in the backward branch, a norm's
        scale split on ``model`` its statistics in each (``axes.model``'s norm rows), and every adapter
        of a frozen base its gradient sums (``axes.model.adapter_sums``). ``found``: ``_norms``."""
        s, p, placement = self.schedule, self.schedule.p, self.placement
        m = placement.model_size
        if m == 1:
            return []
        scales, normed = found
        blocks = [x for x in placement.flat() if self._is_block(x)]
        tokens, k = int(np.prod(act.shape[:-1])), self.layers // (p * s.v)
        row_parallel = [x for x in blocks if len(x.shape) == 3 and x.model_spec[1] == MODEL]
        last = 0 if row_parallel and row_parallel[-1].path in normed else 1
        redone = (
            row_parallel[: len(row_parallel) - last] if self.remat == "layer" else []
        )  # ``_fsdp.tp_matrices``
        # one stage runs each micro-batch's forward and backward once, without the tick loop
        runs, forwards = (s.m, 1) if p == 1 and s.v == 1 else (s.ticks, 2)
        rows = []
        for x in blocks:
            if ADAPTER_RANK in x.names:  # an adapter multiplies its partner, not the tokens
                continue
            if x in row_parallel:  # row-parallel: output partial sums, F and B (and B's remat)
                times = (forwards + (x in redone)) * runs * k
                rows.append((MODEL, "all-reduce", times, tokens * x.shape[2] * item, m, f"{x.path}: outputs"))
            elif len(x.shape) == 3 and x.model_spec[2] == MODEL:  # column-parallel: input-gradient sums, B
                what = f"{x.path}: input gradients"
                rows.append((MODEL, "all-reduce", runs * k, tokens * x.shape[1] * item, m, what))
            elif x.path in scales and x.model_sharded:  # a norm's statistics over a split width, F and B
                times = (forwards + 1 + (not keeps_forward(self.remat))) * runs * k  # remat: F redone in B
                rows.append(
                    (MODEL, "all-reduce", times, tokens * max(item, 4), m, f"{x.path}: its statistics")
                )
        for x, layers in adapter_sums(placement, trainable):  # per layer of a chunk, in the backward branch
            rows.append((MODEL, "all-reduce", runs * k, x.nbytes // layers, m, f"{x.path}: gradient sums"))
        return rows

    def report(self, record: Any, params: Any, batch: Any, temp_bytes: float) -> PipelineReport:
        s = self.schedule
        act = self.activation(params, batch, int(self.placement.mesh.shape.get(DATA, 1)))
        act_bytes = int(np.prod(act.shape)) * act.dtype.itemsize
        return PipelineReport(
            schedule=s.name,
            stages=s.p,
            microbatches=s.m,
            virtual_stages=s.v,
            ticks=s.ticks,
            bubble_model=_schedule.bubble_model(s.p, s.m, s.v),
            bubble_measured=None if record is None else _schedule.bubble_of(np.asarray(record)),
            executed_as_planned=None
            if record is None
            else bool(np.array_equal(np.asarray(record), s.table())),
            stash_slots=s.x_slots,
            cotangent_slots=s.g_slots,
            activation_bytes=act_bytes,
            activation_model_bytes=float((s.x_slots + s.g_slots + 2) * act_bytes),
            temp_bytes=float(temp_bytes),
            remat=self.remat,
            working_model_bytes=self.working_bytes(params, batch),
            record=None if record is None else np.asarray(record),
        )
