"""The run's optimizer from its config (``meshkit train``'s ``--optimizer``, ``--lr``, ``--warmup``,
``--weight-decay``, ``--momentum``): kept apart from ``config``, which the CLI reads without optax."""

from __future__ import annotations

from typing import Any

import jax
import optax

from meshkit.train.config import TrainConfig, warmup_steps

BATCHED = ("layers",)
"""Logical axes Muon's orthogonalisation batches over (a scanned stack's layers; experts are added from
``plans.EXPERT_DIM``): each layer's, each expert's matrix is orthogonalised on its own."""


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to ``lr`` (none with warmup 0), then cosine decay to lr/10 at the last step."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.optimizer.lr,
        warmup_steps=warmup_steps(cfg),
        decay_steps=max(cfg.run.steps, 2),
        end_value=cfg.optimizer.lr / 10,
    )


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW or SGD with momentum, on the warmup + cosine schedule. AdamW decays every leaf but those a
    model holds (``models.stack.held``: their gradient is zero, so decay alone would move them)."""
    lr = lr_schedule(cfg)
    if cfg.optimizer.optimizer == "adamw":
        return optax.adamw(lr, weight_decay=cfg.optimizer.weight_decay, mask=decayed)
    return optax.sgd(lr, momentum=cfg.optimizer.momentum)


def decayed(params: Any) -> Any:
    """AdamW's weight-decay mask: True for every leaf of ``params`` but the held ones (``stack.held``)."""
    from meshkit.models.stack import held

    return jax.tree_util.tree_map_with_path(lambda path, _: not held(path), params)


def muon_matrices(logical_axes: Any) -> Any:
    """Which leaves optax's Muon orthogonalises (``optax.contrib.muon``'s ``muon_weight_dimension_numbers``),
    from a model's logical axes (its ``logical_axes(params)``): a leaf with exactly two named axes besides the
    batched ones (``BATCHED`` and the experts'), neither the vocabulary's, as (input, output); every other
    leaf (norms, biases, embeddings, the head, routers: an unnamed axis) None, AdamW's, as Muon's authors
    train them."""
    from optax.contrib import MuonDimensionNumbers

    from meshkit.plans import EXPERT_DIM

    batched = (*BATCHED, EXPERT_DIM)

    def one(names: tuple) -> Any:
        inner = [i for i, n in enumerate(names) if n not in batched]
        named = [names[i] for i in inner]
        if len(inner) != 2 or None in named or "vocab" in named:
            return None
        return MuonDimensionNumbers(reduction_axis=inner[0], output_axis=inner[1])

    return jax.tree.map(one, logical_axes, is_leaf=lambda x: isinstance(x, tuple))
