"""``meshkit plan``: choose a parallel layout for a model on a cluster, predicted by the cost model and
checked by compiling it ahead of time on simulated devices."""

from meshkit.planner.layout import Layout, ModelShape

__all__ = ["Layout", "ModelShape"]
