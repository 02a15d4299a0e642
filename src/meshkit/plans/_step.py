"""The training step of a plan: its gradients (``_gradients``: the batch axes' collectives written
out; a pipeline's from ``_pipeline``), then optax, jitted with the shardings pinned on its inputs and
outputs.

The optimizer update runs in the global view on the sharded gradients and state; zero1/2 update the
shards where they live and all-gather the new parameters in one bucket. Clipping by global norm is
computed over the sharded gradients (scalar all-reduces). Deterministic mode takes its gradients and
their norm from its own region (``_deterministic``) and compiles without the passes that rewrite by
context. A loss that sets its own sharding where the region is manual is refused in one line.
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

from meshkit.plans import _fsdp
from meshkit.plans._deterministic import deterministic_gradients
from meshkit.plans._gradients import LossFn, _chunk_grad, _gather, _trained, gradient_fn, trained_placement
from meshkit.plans._state_tree import map_state
from meshkit.plans.placement import Placement
from meshkit.spec import DATA, PlanError


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
    return map_state(
        optimizer,
        params,
        jax.eval_shape(optimizer.init, params),
        placement.state_specs(),
        lambda _, spec: NamedSharding(mesh, spec),
        lambda _: NamedSharding(mesh, P()),
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

    return _OwnShardingLine(
        jax.jit(
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
        ),
        placement.plan.name,
        placement.region_axes,
    )


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
