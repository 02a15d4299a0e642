"""Where a collective's group runs (inside a host, or across hosts through how many NICs), at what
bandwidth, and what latency its ring or tree pays (NCCL's model)."""

from __future__ import annotations

import functools
import math

from meshkit.planner.cluster import Cluster
from meshkit.planner.hardware import BASE_LATENCY_S


def crosses_hosts(stride: int, size: int, cluster: Cluster) -> bool:
    """Whether groups of ``size`` devices ``stride`` apart (mesh order stage, data, model: model
    innermost) span more than one host."""
    return _crosses(stride, size, cluster.devices_per_host, cluster.devices)


@functools.lru_cache(maxsize=4096)  # pure arithmetic the search asks again for every layout
def _crosses(stride: int, size: int, dph: int, devices: int) -> bool:
    if size <= 1:
        return False
    span = stride * size
    if span <= dph and dph % span == 0:
        return False
    if stride >= dph or span % dph == 0:
        return True
    return any((r + stride * (size - 1)) // dph != r // dph for r in range(min(devices, span)))


def group_bandwidth(cluster: Cluster, stride: int, size: int, *, one_nic: bool = False) -> float:
    """Bytes/s per device of a ring over ``size`` devices ``stride`` apart: intra-host, or where the
    group spans hosts, through the NICs of its k members on a host (``one_nic``: a point-to-point send)."""
    h = cluster.hardware
    if not crosses_hosts(stride, size, cluster):
        return h.intra_host_bytes_per_s
    k = 1 if one_nic else max(1, min(size, cluster.devices_per_host // stride))
    return min(h.intra_host_bytes_per_s, k * h.inter_host_bytes_per_s)


def collective_latency(cluster: Cluster, op: str, stride: int, size: int) -> float:
    """Seconds one collective waits on its ring's steps (NCCL's model: ``hardware.BASE_LATENCY_S``
    plus a hop per step, ``host_hop_s`` for those between hosts; an all-reduce takes NCCL's tree
    where that is shorter; ``collective-permute``: one hop)."""
    h = cluster.hardware
    if size <= 1:
        return 0.0
    crosses = crosses_hosts(stride, size, cluster)
    if op == "collective-permute":
        return BASE_LATENCY_S + (h.host_hop_s if crosses else h.hop_s)
    k = max(1, min(size, cluster.devices_per_host // stride)) if crosses else size
    hosts = -(-size // k)
    twice = 2 if op == "all-reduce" else 1
    outer = twice * (hosts - 1)
    ring = BASE_LATENCY_S + (twice * (size - 1) - outer) * h.hop_s + outer * h.host_hop_s
    if op != "all-reduce":
        return ring
    tree = BASE_LATENCY_S + 2 * ((k - 1) * h.hop_s + math.ceil(math.log2(hosts)) * h.host_hop_s)
    return min(ring, tree)
