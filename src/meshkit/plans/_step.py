"""The training step of a plan: gradients with the batch axes' collectives written out, then optax.

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
whole are all-reduced once. The optimizer update then runs in the global view on the sharded
gradients and state; zero1/2 update the shards where they live and all-gather the new parameters
in one bucket. Clipping by global norm is computed over the sharded gradients (scalar all-reduces).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.plans import _buckets as buckets
from meshkit.plans import _fsdp, _rng, axes
from meshkit.plans._deterministic import deterministic_gradients
from meshkit.plans._manual import accumulating, manual_data
from meshkit.plans.placement import Placement
from meshkit.spec import DATA, PlanError

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


def _finish(acc: Any, placement: Placement, scatter_now: bool, scale: float,
            live: tuple[str, ...] | None = None) -> Any:  # fmt: skip
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


def _accumulate(grad_fn: Callable, params: Any, state: Any, batch: Any, key: jax.Array, m: int,
                per_micro: Callable = lambda g: g):  # fmt: skip
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


def manual_gradients(loss_fn: LossFn, placement: Placement, accumulate: int, per: _fsdp.PerLayer,
                     compute_dtype: Any = None, form: str = "ring") -> Callable:  # fmt: skip
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
    region = jax.shard_map(run, mesh=mesh, in_specs=(specs(plan.shards_params), P(), rows_spec, P()),
                           out_specs=(P(), P(), P(), specs(plan.shards_optimizer, gplace)), axis_names=set(axes_),
                           check_vma=False)  # fmt: skip

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
    plan = placement.plan
    split = any(rule.splits for rule in plan.rules)  # an axis beyond data that splits the batch
    # frozen leaves under dp: the region sums the trainable leaves' gradients (left to it, XLA's partitioner
    # may sum a LoRA weight's whole merged gradient instead of its adapters')
    # a ZeRO stage over a data axis of one device shards nothing: written out over it, its buckets and
    # gathers were copies XLA keeps (one TPU v5e, a 0.7 B Llama: 2.6x the bytes and 1.6x the step of dp)
    alone = not split and not placement.live_axes
    if alone or (
        not split
        and (
            not placement.has_data_axis
            or (not plan.shards_optimizer and accumulate == 1 and per.trainable is None)
        )
    ):
        chunk = _chunk_grad(loss_fn, per, lambda j, rows: j * rows)

        def plain(params, state, batch, key):
            loss, aux, state, acc = _accumulate(chunk, params, state, batch, key, accumulate)
            return loss, aux, state, jax.tree.map(lambda g: g / accumulate, acc)

        return plain
    return manual_gradients(loss_fn, placement, accumulate, per, compute_dtype, form)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepShardings:
    """Shardings pinned on the step's inputs and outputs."""

    params: Any
    opt_state: Any
    batch: NamedSharding
    scalar: NamedSharding
    state: Any = None
    """The model's other state (replicated), structured like it."""


def state_shardings(optimizer: optax.GradientTransformation, params: Any, placement: Placement) -> Any:
    """Optimizer-state shardings: parameter-shaped leaves follow the plan, the rest replicated."""
    mesh = placement.mesh
    shapes = jax.eval_shape(optimizer.init, params)
    specs = placement.state_specs()
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: NamedSharding(mesh, spec),
        shapes,
        specs,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
        is_leaf=lambda x: isinstance(x, P),
    )


def _param_gather(placement: Placement) -> Callable | None:
    """ZeRO-1/2: the all-gather of the updated parameter shards (bucketed), or None."""
    if (
        not (placement.plan.shards_optimizer and not placement.plan.shards_params)
        or placement.data_size == 1
        or all(leaf.data_dim is None for leaf in placement.flat())
    ):
        return None
    return jax.shard_map(
        lambda p: _gather(p, placement),
        mesh=placement.mesh,
        in_specs=(placement.tree(lambda leaf: leaf.manual_spec(data=True)),),
        out_specs=P(),
        axis_names={DATA},
        check_vma=False,
    )


