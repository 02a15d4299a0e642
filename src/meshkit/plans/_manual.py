"""Whether the loss is being traced inside the step's manual data region, and over which axis.

There each device sees only its rows of the batch; an adapter uses this to make batch statistics
(BatchNorm) span the whole global batch, as they do on one device, by a mean over the data axis.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_AXIS: ContextVar[str | None] = ContextVar("meshkit_manual_data_axis", default=None)
_MICRO: ContextVar[int] = ContextVar("meshkit_micro_batches", default=1)


def manual_data_axis() -> str | None:
    """The manual mesh axis the loss is traced under (its batch split over it), or None."""
    return _AXIS.get()


@contextlib.contextmanager
def manual_data(axis: str) -> Iterator[None]:
    token = _AXIS.set(axis)
    try:
        yield
    finally:
        _AXIS.reset(token)


def micro_batches() -> int:
    """How many micro-batches the step splits each device's rows into (gradient accumulation):
    above 1 the loss sees only a part of the batch per call, so batch statistics cannot span it."""
    return _MICRO.get()


@contextlib.contextmanager
def accumulating(m: int) -> Iterator[None]:
    token = _MICRO.set(m)
    try:
        yield
    finally:
        _MICRO.reset(token)
