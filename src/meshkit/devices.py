"""Simulated CPU devices, a description of the devices JAX sees, and arrays brought to the host."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import jax
import numpy as np
from jax._src import xla_bridge

from meshkit._errors import DeviceSetupError


def backend_started() -> bool:
    """Whether JAX has already initialised its backends (after which device counts are fixed)."""
    return xla_bridge.backends_are_initialized()


def simulate_devices(n: int) -> None:
    """Make JAX's CPU backend expose ``n`` devices.

    Must run before JAX computes anything. Calling it again with the device count already in
    force is a no-op; any other call after the backend started raises ``DeviceSetupError``.
    Where a GPU or TPU backend is present JAX still prefers it; this only shapes the CPU backend.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise DeviceSetupError(f"cannot simulate {n!r} devices: give a positive whole number such as 8")
    if backend_started():
        have = jax.device_count()
        if jax.default_backend() == "cpu" and have == n:
            return
        raise DeviceSetupError(
            f"cannot simulate {n} devices: JAX's backend already started with {have} "
            f"{jax.default_backend()} device(s); call meshkit.simulate_devices({n}) right after "
            f"`import jax`, before any JAX operation, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python"
        )
    jax.config.update("jax_num_cpu_devices", n)


NO_FMA_FLAG = "--xla_cpu_max_isa=AVX"
"""XLA's CPU code generation without fused multiply-adds (AVX2 brought them): deterministic mode's."""


def _fma_off() -> bool:
    flags = os.environ.get("XLA_FLAGS", "").split()
    return any(f in flags for f in (NO_FMA_FLAG, "--xla_cpu_max_isa=SSE4_2"))


def prepare_deterministic() -> None:
    """Deterministic mode on a CPU: XLA's code for AVX2 and later contracts a multiply and an add into one
    fused multiply-add in some loops and not others, by the operands' shapes, so Adam's moments on a ZeRO
    shard differ in the last bit from the whole leaf's. Before JAX starts its backend this turns fused
    multiply-adds off for the process (``NO_FMA_FLAG`` in ``XLA_FLAGS``; other backends ignore it); after,
    it raises ``DeviceSetupError`` unless they are off or the backend is not a CPU."""
    if _fma_off():
        return
    if not backend_started():
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_FMA_FLAG}".strip()
        return
    if jax.default_backend() == "cpu":
        raise DeviceSetupError(
            "deterministic mode on a CPU needs XLA's fused multiply-adds off from the start (their use follows "
            "the shard shapes): call meshkit.prepare_deterministic() right after `import jax`, or set "
            f"XLA_FLAGS={NO_FMA_FLAG} before starting Python"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    """One device as JAX reports it."""

    id: int
    """Device id, unique within its platform (not always contiguous across processes)."""
    platform: str
    """'cpu', 'gpu' or 'tpu'."""
    kind: str
    """``device_kind``, e.g. 'cpu' or 'NVIDIA H200'."""
    process_index: int
    """Index of the process that owns the device."""
    local: bool
    """Whether this process addresses the device directly."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceReport:
    """Global and local devices of this process, as seen by JAX."""

    platform: str
    process_index: int
    process_count: int
    device_count: int
    local_device_count: int
    devices: tuple[DeviceInfo, ...]

    def to_json(self) -> dict:
        return asdict(self)


def describe_devices() -> DeviceReport:
    """Describe every device JAX sees: global vs local, ids, platform, kind and owning process."""
    local_ids = {d.id for d in jax.local_devices()}
    devices = tuple(
        DeviceInfo(
            id=d.id,
            platform=d.platform,
            kind=d.device_kind,
            process_index=d.process_index,
            local=d.id in local_ids,
        )
        for d in jax.devices()
    )
    return DeviceReport(
        platform=jax.default_backend(),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        device_count=jax.device_count(),
        local_device_count=jax.local_device_count(),
        devices=devices,
    )


def host(tree: Any) -> Any:
    """Every leaf as a NumPy array on this host, gathering shards held by other processes.

    (``process_allgather`` alone would concatenate the per-process copies of an array that is
    local to each process, such as the single-device reference.)
    """

    def one(a):
        if not isinstance(a, jax.Array) or a.is_fully_addressable:
            return np.asarray(a)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(one, tree)
