"""Where a step's time goes, read from a ``jax.profiler`` trace: compute, each collective, and the
communication no computation hides; beside the communication ledger's bytes, the achieved bandwidth.

``summarize(trace, ledger)`` reads the Chrome/Perfetto trace that ``jax.profiler`` writes
(``plugins/profile/<run>/<host>.trace.json.gz``, TensorBoard's layout; any such file, also one
meshkit did not write). What it reads:

- **op events**: complete events (``"ph": "X"``) whose ``args`` name an ``hlo_op`` and its
  ``hlo_module``; XLA names them by the HLO instruction (``reduce_scatter.7``), the same name the
  ledger (:mod:`meshkit.analysis.communication`) gives a collective. XLA:CPU also gives
  ``device_ordinal`` (the device; else the thread stands for it) and ``run_id`` (one execution of
  the program: one step; without it the whole trace counts as one).
- **collectives**: an op event is a collective when the ledger names its instruction (its kind is
  the ledger's); without a ledger, when its name reads as one (``all-gather``, ``all_gather.3``,
  ``psum``, ``ppermute``, async ``-start``/``-done`` halves), or when a ``Rendezvous`` event inside
  it names one (XLA:CPU: ``all gather RendezvousKey{...}``) and it holds no other op event.

Per step and device (then averaged over devices; ``TraceSummary`` averages the steps):

Executions the trace holds only part of (those running as tracing began or ended: fewer op events
on some device than a whole execution has) are left out (``partial`` counts them).

- ``wall``: first op start to last op end of the step, over all devices;
- ``compute``: the union of the intervals of the non-collective op events that contain no other op
  event (a while loop's or call's event holds its body's: the body is counted, not the container);
- ``collective[kind]``: the union of the intervals of that kind's op events;
- ``exposed``: the union of all collective intervals less the union of compute intervals on the
  same device: communication no computation of that device overlaps. On XLA:CPU a device runs its
  thunks one at a time, so nearly all collective time is exposed, and most of it is the
  rendezvous in which the device threads wait for each other.

Achieved bandwidth of a kind = the ledger's per-device ring traffic of that kind per step / its time.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.analysis.communication import MODELLED, OTHER, CommLedger

TRACE_GLOB = "plugins/profile/*/*.trace.json.gz"
"""Where ``jax.profiler`` puts the trace under its log directory (TensorBoard's profile plugin layout);
``perfetto_trace.json.gz`` beside it is the same trace without its metadata."""
PERFETTO_NAME = "perfetto_trace.json.gz"

#: How traces spell a collective's kind, by the name with '_' and spaces as '-', with no '.N'
#: suffix and no '-start'/'-done' (XLA's opcodes, the jax primitives that name instructions).
_ALIASES = {
    **{op: op for op in (*MODELLED, *OTHER)},
    "allreduce": "all-reduce",
    "psum": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "reducescatter": "reduce-scatter",
    "psum-scatter": "reduce-scatter",
    "allgather": "all-gather",
    "alltoall": "all-to-all",
    "ppermute": "collective-permute",
}
_SUFFIX = re.compile(r"(\.\d+)+$")


class TraceError(MeshkitError):
    """A trace cannot be found or read."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Op:
    name: str
    module: str
    device: str
    run: str
    thread: tuple[Any, Any]
    start: float  # microseconds, as the trace gives them
    end: float


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """One profiled step (one execution of the program), averaged over devices; seconds."""

    run: str
    """The execution's ``run_id`` in the trace ('all' when the trace gives none)."""
    devices: int
    wall_s: float
    compute_s: float
    collective_s: dict[str, float]
    """Time in each collective kind."""
    exposed_s: float
    """Collective time no computation of the same device overlaps."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveTime:
    """One collective instruction: its time per step (mean over devices and steps) and its bytes."""

    name: str
    """The HLO instruction name (as the ledger names it)."""
    kind: str
    runs_per_step: float
    """Op events per device per step (async halves count each)."""
    time_s: float
    traffic_bytes: float | None
    """Per-device ring traffic per step from the ledger (None: not in a ledger)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceSummary:
    """Where the profiled steps' time went (means over steps; ``steps`` has each)."""

    path: str
    module: str
    steps: tuple[StepTime, ...]
    collectives: tuple[CollectiveTime, ...]
    missing: tuple[str, ...] = field(default=())
    """Collectives the ledger names that no op event of the trace does."""
    partial: int = 0
    """Executions left out because the trace holds only part of them (running as tracing began or ended)."""

    def _mean(self, values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    @property
    def wall_s(self) -> float:
        return self._mean([s.wall_s for s in self.steps])

    @property
    def compute_s(self) -> float:
        return self._mean([s.compute_s for s in self.steps])

    @property
    def exposed_s(self) -> float:
        return self._mean([s.exposed_s for s in self.steps])

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_s / self.wall_s if self.wall_s else 0.0

    def kinds(self) -> dict[str, dict[str, float | None]]:
        """Per collective kind: time per step, ledger traffic per step, achieved GB/s (10^9 bytes/s)."""
        out: dict[str, dict[str, float | None]] = {}
        for kind in sorted({k for s in self.steps for k in s.collective_s}):
            time_s = self._mean([s.collective_s.get(kind, 0.0) for s in self.steps])
            known = [
                c.traffic_bytes for c in self.collectives if c.kind == kind and c.traffic_bytes is not None
            ]
            traffic = sum(known) if known else None
            gbps = traffic / time_s / 1e9 if traffic is not None and time_s > 0 else None
            out[kind] = {"time_s": time_s, "traffic_bytes": traffic, "achieved_gbps": gbps}
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": self.path,
            "module": self.module,
            "steps": len(self.steps),
            "wall_s": self.wall_s,
            "compute_s": self.compute_s,
            "exposed_s": self.exposed_s,
            "exposed_fraction": self.exposed_fraction,
            "kinds": self.kinds(),
            "collectives": [
                {
                    "name": c.name,
                    "kind": c.kind,
                    "runs_per_step": c.runs_per_step,
                    "time_s": c.time_s,
                    "traffic_bytes": c.traffic_bytes,
                }
                for c in self.collectives
            ],
            "per_step": [
                {
                    "run": s.run,
                    "devices": s.devices,
                    "wall_s": s.wall_s,
                    "compute_s": s.compute_s,
                    "collective_s": s.collective_s,
                    "exposed_s": s.exposed_s,
                }
                for s in self.steps
            ],
            "missing": list(self.missing),
            "partial": self.partial,
        }


# -- reading ------------------------------------------------------------------------------------
def find_trace(directory: str | Path) -> Path:
    """The newest ``<host>.trace.json.gz`` under ``directory/plugins/profile/*/`` (or ``directory`` itself
    when it is a trace file)."""
    where = Path(directory)
    if where.is_file():
        return where
    found = [p for p in where.glob(TRACE_GLOB) if p.name != PERFETTO_NAME]
    if not found:
        raise TraceError(
            f"no trace under '{where}' (expected {TRACE_GLOB}): profile a step with jax.profiler.trace('{where}')"
        )
    return max(found, key=lambda p: (p.stat().st_mtime, str(p)))


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a Chrome/Perfetto trace (gzip or plain JSON)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        data = json.loads(raw)
    except (OSError, EOFError, ValueError) as e:
        raise TraceError(
            f"cannot read trace '{path}' ({type(e).__name__}: {e}): give a jax.profiler trace"
        ) from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"'{path}' is not a Chrome trace (no traceEvents list): give a jax.profiler trace")
    return [e for e in events if isinstance(e, dict)]


