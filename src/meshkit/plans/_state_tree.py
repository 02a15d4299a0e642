"""The optimizer state's parameter-shaped leaves, matched to the parameters: where the plan shards the
state (``_step.state_shardings``) and what it holds per device (``_expected.memory_formula``) both ask here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax


def map_state(
    optimizer: optax.GradientTransformation,
    params: Any,
    state: Any,
    tree: Any,
    fn: Callable,
    other: Callable,
    is_leaf: Callable,
) -> Any:
    """``fn(state_leaf, tree_leaf)`` on each leaf of ``state`` (``optimizer.init``'s shapes) that is a
    parameter's, with ``tree`` structured like ``params``; ``other(state_leaf)`` on the rest.

    ``optax.tree_map_params`` finds them by initialising the optimizer on a placeholder. An optimizer
    whose ``init`` reads the parameters' structure (``optax.contrib.muon``, a ``multi_transform`` with a
    labelling function) fails on it; its leaves are matched by path instead: a leaf whose path ends with
    a parameter's path (optax's states hold parameter-shaped trees under their own fields,
    ``mu/blocks/0/wq``), at that parameter's shape."""
    try:
        return optax.tree_map_params(optimizer, fn, state, tree, transform_non_params=other, is_leaf=is_leaf)
    except (TypeError, ValueError, AttributeError):
        pass
    held = {
        tuple(path): (np.shape(leaf), t)
        for (path, leaf), t in zip(
            jax.tree_util.tree_flatten_with_path(params)[0],
            jax.tree.leaves(tree, is_leaf=is_leaf),
            strict=True,
        )
    }

    def one(path, leaf):
        for start in range(len(path)):
            shape, t = held.get(tuple(path[start:]), (None, None))
            if shape == tuple(leaf.shape):
                return fn(leaf, t)
        return other(leaf)

    return jax.tree_util.tree_map_with_path(one, state)
