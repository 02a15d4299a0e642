"""The run's optimizer from its config (``meshkit train``'s ``--optimizer``, ``--lr``, ``--warmup``,
``--weight-decay``, ``--momentum``): kept apart from ``config``, which the CLI reads without optax."""

from __future__ import annotations

import optax

from meshkit.train.config import TrainConfig, warmup_steps


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
    """AdamW or SGD with momentum, on the warmup + cosine schedule."""
    lr = lr_schedule(cfg)
    if cfg.optimizer.optimizer == "adamw":
        return optax.adamw(lr, weight_decay=cfg.optimizer.weight_decay)
    return optax.sgd(lr, momentum=cfg.optimizer.momentum)
