"""Quantized training (``--quantize``): the blocks' weight matmuls in int8, forward and backward, through
Qwix's quantized-training ``dot_general`` (``qwix``'s ``dot_general_qt``, the form MaxText trains with).

Every family writes its projections as ``linear(x, w)`` (``x @ w``). Outside :func:`quantized` that is the
plain matmul; inside it, both operands are quantized to int8 (activations per row, weights per output
column), multiplied on the int8 units with int32 sums and scaled back, and so are the two backward
matmuls (the incoming gradient per channel). What stays in the compute dtype: attention's scores and
weighted sums, the experts' matmuls, and the head and its loss (MaxText's rules quantize the same set).

The scales are absolute maxima over the contracted dimensions. A maximum is exact under any split and
order, and int32 sums of int8 products are exact, so a sharded quantized step equals the one-device
quantized step to the rounding of the float parts. One change from Qwix's default is needed for that: Qwix
maps the largest element to 127.5, a rounding tie, and a one-ulp difference in the division between two
programs then moves it between 127 and 128 (-127 and -128). Calibrating at ``absmax * 127.5 / 127`` maps it
to 127 instead: no tie, and the same integers under every plan.

The context is read when the step is traced: :func:`wrap` enters it inside the loss, so a jitted step's
program is fixed by the loss it was built from.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax

from meshkit.spec import QUANTIZE, one_of

_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("meshkit_quantize", default="none")
_CALIBRATION = (
    f"absmax,{127.5 / 127!r}"  # the largest element to 127, not to the tie 127.5 (module docstring)
)


def available() -> str | None:
    """None where ``--quantize int8`` can run; else the one line saying what to install."""
    try:
        import qwix  # noqa: F401
    except ImportError:
        return "--quantize int8 trains through Qwix, which is not installed: pip install 'meshkit[quantize]'"
    return None


@contextlib.contextmanager
def quantized(mode: str) -> Iterator[None]:
    """Within it, :func:`linear` runs in ``mode`` (one of ``spec.QUANTIZE``)."""
    if mode not in QUANTIZE:
        raise ValueError(f"unknown quantization {mode!r}: use {one_of(QUANTIZE)}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def wrap(loss: Callable, mode: str) -> Callable:
    """``loss`` with its blocks' matmuls in ``mode``: ``loss`` itself for ``"none"``."""
    if mode == "none":
        return loss

    @functools.wraps(loss)
    def quantized_loss(*args: Any, **kwargs: Any) -> Any:
        with quantized(mode):
            return loss(*args, **kwargs)

    return quantized_loss


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` for ``x (..., T, D)`` and ``w (D, F)``: quantized where :func:`quantized` says so."""
    if _MODE.get() == "none":
        return x @ w
    from qwix._src.core import dot_general_qt  # Qwix's own entry point for a function, not a Flax module

    rows = x.reshape(-1, x.shape[-1])  # the weight gradient contracts these rows: tiles of one sequence each
    out = dot_general_qt.dot_general_qt(rows, w, (((1,), (0,)), ((), ())), _config(x.shape[-2] if x.ndim > 2 else None))
    return out.reshape(*x.shape[:-1], w.shape[1])


@functools.cache
def _config(sequence: int | None) -> Any:
    import jax.numpy as jnp
    from qwix._src.core import dot_general_qt

    return dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=jnp.int8,
        rhs_qtype=jnp.int8,
        lhs_calibration_method=_CALIBRATION,
        rhs_calibration_method=_CALIBRATION,
        dlhs_grad_qtype=jnp.int8,
        drhs_grad_qtype=jnp.int8,
        dlhs_grad_calibration_method=_CALIBRATION,
        drhs_grad_calibration_method=_CALIBRATION,
        drhs_tile_size=sequence,
    )