def build_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    placement: Placement,
    shardings: StepShardings,
    *,
    accumulate: int = 1,
    clip_norm: float | None = None,
    grad_norm: bool = False,
    donate: bool = True,
    compute_dtype: Any = None,
    per_layer: _fsdp.PerLayer | None = None,
    gradients: Callable | None = None,
    context_attention: str = "ring",
    deterministic: int | None = None,
) -> Callable:
    """The jitted step ``(params, opt_state, state, batch, key) -> (params, opt_state, state, metrics)``.

    Metrics: the loss, the loss's aux metrics (averaged over the batch, replicated), and
    the global gradient norm when clipping or ``grad_norm`` asks for it (it costs a reduction over
    every gradient, which the compiler may fuse into the last collective). ``gradients`` replaces
    the plan's gradient function (a pipeline's, from ``_pipeline``), same signature as ``gradient_fn``'s.
    ``deterministic``: that many micro-shards summed in one fixed tree (``_deterministic``).
    """
    grads_of = gradients or gradient_fn(
        loss_fn, placement, accumulate, per_layer, compute_dtype, context_attention
    )
    norm_of = optax.tree.norm
    if deterministic is not None and gradients is None:
        grads_of, norm_of = _deterministic_grads(loss_fn, placement, deterministic, per_layer)
    elif deterministic is not None:  # a pipeline's: its norm taken in its region, from the whole sum
        norm_of = lambda _: gradients.norm()  # noqa: E731
    gplace = trained_placement(placement, per_layer)
    gather = _param_gather(gplace)
    mesh = placement.mesh
    grad_sh = gplace.tree(lambda leaf: NamedSharding(mesh, leaf.spec(data=placement.plan.shards_optimizer)))
    with_norm = grad_norm or clip_norm is not None
    if per_layer is not None:
        per_layer.global_norm = with_norm

    def step(params, opt_state, state, batch, key):
        loss, aux_out, state, grads = grads_of(params, state, batch, key)
        if gradients is not None:  # a pipeline's gradients: every leaf's (the frozen ones' dropped here)
            grads = _trained(grads, per_layer)
        grads = lax.with_sharding_constraint(grads, grad_sh)
        metrics = {**(aux_out or {}), "loss": loss}
        if with_norm:
            metrics["grad_norm"] = norm = norm_of(grads)
            if clip_norm is not None:
                factor = jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-30))
                grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        new = optax.apply_updates(_trained(params, per_layer), updates)
        if gather is not None:  # update the shards where they live, then one bucketed all-gather
            new = gather(lax.with_sharding_constraint(new, grad_sh))
        params = (
            new
            if per_layer is None or per_layer.trainable is None
            else per_layer.trainable.merge(new, params)
        )
        return params, opt_state, state, metrics

    return _OwnShardingLine(jax.jit(
        step,
        in_shardings=(
            shardings.params,
            shardings.opt_state,
            shardings.state,
            shardings.batch,
            shardings.scalar,
        ),
        out_shardings=(shardings.params, shardings.opt_state, shardings.state, shardings.scalar),
        donate_argnums=(0, 1, 2) if donate else (),
        compiler_options=None if deterministic is None else DETERMINISTIC_COMPILER_OPTIONS,
    ), placement.plan.name, placement.region_axes)  # fmt: skip


DETERMINISTIC_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "algsimp,while-loop-simplifier"}
"""Deterministic mode's compile: XLA's algebraic simplifier rewrites by context (one partition turns
softmax's ``x / broadcast(s)`` into ``x * broadcast(1 / s)``, a program of several partitions keeps the
divide: one ulp apart), so the same loss would differ between 1 device and 2; without it the per-shard
gradients are the same bits on every mesh. (Fused multiply-adds, which XLA's CPU code uses by
the operands' shapes, are turned off for the process: ``meshkit.devices.prepare_deterministic``.)"""


def _deterministic_grads(
    loss_fn: LossFn, placement: Placement, shards: int, per: Any
) -> tuple[Callable, Callable]:
    """Deterministic mode's gradient function and its gradients' norm (taken from the whole summed
    gradient inside the region, not from the shards: a sum over shards is ordered by the mesh)."""
    region = deterministic_gradients(
        loss_fn, placement, shards, per or _fsdp.PerLayer(placement=placement), _chunk_grad
    )
    last: dict[str, jax.Array] = {}

    def grads_of(params, state, batch, key):
        loss, aux, state, grads, last["norm"] = region(params, state, batch, key)
        return loss, aux, state, grads

    return grads_of, lambda _: last["norm"]


#: JAX's refusals of a sharding annotation inside a region manual over that axis.
_OWN_SHARDING = ("Going from `Manual` AxisType", "can only refer to Auto axes", "contains a manual axes")


class _OwnShardingLine:
    """The jitted step, whose ``lower`` (and call) says in one line that the loss sets its own
    sharding where the plan runs it manual over its batch axes (``with_sharding_constraint``,
    ``reshard``, ``auto_axes``, a layer's ``out_sharding=``), instead of JAX's error from deep inside
    the trace."""

    def __init__(self, jitted: Any, plan: str, axes: tuple[str, ...] = (DATA,)) -> None:
        self.jitted, self.plan, self.axes = jitted, plan, axes

    def _translated(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except (NotImplementedError, ValueError) as e:
            if not any(m in str(e) for m in _OWN_SHARDING):
                raise
            axes = " and ".join(self.axes) or "its mesh axes"
            raise PlanError(
                f"the loss sets its own sharding ({_where(e)}) and plan {self.plan} runs it in jax.shard_map, "
                f"manual over {axes}, where JAX refuses that: remove the annotation (the plan places parameters and "
                "batch itself) or use plan dp or tp without accumulate="
            ) from None

    def lower(self, *args: Any) -> Any:
        return self._translated(self.jitted.lower, *args)

    def __call__(self, *args: Any) -> Any:
        return self._translated(self.jitted, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)


def _where(e: BaseException) -> str:
    """The innermost frame outside JAX and meshkit in ``e``'s traceback (or its cause's: where the
    annotation was traced), as ``file:line in function``."""
    found = "where is not known"
    for err in (e, e.__cause__):
        for frame in traceback.extract_tb(err.__traceback__) if err is not None else ():
            parts = frame.filename.split(os.sep)
            if "jax" not in parts and "meshkit" not in parts and "contextlib.py" not in parts:
                found = f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return found
