"""Ring-algorithm traffic per device of one collective (S = tensor bytes, n = group size): all-reduce
2(n-1)/n*S, reduce-scatter (n-1)/n*S_in, all-gather (n-1)/n*S_out, all-to-all (n-1)/n*S,
collective-permute S. Every model of cost prices its collectives with it (``analysis.cost``,
``analysis.zero``, ``plans._expected``, the planner)."""

from __future__ import annotations

from meshkit._errors import MeshkitError

RING_FACTORS = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def ring_traffic(op: str, size_bytes: float, n: int) -> float:
    """Bytes each device sends (and receives) for one collective under the ring algorithm.

    ``size_bytes`` is S_in for reduce-scatter and S_out for all-gather; a group of one moves nothing
    (collective-permute excepted: it moves S whatever the group).
    """
    if op not in RING_FACTORS:
        raise MeshkitError(f"no ring model for {op!r}: known ops are {', '.join(RING_FACTORS)}")
    if n < 1:
        raise MeshkitError(f"group size must be at least 1, got {n}")
    return RING_FACTORS[op](n) * size_bytes
