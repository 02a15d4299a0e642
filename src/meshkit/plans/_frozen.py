"""Frozen parameters: leaves the step reads but never trains (LoRA's base weights, a frozen encoder).

A ``Trainable`` is one bool per parameter leaf, in the tree's leaf order. The step differentiates the
loss with respect to the trainable leaves only (``_fsdp.value_and_grad``): a frozen leaf has no
gradient, so no gradient collective moves it (no all-reduce, no reduce-scatter over the batch axes),
and no optimizer state (``optimizer``: the user's optimizer over the trainable leaves alone). Frozen
leaves are placed like any other (ZeRO-3 shards them and gathers them for the forward pass), and
come out of a step as they went in, bit for bit.

Trees "of the trainable leaves" keep the parameters' structure with ``None`` where a leaf is frozen
(an empty subtree to ``jax.tree``), so they line up with ``trainable_placement``'s leaves.

Why beside the optimizer and not in ``ParallelSpec``: the spec is the layout (where leaves live, how
the batch splits); which leaves train is what the optimizer changes, and the same layout trains a
model fully or through adapters. A pipeline plan differentiates its stages itself: there the frozen
leaves' gradients are dropped before the update (no optimizer state; XLA then removes their sums).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import optax

from meshkit.plans._leaf_paths import path_str
from meshkit.plans.placement import LeafPlacement, Placement
from meshkit.spec import PlanError


@dataclass(frozen=True, kw_only=True, slots=True)
class Trainable:
    """Which parameter leaves train: ``mask[i]`` for the i-th leaf of ``jax.tree.leaves(params)``."""

    mask: tuple[bool, ...]

    @classmethod
    def of(cls, trainable: Any, params: Any) -> Trainable | None:
        """From a pytree of bools shaped like ``params`` (or a prefix of it) or a predicate on a leaf's
        path (``"blocks/0/attn/wq"``); None where every leaf trains."""
        if trainable is None:
            return None
        paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        if callable(trainable):
            mask = tuple(bool(trainable(p)) for p in paths)
        else:
            try:
                full = jax.tree.broadcast(trainable, params)
            except (ValueError, TypeError) as e:
                raise PlanError(
                    f"trainable= must be a function of a leaf's path or a tree of bools shaped like the "
                    f"parameters ({' '.join(str(e).split())[:240]})"
                ) from None
            mask = tuple(bool(m) for m in jax.tree.leaves(full))
        if not any(mask):
            raise PlanError("trainable= freezes every parameter: mark at least one leaf trainable")
        return None if all(mask) else cls(mask=mask)

    @property
    def indices(self) -> list[int]:
        return [i for i, m in enumerate(self.mask) if m]

    def train(self, tree: Any, is_leaf: Callable | None = None) -> Any:
        """``tree`` (parameter-structured) with its frozen leaves made ``None``."""
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
        self._check(len(leaves))
        return jax.tree.unflatten(treedef, [x if m else None for x, m in zip(leaves, self.mask, strict=True)])

    def merge(self, trained: Any, full: Any) -> Any:
        """``full`` with its trainable leaves replaced by ``trained``'s (a tree of the trainable leaves)."""
        leaves, treedef = jax.tree.flatten(full)
        new = iter(jax.tree.leaves(trained))
        return jax.tree.unflatten(
            treedef, [next(new) if m else x for x, m in zip(leaves, self.mask, strict=True)]
        )

    def placement(self, placement: Placement) -> Placement:
        """The placement of the trainable leaves (the gradients' and the optimizer state's)."""
        return dataclasses.replace(
            placement, leaves=self.train(placement.leaves, is_leaf=lambda x: isinstance(x, LeafPlacement))
        )

    def optimizer(self, inner: optax.GradientTransformation) -> FrozenOptimizer:
        """``inner`` over the trainable leaves: ``init`` takes the whole parameters, ``update`` the
        trainable leaves' gradients (and the whole parameters)."""

        def init(params):
            return inner.init(self.train(params))

        def update(grads, state, params=None):
            return inner.update(grads, state, None if params is None else self.train(params))

        out = FrozenOptimizer(init, update)
        out.inner, out.trainable = inner, self
        return out

    def sizes(self, placement: Placement, params: Any) -> tuple[Placement, Any]:
        """The placement and (shapes of the) parameters of the trainable leaves alone."""
        return self.placement(placement), self.train(params)

    def _check(self, n: int) -> None:
        if n != len(self.mask):
            raise PlanError(f"trainable= names {len(self.mask)} leaves, the parameters have {n}")


class FrozenOptimizer(optax.GradientTransformation):
    """An optimizer over the trainable leaves of whole parameters (``Trainable.optimizer``); ``inner``
    is the user's and ``trainable`` the leaves it updates: the memory ledger and the peak model count
    ``inner``'s state for those leaves alone (``optimizer_view``)."""

    inner: optax.GradientTransformation
    trainable: Trainable


def optimizer_view(
    optimizer: optax.GradientTransformation, placement: Placement, params: Any
) -> tuple[optax.GradientTransformation, Placement, Any]:
    """``(optimizer, placement, params)`` as the optimizer state is laid out: for a ``FrozenOptimizer``
    its inner optimizer over the trainable leaves; otherwise the arguments themselves. The one rule the
    step's shardings, the memory ledger and the peak model read optimizer state by."""
    if isinstance(optimizer, FrozenOptimizer):
        return (optimizer.inner, *optimizer.trainable.sizes(placement, params))
    return optimizer, placement, params