def kind_of(name: str) -> str | None:
    """The collective kind a trace's name spells (``reduce_scatter.7``, ``all-gather-start``, ``psum``), or None."""
    base = _SUFFIX.sub("", name.strip().lower().replace("_", "-").replace(" ", "-"))
    for half in ("-start", "-done"):
        base = base.removesuffix(half)
    return _ALIASES.get(_SUFFIX.sub("", base))


def _ops(events: list[dict[str, Any]]) -> tuple[list[_Op], dict[tuple[Any, Any], list[tuple[float, str]]]]:
    """Op events, and per thread the (start, name) of Rendezvous events (XLA:CPU's collective waits)."""
    ops, rendezvous = [], defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or "ts" not in e:
            continue
        args = e.get("args") or {}
        thread = (e.get("pid"), e.get("tid"))
        if e.get("name") == "Rendezvous" and isinstance(args.get("name"), str):
            rendezvous[thread].append((float(e["ts"]), args["name"]))
        if "hlo_op" not in args or "hlo_module" not in args:
            continue
        start = float(e["ts"])
        ops.append(
            _Op(
                name=str(args["hlo_op"]),
                module=str(args["hlo_module"]),
                device=str(args.get("device_ordinal", thread)),
                run=str(args.get("run_id", "all")),
                thread=thread,
                start=start,
                end=start + float(e["dur"]),
            )
        )
    for marks in rendezvous.values():
        marks.sort()
    return ops, rendezvous


def _rendezvous_kind(op: _Op, rendezvous: dict) -> str | None:
    marks = rendezvous.get(op.thread, [])
    i = bisect.bisect_left(marks, (op.start, ""))
    while i < len(marks) and marks[i][0] <= op.end:
        if kind := kind_of(marks[i][1].split("RendezvousKey")[0]):
            return kind
        i += 1
    return None


# -- intervals ----------------------------------------------------------------------------------
def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans: list[tuple[float, float]], cut: list[tuple[float, float]]) -> float:
    """Length of ``spans`` outside ``cut`` (both unions: sorted, disjoint)."""
    total, j = 0.0, 0
    for a, b in spans:
        covered = 0.0
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            covered += min(b, cut[k][1]) - max(a, cut[k][0])
            k += 1
        total += (b - a) - covered
    return total


