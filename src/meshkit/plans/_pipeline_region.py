"""A pipeline plan's gradient function (see ``_pipeline``): the per-device step inside the manual
region over ``stage`` (and ``data``), i.e. the schedule's ticks (``_pipeline_ticks``) or, on one
stage, plain gradient accumulation, and the sums after it (over the stages, over the data axis, and
deterministic mode's fixed-order ones); and its global-view wrapper, ``pipeline_gradients``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshkit.plans import _buckets as buckets
from meshkit.plans import _schedule
from meshkit.plans._deterministic import TreeAdder, slice_shard, tree_sum
from meshkit.plans._gradients import _finish, _gather
from meshkit.plans._pipeline_ticks import _Ticks
from meshkit.plans._remat import remat_policy
from meshkit.plans._stages import Stages, relayout, split_loss, stages_join, whole_loss
from meshkit.plans.placement import Placement
from meshkit.spec import DATA, STAGE


def _micro(batch: Any, m: int) -> Any:
    return jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m, *a.shape[1:])), batch)


def local_pipeline(
    stages: Stages,
    sched: _schedule.Schedule,
    placement: Placement,
    remat: str = "none",
    shards: int | None = None,
) -> Callable:
    """Per-device ``(params, batch) -> (loss, record, grads, norm)`` inside the manual region.

    Over ``data``: gradients all-reduced (dp+pp), or under fsdp+pp (ZeRO-3) the parameter shards
    all-gathered once before the schedule and the gradients reduce-scattered once after it (both
    bucketed, ``_gradients``' helpers): the stage's full parameters live through the step.

    Deterministic mode (``shards``: the step's micro-shards, m per data replica): every micro-batch's
    loss and gradients are added in ``tree_sum``'s binary tree (``TreeAdder`` over a device's micro-batches
    as their backwards end, then the block sums of every data replica, all-gathered, in index order);
    the embedding and head gradients are added over the stages in stage order, and the gradients' norm
    is taken from the whole sum, so the bits are the same on any data axis for the same stages.
    ``norm`` is None outside deterministic mode."""
    region = _Region(stages, sched, placement, remat_policy(remat), shards)
    return region.single_stage if sched.p == 1 and sched.v == 1 else region.run


class _Region:
    """What :func:`local_pipeline` returns, with the sums its two forms share: ``run`` (the schedule's
    ticks over two or more virtual stages) and ``single_stage`` (p = v = 1)."""

    def __init__(
        self, stages: Stages, sched: _schedule.Schedule, placement: Placement, policy: Any, shards: int | None
    ) -> None:
        self.stages, self.sched, self.placement, self.policy, self.shards = (
            stages,
            sched,
            placement,
            policy,
            shards,
        )
        self.data_size, self.zero3 = placement.data_size, placement.plan.shards_params
        self.p, self.m, self.v = sched.p, sched.m, sched.v
        self.blocks_of = [leaf.model_spec[:1] == (STAGE,) for leaf in placement.flat()]

    def over_replicas(self, tree):
        """Deterministic mode: every data replica's block sums, gathered, added in index order."""
        return tree_sum(jax.tree.map(lambda x: lax.all_gather(x, DATA), tree)) if self.data_size > 1 else tree

    def in_tree_order(self, loss, grads):
        """Deterministic mode, after the sums: the norm and (fsdp+pp) this device's shard of the whole
        gradient."""
        loss, grads = lax.optimization_barrier((loss, grads))  # the last adds are not fused into the norm
        loss, grads = jax.tree.map(lambda x: x * (1.0 / self.shards), (loss, grads))
        flat = jax.tree.leaves(grads)
        squares = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in flat]
        if self.p > 1:  # a stage holds its blocks' slice: their squares added over the stages in stage order
            split = jnp.stack([sq for sq, b in zip(squares, self.blocks_of, strict=True) if b])
            split = iter(tree_sum(lax.all_gather(split, STAGE)))
            squares = [next(split) if b else sq for sq, b in zip(squares, self.blocks_of, strict=True)]
        norm = jnp.sqrt(sum(squares))
        if self.zero3:
            dims = [leaf.data_dim for leaf in self.placement.flat()]
            flat = [slice_shard(g, d, self.data_size) for g, d in zip(flat, dims, strict=True)]
        return loss, jax.tree.unflatten(jax.tree.structure(grads), flat), norm

    def over_data(self, loss, grads):
        data_size = self.data_size
        if self.zero3:
            grads = _finish(grads, self.placement, scatter_now=True, scale=1.0 / data_size)
        elif data_size > 1:
            grads = jax.tree.map(
                lambda g: g / data_size, buckets.manual_sum(lambda t: lax.psum(t, DATA), grads)
            )
        if data_size > 1:
            loss = buckets.manual_sum(lambda t: lax.pmean(t, DATA), loss)
        return loss, grads

    def gathered(self, params, batch):
        """ZeRO-3's stage parameters, gathered; deterministic mode keeps the gather (and the batch's
        split) from being fused into the micro-batches' gradients, whose bits would then follow the mesh."""
        if self.zero3:
            params = _gather(params, self.placement)
        return (params, batch) if self.shards is None else lax.optimization_barrier((params, batch))

    def run(self, params, batch):
        stages, p, v, shards = self.stages, self.p, self.v, self.shards
        params, batch = self.gathered(params, batch)
        top, blocks = stages.split(params)
        d = lax.axis_index(STAGE) if p > 1 else 0
        if v > 1 and p > 1:  # interleaved: this device's chunks c p + d, from its stored slice
            blocks = relayout(blocks, p, v, d, back=False)
        ticks = _Ticks(
            stages, self.sched, self.policy, top, blocks, _micro(batch, self.m), d, tree=shards is not None
        )
        acc_c, acc_t, loss, record = ticks.run()
        if v > 1 and p > 1:
            acc_c = relayout(acc_c, p, v, d, back=True)
        if shards is not None:
            acc_c, acc_t, loss = self.over_replicas((acc_c, acc_t, loss))
            # then over the stages: only the first holds the embedding's gradients and the last the head's
            # and the loss, each summed over every micro-shard already (a tied embedding adds its two
            # halves once, after all the micro-shards, as one stage does: ``split_loss``)
            if p > 1:
                acc_t, loss = tree_sum(jax.tree.map(lambda x: lax.all_gather(x, STAGE), (acc_t, loss)))
            loss, grads, norm = self.in_tree_order(loss, stages_join(stages, acc_t, acc_c))
            return loss, record[:, None, :], grads, norm
        if p > 1:
            acc_t, loss = buckets.manual_sum(lambda t: lax.psum(t, STAGE), (acc_t, loss))
        loss, grads = self.over_data(loss, stages_join(stages, acc_t, acc_c))
        return loss, record[:, None, :], grads, None

    def single_stage(self, params, batch):
        """One stage (p = v = 1): nothing to send and no bubble; its schedule (F j then B j) is gradient
        accumulation, run as a scan of ``jax.value_and_grad`` over the micro-batches (one call for
        m = 1): no tick loop, no permutes, no recomputing backward. The record is the table."""
        stages, m, policy = self.stages, self.m, self.policy
        params, batch = self.gathered(params, batch)
        micro = _micro(batch, m)
        if self.shards is not None:
            return self.single_stage_in_tree(params, micro)
        grad = jax.value_and_grad(lambda pr, mb: whole_loss(stages, pr, mb, policy) / m)
        if m == 1:
            loss, grads = grad(params, jax.tree.map(lambda a: a[0], micro))
        else:
            zero = jax.eval_shape(grad, params, jax.tree.map(lambda a: a[0], micro))
            step = lambda acc, mb: (jax.tree.map(jnp.add, acc, grad(params, mb)), None)  # noqa: E731
            loss, grads = lax.scan(step, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), zero), micro)[0]
        loss, grads = self.over_data(loss, grads)
        return loss, jnp.asarray(self.sched.table()), grads, None

    def single_stage_in_tree(self, params, micro):
        """Deterministic mode on one stage: each micro-batch's loss and gradients kept apart, added in
        the tree."""
        stages, m, policy = self.stages, self.m, self.policy
        top, blocks = stages.split(params)
        grad = jax.value_and_grad(
            lambda te, th, bl, mb: split_loss(stages, te, th, bl, mb, policy), argnums=(0, 1, 2)
        )
        adder = TreeAdder(m)

        def add(sums, j):
            return adder.add(sums, j, grad(top, top, blocks, jax.tree.map(lambda a: a[j], micro))), None

        zero = jax.eval_shape(grad, top, top, blocks, jax.tree.map(lambda a: a[0], micro))
        sums = adder.zeros(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), zero))
        loss, (at_embed, at_head, blocks) = self.over_replicas(
            adder.total(lax.scan(add, sums, jnp.arange(m, dtype=jnp.int32))[0])
        )
        # the embedding's and the head's gradients summed apart over every micro-shard, then added, as
        # over two stages (a tied embedding has both: adding them per micro-batch changes the bits)
        top = jax.tree.map(jnp.add, at_embed, at_head)
        loss, grads, norm = self.in_tree_order(loss, stages_join(stages, top, blocks))
        return loss, jnp.asarray(self.sched.table()), grads, norm


