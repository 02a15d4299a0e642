"""Reference models: plain pytrees and pure functions. Models never see the mesh."""

import importlib
from typing import Any

from meshkit.models import registry

_LAZY = ("gpt", "generate", "linear", "llama", "mlp", "reference_np")
"""The model modules, imported on first use: the registry (``meshkit train --help`` reads it) needs no JAX."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"meshkit.models.{name}")
    raise AttributeError(f"module 'meshkit.models' has no attribute {name!r}")


def module_of(cfg: Any) -> Any:
    """The module of a model config (its family's, ``meshkit.models.registry``): its ``init``, ``apply``,
    ``make_loss``, ``stages``, ``logical_axes`` and ``flops_per_token``."""
    return registry.family_of(cfg).module


def num_params(params: Any) -> int:
    """Total number of parameter elements in a pytree (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
    import jax

    return sum(leaf.size for leaf in jax.tree.leaves(params))


__all__ = ["gpt", "linear", "llama", "mlp", "module_of", "num_params", "reference_np", "registry"]
