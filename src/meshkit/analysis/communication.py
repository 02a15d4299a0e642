"""The communication ledger: every collective a compiled program executes, with bytes and groups.

``communication(x)`` takes a ``jax.stages.Compiled``, a ``jax.stages.Lowered`` (compiled here,
since the partitioner inserts most collectives at compile time) or HLO text, and returns a
``CommLedger``: one ``Collective`` per collective instruction, with its element types and shapes,
the bytes it moves (``S`` in the ring formulas), its replica groups, the mesh axes they span,
how many times it runs per step (loop trip counts), and the per-device traffic of the ring model.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import jax

from meshkit._errors import HloParseError
from meshkit.analysis._groups import (
    MeshShape,
    ReplicaGroups,
    expand_groups,
    groups_text,
    match_axes,
    pair_axes,
    parse_replica_groups,
)
from meshkit.analysis._hlo import Array, Instruction, Module, frequencies, parse_module, parse_type
from meshkit.analysis.cost import ring_traffic

#: Collectives the ring model covers, by the name XLA prints for the synchronous form.
MODELLED = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
#: Other cross-device operations, reported with their bytes but no ring-model traffic.
OTHER = ("collective-broadcast", "ragged-all-to-all", "send", "recv", "all-reduce-scatter")
#: Async forms: the ``-start`` half carries the operation, the ``-done`` half is not counted.
_ASYNC = {f"{op}-start": op for op in (*MODELLED, *OTHER)}


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective instruction of a compiled program."""

    op: str
    """'all-reduce', 'reduce-scatter', 'all-gather', 'all-to-all', 'collective-permute', or another
    cross-device opcode as XLA prints it (without '-start')."""
    name: str
    """Instruction name in the HLO text."""
    computation: str
    """Name of the computation that holds it."""
    line: int
    """Line number in the HLO text."""
    dtypes: tuple[str, ...]
    """Element type of each operand (several for tuple collectives)."""
    shapes: tuple[tuple[int, ...], ...]
    """Per-device shape of each operand."""
    operand_bytes: tuple[int, ...]
    """Bytes of each operand on one device."""
    in_bytes: int
    """Bytes of the operands on one device."""
    out_bytes: int
    """Bytes of the results on one device."""
    size_bytes: int
    """``S`` of the ring formulas: in_bytes, except all-gather (out_bytes)."""
    replica_groups: str | None
    """Groups as printed (None for collective-permute, which has pairs)."""
    groups: tuple[tuple[int, ...], ...]
    """Device groups (collective-permute: each source/target pair)."""
    group_size: int
    """Devices per group (collective-permute: 2)."""
    axes: tuple[str, ...] | None
    """Mesh axes the groups span, or None when they match no set of mesh axes."""
    executions: int
    """Times it runs per execution of the program (product of known loop trip counts)."""
    exact: bool
    """False when it sits in a loop whose trip count the compiler does not state."""
    in_loop: bool
    """Whether it sits inside a while loop."""
    in_conditional: bool
    """Whether it sits under a conditional branch (so it runs at most ``executions`` times)."""
    is_async: bool
    """Whether it was issued as an async start/done pair (counted once)."""
    traffic_bytes: float | None
    """Per-device bytes sent (= received) per execution under the ring model; None for OTHER ops."""

    @property
    def total_traffic_bytes(self) -> float | None:
        return None if self.traffic_bytes is None else self.traffic_bytes * self.executions

    @property
    def nonscalar_traffic_bytes(self) -> float | None:
        """Total traffic less the share of scalar operands (metrics combined into a tuple collective)."""
        total = self.total_traffic_bytes
        if total is None or not self.operand_bytes:
            return total
        kept = sum(b for b, s in zip(self.operand_bytes, self.shapes, strict=True) if s != ())
        return total * kept / (sum(self.operand_bytes) or 1)

    @property
    def axes_label(self) -> str:
        if self.axes is None:
            return f"groups of {self.group_size}"
        return "+".join(self.axes) if self.axes else "(none)"


@dataclass(frozen=True, kw_only=True, slots=True)
class Total:
    """Totals over a set of collectives, per execution of the program."""

    instructions: int
    executions: int
    size_bytes: int
    traffic_bytes: float


