"""The remat policies' meaning: each name of ``meshkit.spec.REMAT_POLICIES`` as a ``jax.checkpoint``
policy (None: no checkpointing). What each keeps is described in ``meshkit.spec``; why ZeRO-3 needs
``regather`` in ``_fsdp``."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from meshkit.spec import REMAT_POLICIES


def _all_but_gathers(prim, *_, **__) -> bool:
    """Save every value but an all-gather's output (JAX 0.12's ``save_anything_except_these_names``
    saves everything, and a name on the gathered value would still let its producer be saved)."""
    return prim.name != "all_gather"


INT8_RESULT = "meshkit_int8_matmul"
"""The name (``jax.ad_checkpoint.checkpoint_name``) of an int8 matmul's rescaled result
(``models.quantize.linear``): what ``dots`` keeps of it."""


def _dots(prim, *avals, **params) -> bool:
    """``dots_saveable``, but an int8 matmul (``--quantize``) keeps its rescaled result, not its int32
    sums (twice bf16's bytes)."""
    if prim.name == "dot_general":
        return not any(getattr(a, "dtype", None) == np.int8 for a in avals)
    return prim.name == "name" and params.get("name") == INT8_RESULT


_POLICIES: dict[str, Any] = {
    "none": None,
    "layer": jax.checkpoint_policies.nothing_saveable,
    "dots": _dots,
    "regather": _all_but_gathers,
}
assert tuple(_POLICIES) == REMAT_POLICIES, "every remat policy of meshkit.spec needs its jax policy here"


def remat_policy(name: str) -> Any:
    """The ``jax.checkpoint`` policy of a remat policy name (None for 'none')."""
    return _POLICIES[name]


def keeps_forward(name: str) -> bool:
    """Whether the backward pass reads the forward's own values, recomputing none of them (no
    checkpointing, or ``regather``'s every value but a gather): sequence parallelism's gathered inputs
    are then kept, not gathered again (``plans.axes.model``)."""
    return _POLICIES[name] in (None, _all_but_gathers)
