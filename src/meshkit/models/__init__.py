"""Reference models: plain pytrees and pure functions. Models never see the mesh."""

from typing import Any

import jax

from meshkit.models import gpt, linear, llama, mlp, reference_np


def num_params(params: Any) -> int:
    """Total number of parameter elements in a pytree (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
    return sum(leaf.size for leaf in jax.tree.leaves(params))


__all__ = ["gpt", "linear", "llama", "mlp", "num_params", "reference_np"]
