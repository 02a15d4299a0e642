"""How the plans name a parameter leaf: its path in the tree as ``a/b/c`` (the key of a placement's
decisions, of the tensor-parallel rules' regexes and of ``trainable=``'s predicate), and the logical
axis names a model gives each leaf, by that key."""

from __future__ import annotations

from typing import Any

import jax


def path_str(path) -> str:
    """A leaf's path from ``jax.tree_util.tree_flatten_with_path`` as ``a/b/c``."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def logical_names(logical_axes: Any) -> dict[str, tuple]:
    """Per leaf path, its logical axis names (none without ``logical_axes``)."""
    if logical_axes is None:
        return {}
    names = jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0]
    return {path_str(p): tuple(axes) for p, axes in names}
