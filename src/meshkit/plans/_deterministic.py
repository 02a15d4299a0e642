"""Deterministic mode: the same bits on 1, 2, 4 or 8 devices.

A step's bits depend on the mesh in two places: the reduction inside a device over its share of the
batch (XLA orders a sum by the shape it sums, and the share shrinks as devices are added), and the
sum across devices (a ring all-reduce or reduce-scatter adds in an order set by the device count).
Deterministic mode fixes both:

- the global batch is cut into ``S`` micro-shards of ``M = batch / S`` rows, ``S`` fixed by the spec
  (``ParallelSpec.deterministic``), whatever the mesh: each device runs the same per-shard gradient
  (a ``lax.map`` over its ``S / N`` shards, every shard's rows at the same offset of the global
  batch, so random keys draw as on one device) and keeps every shard's gradient;
- the ``S`` gradients are added as ONE binary tree, pairs ``(0, 1), (2, 3), ...`` level by level:
  each device holds a contiguous power-of-two block of shards and adds its block as a subtree (as its
  shards are done: ``TreeAdder``, ``log2(S / N) + 1`` partial sums rather than ``S / N`` gradients), then
  an ``all_gather`` brings every device's block sum and the upper levels of the same tree are added
  locally in index order. Elementwise adds in a fixed order are exact bit for bit, so the sum is the
  same on any power-of-two data axis up to ``S``.

The loss and the loss's aux metrics are added in the same tree; the gradients' global norm (clipping)
is taken from the whole gradient, the same on every device. ZeRO-1/2/3 then keep the shard of the
summed gradient that the device updates (the optimizer's update is elementwise: a shard's bits are the
whole update's); ZeRO-3 gathers its parameter shards once at the start of the step (the per-shard
gradients need whole parameters).

The price, in bytes: the all-gather of block sums moves ``(N-1) x |grad|`` into each device, where a
ring all-reduce moves ``2 (N-1) / N x |grad|`` (``N/2`` times as many; zero1-3's reduce-scatter moves
``(N-1) / N x |grad|``), plus ZeRO-3's whole-parameter gather; in memory, per device, ``log2(S / N) + 1``
partial sums of the gradients (``TreeAdder``) and ZeRO-3's whole parameters during the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshkit.plans import _fsdp
from meshkit.plans._expected import Expected
from meshkit.plans._manual import manual_data
from meshkit.plans.memory import zero_stage
from meshkit.plans.placement import Placement
from meshkit.spec import DATA, PLANS, PlanError


def tree_sum(stacked: Any) -> Any:
    """The sum over the leading dim of every leaf, as a binary tree: pairs ``(0, 1), (2, 3), ...``
    first, then pairs of those sums, and so on (an odd last term waits for the next level)."""

    def one(x: jax.Array) -> jax.Array:
        while x.shape[0] > 1:
            odd = x[-1:] if x.shape[0] % 2 else None
            even = x[: x.shape[0] // 2 * 2]
            even = even.reshape((even.shape[0] // 2, 2, *even.shape[1:]))
            x = even[:, 0] + even[:, 1]
            if odd is not None:
                x = jnp.concatenate([x, odd])
        return x[0]

    return jax.tree.map(one, stacked)


class TreeAdder:
    """Adds ``m`` (a power of two) values that arrive one at a time in index order ``0 .. m-1`` into
    the same binary tree as ``tree_sum``, holding ``log2(m) + 1`` partial sums instead of ``m``
    values: a binary counter. Value ``j`` is added to the partial sum of each level whose bit of
    ``j`` is set (the left neighbour's subtree) and rests at the first level whose bit is clear; the
    last value (every bit set) leaves the whole sum at the top level. ``j`` may be traced: the
    levels are selected elementwise, so the adds are the same in a loop whose order is data."""

    def __init__(self, m: int) -> None:
        if m < 1 or m & (m - 1):
            raise ValueError(f"TreeAdder sums a power of two of values, not {m}")
        self.levels = m.bit_length()

    def zeros(self, like: Any) -> tuple:
        return tuple(jax.tree.map(jnp.zeros_like, like) for _ in range(self.levels))

    def add(self, sums: tuple, j: Any, value: Any, when: Any = True) -> tuple:
        """``sums`` after value ``j`` arrives (unchanged where ``when`` is false)."""
        done = jnp.logical_not(when)
        out = []
        for level, partial in enumerate(sums):
            top = level == self.levels - 1
            bit = jnp.bool_(False) if top else (j >> level) & 1 == 1
            rest = jnp.logical_and(jnp.logical_not(done), jnp.logical_not(bit))
            out.append(jax.tree.map(lambda p, v, r=rest: jnp.where(r, v, p), partial, value))
            if not top:
                merge = jnp.logical_and(jnp.logical_not(done), bit)
                value = jax.tree.map(lambda p, v, m=merge: jnp.where(m, p + v, v), partial, value)
            done = jnp.logical_or(done, rest)
        return tuple(out)

    def total(self, sums: tuple) -> Any:
        return sums[-1]


def check_batch(examples: int, shards: int, batch_devices: int) -> None:
    """A global batch of ``examples`` must cut into ``shards`` micro-shards of equal size, and the
    shards share out evenly over the batch devices."""
    if shards % batch_devices:
        raise PlanError(
            f"deterministic={shards} micro-shards do not share out over {batch_devices} batch devices: use "
            f"deterministic={batch_devices} or more (a power of two), or fewer devices"
        )
    if examples % shards:
        raise PlanError(
            f"deterministic mode cuts the batch into {shards} micro-shards: a batch of {examples} examples "
            f"does not divide; use a multiple of {shards}"
        )


def _per_shard_layer(per: _fsdp.PerLayer, placement: Placement) -> _fsdp.PerLayer:
    """The per-layer settings over whole parameters (ZeRO-3's shards are gathered once beforehand)."""
    import dataclasses

    whole = dataclasses.replace(placement, plan=PLANS["dp"])
    return _fsdp.PerLayer(placement=whole, remat=per.remat)


def slice_shard(g: jax.Array, dim: int | None, n: int) -> jax.Array:
    """This device's rows of the whole gradient ``g`` on ``dim`` (the data axis's split)."""
    if dim is None or n == 1:
        return g
    size = g.shape[dim] // n
    return lax.dynamic_slice_in_dim(g, lax.axis_index(DATA) * size, size, axis=dim)


def _gathered(params: Any, placement: Placement) -> Any:
    """ZeRO-3's parameter shards gathered whole over the data axis (the per-shard gradients need whole
    parameters)."""
    leaves = [
        x if leaf.data_dim is None else lax.all_gather(x, DATA, axis=leaf.data_dim, tiled=True)
        for x, leaf in zip(jax.tree.leaves(params), placement.flat(), strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _sliced(grads: Any, placement: Placement) -> Any:
    """This device's shard of every whole gradient (``slice_shard``), what ZeRO-1/2/3 update."""
    dims = [leaf.data_dim for leaf in placement.flat()]
    flat = [slice_shard(g, d, placement.data_size) for g, d in zip(jax.tree.leaves(grads), dims, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(grads), flat)


def deterministic_gradients(
    loss_fn: Callable, placement: Placement, shards: int, per: _fsdp.PerLayer, chunk_grad: Callable
) -> Callable:
    """Global-view ``(params, state, batch, key) -> (loss, aux, state, grads, norm)``: the step's
    gradients (and their global norm) with the same bits on every power-of-two data axis up to
    ``shards``. ``state`` is threaded through a device's shards in order and comes back as the last
    device's; deterministic mode refuses stateful losses before it gets here. ``chunk_grad`` is the
    step's per-chunk gradient (``_gradients._chunk_grad``: random keys offset to the chunk's first row)."""
    plan = placement.plan
    n = placement.data_size
    if placement.batch_axes not in ((), (DATA,)):
        raise PlanError(
            f"deterministic mode runs over the data axis alone, not {' x '.join(placement.batch_axes)}"
        )
    local = shards // n
    whole = _per_shard_layer(per, placement)

    def first_row(j, rows):
        return ((lax.axis_index(DATA) if n > 1 else 0) * local + j) * rows

    chunk = chunk_grad(loss_fn, whole, first_row)

    def run(params, state, batch, key):
        if plan.shards_params and n > 1:
            params = _gathered(params, placement)
        micros = jax.tree.map(lambda a: a.reshape((local, a.shape[0] // local, *a.shape[1:])), batch)
        # what comes before (ZeRO-3's gather, the batch's split) is not fused into the shards' gradients
        params, micros = lax.optimization_barrier((params, micros))

        def shard(state, j):
            micro = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, j, keepdims=False), micros)
            with manual_data(DATA):
                (loss, (aux, state)), grads = chunk(params, state, micro, key, j)
            return state, (loss, aux, grads)

        out = jax.eval_shape(shard, state, 0)[1]
        adder = TreeAdder(local)  # this device's subtree of its `local` shards, added as they are done
        sums = adder.zeros(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out))

        def body(j, carry):
            state, sums = carry
            state, out = shard(state, j)
            return state, adder.add(sums, j, out)

        # a loop whose trip count the compiler cannot read, so that it is a loop on every mesh (one of a
        # single trip would be inlined and fused with its neighbours, changing the bits)
        trips = lax.optimization_barrier(jnp.int32(local))
        state, sums = lax.fori_loop(0, trips, body, (state, sums))
        block = adder.total(sums)
        if n > 1:  # the upper levels of the same tree, over every device's block sum in index order
            block = tree_sum(jax.tree.map(lambda x: lax.all_gather(x, DATA), block))
        # the sum's last adds are not fused into what reads it (the norm's reductions would otherwise be
        # compiled beside the all-gather on some meshes and beside the local tree on others)
        block = lax.optimization_barrier(block)
        loss, aux, grads = jax.tree.map(lambda x: x * (1.0 / shards), block)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        return loss, aux, state, _sliced(grads, placement) if plan.shards_optimizer else grads, norm

    if n == 1 and not placement.has_data_axis:
        raise PlanError("deterministic mode needs a data axis in the mesh (data=1 on one device)")
    in_specs = (
        placement.tree(lambda leaf: leaf.manual_spec(data=plan.shards_params)),
        P(),
        placement.batch_spec(),
        P(),
    )
    grad_specs = placement.tree(lambda leaf: leaf.manual_spec(data=plan.shards_optimizer))
    return jax.shard_map(
        run,
        mesh=placement.mesh,
        in_specs=in_specs,
        out_specs=(P(), P(), P(), grad_specs, P()),
        axis_names={DATA},
        check_vma=False,
    )


def expected(
    placement: Placement, param_bytes: int, scalars: int = 1, summed: int | None = None
) -> list[Expected]:
    """The collectives deterministic mode runs per step (ring model): the all-gather of every device's
    block sum (``summed`` bytes, default the gradients, which are parameter-sized, and ``scalars``
    float32 metrics: the loss and its aux), ZeRO-3's gather of the parameters and ZeRO-1/2's gather of
    the updated shards."""
    n = placement.data_size
    if n == 1:
        return []
    summed = param_bytes if summed is None else summed
    traffic = (n - 1) * (summed + 4 * scalars)
    what = "deterministic: every device's block sum of the micro-shards' gradients"
    if placement.plan.shards_optimizer:
        traffic += (n - 1) / n * param_bytes
        what += ", and the parameters' " + ("shards" if placement.plan.shards_params else "updated shards")
    return [
        Expected(op="all-gather", axes=DATA, count=1, size_bytes=n * summed, traffic_bytes=traffic, what=what)
    ]


def price(placement: Placement, grad_bytes: int, param_bytes: int) -> dict[str, float]:
    """Bytes into each device per step, deterministic mode beside the plan's normal collectives (ring
    model): ``deterministic`` (the block sums' all-gather, plus ZeRO-3's parameter gather and, for
    ZeRO-1/2, the updated shards' gather) and ``normal``."""
    n = placement.data_size
    plan = placement.plan
    if n == 1:
        return {"deterministic": 0.0, "normal": 0.0}
    gather = (n - 1) / n
    det = (n - 1) * grad_bytes + (gather * param_bytes if plan.shards_optimizer else 0.0)
    # the stage's own collectives (``ZeroStage``): zero3 gathers forward and backward, fsdp+pp once per step
    rows = zero_stage(plan.zero).collectives(grad_bytes, param_bytes, gathers=1 if plan.pipeline else 2)
    normal = sum(row.traffic(n) for row in rows)
    return {"deterministic": float(det), "normal": float(normal)}
