"""Flax linen: ``variables['params']`` trained, the other collections carried, ``module.apply`` in the loss."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from meshkit.adapters._common import Adapted, batch_norm_axis, require, to_axes
from meshkit.plans import manual_data_axis


class LinenModel:
    """The module bound to the step's variables: ``model(*args, **kwargs)`` is ``module.apply``
    with the current params and state, the step's rngs, and the state collections mutable."""

    def __init__(self, module: Any, variables: dict, rngs: dict, mutable: list[str]) -> None:
        self.module, self.variables, self.rngs, self.mutable = module, variables, rngs, mutable
        self.updates: dict = {}

    def __call__(self, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        variables = {**self.variables, **self.updates}
        if not self.mutable:
            return self.module.apply(variables, *args, rngs=self.rngs, method=method, **kwargs)
        out, updates = self.module.apply(
            variables, *args, rngs=self.rngs, method=method, mutable=self.mutable, **kwargs
        )
        self.updates = {**self.updates, **updates}
        return out


def from_linen(module: Any, variables: dict, *, rng_streams: Sequence[str] = ("dropout",)) -> Adapted:
    """A linen module and its ``variables`` (from ``module.init``): the ``params`` collection is
    trained, every other collection (``batch_stats``, ...) is carried as state and mutable in the
    loss. Partition metadata (``nn.with_logical_partitioning`` / ``nn.with_partitioning``) is read as
    logical axes and unboxed. The loss receives a callable bound to the step's variables:
    ``loss_fn(model, batch[, key])`` with ``model(x, train=True)`` = ``module.apply(...)``; with a key,
    ``rngs={stream: key}`` for the one stream named in ``rng_streams`` (several: the key folded
    with the stream's index).
    """
    nn = require("flax.linen", "flax")
    import jax

    if not isinstance(module, nn.Module):
        raise TypeError(f"from_linen takes a flax.linen.Module, got {type(module).__name__}")
    if not isinstance(variables, dict) or "params" not in variables:
        raise TypeError(
            "from_linen takes the variables from module.init(...): a dict with a 'params' collection"
        )
    boxed = dict(variables)
    specs = nn.get_partition_spec(boxed["params"])
    plain = nn.meta.unbox(boxed)
    params = plain["params"]
    state = {k: v for k, v in plain.items() if k != "params"}
    has_names = any(len(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, tuple)))
    logical = (
        jax.tree.map(lambda s, p: to_axes(s, p.ndim), specs, params, is_leaf=lambda x: isinstance(x, tuple))
        if has_names
        else None
    )
    streams = tuple(rng_streams)

    def wrap(user_loss: Callable, *, has_aux: bool, rng: bool) -> Callable:
        def loss(p, s, batch, *key):
            rngs = {}
            if key:
                rngs = {
                    name: key[0] if len(streams) == 1 else jax.random.fold_in(key[0], i)
                    for i, name in enumerate(streams)
                }
            bound = LinenModel(module, {"params": p, **s}, rngs, sorted(s))
            with nn.intercept_methods(_sync_batch_norm(nn, manual_data_axis())):
                out = user_loss(bound, batch, *key)
            return out, {**s, **{k: v for k, v in bound.updates.items() if k in s}}

        return loss

    def rebuild(p: Any, s: Any) -> Any:
        return {"params": p, **s}

    return Adapted(
        framework="linen", params=params, state=state, logical_axes=logical, wrap=wrap, rebuild=rebuild
    )


def _sync_batch_norm(nn: Any, axis: str | None) -> Callable:
    """A method interceptor that has BatchNorm average its batch statistics over the global batch,
    as on one device (``batch_norm_axis``: over ``axis`` inside the manual data region)."""

    def intercept(next_fun, args, kwargs, context):
        m = context.module
        if isinstance(m, nn.BatchNorm):
            running = bool(kwargs.get("use_running_average", m.use_running_average))
            object.__setattr__(m, "axis_name", batch_norm_axis(m.axis_name, axis, running=running))
        return next_fun(*args, **kwargs)

    return intercept
