"""Training: the Trainer (any loss, parameters and optax optimizer, under any plan).

Names are imported on first use, so that reading the job's config (``meshkit train --help``, and
every other command, which loads the ``train`` command's options) does not start JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshkit.train.trainer import PlanReport, Trainer

__all__ = ["PlanReport", "Trainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("meshkit.train.trainer"), name)
    raise AttributeError(f"module 'meshkit.train' has no attribute {name!r}")
