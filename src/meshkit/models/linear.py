"""Linear regression as a plain pytree and pure functions (MSE loss)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Params = dict[str, jax.Array]
Axes = dict[str, tuple[str | None, ...]]


def init(key: jax.Array, in_dim: int, out_dim: int = 1, dtype=jnp.float32) -> Params:
    """``{"w": (in, out), "b": (out,)}`` with w ~ N(0, 1/in) and b zeros."""
    w_io = jax.random.normal(key, (in_dim, out_dim), dtype) / jnp.sqrt(in_dim).astype(dtype)
    return {"w": w_io, "b": jnp.zeros((out_dim,), dtype)}


def apply(params: Params, x_bi: jax.Array) -> jax.Array:
    """Predictions ``(B, out)`` for inputs ``(B, in)``."""
    return x_bi @ params["w"] + params["b"]


def loss(params: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean squared error over every element of the batch ``(x (B, in), y (B, out))``."""
    x_bi, y_bo = batch
    return jnp.mean((apply(params, x_bi) - y_bo) ** 2)


def logical_axes(params: Params) -> Axes:
    """Logical axis names per dimension: input features are ``"embed"``, the outputs are unsharded."""
    del params  # the layout does not depend on the sizes
    return {"w": ("embed", None), "b": (None,)}
