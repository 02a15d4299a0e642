"""The gradients of a plan's step: the batch axes' collectives written out, in one region.

One gradient region serves every plan (``manual_gradients``): ``jax.shard_map`` manual over the
union of the plan's batch-like axes (``replica``, ``data``, ``expert``, ``context``: those it uses),
the ``model`` axis, if any, left to the compiler, which partitions the tensor-parallel matmuls. The
context split (each device ``T / C`` of every sequence, ``_context``) and the expert split (``E / N``
experts per device, their rows sent by all_to_all, ``_experts``) are in force while the loss is
traced where their axis is used; so context and expert parallelism combine with tensor parallelism
and with ZeRO-3 by the same code. After the micro-batch loop each leaf's gradient is summed over the
region's axes less those it is split on (``Placement.sum_axes``): ``data`` where ZeRO
reduce-scattered it, ``expert`` for an expert leaf. Collectives on the data axis, per ZeRO stage,
with ``m`` micro-batches accumulated locally:

- dp:    local sum over micro-batches, then one all-reduce of the gradients (with one micro-batch,
         and for tensor parallelism alone, the whole gradient is left to XLA's partitioner, which
         emits that same single all-reduce);
- zero1: local sum, then one reduce-scatter (every device holds full local gradients, as ZeRO-1);
- zero2: one reduce-scatter per micro-batch into a sharded accumulator;
- hsdp:  zero3 within each group of the ``data`` axis, the batch split over ``replica`` x ``data``;
         after the micro-batch loop each gradient shard is all-reduced over ``replica`` (P / N
         bytes, one all-reduce once XLA combines them); fsdp+cp, fsdp+ep and fsdp+tp+cp the same,
         the context or expert axis in the replicas' place;
- zero3: where the loss has layers (a ``lax.scan`` over stacked leaves, or blocks marked with
  ``meshkit.layer``), each layer gathers its parameters inside and reduce-scatters their gradients
  in its backward pass (``_fsdp``); every other leaf is all-gathered before each micro-batch's
  gradient (XLA hoists that gather out of the micro-batch loop: the parameters are loop-invariant),
  and its gradient reduce-scattered per micro-batch. (Differentiating through the bucketed gather instead would make its transpose, a
  pad of every leaf to the bucket's size, cost time quadratic in the leaf count.)

The loss has one internal form, ``(params, state, batch, key) -> (loss, (aux, state))``: ``state``
(BatchNorm statistics, RNG counters) is threaded through the micro-batches, never differentiated,
and comes back replicated; ``aux`` metrics are averaged like the loss. Each chunk of the batch (a
device's rows of a micro-batch) sees ``key`` and the PRNG keys in ``state`` as rows keys at the
chunk's first row (``_rng``), so random draws equal a single device's on the whole batch.

Reduce-scatters and all-gathers are bucketed per dtype (``_buckets``). Leaves a ZeRO plan keeps
whole are all-reduced once. The step (``_step``) updates the parameters from these gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshkit.plans import _buckets as buckets
from meshkit.plans import _fsdp, _rng, axes
from meshkit.plans._manual import accumulating, manual_data
from meshkit.plans.placement import Placement
from meshkit.spec import Plan

LossFn = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, tuple[Any, Any]]]
"""``(params, state, batch, key) -> (loss, (aux, new_state))``."""


def _split_micro(batch: Any, m: int) -> Any:
    return jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m, *a.shape[1:])), batch)


def _tree_apply(fn, tree: Any, placement: Placement) -> Any:
    """Apply a list function over the leaves of a parameter-shaped tree."""
    leaves = jax.tree.leaves(tree)
    return jax.tree.unflatten(jax.tree.structure(tree), fn(leaves, placement.flat(), placement.data_size))


def _gather(params: Any, placement: Placement) -> Any:
    return _tree_apply(buckets.all_gather, params, placement)


def _scatter(grads: Any, placement: Placement) -> Any:
    """Reduce-scatter the data-sharded leaves (bucketed); replicated leaves stay local."""
    return _tree_apply(buckets.reduce_scatter, grads, placement)


def _finish(
    acc: Any, placement: Placement, scatter_now: bool, scale: float, live: tuple[str, ...] | None = None
) -> Any:
    """Reduce what is still local over the region's ``live`` axes (those of more than one device;
    default the batch axes), then scale: each leaf's gradient is summed over them less the axes it is
    split on (``Placement.sum_axes``), one all-reduce per distinct set, the leaves kept whole first
    (all of them under dp)."""
    if scatter_now:
        acc = _scatter(acc, placement)
    grads = jax.tree.leaves(acc)
    flat = placement.flat()
    if live is None:  # (a pipeline's region: its batch axes)
        live = tuple(a for a in placement.batch_axes if placement.mesh.shape[a] > 1)
    groups: dict[tuple[bool, tuple[str, ...]], list[int]] = {}
    for i, leaf in enumerate(flat):
        if over := placement.sum_axes(leaf, live):
            groups.setdefault((leaf.data_dim is not None, over), []).append(i)
    for (_, over), idx in sorted(groups.items(), key=lambda kv: kv[0][0]):  # whole leaves first
        specs = [buckets.model_spec(flat[i]) for i in idx]
        summed = buckets.manual_sum(lambda t, o=over: lax.psum(t, o), [grads[i] for i in idx], specs)
        for i, g in zip(idx, summed, strict=True):
            grads[i] = g
    return jax.tree.unflatten(jax.tree.structure(acc), [g * scale for g in grads])


def _chunk_grad(
    loss_fn: LossFn, per: _fsdp.PerLayer, first_row: Callable[[int | jax.Array, int], jax.Array]
) -> Callable:
    """``(params, state, micro, key, j) -> ((loss, (aux, state)), grads)`` on micro-batch ``j``,
    with the keys offset to the chunk's first row of the global batch (``first_row(j, rows)``);
    per layer (gathers, remat) where ``per`` says so (``_fsdp``)."""

    def pair(p, extra):  # the form _fsdp differentiates: (params, everything else) -> (loss, aux)
        return loss_fn(p, *extra)

    def inner(params, state, micro, key, j):
        rows = jax.tree.leaves(micro)[0].shape[0]
        offset = first_row(j, rows)
        extra = (_rng.with_offset(state, offset, rows), micro, _rng.rows_key(key, offset, rows))
        (loss, (aux, new)), grads = _fsdp.value_and_grad(pair, per, params, extra)
        return (loss, (aux, _rng.without_offset(new))), grads

    return inner


def _accumulate(
    grad_fn: Callable,
    params: Any,
    state: Any,
    batch: Any,
    key: jax.Array,
    m: int,
    per_micro: Callable = lambda g: g,
):
    """Mean loss and aux, final state and summed ``per_micro(grads)`` over ``m`` micro-batches
    (a scan when m > 1; the state runs through them in order)."""
    if m == 1:
        (loss, (aux, state)), grads = grad_fn(params, state, batch, key, 0)
        return loss, aux, state, per_micro(grads)
    micros = _split_micro(batch, m)

    def one(state, micro, j):
        with accumulating(m):
            (loss, (aux, state)), grads = grad_fn(params, state, micro, key, j)
        return loss, aux, state, per_micro(grads)

    def body(carry, xs):
        loss, aux, state, grads = one(carry[2], *xs)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        return (carry[0] + loss, add(carry[1], aux), state, add(carry[3], grads)), None

    shapes = jax.eval_shape(one, state, _first(micros), 0)
    zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731
    carry = (zeros(shapes[0]), zeros(shapes[1]), state, zeros(shapes[3]))
    (loss, aux, state, acc), _ = lax.scan(body, carry, (micros, jnp.arange(m)))
    return loss / m, jax.tree.map(lambda a: a / m, aux), state, acc


def _cast(tree: Any, dtype: Any) -> Any:
    """Floating leaves of ``tree`` in ``dtype``."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


