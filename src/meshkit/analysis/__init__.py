"""Read what a compiled JAX program communicates and stores, and set it beside the cost model.

Independent of the rest of meshkit: point it at any jitted function's ``lower(...).compile()``.
"""

from meshkit.analysis._groups import MAX_DEVICES
from meshkit.analysis.communication import MODELLED, OTHER, Collective, CommLedger, Total, communication
from meshkit.analysis.cost import (
    CONVENTIONS,
    CommModel,
    Convention,
    MemoryModel,
    bubble,
    convention,
    ring_traffic,
    zero_communication,
    zero_memory,
)
from meshkit.analysis.memory import MemoryLedger, memory

__all__ = [
    "CONVENTIONS",
    "MAX_DEVICES",
    "MODELLED",
    "OTHER",
    "Collective",
    "CommLedger",
    "CommModel",
    "Convention",
    "MemoryLedger",
    "MemoryModel",
    "Total",
    "bubble",
    "communication",
    "convention",
    "memory",
    "ring_traffic",
    "zero_communication",
    "zero_memory",
]
