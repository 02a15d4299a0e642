"""What a ``Trainer`` is given, checked before anything compiles: every bad leaf named with its fix.

Parameters are the floating arrays the optimizer trains. Everything else a model carries (integer
counters, BatchNorm statistics, RNG keys) belongs in ``state=``; whole framework objects go
through an adapter (``meshkit.from_nnx``, ``from_linen``, ``from_equinox``) first.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshkit.spec import PlanError


def _path(keys) -> str:
    return (
        "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys) or "(root)"
    )


def _framework(x: Any) -> str | None:
    """'nnx', 'linen' or 'equinox' when ``x`` is (a piece of) such a model, else None."""
    for cls in type(x).__mro__:
        mod = cls.__module__ or ""
        if mod.startswith("flax.nnx"):
            return "nnx"
        if mod.startswith("flax.linen") or mod.startswith("flax.core"):
            return "linen"
        if mod.startswith("equinox"):
            return "equinox"
    return None


_ADAPTER = {
    "nnx": "meshkit.from_nnx(model) (nnx.split: Params trained, the rest carried as state)",
    "linen": "meshkit.from_linen(module, variables) (variables['params'] trained, other collections carried as state)",
    "equinox": "meshkit.from_equinox(model) (eqx.partition: floating arrays trained, the rest kept static)",
}


def check_params(params: Any) -> None:
    """Raise ``PlanError`` naming the first leaf the optimizer cannot train, and the fix."""
    kind = _framework(params)
    if kind in ("nnx", "linen"):
        raise PlanError(
            f"params is a {kind} {type(params).__name__}, not a pytree of arrays: use {_ADAPTER[kind]}"
        )
    if (
        isinstance(params, dict)
        and "params" in params
        and len(params) > 1
        and not _leaf_like(params["params"])
    ):
        others = sorted(k for k in params if k != "params")
        raise PlanError(
            f"params holds the Flax variable collections {['params', *others]}: only 'params' is trained; "
            f"use {_ADAPTER['linen']}"
        )
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_foreign)[0]
    if not leaves:
        raise PlanError("params is empty: pass a pytree of floating arrays (e.g. {'w': jnp.zeros((4, 4))})")
    for keys, x in leaves:
        where = f"params leaf {_path(keys)}"
        if (kind := _framework(x)) is not None:
            raise PlanError(f"{where} is a {kind} {type(x).__name__}: use {_ADAPTER[kind]}")
        if isinstance(x, bool | int | float | complex) and _framework(params) == "equinox":
            raise PlanError(
                f"{where} is a Python {type(x).__name__} ({x!r}) of an Equinox module: use {_ADAPTER['equinox']}"
            )
        if isinstance(x, bool | int | float | complex):
            raise PlanError(
                f"{where} is a Python {type(x).__name__} ({x!r}): train arrays, e.g. jnp.asarray({x!r}, jnp.float32), "
                "or pass constants in state= (carried, not trained) or close over them in the loss"
            )
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            fix = (
                "meshkit.from_equinox(model) (eqx.partition keeps it static)"
                if _framework(params) == "equinox"
                else "keep only arrays in params and close over other objects in the loss"
            )
            raise PlanError(f"{where} is a {type(x).__name__}, not an array: use {fix}")
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise PlanError(
                f"{where} is a PRNG key: pass it in state= (carried through the step), or use rng="
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise PlanError(
                f"{where} has dtype {x.dtype}: only floating arrays are trained; pass counters and other "
                "non-float arrays in state= (carried through the step, not differentiated)"
            )


def _foreign(x: Any) -> bool:
    """A Flax object inside a tree (Equinox modules are pytrees of their own: their leaves are checked)."""
    return _framework(x) in ("nnx", "linen")


def _leaf_like(x: Any) -> bool:
    return hasattr(x, "dtype")


def check_state(state: Any) -> None:
    """Raise ``PlanError`` naming the first state leaf that cannot be carried through a jitted step."""
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=_foreign)[0]
    for keys, x in leaves:
        where = f"state leaf {_path(keys)}"
        if (kind := _framework(x)) is not None:
            raise PlanError(f"{where} is a {kind} {type(x).__name__}: use {_ADAPTER[kind]}")
        if isinstance(x, bool | int | float | complex):
            raise PlanError(
                f"{where} is a Python {type(x).__name__} ({x!r}): carry arrays, e.g. jnp.asarray({x!r}), "
                "or close over constants in the loss"
            )
        if not isinstance(x, jax.Array | np.ndarray | np.generic):
            raise PlanError(f"{where} is a {type(x).__name__}, not an array: state holds arrays only")


def check_optimizer(optimizer: Any) -> None:
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise PlanError(
            f"optimizer must be an optax.GradientTransformation (e.g. optax.adamw(3e-4)), got {type(optimizer).__name__}"
        )


def base_key(rng: Any) -> jax.Array | None:
    """``rng=``: None, an int seed, a typed key, or a raw uint32 key (``jax.random.PRNGKey``)."""
    if rng is None:
        return None
    if isinstance(rng, int) and not isinstance(rng, bool):
        return jax.random.key(rng)
    if isinstance(rng, jax.Array | np.ndarray):
        if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ():
            if str(jax.random.key_impl(rng)) not in ("threefry2x32", "fry"):
                raise PlanError(
                    f"rng must be a threefry key (jax.random.key's default), got {jax.random.key_impl(rng)}"
                )
            return rng
        if rng.dtype == np.uint32 and rng.shape == (2,):
            return jax.random.wrap_key_data(jnp.asarray(rng))
    raise PlanError(
        f"rng must be an int seed or a single PRNG key (jax.random.key(0)), got {type(rng).__name__}"
    )
