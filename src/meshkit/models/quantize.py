"""Quantized training (``--quantize``): the blocks' weight matmuls in int8, forward and backward, through
Qwix's quantized-training ``dot_general`` (``qwix``'s ``dot_general_qt``, the form MaxText trains with).

Every family writes its projections as ``linear(x, w)`` (``x @ w``). Outside :func:`quantized` that is the
plain matmul; inside it, both operands are quantized to int8 (activations per row, weights per output
column), multiplied on the int8 units with int32 sums and scaled back, and so are the two backward
matmuls (the incoming gradient per channel). What stays in the compute dtype: attention's scores and
weighted sums, the experts' matmuls, and the head and its loss (MaxText's rules quantize the same set).

The scales are absolute maxima over the contracted dimensions. A maximum is exact under any split and
order, and int32 sums of int8 products are exact, so a sharded quantized step can equal the one-device
quantized step to the rounding of the float parts. Two choices make it so:

- Qwix maps the largest element to 127.5, a rounding tie: a one-ulp difference in the division between
  two programs then moves it between 127 and 128 (-127 and -128). Calibrating at ``absmax * 127.5 / 127``
  maps it to 127: no tie, the same integers under every plan.
- The weight gradient contracts the tokens, which data-parallel plans split, and fsdp's step runs each
  device's loss on its own rows: a scale over all tokens would be a per-device scale there. Its scales
  are taken per sequence instead (Qwix's ``drhs_tile_size``, the rows flattened so that a tile is one
  sequence), which every plan that splits the batch keeps whole. Plans that split a sequence (the
  context axis) are refused (``train.config``). The cost: the weight gradient is summed over the
  sequences in float, from one int32 matrix per sequence.

Under tensor parallelism the partial sums a split contraction all-reduces are int32 (4 bytes, where bf16
moves 2), and each scale over a split dimension adds a small all-reduce (the model axis's ledger rows).

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
from jax.ad_checkpoint import checkpoint_name

from meshkit.plans import INT8_RESULT
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
    out = dot_general_qt.dot_general_qt(
        rows, w, (((1,), (0,)), ((), ())), _config(x.shape[-2] if x.ndim > 2 else None)
    )
    return checkpoint_name(out.reshape(*x.shape[:-1], w.shape[1]), INT8_RESULT)  # what remat "dots" keeps


_OPERANDS = ("lhs", "rhs", "dlhs_grad", "drhs_grad", "dlhs_residual", "drhs_residual")
"""Every operand of the three matmuls Qwix quantizes: the forward's two, and each backward matmul's incoming
gradient and residual (the forward's float operand requantized along the backward's own contraction: Qwix
reuses the forward's int8 operand otherwise, whose scales cannot tile, and the weight gradient fell back to
float)."""


@functools.cache
def _config(sequence: int | None) -> Any:
    import jax.numpy as jnp
    from qwix._src.core import dot_general_qt

    return dot_general_qt.DotGeneralQtConfig(
        **{f"{o}_qtype": jnp.int8 for o in _OPERANDS},
        **{f"{o}_calibration_method": _CALIBRATION for o in _OPERANDS},
        drhs_tile_size=sequence,
        use_original_residuals=True,
    )
