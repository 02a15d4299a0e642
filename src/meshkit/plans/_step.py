"""The training step of a plan: gradients with the data-axis collectives written out, then optax.

The gradient runs in ``jax.shard_map`` manual over the ``data`` axis only (the ``model`` axis, if
any, stays with the compiler, which partitions the tensor-parallel matmuls). Collectives on the
data axis, per ZeRO stage, with ``m`` micro-batches accumulated locally:

- dp:    local sum over micro-batches, then one all-reduce of the gradients (with one micro-batch,
         and for tensor parallelism alone, the whole gradient is left to XLA's partitioner, which
         emits that same single all-reduce);
- zero1: local sum, then one reduce-scatter (every device holds full local gradients, as ZeRO-1);
- zero2: one reduce-scatter per micro-batch into a sharded accumulator;
- hsdp:  zero3 within each group of the ``data`` axis, the batch split over ``replica`` x ``data``
         (the region manual over both); after the micro-batch loop each gradient shard is
         all-reduced over ``replica`` (P / N bytes, one all-reduce once XLA combines them);
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

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.plans import _buckets as buckets
from meshkit.plans import _context, _experts, _fsdp, _rng
from meshkit.plans._deterministic import deterministic_gradients
from meshkit.plans._manual import accumulating, manual_data
from meshkit.plans.placement import Placement
from meshkit.spec import CONTEXT, DATA, EXPERT, REPLICA, PlanError

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


def _finish(acc: Any, placement: Placement, scatter_now: bool, scale: float) -> Any:
    """Reduce what is still local (one all-reduce of every leaf kept whole: all of them under dp), scale."""
    if scatter_now:
        acc = _scatter(acc, placement)
    grads = jax.tree.leaves(acc)
    whole = [i for i, leaf in enumerate(placement.flat()) if leaf.data_dim is None]
    # over a size-1 axis XLA rejects the psum (fsdp+tp, data=1); hsdp: whole leaves over replica x data
    axes = tuple(a for a in placement.batch_axes if placement.mesh.shape[a] > 1)
    if whole and axes:
        specs = [buckets.model_spec(placement.flat()[i]) for i in whole]
        summed = buckets.manual_sum(lambda t: lax.psum(t, axes), [grads[i] for i in whole], specs)
        for i, g in zip(whole, summed, strict=True):
            grads[i] = g
    if placement.replica_size > 1:  # hsdp: the data axis's shards, each all-reduced across the replicas
        shards = [i for i, leaf in enumerate(placement.flat()) if leaf.data_dim is not None]
        for i, g in zip(shards, lax.psum([grads[i] for i in shards], REPLICA), strict=True):
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


def local_gradients(
    loss_fn: LossFn, placement: Placement, accumulate: int, per: _fsdp.PerLayer, compute_dtype: Any = None
) -> Callable:
    """The per-device gradient function (inside the manual data region).

    With ``compute_dtype`` (mixed precision) under zero3, the parameter shards are cast before the
    all-gathers and the gradients reduce-scattered in that dtype (half the bytes for bf16), then
    cast back to the parameters' dtype before they are accumulated and the optimizer sees them.
    """
    low = compute_dtype is not None and placement.plan.gathers_in_compute_dtype
    scale = 1.0 / (placement.batch_devices * accumulate)
    axes = placement.batch_axes  # (replica, data) under hsdp: the chunk's index is row-major over both
    axis = axes if len(axes) > 1 else DATA

    def first_row(j, rows):
        return (lax.axis_index(axis) * accumulate + j) * rows

    chunk = _chunk_grad(loss_fn, per, first_row)  # zero3: gathers per layer where the loss has layers

    def grad_fn(params, state, micro, key, j):
        with manual_data(axis):
            return chunk(_cast(params, compute_dtype) if low else params, state, micro, key, j)

    def scatter(g):  # per-layer leaves come back already reduce-scattered
        return _tree_apply(
            lambda leaves, _, n: buckets.reduce_scatter(leaves, per.whole_step_leaves(), n), g, placement
        )

    def run(params, state, batch, key):
        per_micro = scatter if placement.plan.shards_gradients else (lambda g: g)
        if low:
            per_micro = lambda g: jax.tree.map(lambda s, p: s.astype(p.dtype), scatter(g), params)  # noqa: E731
        loss, aux, state, acc = _accumulate(grad_fn, params, state, batch, key, accumulate, per_micro)
        grads = _finish(
            acc,
            placement,
            scatter_now=placement.plan.shards_optimizer and not placement.plan.shards_gradients,
            scale=scale,
        )
        if placement.batch_devices == 1:  # over a size-1 axis XLA rejects the collective (fsdp+tp, data=1)
            return loss, aux, state, grads
        mean = lambda t: buckets.manual_sum(lambda v: lax.pmean(v, axis), t)  # noqa: E731
        return mean(loss), mean(aux), state, grads

    return run


def context_gradients(
    loss_fn: LossFn,
    placement: Placement,
    accumulate: int,
    per: _fsdp.PerLayer,
    form: str,
    compute_dtype: Any = None,
) -> Callable:
    """Context plans: the batch's sequences in ``_context.balanced_order``, split over the context axis
    (and its rows over data), the loss traced with the split in force (attention in ``form``), then one
    all-reduce of the gradients over data and context. Every device holds as many tokens, so the mean
    of the devices' mean losses is the global mean.

    fsdp+cp: zero3 over data within the region (parameters arrive as data shards, gathered per layer,
    gradients reduce-scattered over data per micro-batch, ``_fsdp``), replicated over context: after the
    micro-batch loop each gradient shard is all-reduced over context (as hsdp's over replica), and a
    leaf kept whole on data over data and context."""
    mesh = placement.mesh
    n = int(mesh.shape[CONTEXT])
    axes = tuple(a for a in (DATA, CONTEXT) if a in mesh.shape)
    data = DATA in mesh.shape
    scale = 1.0 / (n * placement.data_size * accumulate)
    zero3 = placement.plan.shards_params and per.gathers
    low = zero3 and compute_dtype is not None and placement.plan.gathers_in_compute_dtype

    def first_row(j, rows):
        return ((lax.axis_index(DATA) if data else 0) * accumulate + j) * rows

    chunk = _chunk_grad(loss_fn, per, first_row)

    def grad_fn(params, state, micro, key, j):
        return chunk(_cast(params, compute_dtype) if low else params, state, micro, key, j)

    def scatter(g, params):  # zero3: per-layer leaves come back reduce-scattered already
        g = _tree_apply(
            lambda leaves, _, k: buckets.reduce_scatter(leaves, per.whole_step_leaves(), k), g, placement
        )
        return jax.tree.map(lambda s, p: s.astype(p.dtype), g, params) if low else g

    def reduce(acc):
        if not zero3:
            return jax.tree.map(lambda g: lax.psum(g, axes) * scale, acc)
        split = [leaf.data_dim is not None for leaf in placement.flat()]
        out = [
            lax.psum(g, CONTEXT if s else axes) * scale
            for g, s in zip(jax.tree.leaves(acc), split, strict=True)
        ]
        return jax.tree.unflatten(jax.tree.structure(acc), out)

    def run(params, state, batch, key):
        per_micro = (lambda g: scatter(g, params)) if zero3 else (lambda g: g)
        with _context.split_sequence(n, form) as split:
            loss, aux, state, acc = _accumulate(grad_fn, params, state, batch, key, accumulate, per_micro)
        _context.check_attended(split)
        mean = lambda t: jax.tree.map(lambda v: lax.pmean(v, axes), t)  # noqa: E731
        return mean(loss), mean(aux), state, reduce(acc)

    rows = P(DATA if data else None, CONTEXT)
    specs = placement.tree(lambda leaf: leaf.manual_spec(data=zero3))
    region = jax.shard_map(run, mesh=mesh, in_specs=(specs, P(), rows, P()), out_specs=(P(), P(), P(), specs),
                           axis_names=set(axes), check_vma=False)  # fmt: skip

    def grads(params, state, batch, key):
        return region(params, state, _context.to_balanced(batch, n), key)

    return grads


def expert_gradients(loss_fn: LossFn, placement: Placement, accumulate: int, per: _fsdp.PerLayer) -> Callable:
    """Expert plans: the batch's rows over data x expert, each device holding ``E / N`` experts' weights
    (leaves with an ``expert`` dim) and every other leaf whole; the loss traced with the expert split
    in force (its MoE rows travel to their experts by all_to_all and back, ``_experts``). Then one
    all-reduce of the dense gradients over data x expert and one of the expert gradients over data
    (each device's expert gradient already sums every expert-group device's tokens, through the
    all_to_all's transpose).

    fsdp+ep: the dense leaves zero3 over data within the region (gathered per layer, gradients
    reduce-scattered over data per micro-batch, ``_fsdp``), their gradient shards then all-reduced over
    expert (as hsdp's over replica); expert leaves whole on data, as above."""
    axes = placement.batch_axes
    dense_axes = tuple(a for a in axes if placement.mesh.shape[a] > 1)
    expert_axes = tuple(a for a in dense_axes if a != EXPERT)
    scale = 1.0 / (placement.batch_devices * accumulate)
    chunk = _chunk_grad(loss_fn, per, lambda j, rows: (lax.axis_index(axes) * accumulate + j) * rows)
    zero3 = placement.plan.shards_params and per.gathers
    # per leaf, the axes its gradient is summed over after the micro-batch loop
    sums = [
        expert_axes if EXPERT in leaf.model_spec
        else tuple(a for a in dense_axes if a != DATA) if zero3 and leaf.data_dim is not None
        else dense_axes
        for leaf in placement.flat()
    ]  # fmt: skip

    def scatter(g):  # zero3: per-layer leaves come back reduce-scattered already
        return _tree_apply(
            lambda leaves, _, n: buckets.reduce_scatter(leaves, per.whole_step_leaves(), n), g, placement
        )

    def reduce(acc):
        leaves = jax.tree.leaves(acc)
        out = [lax.psum(g, a) if a else g for g, a in zip(leaves, sums, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(acc), [g * scale for g in out])

    def run(params, state, batch, key):
        with _experts.split_experts(placement.expert_size) as split:
            loss, aux, state, acc = _accumulate(
                chunk, params, state, batch, key, accumulate, scatter if zero3 else (lambda g: g)
            )
        per.experts = tuple(split.rows[-1:])  # the ledger's all_to_all size
        mean = lambda t: jax.tree.map(lambda v: lax.pmean(v, axes), t)  # noqa: E731
        return mean(loss), mean(aux), state, reduce(acc)

    specs = placement.tree(lambda leaf: leaf.spec(data=zero3))
    return jax.shard_map(run, mesh=placement.mesh, in_specs=(specs, P(), placement.batch_spec(), P()),
                         out_specs=(P(), P(), P(), specs), axis_names=set(axes), check_vma=False)  # fmt: skip


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
    partitioner, which emits the single gradient all-reduce the model predicts; everything else
    runs manual over the data axis. ``per`` carries the remat policy and records the layers found.
    """
    per = _fsdp.PerLayer(placement=placement) if per is None else per
    if placement.plan.context:
        return context_gradients(loss_fn, placement, accumulate, per, form, compute_dtype)
    if placement.plan.expert:
        return expert_gradients(loss_fn, placement, accumulate, per)
    if not placement.has_data_axis or (not placement.plan.shards_optimizer and accumulate == 1):
        chunk = _chunk_grad(loss_fn, per, lambda j, rows: j * rows)

        def plain(params, state, batch, key):
            loss, aux, state, acc = _accumulate(chunk, params, state, batch, key, accumulate)
            return loss, aux, state, jax.tree.map(lambda g: g / accumulate, acc)

        return plain
    zero3 = placement.plan.shards_params
    in_specs = (placement.tree(lambda leaf: leaf.manual_spec(data=zero3)), P(), placement.batch_spec(), P())
    out_specs = (
        P(),
        P(),
        P(),
        placement.tree(lambda leaf: leaf.manual_spec(data=placement.plan.shards_optimizer)),
    )
    return jax.shard_map(
        local_gradients(loss_fn, placement, accumulate, per, compute_dtype),
        mesh=placement.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(placement.batch_axes),
        check_vma=False,  # collectives are written out explicitly; no implicit psum on transpose
    )


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
    if not (placement.plan.shards_optimizer and not placement.plan.shards_params) or all(
        leaf.data_dim is None for leaf in placement.flat()
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
    gather = _param_gather(placement)
    mesh = placement.mesh
    grad_sh = placement.tree(
        lambda leaf: NamedSharding(mesh, leaf.spec(data=placement.plan.shards_optimizer))
    )
    with_norm = grad_norm or clip_norm is not None
    if per_layer is not None:
        per_layer.global_norm = with_norm

    def step(params, opt_state, state, batch, key):
        loss, aux_out, state, grads = grads_of(params, state, batch, key)
        grads = lax.with_sharding_constraint(grads, grad_sh)
        metrics = {**(aux_out or {}), "loss": loss}
        if with_norm:
            metrics["grad_norm"] = norm = norm_of(grads)
            if clip_norm is not None:
                factor = jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-30))
                grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if gather is not None:  # update the shards where they live, then one bucketed all-gather
            params = gather(lax.with_sharding_constraint(params, grad_sh))
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
    ), placement.plan.name, placement.batch_axes + ((CONTEXT,) if placement.plan.context else ()))  # fmt: skip


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