@dataclass(frozen=True, kw_only=True, slots=True)
class CommLedger:
    """All collectives of one program, with totals."""

    module: str
    num_devices: int | None
    mesh: MeshShape | None
    records: tuple[Collective, ...]
    warnings: tuple[str, ...] = field(default=())

    def kinds(self) -> list[str]:
        """Sorted distinct collective ops (like the chapter's ``collectives()`` helper)."""
        return sorted({r.op for r in self.records})

    def count(self, op: str | None = None) -> int:
        """Executions per step of ``op`` (all ops when None)."""
        return sum(r.executions for r in self.records if op is None or r.op == op)

    def _totals(self, key) -> dict[str, Total]:
        out: dict[str, list[Collective]] = {}
        for r in self.records:
            out.setdefault(key(r), []).append(r)
        return {
            k: Total(
                instructions=len(rs),
                executions=sum(r.executions for r in rs),
                size_bytes=sum(r.size_bytes * r.executions for r in rs),
                traffic_bytes=sum(r.total_traffic_bytes or 0.0 for r in rs),
            )
            for k, rs in out.items()
        }

    def by_op(self) -> dict[str, Total]:
        """Totals per collective op."""
        return self._totals(lambda r: r.op)

    def by_axes(self) -> dict[str, Total]:
        """Totals per set of mesh axes (``'data'``, ``'data+model'``, or ``'groups of n'``)."""
        return self._totals(lambda r: r.axes_label)

    @property
    def traffic_bytes(self) -> float:
        """Per-device ring-model traffic of one execution, all collectives together."""
        return sum(r.total_traffic_bytes or 0.0 for r in self.records)

    @property
    def size_bytes(self) -> int:
        return sum(r.size_bytes * r.executions for r in self.records)

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "num_devices": self.num_devices,
            "mesh": dict(self.mesh) if self.mesh else None,
            "records": [
                {**asdict(r), "total_traffic_bytes": r.total_traffic_bytes, "axes_label": r.axes_label}
                for r in self.records
            ],
            "by_op": {k: asdict(v) for k, v in self.by_op().items()},
            "by_axes": {k: asdict(v) for k, v in self.by_axes().items()},
            "traffic_bytes": self.traffic_bytes,
            "size_bytes": self.size_bytes,
            "warnings": list(self.warnings),
        }


def hlo_text(x: Any) -> str:
    """HLO text of a Compiled, a Lowered (compiled first) or a string."""
    if isinstance(x, str):
        return x
    if isinstance(x, jax.stages.Lowered):
        x = x.compile()
    if isinstance(x, jax.stages.Compiled):
        return x.as_text()
    raise HloParseError(
        f"cannot read communication from a {type(x).__name__}: pass jitted.lower(*args).compile(), "
        f"jitted.lower(*args), or HLO text"
    )


def mesh_of(x: Any) -> MeshShape | None:
    """Mesh axes (name, size) of the first NamedSharding among a Compiled's inputs, if any."""
    try:
        shardings = x.input_shardings
    except Exception:
        return None
    for s in jax.tree.leaves(shardings):
        mesh = getattr(s, "mesh", None)
        if mesh is not None and getattr(mesh, "shape", None):
            return tuple((str(k), int(v)) for k, v in mesh.shape.items())
    return None


def _arrays(module: Module, inst: Instruction) -> tuple[tuple[Array, ...] | None, tuple[Array, ...]]:
    return module.operand_types(inst), parse_type(inst.type_text)


def _sizes(op: str, start: bool, ins: tuple[Array, ...] | None, outs: tuple[Array, ...], n: int):
    out_b = sum(a.nbytes for a in outs)
    if ins is None:  # operands not in the text: derive from the result
        if op == "all-gather":
            ins_b = out_b // n if not start else out_b // (n + 1)
        elif op == "reduce-scatter":
            ins_b = out_b * n
        else:
            ins_b = out_b
    else:
        ins_b = sum(a.nbytes for a in ins)
    if start:  # async starts return (operands, results[, scratch]) tuples
        if op == "all-gather":
            out_b = ins_b * n
        elif op != "reduce-scatter":
            out_b = ins_b
    size = out_b if op == "all-gather" else ins_b
    return ins_b, out_b, size


def communication(x: Any, mesh: MeshShape | Any | None = None) -> CommLedger:
    """Read every collective of a compiled program.

    ``x``: ``jax.stages.Compiled``, ``jax.stages.Lowered`` or HLO text. ``mesh``: a
    ``jax.sharding.Mesh`` or ``(("data", 4), ("model", 2))`` used to name the axes of replica
    groups; by default the mesh of the program's input shardings, or the one printed in the text.
    """
    text = hlo_text(x)
    gc_was_on = gc.isenabled()
    gc.disable()  # millions of small objects: cyclic GC passes would make parsing superlinear
    try:
        return _communication(x, text, mesh)
    finally:
        if gc_was_on:
            gc.enable()


