"""Self-test of every collective on the current devices: values against NumPy, time, bus bandwidth.

``selftest()`` runs psum, pmean, pmax, all_gather, psum_scatter, all_to_all and ppermute as
``jax.jit(jax.shard_map(...))`` over a 1-D mesh ``i`` of all devices, at each requested size, and
checks every output element this process holds against a NumPy reference computed from the
known global input. Sizes are ``S`` of the ring formulas per device (the tensor a collective
reduces, or all-gather's gathered result, as nccl-tests counts them); ``S`` and the ring-model
traffic are read back from the compiled program by :func:`meshkit.analysis.communication`, so they
are the real sizes. Bus bandwidth is ring traffic per device / median time (GB/s, 1e9 B/s).

Inputs are float32 integers ``d + n * (j mod L)`` (device ``d`` of ``n``, position ``j``) with
``L = 2**24 // n**2``: values differ between devices at every position and every sum is exact in
float32, so all checks but pmean's are exact. Only addressable shards are read, so the same call
works in every process of a multi-process job; the processes then agree on the verdicts.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit._errors import MeshkitError
from meshkit.analysis.communication import communication
from meshkit.mesh import make_mesh

AXIS = "i"
#: Default sizes: one small (latency-bound) and one large (bandwidth-bound), bytes per device.
SIZES = (64 * 2**10, 4 * 2**20)
#: Tolerance of pmean relative to each expected element: a few float32 roundings of the division.
PMEAN_RTOL = 4 * 2.0**-24


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One collective: the function each device runs, and the NumPy reference."""

    name: str
    """Name of the ``jax.lax`` collective, e.g. ``'psum'``."""
    op: str
    """The XLA collective it must compile to, e.g. ``'all-reduce'``."""
    body: Callable[[int], Callable[[jax.Array], jax.Array]]
    """``n -> f``: the per-device function, given the device count."""
    reference: Callable[[np.ndarray], np.ndarray]
    """Global input ``(n, k)`` -> global expected output (a view where possible)."""
    gathers: bool = False
    """Whether ``S`` is the output (all-gather): each device then holds S/n of input."""
    rtol: float = 0.0
    """Allowed error relative to each expected element (0: exact)."""


def _ref_psum(x: np.ndarray) -> np.ndarray:
    return np.broadcast_to(x.sum(0, keepdims=True), x.shape)


def _ref_pmean(x: np.ndarray) -> np.ndarray:
    return np.broadcast_to(x.mean(0, keepdims=True, dtype=np.float64), x.shape)


def _ref_pmax(x: np.ndarray) -> np.ndarray:
    return np.broadcast_to(x.max(0, keepdims=True), x.shape)