@contextlib.contextmanager
def _splits(placement: Placement, per: _fsdp.PerLayer, form: str) -> Iterator[None]:
    """The loss traced with the plan's splits in force, each axis's own (``plans.axes``: the sequence
    over ``context``, attention in ``form``; the experts over ``expert``), and their checks after it."""
    with contextlib.ExitStack() as stack:
        for axis in axes.active(placement.plan):
            stack.enter_context(axis.tracing(placement, per, form))
        yield


def manual_gradients(
    loss_fn: LossFn,
    placement: Placement,
    accumulate: int,
    per: _fsdp.PerLayer,
    compute_dtype: Any = None,
    form: str = "ring",
) -> Callable:
    """The one gradient region of every plan the partitioner does not take alone: ``jax.shard_map``
    manual over the union of the plan's batch-like axes (``Placement.region_axes``), each device on its
    rows (and, under context parallelism, its ``T / C`` of every sequence, in
    ``_context.balanced_order``). The collectives are written out (``check_vma=False``: no implicit
    psum on a transpose).

    Per micro-batch the ZeRO collectives on ``data`` (zero2/3: the reduce-scatter; zero3: the
    parameters gathered, per layer where the loss has layers, ``_fsdp``); after the loop zero1's
    reduce-scatter and each leaf's sum over the other axes (``_finish``), then the scale by the
    devices' count: each holds as many tokens, so the mean of their means is the global mean. With
    ``compute_dtype`` (mixed precision) where the plan gathers in it, the parameter shards are cast
    before the gathers and the gradients reduce-scattered in that dtype (half the bytes for bf16),
    then cast back before they are accumulated and the optimizer sees them."""
    plan, mesh = placement.plan, placement.mesh
    rows, axes_, live = placement.batch_axes, placement.region_axes, placement.live_axes
    row_axis = rows if len(rows) > 1 else rows[0] if rows else None  # hsdp: row-major over both
    low = compute_dtype is not None and plan.gathers_in_compute_dtype
    sequence = [a for a in axes_ if a not in rows]  # the axes that split every sequence (context)
    scale = 1.0 / (placement.batch_devices * axes.sequence_split(placement) * accumulate)

    def first_row(j, n):
        return ((lax.axis_index(row_axis) if rows else 0) * accumulate + j) * n

    chunk = _chunk_grad(loss_fn, per, first_row)  # zero3: gathers per layer where the loss has layers
    gplace = trained_placement(placement, per)  # the gradients' leaves: the trainable ones

    def grad_fn(params, state, micro, key, j):
        with manual_data(row_axis):
            return chunk(_cast(params, compute_dtype) if low else params, state, micro, key, j)

    def per_micro(g, params):  # per-layer leaves come back already reduce-scattered
        if plan.shards_gradients:  # (the layers are known once the loss is traced)
            whole = [x for x in _trained(per.whole_step_leaves(), per) if x is not None]
            g = _tree_apply(lambda x, _, n: buckets.reduce_scatter(x, whole, n), g, gplace)
        return jax.tree.map(lambda s, p: s.astype(p.dtype), g, _trained(params, per)) if low else g

    def run(params, state, batch, key):
        with _splits(placement, per, form):
            loss, aux, state, acc = _accumulate(
                grad_fn, params, state, batch, key, accumulate, lambda g: per_micro(g, params)
            )
        scatter_now = plan.shards_optimizer and not plan.shards_gradients
        grads = _finish(acc, gplace, scatter_now, scale, live)
        if not live:  # over a size-1 axis XLA rejects the collective (fsdp+tp, data=1)
            return loss, aux, state, grads
        over = live if len(live) > 1 else live[0]
        mean = lambda t: buckets.manual_sum(lambda v: lax.pmean(v, over), t)  # noqa: E731
        return mean(loss), mean(aux), state, grads

    def specs(data: bool, where: Placement = placement) -> Any:
        return where.tree(lambda leaf: leaf.manual_spec(data=data, manual=axes_))

    rows_spec = P(row_axis, *sequence) if sequence else placement.batch_spec()
    region = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(specs(plan.shards_params), P(), rows_spec, P()),
        out_specs=(P(), P(), P(), specs(plan.shards_optimizer, gplace)),
        axis_names=set(axes_),
        check_vma=False,
    )

    def arranged(params, state, batch, key):  # each axis's layout of the batch (context: balanced order)
        for axis in axes.active(plan):
            batch = axis.arrange(batch, placement)
        return region(params, state, batch, key)

    return arranged


