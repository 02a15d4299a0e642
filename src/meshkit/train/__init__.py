"""Training: the Trainer (any loss, parameters and optax optimizer, under any plan).

Names are imported on first use, so that reading the job's config (``meshkit train --help``, and
every other command, which loads the ``train`` command's options) does not start JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshkit.train._inputs import base_key
    from meshkit.train.report import PlanReport
    from meshkit.train.trainer import Trainer

_WHERE = {
    "PlanReport": "meshkit.train.report",
    "Trainer": "meshkit.train.trainer",
    "base_key": "meshkit.train._inputs",
}
__all__ = ["PlanReport", "Trainer", "base_key"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'meshkit.train' has no attribute {name!r}")
