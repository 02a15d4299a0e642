"""Random keys that draw, on a slice of the batch, exactly what one device draws on the whole batch.

Inside the manual ``data`` region every device runs the user's loss on its own rows of the batch
(and on one micro-batch at a time). A plain key would draw the same local mask on every device, so
dropout would differ from a single-device run. A *rows key* carries the first row and the row
count of the slice it is used on. A draw whose leading dim is that row count (a dropout mask over
the batch) gets the bits of rows ``first .. first + rows`` of the same draw on the whole batch
(JAX's partitionable threefry numbers every element of a draw by its flat index, so a slice is an
offset of the counters); likewise ``split(key, rows)`` gives those examples' keys of
``split(key, batch)`` (Equinox's per-example keys), as plain keys. Every other draw, split and
fold-in acts on the threefry key alone and keeps the slice, so keys derived inside the model
(Flax's ``make_rng``, NNX's ``Rngs``) stay aligned and draws not over the batch equal the single
device's. With first row 0 and the whole batch a rows key draws exactly what ``jax.random.key``
draws.

The one ambiguity: a draw not over the batch whose leading dim happens to equal the slice's row
count is taken to be over the batch (still valid random numbers, only not the single-device ones).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import random as xrandom

_FRY = xrandom.threefry_prng_impl


def _split(data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    plain = jnp.concatenate([_FRY.split(data[:2], shape), jnp.broadcast_to(data[2:], (*shape, 2))], axis=-1)
    if not shape:
        return plain
    # One key per example of the slice: those examples' keys of the whole batch's split, as plain keys.
    hi, lo = _counters(data, shape)
    k1, k2 = xrandom.threefry2x32_p.bind(data[0], data[1], hi, lo)
    zeros = jnp.zeros((*shape, 2), jnp.uint32)
    per_example = jnp.concatenate([jnp.stack([k1, k2], axis=-1), zeros], axis=-1)
    return jnp.where(shape[0] == data[3], per_example, plain)


def _fold_in(data: jax.Array, msg: jax.Array) -> jax.Array:
    return jnp.concatenate([_FRY.fold_in(data[:2], msg), data[2:]])


def _mul_2x32(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """``a * b`` (uint32 array times a constant) as (hi, lo) uint32 words."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = jnp.uint32(b >> 16), jnp.uint32(b & 0xFFFF)
    lo = a_lo * b_lo
    mid1, mid2 = a_hi * b_lo, a_lo * b_hi
    hi = a_hi * b_hi + (mid1 >> 16) + (mid2 >> 16)
    for part in (mid1 << 16, mid2 << 16):
        new = lo + part
        hi = hi + (new < lo).astype(jnp.uint32)
        lo = new
    return hi, lo


def _counters(data: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Threefry counters (hi, lo) of a draw of ``shape`` over the slice: flat indices in the whole
    batch's draw, i.e. shifted by ``first * prod(shape[1:])``."""
    stride = math.prod(shape[1:])
    if math.prod(shape) >= 2**32 or stride >= 2**32:
        raise ValueError(f"a random draw of shape {shape} is too large for a meshkit rows key")
    base_hi, base_lo = _mul_2x32(data[2], stride)
    local = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    lo = local + base_lo
    return jnp.broadcast_to(base_hi, shape) + (lo < local).astype(jnp.uint32), lo


def _bits(data: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    if not shape:
        return _FRY.random_bits(data[:2], bit_width, shape)
    hi, lo = _counters(data, shape)
    over_batch = shape[0] == data[3]
    hi, lo = (
        jnp.where(over_batch, hi, 0),
        jnp.where(over_batch, lo, lax.iota(jnp.uint32, lo.size).reshape(shape)),
    )
    bits1, bits2 = xrandom.threefry2x32_p.bind(data[0], data[1], hi, lo)
    if bit_width == 64:
        return (bits1.astype(jnp.uint64) << 32) | bits2.astype(jnp.uint64)
    out = bits1 ^ bits2
    return out if bit_width == 32 else out.astype(jnp.dtype(f"uint{bit_width}"))


def _seed(seed: jax.Array) -> jax.Array:
    return jnp.concatenate([_FRY.seed(seed), jnp.zeros((2,), jnp.uint32)])


ROWS = xrandom.define_prng_impl(
    key_shape=(4,),
    seed=_seed,
    split=_split,
    random_bits=_bits,
    fold_in=_fold_in,
    name="meshkit_rows",
    tag="mkr",
)


def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def rows_key(key: jax.Array, offset: jax.Array | int, rows: int) -> jax.Array:
    """A threefry key (any shape) as a rows key for the ``rows`` rows starting at batch row ``offset``."""
    data = jax.random.key_data(key)
    off = jnp.broadcast_to(jnp.asarray(offset, jnp.uint32), (*data.shape[:-1], 1))
    n = jnp.full((*data.shape[:-1], 1), rows, jnp.uint32)
    return jax.random.wrap_key_data(jnp.concatenate([data, off, n], axis=-1), impl=ROWS)


def plain_key(key: jax.Array) -> jax.Array:
    """A rows key back as the threefry key it carries (the offset dropped)."""
    return jax.random.wrap_key_data(jax.random.key_data(key)[..., :2], impl="threefry2x32")


def with_offset(tree: Any, offset: jax.Array | int, rows: int) -> Any:
    """Every threefry key leaf of ``tree`` as a rows key for the slice."""
    return jax.tree.map(lambda x: rows_key(x, offset, rows) if is_key(x) else x, tree)


def without_offset(tree: Any) -> Any:
    """Every rows key leaf of ``tree`` back as a threefry key."""
    return jax.tree.map(lambda x: plain_key(x) if is_key(x) and _is_rows(x) else x, tree)


def _is_rows(x: jax.Array) -> bool:
    return jax.random.key_impl(x) == ROWS
