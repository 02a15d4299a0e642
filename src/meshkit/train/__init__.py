"""Training: the Trainer (any loss, parameters and optax optimizer, under any plan)."""

from meshkit.train.trainer import PlanReport, Trainer

__all__ = ["PlanReport", "Trainer"]