def _communication(x: Any, text: str, mesh: Any) -> CommLedger:
    if mesh is not None and hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
        mesh = tuple((str(k), int(v)) for k, v in mesh.shape.items())
    elif mesh is None and isinstance(x, jax.stages.Lowered | jax.stages.Compiled):
        mesh = mesh_of(x)
    module = parse_module(text)
    freq = frequencies(module)
    n_dev = module.num_partitions or module.replica_count
    if mesh is None:
        mesh = _printed_mesh(module.instructions)
    if n_dev is None and mesh is not None:
        n_dev = 1
        for _, s in mesh:
            n_dev *= s
    records, warnings = [], []
    matched: dict[frozenset, tuple[str, ...] | None] = {}
    parsed: dict[str, ReplicaGroups] = {}
    for inst in module.instructions:
        op, start = inst.opcode, False
        if op in _ASYNC:
            op, start = _ASYNC[op], True
        elif op not in MODELLED and op not in OTHER:
            continue
        f = freq.get(inst.computation)
        if f is None:
            continue  # dead computation, never called
        rec = _record(module, inst, op, start, f, mesh, n_dev, matched, parsed)
        if not rec.exact:
            warnings.append(
                f"{rec.op} {rec.name} runs inside a loop whose trip count the compiler does not state; counted once"
            )
        records.append(rec)
    return CommLedger(
        module=module.name, num_devices=n_dev, mesh=mesh, records=tuple(records), warnings=tuple(warnings)
    )


def _printed_mesh(instructions: Iterable[Instruction]) -> MeshShape | None:
    for inst in instructions:
        if "replica_groups=mesh[" in inst.attrs:
            rg = parse_replica_groups(inst.attrs, None)
            if rg is not None and rg.mesh:
                return rg.mesh
    return None


def _groups_of(attrs: str, n_dev: int | None, parsed: dict[str, ReplicaGroups]) -> ReplicaGroups | None:
    """Parse replica groups once per distinct text (large programs repeat a handful of forms)."""
    text = groups_text(attrs)
    if text is None:
        return None
    if text not in parsed:
        parsed[text] = expand_groups(text, n_dev)
    return parsed[text]


def _record(module, inst, op, start, f, mesh, n_dev, matched, parsed) -> Collective:
    ins, outs = _arrays(module, inst)
    rg: ReplicaGroups | None = None
    if op in ("collective-permute", "send", "recv"):
        pairs_text = inst.attrs.split("source_target_pairs=", 1)
        pairs: tuple[tuple[int, int], ...] = ()
        if len(pairs_text) == 2:
            pairs = tuple(
                (int(a), int(b))
                for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", pairs_text[1].split("}}")[0] + "}")
            )
        groups = pairs
        n = 2
        axes = pair_axes(pairs, mesh) if mesh and pairs else None
    else:
        rg = _groups_of(inst.attrs, n_dev, parsed)
        if rg is None:  # no groups printed: every device takes part
            if n_dev is None:
                raise HloParseError(
                    f"{inst.opcode} {inst.name} has no replica_groups and the device count is unknown"
                )
            groups = (tuple(range(n_dev)),)
        else:
            groups = rg.groups
        n = len(groups[0]) if groups else 1
        if rg is not None and rg.axes is not None and (mesh is None or rg.mesh == tuple(mesh)):
            axes = rg.axes
        elif mesh is not None:
            key = frozenset(frozenset(g) for g in groups)
            if key not in matched:
                matched[key] = match_axes(groups, mesh)
            axes = matched[key]
        else:
            axes = None
    ins_b, out_b, size = _sizes(op, start, ins, outs, n)
    arrays = ins if ins is not None else outs
    return Collective(
        op=op,
        name=inst.name,
        computation=inst.computation,
        line=inst.line,
        dtypes=tuple(a.dtype for a in arrays),
        shapes=tuple(a.dims for a in arrays),
        operand_bytes=tuple(a.nbytes for a in arrays),
        in_bytes=ins_b,
        out_bytes=out_b,
        size_bytes=size,
        replica_groups=rg.text if rg else None,
        groups=tuple(tuple(g) for g in groups),
        group_size=n,
        axes=tuple(axes) if axes is not None else None,
        executions=f.count,
        exact=f.exact,
        in_loop=f.loops > 0,
        in_conditional=f.conditional,
        is_async=start or f.async_wrapped,
        traffic_bytes=ring_traffic(op, size, n) if op in MODELLED else None,
    )
