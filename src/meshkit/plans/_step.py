"""The training step of a plan: gradients with the data-axis collectives written out, then optax.

The gradient runs in ``jax.shard_map`` manual over the ``data`` axis only (the ``model`` axis, if
any, stays with the compiler, which partitions the tensor-parallel matmuls). Collectives on the
data axis, per ZeRO stage, with ``m`` micro-batches accumulated locally:

- dp:    local sum over micro-batches, then one all-reduce of the gradients (with one micro-batch,
         and for tensor parallelism alone, the whole gradient is left to XLA's partitioner, which
         emits that same single all-reduce);
- zero1: local sum, then one reduce-scatter (every device holds full local gradients, as ZeRO-1);
- zero2: one reduce-scatter per micro-batch into a sharded accumulator;
- zero3: where the loss has layers (a ``lax.scan`` over stacked leaves, or blocks marked with
  ``meshkit.layer``), each layer gathers its parameters inside and reduce-scatters their gradients
  in its backward pass (``_fsdp``); every other leaf is all-gathered before each micro-batch's
  gradient (XLA hoists that gather out of the micro-batch loop: the parameters are loop-invariant),
  and its gradient reduce-scattered per micro-batch. (Differentiating through the bucketed gather instead would make its transpose, a
  pad of every leaf to the bucket's size, cost time quadratic in the leaf count.)

Reduce-scatters and all-gathers are bucketed per dtype (``_buckets``). Leaves a ZeRO plan keeps
whole are all-reduced once. The optimizer update then runs in the global view on the sharded
gradients and state; zero1/2 update the shards where they live and all-gather the new parameters
in one bucket. Clipping by global norm is computed over the sharded gradients (scalar all-reduces).
"""

from __future__ import annotations

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
from meshkit.plans import _fsdp
from meshkit.plans._layout import DATA, Layout

LossFn = Callable[[Any, Any], jax.Array]


def _split_micro(batch: Any, m: int) -> Any:
    return jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m, *a.shape[1:])), batch)


def _tree_apply(fn, tree: Any, layout: Layout) -> Any:
    """Apply a list function over the leaves of a parameter-shaped tree."""
    leaves = jax.tree.leaves(tree)
    return jax.tree.unflatten(jax.tree.structure(tree), fn(leaves, layout.flat(), layout.data_size))


def _gather(params: Any, layout: Layout) -> Any:
    return _tree_apply(buckets.all_gather, params, layout)


def _scatter(grads: Any, layout: Layout) -> Any:
    """Reduce-scatter the data-sharded leaves (bucketed); replicated leaves stay local."""
    return _tree_apply(buckets.reduce_scatter, grads, layout)


def _finish(acc: Any, layout: Layout, scatter_now: bool, scale: float) -> Any:
    """Reduce what is still local (one all-reduce of every leaf kept whole: all of them under dp), scale."""
    if scatter_now:
        acc = _scatter(acc, layout)
    grads = jax.tree.leaves(acc)
    whole = [i for i, leaf in enumerate(layout.flat()) if leaf.data_dim is None]
    if whole:
        for i, g in zip(whole, lax.psum([grads[i] for i in whole], DATA), strict=True):
            grads[i] = g
    return jax.tree.unflatten(jax.tree.structure(acc), [g * scale for g in grads])


def _accumulate(grad_fn: Callable, params: Any, batch: Any, m: int, per_micro: Callable = lambda g: g):
    """Mean loss and summed ``per_micro(grads)`` over ``m`` micro-batches (a scan when m > 1)."""
    if m == 1:
        loss, grads = grad_fn(params, batch)
        return loss, per_micro(grads)
    micros = _split_micro(batch, m)

    def one(micro):
        loss, grads = grad_fn(params, micro)
        return loss, per_micro(grads)

    def body(carry, micro):
        loss, grads = one(micro)
        return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads)), None

    loss0, grads0 = jax.eval_shape(one, _first(micros))
    acc0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), grads0)
    (loss, acc), _ = lax.scan(body, (jnp.zeros((), loss0.dtype), acc0), micros)
    return loss / m, acc


def local_gradients(loss_fn: LossFn, layout: Layout, accumulate: int, per: _fsdp.PerLayer) -> Callable:
    """The per-device gradient function (inside the manual data region)."""
    stage = layout.plan.stage
    scale = 1.0 / (layout.data_size * accumulate)

    def grad_fn(params, micro):  # zero3: gathers per layer where the loss has layers (_fsdp), else up front
        return _fsdp.value_and_grad(loss_fn, per, params, micro)

    def scatter(g):  # per-layer leaves come back already reduce-scattered
        return _tree_apply(
            lambda leaves, _, n: buckets.reduce_scatter(leaves, per.whole_step_leaves(), n), g, layout
        )

    def run(params, batch):
        per_micro = scatter if stage in ("zero2", "zero3") else (lambda g: g)
        loss, acc = _accumulate(grad_fn, params, batch, accumulate, per_micro)
        grads = _finish(acc, layout, scatter_now=stage == "zero1", scale=scale)
        return lax.pmean(loss, DATA), grads

    return run


