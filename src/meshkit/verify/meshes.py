"""Deterministic mode's "bitwise across meshes": the meshes a plan is compared on, and the
comparison across processes (digests of the bits, exchanged).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from meshkit._errors import MeshkitError
from meshkit.devices import host
from meshkit.spec import DATA, STAGE, ParallelSpec
from meshkit.verify.compare import bitwise_equal


def comparison_meshes(spec: ParallelSpec, devices: Sequence[Any]) -> dict[str, Any]:
    """The meshes deterministic mode compares for ``spec``, on the first of ``devices``, by label: a data
    axis of N = 1, 2, 4... devices, N dividing the devices and at most the micro-shards. A plan with a stage
    axis holds its stage degree S and varies the data axis: ``(stage, data)`` meshes of S x N devices (a
    tied embedding keeps its bits across data axes, not between one stage and several:
    docs/deterministic.md)."""
    from jax.sharding import Mesh

    stages = spec.degrees(jax.device_count())[STAGE] if spec.plan_info.pipeline else None
    per = stages or 1
    out, n = {}, 1
    while n <= spec.deterministic and n * per <= len(devices):
        if len(devices) % (n * per) == 0:
            chosen = np.array(devices[: n * per])
            if stages is None:
                out[f"{DATA}={n}"] = Mesh(chosen, (DATA,))
            else:
                out[f"{STAGE}={stages},{DATA}={n}"] = Mesh(chosen.reshape(stages, n), (STAGE, DATA))
        n *= 2
    return out


def check_meshes(spec: ParallelSpec) -> None:
    """Refuse, in one line and before any training, a deterministic spec whose 'bitwise across meshes'
    check has no mesh to run on: on several processes each compares meshes of its own devices, so those
    must be as many in every process and hold the plan's stage degree."""
    if spec.deterministic is None:
        return
    processes, local = jax.process_count(), jax.local_device_count()
    if processes > 1 and jax.device_count() != processes * local:
        raise MeshkitError(
            f"meshkit verify --deterministic on {processes} processes compares meshes of each process's own "
            f"devices: give every process as many (--devices-per-process), not {jax.device_count()} over "
            f"{processes}"
        )
    if not comparison_meshes(spec, jax.local_devices() if processes > 1 else jax.devices()):
        stages = spec.degrees(jax.device_count())[STAGE]
        raise MeshkitError(
            f"meshkit verify --deterministic compares meshes of one process's {local} devices, too few for "
            f"plan {spec.plan}'s {stages} stages: give each process at least {stages} (--devices-per-process)"
        )


def bitwise_meshes(params: Any, train_on: Callable[[Any], Any], spec: ParallelSpec) -> dict[str, bool]:
    """Deterministic mode: ``train_on(mesh)`` (the parameters after the same K steps) on each of
    ``comparison_meshes``, compared bit for bit with ``params`` (the plan's run).

    On one process the meshes are of the first devices. On several (``meshkit launch``) the plan ran on
    every process's devices; each process trains on meshes of its own devices (no collective across
    processes) and compares with the plan's parameters gathered to it, and the processes exchange
    digests of those bits, so that every process returns the same verdict: ``data=N`` holds where every
    process's run equals the plan's bits, and the row of the plan's own mesh (``2 processes x 4``) where
    every process gathered the same bits of it."""
    if jax.process_count() == 1:
        return {
            label: bitwise_equal(train_on(mesh), params)
            for label, mesh in comparison_meshes(spec, jax.devices()).items()
        }
    from jax.experimental import multihost_utils

    meshes = comparison_meshes(spec, jax.local_devices())
    mine = np.stack([_digest(params)] + [_digest(train_on(mesh)) for mesh in meshes.values()])
    every = np.asarray(multihost_utils.process_allgather(mine))  # (processes, 1 + meshes, digest)
    out = {label: bool((every[:, i + 1] == every[0, 0]).all()) for i, label in enumerate(meshes)}
    out[f"{jax.process_count()} processes x {jax.local_device_count()}"] = bool(
        (every[:, 0] == every[0, 0]).all()
    )
    return out


def _digest(tree: Any) -> np.ndarray:
    """SHA-256 of ``tree``'s bits on this host (shards of other processes gathered), as 32 bytes."""
    h = hashlib.sha256()
    for a in jax.tree.leaves(host(tree)):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest(), np.uint8)
