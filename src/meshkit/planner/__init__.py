"""``meshkit plan``: choose a parallel layout for a model on a cluster, predicted by the cost model and
checked by compiling it ahead of time on simulated devices."""

from meshkit.planner.cluster import Cluster, Job
from meshkit.planner.hardware import HARDWARE, Hardware, hardware
from meshkit.planner.layout import Layout, ModelShape
from meshkit.planner.predict import Prediction, predict
from meshkit.planner.search import Search, search

__all__ = [
    "HARDWARE",
    "Cluster",
    "Hardware",
    "Job",
    "Layout",
    "ModelShape",
    "Prediction",
    "Search",
    "hardware",
    "predict",
    "search",
]