def trained_placement(placement: Placement, per: _fsdp.PerLayer | None) -> Placement:
    """The placement of the leaves that get gradients (all of them unless some are frozen)."""
    trainable = None if per is None else per.trainable
    return placement if trainable is None else trainable.placement(placement)


def _trained(tree: Any, per: _fsdp.PerLayer | None) -> Any:
    """A parameter-structured tree's trainable leaves (``_frozen.Trainable.train``)."""
    trainable = None if per is None else per.trainable
    return tree if trainable is None else trainable.train(tree)


def _first(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[0], tree)


def in_region(plan: Plan, live: bool, data_axis: bool, accumulate: int, frozen: bool) -> bool:
    """Whether a plan's gradients run in the manual region (``manual_gradients``) rather than left to
    XLA's partitioner alone: ``live``, some region axis has more than one device; ``data_axis``, the
    mesh has a data axis; ``frozen``, some leaves do not train. Attention reads it too: a Pallas kernel
    (splash) runs only where no axis but the model axis is left to the partitioner
    (``plans.attention``), so only in the region, and the planner's memory of meshkit's step with it.

    An axis beyond data that splits the batch (context, expert) always runs it; frozen leaves under dp
    do (the region sums the trainable leaves' gradients; left to it, XLA's partitioner may sum a LoRA
    weight's whole merged gradient instead of its adapters'); a ZeRO stage over a data axis of one
    device does not (written out over it, its buckets and gathers were copies XLA keeps: one TPU v5e,
    a 0.7 B Llama, 2.6x the bytes and 1.6x the step of dp)."""
    if any(rule.splits for rule in plan.rules):
        return True
    return live and data_axis and (plan.shards_optimizer or accumulate > 1 or frozen)