def _first(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[0], tree)


def gradient_fn(
    loss_fn: LossFn, layout: Layout, accumulate: int, per: _fsdp.PerLayer | None = None
) -> Callable:
    """Global-view ``(params, batch) -> (loss, grads)`` with the plan's collectives.

    Plain data parallelism of one micro-batch (and tensor parallelism alone) is left to XLA's
    partitioner, which emits the single gradient all-reduce the model predicts; everything else
    runs manual over the data axis. ``per`` carries the remat policy and records the layers found.
    """
    per = _fsdp.PerLayer(layout=layout) if per is None else per
    if not layout.has_data_axis or (layout.plan.stage == "dp" and accumulate == 1):

        def plain(params, batch):
            grad_fn = lambda p, b: _fsdp.value_and_grad(loss_fn, per, p, b)  # noqa: E731
            loss, acc = _accumulate(grad_fn, params, batch, accumulate)
            return loss, jax.tree.map(lambda g: g / accumulate, acc)

        return plain
    zero3 = layout.plan.stage == "zero3"
    in_specs = (layout.tree(lambda leaf: leaf.manual_spec(data=zero3)), P(DATA))
    out_specs = (P(), layout.tree(lambda leaf: leaf.manual_spec(data=layout.plan.stage != "dp")))
    return jax.shard_map(
        local_gradients(loss_fn, layout, accumulate, per),
        mesh=layout.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={DATA},
        check_vma=False,  # collectives are written out explicitly; no implicit psum on transpose
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepShardings:
    """Shardings pinned on the step's inputs and outputs."""

    params: Any
    opt_state: Any
    batch: NamedSharding
    scalar: NamedSharding


def state_shardings(optimizer: optax.GradientTransformation, params: Any, layout: Layout) -> Any:
    """Optimizer-state shardings: parameter-shaped leaves follow the plan, the rest replicated."""
    mesh = layout.mesh
    shapes = jax.eval_shape(optimizer.init, params)
    specs = layout.state_specs()
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: NamedSharding(mesh, spec),
        shapes,
        specs,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
        is_leaf=lambda x: isinstance(x, P),
    )


def _param_gather(layout: Layout) -> Callable | None:
    """ZeRO-1/2: the all-gather of the updated parameter shards (bucketed), or None."""
    if layout.plan.stage not in ("zero1", "zero2") or all(leaf.data_dim is None for leaf in layout.flat()):
        return None
    return jax.shard_map(
        lambda p: _gather(p, layout),
        mesh=layout.mesh,
        in_specs=(layout.tree(lambda leaf: leaf.manual_spec(data=True)),),
        out_specs=P(),
        axis_names={DATA},
        check_vma=False,
    )


def build_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    layout: Layout,
    shardings: StepShardings,
    *,
    accumulate: int = 1,
    clip_norm: float | None = None,
    grad_norm: bool = False,
    donate: bool = True,
    per_layer: _fsdp.PerLayer | None = None,
) -> Callable:
    """The jitted step ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

    Metrics: the loss, and the global gradient norm when clipping or ``grad_norm`` asks for it (it
    costs a reduction over every gradient, which the compiler may fuse into the last collective).
    """
    grads_of = gradient_fn(loss_fn, layout, accumulate, per_layer)
    gather = _param_gather(layout)
    mesh = layout.mesh
    grad_sh = layout.tree(lambda leaf: NamedSharding(mesh, leaf.spec(data=layout.plan.stage != "dp")))
    with_norm = grad_norm or clip_norm is not None

    def step(params, opt_state, batch):
        loss, grads = grads_of(params, batch)
        grads = lax.with_sharding_constraint(grads, grad_sh)
        metrics = {"loss": loss}
        if with_norm:
            metrics["grad_norm"] = norm = optax.tree.norm(grads)
            if clip_norm is not None:
                factor = jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-30))
                grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if gather is not None:  # update the shards where they live, then one bucketed all-gather
            params = gather(lax.with_sharding_constraint(params, grad_sh))
        return params, opt_state, metrics

    scalars = dict.fromkeys(("loss", "grad_norm") if with_norm else ("loss",), shardings.scalar)
    return jax.jit(
        step,
        in_shardings=(shardings.params, shardings.opt_state, shardings.batch),
        out_shardings=(shardings.params, shardings.opt_state, scalars),
        donate_argnums=(0, 1) if donate else (),
    )