def _leaves(ops: list[_Op]) -> list[_Op]:
    """Ops that hold no other op of their thread (a while loop's event holds its body's)."""
    out, by_thread = [], defaultdict(list)
    for op in ops:
        by_thread[op.thread].append(op)
    for items in by_thread.values():
        items.sort(key=lambda o: (o.start, -o.end))
        for i, op in enumerate(items):
            following = items[i + 1] if i + 1 < len(items) else None
            if following is None or following.start >= op.end:
                out.append(op)
    return out


# -- the summary --------------------------------------------------------------------------------
def summarize(
    trace: str | Path, ledger: CommLedger | None = None, *, module: str | None = None
) -> TraceSummary:
    """Where the time of each execution of ``module`` (the ledger's; else the module with collectives
    and the most op time) went. ``trace``: a trace file or a ``jax.profiler`` log directory."""
    path = find_trace(trace)
    ops, rendezvous = _ops(read_events(path))
    if not ops:
        raise TraceError(
            f"'{path}' holds no XLA op events (args hlo_op, hlo_module): was a step run while tracing?"
        )
    named = {r.name: r for r in ledger.records} if ledger is not None else {}
    module = module or (ledger.module if ledger is not None else None)
    kinds: dict[tuple[str, str], str | None] = {}
    for op in ops:
        if (op.module, op.name) not in kinds:
            rec = named.get(op.name) if op.module == module else None
            kinds[op.module, op.name] = rec.op if rec is not None else kind_of(op.name)
    leaves = set(_leaves(ops))  # a loop's event holds its body's rendezvous: only a leaf's are its own
    for op in ops:  # a name that does not say it is a collective: the rendezvous inside it may
        if kinds[op.module, op.name] is None and op in leaves and (k := _rendezvous_kind(op, rendezvous)):
            kinds[op.module, op.name] = k
    modules = sorted({op.module for op in ops})
    if module is None:
        time_of: dict[str, float] = defaultdict(float)
        for op in ops:
            time_of[op.module] += op.end - op.start
        module = max(modules, key=lambda m: (any(kinds[k] for k in kinds if k[0] == m), time_of[m]))
    if module not in modules:
        raise TraceError(f"'{path}' holds no op events of module {module!r} (it holds {', '.join(modules)})")
    ops = [op for op in ops if op.module == module]
    by_run = defaultdict(list)
    for op in ops:
        by_run[op.run].append(op)
    most = max(_per_device(run_ops) for run_ops in by_run.values())
    complete = {run: run_ops for run, run_ops in by_run.items() if _per_device(run_ops) == most}
    partial, by_run = len(by_run) - len(complete), complete
    here = {name: kind for (m, name), kind in kinds.items() if m == module}
    steps, per_name, runs = [], defaultdict(lambda: [0, 0.0]), len(by_run)
    for run, run_ops in sorted(by_run.items(), key=lambda kv: min(o.start for o in kv[1])):
        steps.append(_step(run, run_ops, here, per_name))
    devices = max(s.devices for s in steps)
    collectives = []
    for name, (count, time_us) in sorted(per_name.items()):
        rec = named.get(name)
        collectives.append(
            CollectiveTime(
                name=name,
                kind=here[name] or "",
                runs_per_step=count / devices / runs,
                time_s=time_us / 1e6 / devices / runs,
                traffic_bytes=rec.total_traffic_bytes if rec is not None else None,
            )
        )
    missing = tuple(sorted(n for n in named if n not in per_name))
    return TraceSummary(
        path=str(path),
        module=module,
        steps=tuple(steps),
        collectives=tuple(collectives),
        missing=missing,
        partial=partial,
    )


def _per_device(ops: list[_Op]) -> int:
    """The fewest op events any device of an execution has (a cut execution has fewer than a whole one)."""
    counts: dict[str, int] = defaultdict(int)
    for op in ops:
        counts[op.device] += 1
    return min(counts.values())


def _step(run: str, ops: list[_Op], kinds: dict[str, str | None], per_name: dict) -> StepTime:
    wall = max(o.end for o in ops) - min(o.start for o in ops)
    by_device = defaultdict(list)
    for op in ops:
        by_device[op.device].append(op)
    compute = exposed = 0.0
    collective: dict[str, float] = defaultdict(float)
    for dev_ops in by_device.values():
        comp = _union([(o.start, o.end) for o in _leaves(dev_ops) if kinds[o.name] is None])
        comm = [o for o in dev_ops if kinds[o.name] is not None]
        for o in comm:
            per_name[o.name][0] += 1
            per_name[o.name][1] += o.end - o.start
        for kind in {kinds[o.name] for o in comm}:
            collective[kind] += _length(_union([(o.start, o.end) for o in comm if kinds[o.name] == kind]))
        compute += _length(comp)
        exposed += _minus(_union([(o.start, o.end) for o in comm]), comp)
    n = len(by_device)  # at least 1: a run has ops
    return StepTime(
        run=run,
        devices=n,
        wall_s=wall / 1e6,
        compute_s=compute / n / 1e6,
        collective_s={k: v / n / 1e6 for k, v in sorted(collective.items())},
        exposed_s=exposed / n / 1e6,
    )
