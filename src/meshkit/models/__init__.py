"""Reference models: plain pytrees and pure functions. Models never see the mesh."""

from typing import Any

import jax

from meshkit.models import gpt, linear, llama, mlp, reference_np


def module_of(cfg: Any) -> Any:
    """The module of a model config (``gpt`` or ``llama``): its ``init``, ``apply``, ``make_loss``,
    ``stages``, ``logical_axes`` and ``flops_per_token``."""
    if isinstance(cfg, llama.LlamaConfig):
        return llama
    if isinstance(cfg, gpt.GPTConfig):
        return gpt
    raise TypeError(f"no meshkit model has config {type(cfg).__name__}")


def num_params(params: Any) -> int:
    """Total number of parameter elements in a pytree (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
    return sum(leaf.size for leaf in jax.tree.leaves(params))


__all__ = ["gpt", "linear", "llama", "mlp", "module_of", "num_params", "reference_np"]
