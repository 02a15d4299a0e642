"""``meshkit.layer``: the hook a model marks its blocks with, so a plan can act per block.

Wrapping a block function, ``layer(block_fn)(block_params, *inputs)``, changes nothing when no plan
is tracing the model (a single-device run, a test, a notebook): it calls ``block_fn``. Inside a
meshkit step the plan installs a handler (a context variable, set only while the loss is traced):
ZeRO-3 all-gathers the block's parameter shards inside the block and frees them after, and every
plan applies the activation-checkpoint (remat) policy the ``Trainer`` was given. ``block_params``
must be taken from the parameters the loss received without arithmetic on them (indexing a list
or a dict is fine), and those leaves must not also be used outside the block; the plan checks the
latter and otherwise gathers them once for the whole step.

Use it the way ``jax.checkpoint`` is used::

    for p in params["blocks"]:
        x = meshkit.layer(block)(p, x)

Models written as ``lax.scan`` over stacked layer parameters need no hook (see ``_fsdp``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

_HANDLER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("meshkit_layer", default=None)


def layer(block_fn: Callable) -> Callable:
    """Mark ``block_fn(params, *inputs)`` as one layer of the model (see the module docstring)."""

    @functools.wraps(block_fn)
    def call(params: Any, *inputs: Any) -> Any:
        handler = _HANDLER.get()
        if handler is None:
            return block_fn(params, *inputs)
        return handler(block_fn, params, inputs)

    return call


@contextlib.contextmanager
def handling(handler: Callable[[Callable, Any, tuple], Any]) -> Iterator[None]:
    """Route ``layer`` calls to ``handler(block_fn, params, inputs)`` while tracing a loss.

    The handler runs with no handler installed, so blocks nested in a block run as plain calls.
    """

    def outer(block_fn, params, inputs):
        token = _HANDLER.set(None)
        try:
            return handler(block_fn, params, inputs)
        finally:
            _HANDLER.reset(token)

    token = _HANDLER.set(outer)
    try:
        yield
    finally:
        _HANDLER.reset(token)