def gradient_fn(
    loss_fn: LossFn,
    placement: Placement,
    accumulate: int,
    per: _fsdp.PerLayer | None = None,
    compute_dtype: Any = None,
    form: str = "ring",
) -> Callable:
    """Global-view ``(params, state, batch, key) -> (loss, aux, state, grads)`` with the plan's collectives.

    Plain data parallelism of one micro-batch (and tensor parallelism alone) is left to XLA's
    partitioner, which emits the single gradient all-reduce the model predicts, and so is every plan
    whose region axes all have one device (nothing to shard or sum); everything else runs in the one
    manual region (``manual_gradients``). ``per`` carries the remat policy and
    records the layers found.
    """
    per = _fsdp.PerLayer(placement=placement) if per is None else per
    live = bool(placement.live_axes)
    if not in_region(placement.plan, live, placement.has_data_axis, accumulate, per.trainable is not None):
        chunk = _chunk_grad(loss_fn, per, lambda j, rows: j * rows)

        def plain(params, state, batch, key):
            loss, aux, state, acc = _accumulate(chunk, params, state, batch, key, accumulate)
            return loss, aux, state, jax.tree.map(lambda g: g / accumulate, acc)

        return plain
    return manual_gradients(loss_fn, placement, accumulate, per, compute_dtype, form)