def _ref_all_gather(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    return np.broadcast_to(x.reshape(1, -1), (n, x.size))


def _ref_psum_scatter(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    return x.sum(0).reshape(n, -1)


def _ref_all_to_all(x: np.ndarray) -> np.ndarray:
    n, k = x.shape
    return x.reshape(n, n, k // n).transpose(1, 0, 2).reshape(n * n, k // n)


def _ref_ppermute(x: np.ndarray) -> np.ndarray:
    return np.roll(x, 1, axis=0)


def _shift(n: int) -> list[tuple[int, int]]:
    return [(s, (s + 1) % n) for s in range(n)]


CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check(
            name="psum", op="all-reduce", body=lambda n: lambda x: jax.lax.psum(x, AXIS), reference=_ref_psum
        ),
        Check(
            name="pmean",
            op="all-reduce",
            body=lambda n: lambda x: jax.lax.pmean(x, AXIS),
            reference=_ref_pmean,
            rtol=PMEAN_RTOL,
        ),
        Check(
            name="pmax", op="all-reduce", body=lambda n: lambda x: jax.lax.pmax(x, AXIS), reference=_ref_pmax
        ),
        Check(
            name="all_gather",
            op="all-gather",
            gathers=True,
            reference=_ref_all_gather,
            body=lambda n: lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True),
        ),
        Check(
            name="psum_scatter",
            op="reduce-scatter",
            reference=_ref_psum_scatter,
            body=lambda n: lambda x: jax.lax.psum_scatter(x, AXIS, scatter_dimension=1, tiled=True),
        ),
        Check(
            name="all_to_all",
            op="all-to-all",
            reference=_ref_all_to_all,
            body=lambda n: lambda x: jax.lax.all_to_all(x, AXIS, 1, 0, tiled=True),
        ),
        Check(
            name="ppermute",
            op="collective-permute",
            reference=_ref_ppermute,
            body=lambda n: lambda x: jax.lax.ppermute(x, AXIS, _shift(n)),
        ),
    )
}
"""Every collective checked, by name; each compiles to exactly one ``op``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SelfTestRow:
    """One collective at one size."""

    collective: str
    """``jax.lax`` name, e.g. ``'psum_scatter'``."""
    op: str
    """XLA collective it is expected to compile to."""
    size: int
    """Requested S in bytes per device."""
    shape: tuple[int, ...]
    """Per-device input shape (float32)."""
    ok: bool
    """Whether every checked element is within tolerance (in every process)."""
    max_abs_error: float
    """Largest |output - NumPy| over the checked elements (inf on a shape mismatch)."""
    rtol: float
    """Allowed |error| relative to each expected element (0: exact)."""
    shards_checked: int
    """Output shards compared (all processes together)."""
    time_s: float
    """Median wall time of one call after a warm-up (slowest process)."""
    ops: tuple[str, ...]
    """Collective ops found in the compiled program, in program order."""
    size_bytes: int
    """S of the ring formula, read from the compiled program."""
    traffic_bytes: float
    """Ring-model traffic per device of one call, from the compiled program."""

    @property
    def bus_gbps(self) -> float:
        """Achieved bus bandwidth: ring traffic per device / time, in GB/s (1e9 B/s)."""
        return self.traffic_bytes / self.time_s / 1e9 if self.time_s > 0 else math.inf

    @property
    def ledger_matches(self) -> bool:
        """Whether the program holds exactly one collective, the expected op."""
        return self.ops == (self.op,)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bus_gbps": self.bus_gbps, "ledger_matches": self.ledger_matches}


@dataclass(frozen=True, kw_only=True, slots=True)
class SelfTestReport:
    """Every collective at every size, on the devices of this job."""

    platform: str
    device_count: int
    process_index: int
    process_count: int
    repeats: int
    rows: tuple[SelfTestRow, ...]

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return all(r.ok for r in self.rows)

    def failures(self) -> tuple[SelfTestRow, ...]:
        return tuple(r for r in self.rows if not r.ok)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "platform": self.platform,
            "device_count": self.device_count,
            "process_index": self.process_index,
            "process_count": self.process_count,
            "repeats": self.repeats,
            "rows": [r.to_json() for r in self.rows],
        }


_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
}


def parse_size(text: str | int) -> int:
    """Bytes from ``4096``, ``64KiB``, ``4MiB``, ``4M`` (binary) or ``4MB`` (decimal)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        unit = m and m.group(2).lower()
        if m is None or unit not in _UNITS:
            raise MeshkitError(f"bad size {text!r}: write bytes such as 4096, 64KiB or 4MiB")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise MeshkitError(f"bad size {text!r}: sizes are at least 1 byte")
    return value


def parse_sizes(items: Iterable[str | int]) -> tuple[int, ...]:
    """Sizes from a list whose items may be comma-separated: ``["64KiB,4MiB"]``."""
    out = []
    for item in items:
        parts = item.split(",") if isinstance(item, str) else [item]
        out.extend(parse_size(p) for p in parts if not isinstance(p, str) or p.strip())
    if not out:
        raise MeshkitError("no sizes given: pass sizes such as --sizes 64KiB,4MiB")
    return tuple(out)


