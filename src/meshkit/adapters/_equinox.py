"""Equinox: ``eqx.partition`` into floating arrays (trained) and the rest (static), combined in the loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshkit.adapters._common import Adapted, batch_norm_axis, require
from meshkit.plans import manual_data_axis


def _sync_batch_norm(eqx: Any, model: Any, axis: Any) -> Any:
    """Inside the manual data region, BatchNorm's mean runs over its batch axis and the plan's data
    axes too, as ``batch_norm_axis`` (the one rule, every framework's) joins them; its own names are
    bound where it takes its statistics (it raises without its vmap). Under gradient accumulation a
    BatchNorm that takes batch statistics (not in inference mode) is refused there, as Flax's are;
    its mode is read from the module (``inference=``, ``eqx.nn.inference_mode``), not from a call's
    own ``inference=``."""
    norms = _norms(eqx, model)
    names = [
        batch_norm_axis(bn.axis_name, axis, running=bool(getattr(bn, "inference", False)), own_bound=True)
        for bn in norms
    ]
    if axis is None or not norms:
        return model
    if any(getattr(bn, "mode", "batch") == "ema" for bn in norms):
        from meshkit.spec import PlanError

        raise PlanError(
            "eqx.nn.BatchNorm in mode 'ema' cannot run in a plan's manual data region (Equinox's State.set "
            "rejects the constant it stores there): use eqx.nn.BatchNorm(..., mode='batch'), Equinox's advice "
            "for new code, or plan dp without accumulation"
        )
    return eqx.tree_at(lambda t: [bn.axis_name for bn in _norms(eqx, t)], model, names)


def _norms(eqx: Any, model: Any) -> list:
    import jax

    return [
        m
        for m in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, eqx.nn.BatchNorm))
        if isinstance(m, eqx.nn.BatchNorm)
    ]


def from_equinox(model: Any, state: Any = None) -> Adapted:
    """An Equinox module (and its ``eqx.nn.State``, from ``eqx.nn.make_with_state``): floating
    arrays are trained, everything else stays static. The loss receives the combined module:
    ``loss_fn(model, batch[, key])``, or with ``state``, ``loss_fn(model, state, batch[, key]) ->
    (out, new_state)`` as Equinox's stateful layers return it.
    """
    eqx = require("equinox", "equinox")
    if not isinstance(model, eqx.Module):
        raise TypeError(f"from_equinox takes an equinox.Module, got {type(model).__name__}")
    params, static = eqx.partition(model, eqx.is_inexact_array)
    stateful = state is not None

    def wrap(user_loss: Callable, *, has_aux: bool, rng: bool) -> Callable:
        def loss(p, s, batch, *key):
            m = _sync_batch_norm(eqx, eqx.combine(p, static), manual_data_axis())
            if stateful:
                return user_loss(m, s, batch, *key)
            return user_loss(m, batch, *key), s

        return loss

    def rebuild(p: Any, s: Any) -> Any:
        m = eqx.combine(p, static)
        return (m, s) if stateful else m

    return Adapted(
        framework="equinox",
        params=params,
        state=state if stateful else {},
        logical_axes=None,
        wrap=wrap,
        rebuild=rebuild,
    )
