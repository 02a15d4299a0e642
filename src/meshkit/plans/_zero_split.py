"""The ZeRO split of each leaf: which dim a ZeRO plan splits over the ``data`` axis (the largest that
divides), or why the leaf stays whole there (too small, split on another axis, no dim that divides).

What each stage shards and moves is ``analysis.zero``'s rule; ``placement.place`` asks this module for
every leaf, beside the tensor-parallel rules' split on ``model`` (``tp_rules``).
"""

from __future__ import annotations

from typing import Any

from meshkit.plans._leaf_paths import logical_names


def data_dim(
    shape: tuple[int, ...],
    model_spec,
    n: int,
    min_size: int,
    *,
    two_d: bool,
    skip: frozenset[int] = frozenset(),
) -> tuple[int | None, str | None]:
    """The dim a ZeRO plan splits over data: the largest that divides, other than a dim split on the
    model axis (``two_d``: fsdp+tp splits such a leaf on both axes, else it stays whole on data)
    or a ``skip``ped one (a scanned model's stacked layer axis, which its scan slices)."""
    if any(a is not None for a in model_spec) and not two_d:
        axis = next(a for a in model_spec if a is not None)  # the model axis, or the expert axis (fsdp+ep)
        return None, f"split on the {axis} axis (a leaf is not split on both axes)"
    size = 1
    for s in shape:
        size *= s
    if size < max(min_size, 1) or not shape:
        return None, f"too small ({size} elements)"
    free = [d for d in range(len(shape)) if model_spec[d] is None and d not in skip]
    for d in sorted(free, key=lambda d: (-shape[d], d)):
        if shape[d] % n == 0:
            return d, None
    excluded = " other than its model-split and stacked-layer dims" if len(free) < len(shape) else ""
    return None, f"no dim of {shape}{excluded} divides over data={n}"


def layer_dims(logical_axes: Any) -> dict[str, frozenset[int]]:
    """Per leaf path, the dims the logical axes name ``"layers"`` (a scanned model's stacked axis)."""
    return {
        k: frozenset(d for d, a in enumerate(axes) if a == "layers")
        for k, axes in logical_names(logical_axes).items()
    }
