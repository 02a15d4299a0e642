"""How two runs are compared, and the tolerances that say "the same function": relative
differences over whole trees, bit-for-bit equality, float64 twins of trees.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshkit.devices import host

#: Plan vs one device when both run in float64 (the same function, its sums in another order).
TOL_EXACT = 1e-10
#: float32 plan vs NumPy float64 after K steps (linear, MLP).
TOL_FLOAT64 = 1e-4
#: The float32 first step's bound over the largest of ``ORDERS`` one-device errors (module docstring).
TAIL = 2.0
#: Batch orders one device runs in float32 (the given one first) to measure its own rounding.
ORDERS = 4
#: Two float32 first steps this close are the same function, rounding apart: the largest float32
#: first-step error measured on any model here is 1.6e-6, while another random draw (dropout masks
#: that follow the rows, or float64's own random numbers) moves it by 1e-2 and more.
TOL_SAME = 1e-4


def relative_difference(a: Any, b: Any) -> float:
    """``max|a - b| / max|b|`` over all floating leaves of the two trees together, leaves paired
    by their path (``['Dense_0']['kernel']``); any other leaf (an int counter, a key) must be
    equal, or the difference is infinite.

    One scale for the whole tree, not one per leaf: a leaf whose exact value is 0 holds float
    noise (the key bias of an attention layer: softmax ignores it, so its gradient is rounding),
    and dividing that noise by its own size made trees equal to 6e-8 differ by 0.9.
    """
    pairs = _paired_leaves(host(jax.tree.map(_key_data, a)), host(jax.tree.map(_key_data, b)))
    diff, scale = 0.0, 0.0
    for x, y in pairs:
        if not (jnp.issubdtype(x.dtype, jnp.inexact) and jnp.issubdtype(y.dtype, jnp.inexact)):
            if not np.array_equal(x, y):
                return math.inf
            continue
        x, y = x.astype(np.float64), y.astype(np.float64)
        if x.size:
            diff, scale = max(diff, float(np.max(np.abs(x - y)))), max(scale, float(np.max(np.abs(y))))
    return diff / (scale or 1.0)


def _paired_leaves(a: Any, b: Any) -> list[tuple[Any, Any]]:
    """The leaves of ``a`` and ``b`` paired by path; a path in one tree only is an error naming it."""
    flat_a = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(a)[0]}
    flat_b = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(b)[0]}
    if flat_a.keys() != flat_b.keys():
        only = sorted(flat_a.keys() ^ flat_b.keys())
        raise ValueError(f"relative_difference: the trees differ in structure: {only[:3]} in one tree only")
    return [(v, flat_b[k]) for k, v in flat_a.items()]


def _key_data(a: Any) -> Any:
    """A typed PRNG key as its key data (NumPy cannot hold it); any other leaf as it is."""
    if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(a)
    return a


def bitwise_equal(a: Any, b: Any) -> bool:
    pairs = zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b)), strict=True)
    return all(np.array_equal(x, y) for x, y in pairs)


def _floating(a: Any) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def _to_float64(tree: Any) -> Any:
    """``tree`` as its float64 twin holds it (call under ``jax.enable_x64``): floating leaves as
    NumPy float64, and weakly typed scalars (an Equinox BatchNorm's counter) as the weak scalars
    float64 mode makes of the same number (int64, float64), so that the model's own updates of
    them keep their type; everything else as it is."""

    def one(a: Any) -> Any:
        if getattr(a, "weak_type", False) and np.ndim(a) == 0:
            return jnp.asarray(a.item())
        return np.asarray(a, np.float64) if _floating(a) else a

    return jax.tree.map(one, tree)


def _float_leaves(tree: Any) -> list[np.ndarray]:
    """The floating array leaves of ``tree`` (an optimizer state: its moments, not its step count)."""
    return [a for a in jax.tree.leaves(host(tree)) if _floating(a) and np.ndim(a)]
