"""Flax NNX: ``nnx.split`` into Params (trained) and everything else (state), merged in the loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshkit.adapters._common import Adapted, batch_norm_axis, require, to_axes
from meshkit.plans import manual_data_axis


def _sync_batch_norm(nnx: Any, model: Any, axis: str | None) -> None:
    """BatchNorm statistics span the global batch, as on one device (``batch_norm_axis``: a mean
    over ``axis`` inside the manual data region)."""
    for _, m in nnx.iter_modules(model):
        if isinstance(m, nnx.BatchNorm):
            m.axis_name = batch_norm_axis(m.axis_name, axis, running=bool(m.use_running_average))


def from_nnx(model: Any) -> Adapted:
    """An NNX module: ``nnx.Param`` variables are trained; every other variable (BatchStat,
    RngKey/RngCount, custom ones) is carried as state. The loss receives the merged module:
    ``loss_fn(model, batch[, key]) -> loss | (loss, aux)``; the module's updates to its variables
    (BatchNorm running statistics, RNG counts) are the new state.
    """
    nnx = require("flax.nnx", "flax")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"from_nnx takes an nnx.Module, got {type(model).__name__}")
    graphdef, params_state, rest_state = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params_state)
    state = nnx.to_pure_dict(rest_state)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(params_state))
    has_names = any(len(s) for s in _leaves(specs))
    import jax

    logical = (
        jax.tree.map(lambda s, p: to_axes(s, p.ndim), specs, params, is_leaf=lambda x: isinstance(x, tuple))
        if has_names
        else None
    )

    def rebuild(p: Any, s: Any) -> Any:
        ps, rs = nnx.clone(params_state), nnx.clone(rest_state)
        nnx.replace_by_pure_dict(ps, p)
        nnx.replace_by_pure_dict(rs, s)
        return nnx.merge(graphdef, ps, rs)

    def wrap(user_loss: Callable, *, has_aux: bool, rng: bool) -> Callable:
        def loss(p, s, batch, *key):
            m = rebuild(p, s)
            _sync_batch_norm(nnx, m, manual_data_axis())
            out = user_loss(m, batch, *key)
            return out, nnx.to_pure_dict(nnx.state(m, nnx.Not(nnx.Param)))

        return loss

    return Adapted(
        framework="nnx", params=params, state=state, logical_axes=logical, wrap=wrap, rebuild=rebuild
    )


def _leaves(tree: Any) -> list:
    import jax

    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple))
