"""NumPy float64 references: linear regression and the MLP with hand-written gradients, Adam and SGD.

Parameters use the same pytree layout as :mod:`meshkit.models.linear` (``{"w", "b"}``) and
:mod:`meshkit.models.mlp` (a list of ``{"w", "b"}``), holding float64 NumPy arrays, so a distributed run
can be compared with an exact-arithmetic-like baseline after K optimizer steps. ``jax.tree`` is used only
to walk the structure; every number is computed by NumPy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

Layer = dict[str, np.ndarray]


def to_float64(tree: Any) -> Any:
    """Copy any pytree of arrays (JAX or NumPy) to float64 NumPy arrays."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def mlp_apply(params: list[Layer], x_bd: np.ndarray) -> np.ndarray:
    """Forward pass: tanh on every hidden layer, linear output."""
    for layer in params[:-1]:
        x_bd = np.tanh(x_bd @ layer["w"] + layer["b"])
    return x_bd @ params[-1]["w"] + params[-1]["b"]


def mlp_loss(params: list[Layer], x_bd: np.ndarray, y_bo: np.ndarray) -> float:
    """Mean squared error over every element."""
    return float(np.mean((mlp_apply(params, x_bd) - y_bo) ** 2))


def mlp_grad(params: list[Layer], x_bd: np.ndarray, y_bo: np.ndarray) -> tuple[float, list[Layer]]:
    """Loss and its gradient by backpropagation."""
    acts = [x_bd]  # the input of each layer
    for layer in params[:-1]:
        acts.append(np.tanh(acts[-1] @ layer["w"] + layer["b"]))
    err_bo = acts[-1] @ params[-1]["w"] + params[-1]["b"] - y_bo
    delta_bo = 2.0 * err_bo / err_bo.size  # d loss / d pre-activation of the current layer
    grads: list[Layer] = []
    for i in reversed(range(len(params))):
        grads.append({"w": acts[i].T @ delta_bo, "b": delta_bo.sum(0)})
        if i:
            delta_bo = (delta_bo @ params[i]["w"].T) * (1.0 - acts[i] ** 2)
    return float(np.mean(err_bo**2)), grads[::-1]


def linear_apply(params: Layer, x_bi: np.ndarray) -> np.ndarray:
    """Predictions ``x @ w + b``."""
    return mlp_apply([params], x_bi)


def linear_loss(params: Layer, x_bi: np.ndarray, y_bo: np.ndarray) -> float:
    """Mean squared error over every element."""
    return mlp_loss([params], x_bi, y_bo)


def linear_grad(params: Layer, x_bi: np.ndarray, y_bo: np.ndarray) -> tuple[float, Layer]:
    """Loss and its gradient: ``dw = x^T (2 e / n)``, ``db = sum_b 2 e / n`` with ``e = x w + b - y``."""
    value, (grads,) = mlp_grad([params], x_bi, y_bo)
    return value, grads


class AdamState(NamedTuple):
    """Step count and first and second moment estimates."""

    count: int
    mu: Any
    nu: Any


def adam_init(params: Any) -> AdamState:
    """Zero moments, zero steps."""
    zeros = jax.tree.map(np.zeros_like, params)
    return AdamState(0, zeros, zeros)


def adam_step(
    params: Any,
    grads: Any,
    state: AdamState,
    lr: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> tuple[Any, AdamState]:
    """One ``optax.adam`` step (``eps_root=0``, bias-corrected moments) applied to ``params``."""
    count = state.count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    params = jax.tree.map(
        lambda p, m, v: p - lr * (m / (1 - b1**count)) / (np.sqrt(v / (1 - b2**count)) + eps), params, mu, nu
    )
    return params, AdamState(count, mu, nu)


def sgd_momentum_init(params: Any) -> Any:
    """Zero momentum trace."""
    return jax.tree.map(np.zeros_like, params)


def sgd_momentum_step(
    params: Any, grads: Any, trace: Any, lr: float, momentum: float = 0.9
) -> tuple[Any, Any]:
    """One ``optax.sgd(lr, momentum)`` step (heavy ball, not Nesterov): ``t = g + m t``, ``p -= lr t``."""
    trace = jax.tree.map(lambda t, g: g + momentum * t, trace, grads)
    return jax.tree.map(lambda p, t: p - lr * t, params, trace), trace
