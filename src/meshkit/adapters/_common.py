"""What every adapter returns: parameters, state, logical axes, and the glue into the loss."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshkit._errors import MeshkitError


@dataclass(frozen=True, kw_only=True, slots=True)
class Adapted:
    """A framework model split for ``Trainer``: pass it as ``params``."""

    framework: str
    params: Any
    """Trainable floating arrays (a plain pytree: nested dicts for Flax, the module's array
    leaves for Equinox)."""
    state: Any
    """Everything else the model carries and updates (BatchNorm statistics, RNG state, counters)."""
    logical_axes: Any
    """Per parameter a tuple of logical axis names (None where unannotated), from the framework's
    partition metadata; None when the model carries none."""
    wrap: Callable[..., Callable]
    """``wrap(user_loss, *, has_aux, rng) -> loss(params, state, batch[, key]) -> (out, new_state)``."""
    rebuild: Callable[[Any, Any], Any]
    """``rebuild(params, state)``: the framework's model holding them (e.g. after training)."""

    def loss(self, user_loss: Callable, *, has_aux: bool = False, rng: bool = False) -> Callable:
        """``user_loss`` (written against the framework's model) in the Trainer's stateful form."""
        return self.wrap(user_loss, has_aux=has_aux, rng=rng)


def require(module: str, extra: str) -> Any:
    """Import an optional framework, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MeshkitError(
            f"{module} is not installed: pip install 'meshkit[{extra}]' (or the pinned {extra} version)"
        ) from None


def to_axes(spec: Any, ndim: int) -> tuple:
    """A PartitionSpec or tuple of names as a tuple of ``ndim`` logical names (None-padded).

    Entries naming several axes at once (``('data', 'model')``) are kept as given.
    """
    names = tuple(spec) if spec is not None else ()
    return names + (None,) * (ndim - len(names))


def batch_norm_axis(own: Any, axis: Any, *, running: bool = False, own_bound: bool = False) -> Any:
    """The axis a Flax BatchNorm averages its statistics over in a plan's step, with the meaning it
    has on one device (a mean over the whole batch): the manual data axis ``axis`` where the plan
    splits the batch over devices (each device holds some rows), joined with the BatchNorm's own
    ``axis_name`` where the loss binds it (the user's ``vmap`` over the device's rows: on one device
    that vmap spans the whole batch, so its mean must also span the devices), or None where the plan
    has no data axis (each device holds the whole batch). A name the loss does not bind (Flax's
    ResNet: ``axis_name='batch'``, for ``pmap``) thus means the global batch. ``own_bound``: the
    caller asks before the loss runs, where its own names are bound (Equinox's BatchNorm, which
    raises without the vmap that binds them, on one device too). Under gradient accumulation batch
    statistics (not ``running`` averages) are refused: no micro-batch is the batch."""
    from jax import lax

    refuse_accumulated_batch_statistics(running=running)
    split = () if axis is None else tuple(axis) if isinstance(axis, tuple | list) else (axis,)
    bound = ()
    for name in own if isinstance(own, tuple | list) else () if own is None else (own,):
        if not own_bound:
            try:
                lax.axis_size(name)
            except NameError:  # unbound: it names the devices' split of the batch
                continue
        if name not in split:
            bound += (name,)
    names = bound + split
    if not names:
        return None
    return names[0] if len(names) == 1 else names


def refuse_accumulated_batch_statistics(*, running: bool = False) -> None:
    """Under gradient accumulation the loss sees one micro-batch per call, so a BatchNorm's batch
    statistics would be each micro-batch's own (one device has one mean over the whole batch): one
    line, for every framework's BatchNorm. ``running``: it normalises with its running averages
    (no batch statistics), which accumulation does not change."""
    from meshkit.plans import micro_batches

    if micro_batches() > 1 and not running:
        from meshkit.spec import PlanError

        raise PlanError(
            f"BatchNorm's batch statistics cannot span the batch with accumulate={micro_batches()} (each "
            "micro-batch has its own mean, unlike one device): use accumulate=1 or a norm without batch "
            "statistics (LayerNorm, GroupNorm)"
        )