def inputs(n: int, k: int) -> np.ndarray:
    """Global input ``(n, k)``: ``d + n * (j mod L)``, exact float32 integers whose sums over
    devices stay below 2**24."""
    period = max(1, 2**24 // (n * n))
    return (np.arange(n)[:, None] + n * (np.arange(k) % period)[None, :]).astype(np.float32)


def _columns(check: Check, size: int, n: int) -> int:
    """Per-device input columns so that S >= size and the collective's splits are even."""
    elements = -(-size // 4)
    elements = -(-elements // n) * n
    return elements // n if check.gathers else elements


def _time(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # warm-up: first execution
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compare(out: jax.Array, expected: np.ndarray, rtol: float) -> tuple[float, bool, int]:
    """(max |error|, every element within ``rtol * |expected|``, shards compared) over the
    shards this process holds; never gathers the global array."""
    if out.shape != expected.shape:
        return math.inf, False, 0
    errors, within = [0.0], True
    for shard in out.addressable_shards:
        got = np.asarray(shard.data, np.float64)
        want = np.asarray(expected[shard.index], np.float64)
        diff = np.abs(got - want)
        errors.append(np.max(diff, initial=0.0))
        within &= bool(np.all(diff <= rtol * np.abs(want)))  # False on NaN
    return float(np.max(errors)), within, len(out.addressable_shards)


def run_check(check: Check, size: int, mesh: jax.sharding.Mesh, repeats: int) -> SelfTestRow:
    """Compile, run and check one collective at one size (this process's view)."""
    n = mesh.devices.size
    x = inputs(n, _columns(check, size, n))
    sharding = NamedSharding(mesh, P(AXIS))
    arg = jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    fn = jax.jit(jax.shard_map(check.body(n), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    compiled = fn.lower(arg).compile()
    ledger = communication(compiled)
    seconds = _time(lambda: compiled(arg), repeats)
    expected = check.reference(x)
    err, within, shards = _compare(compiled(arg), expected, check.rtol)
    hits = [r for r in ledger.records if r.op == check.op] or list(ledger.records)
    return SelfTestRow(
        collective=check.name,
        op=check.op,
        size=size,
        shape=(1, x.shape[1]),
        ok=within,
        max_abs_error=err,
        rtol=check.rtol,
        shards_checked=shards,
        time_s=seconds,
        ops=tuple(r.op for r in ledger.records),
        size_bytes=sum(r.size_bytes * r.executions for r in hits),
        traffic_bytes=ledger.traffic_bytes,
    )


def _agree(rows: Sequence[SelfTestRow]) -> tuple[SelfTestRow, ...]:
    """Combine the processes' verdicts: ok in all, worst error, slowest time, shards summed."""
    local = np.array([[r.ok, r.max_abs_error, r.time_s, r.shards_checked] for r in rows], np.float32)
    every = np.asarray(multihost_utils.process_allgather(local))  # (processes, rows, 4)
    return tuple(
        replace(
            r,
            ok=bool(every[:, i, 0].all()),
            max_abs_error=float(every[:, i, 1].max()),
            time_s=float(every[:, i, 2].max()),
            shards_checked=int(every[:, i, 3].sum()),
        )
        for i, r in enumerate(rows)
    )


def selftest(
    sizes: Iterable[int | str] = SIZES,
    repeats: int = 5,
    collectives: Iterable[str] | None = None,
) -> SelfTestReport:
    """Check every collective (or those named) at every size on all devices of this job.

    Every process of a multi-process job must call it with the same arguments.
    """
    sizes = parse_sizes(sizes)
    if repeats < 1:
        raise MeshkitError(f"repeats must be at least 1, got {repeats}")
    names = list(CHECKS) if collectives is None else list(collectives)
    unknown = [c for c in names if c not in CHECKS]
    if unknown:
        raise MeshkitError(f"unknown collective {unknown[0]!r}: choose from {', '.join(CHECKS)}")
    mesh = make_mesh(f"{AXIS}=-1")
    rows = [run_check(CHECKS[c], s, mesh, repeats) for s in sizes for c in names]
    return SelfTestReport(
        platform=jax.default_backend(),
        device_count=jax.device_count(),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        repeats=repeats,
        rows=_agree(rows),
    )