def pipeline_gradients(
    stages: Stages,
    placement: Placement,
    sched: _schedule.Schedule,
    remat: str = "none",
    shards: int | None = None,
) -> Callable:
    """Global-view ``(params, state, batch, key) -> (loss, {"schedule": record}, state, grads)``:
    the gradient function ``build_step`` takes for a pipeline plan (state and key pass through).
    Deterministic mode (``shards``): the function's ``norm()`` is the last call's gradient norm, taken
    in the region from the whole sum (``local_pipeline``).

    One stage and one micro-batch without ZeRO-3 or a model axis is the plan without stages: the
    loss's gradient in the global view, XLA's partitioner all-reducing it over ``data`` as under
    dp (so ``stage=1`` costs what dp costs)."""

    mesh = placement.mesh
    has_data = DATA in mesh.shape
    zero3 = placement.plan.shards_params
    one = (sched.p, sched.v, sched.m) == (1, 1, 1)
    if one and not zero3 and placement.model_size == 1 and shards is None:
        table, policy = jnp.asarray(sched.table()), remat_policy(remat)

        def plain(params, state, batch, key):
            loss, grads = jax.value_and_grad(lambda pr: whole_loss(stages, pr, batch, policy))(params)
            return loss, {"schedule": table}, state, grads

        return plain
    specs = placement.tree(
        lambda leaf: P(*[a if a in (STAGE, DATA) else None for a in leaf.spec(data=zero3)])
    )
    manual = {STAGE} | ({DATA} if has_data else set())
    body = jax.shard_map(
        local_pipeline(stages, sched, placement, remat, shards),
        mesh=mesh,
        in_specs=(specs, P(DATA) if has_data else P()),
        out_specs=(P(), P(None, STAGE), specs, None if shards is None else P()),
        axis_names=manual,
        check_vma=False,  # the collectives are written out; no implicit psum on transpose
    )
    last: dict[str, Any] = {}

    def grads_of(params, state, batch, key):
        loss, record, grads, last["norm"] = body(params, batch)
        return loss, {"schedule": record}, state, grads

    grads_of.norm = lambda: last["norm"]  # type: ignore[attr-defined]
    return grads_of
