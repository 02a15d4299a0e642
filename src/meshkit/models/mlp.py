"""A multilayer perceptron as a plain pytree and pure functions (tanh hidden layers, MSE loss)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Params = list[dict[str, jax.Array]]


def init(key: jax.Array, sizes: Sequence[int], dtype=jnp.float32) -> Params:
    """Layers ``[{"w": (a, b), "b": (b,)}, ...]`` for ``sizes = [in, hidden..., out]``, w ~ N(0, 1/a)."""
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b), dtype) / jnp.sqrt(a).astype(dtype), "b": jnp.zeros((b,), dtype)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def apply(params: Params, x_bd: jax.Array) -> jax.Array:
    """Forward pass: tanh on every hidden layer, linear output."""
    for layer in params[:-1]:
        x_bd = jnp.tanh(x_bd @ layer["w"] + layer["b"])
    return x_bd @ params[-1]["w"] + params[-1]["b"]


def loss(params: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean squared error over the batch ``(x, y)``."""
    x, y = batch
    return jnp.mean((apply(params, x) - y) ** 2)
