"""The communication ledger: every collective a compiled program executes, with bytes and groups.

``communication(x)`` takes a ``jax.stages.Compiled``, a ``jax.stages.Lowered`` (compiled here,
since the partitioner inserts most collectives at compile time) or HLO text, and returns a
``CommLedger``: one ``Collective`` per collective instruction, with its element types and shapes,
the bytes it moves (``S`` in the ring formulas), its replica groups, the mesh axes they span,
how many times it runs per step (loop trip counts), and the per-device traffic of the ring model.

Two forms XLA:TPU prints are read as what they run: a reduce-scatter fused as an all-reduce and the
slice of its partition (a ``kCustom`` fusion calling ``all-reduce-scatter.N``) is one reduce-scatter of
its input; and a collective that its async-collective fusion splits into pieces (its start, the compute
it overlaps and its end, each a fusion holding a copy of the instruction with the same ``channel_id`` and
``chain_id``) is one collective, counted once and marked async.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from meshkit._errors import HloParseError
from meshkit.analysis._groups import (
    MeshShape,
    ReplicaGroups,
    device_groups,
    expand_groups,
    group_mode,
    groups_text,
    match_axes,
    pair_axes,
)
from meshkit.analysis._hlo import (
    Instruction,
    Module,
    UnboundedDimension,
    frequencies,
    parse_module,
)
from meshkit.analysis._operands import operand_arrays, source_target_pairs
from meshkit.analysis.cost import ring_traffic

#: Collectives the ring model covers, by the name XLA prints for the synchronous form.
MODELLED = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
#: Other cross-device operations, reported with their bytes but no ring-model traffic.
OTHER = ("collective-broadcast", "ragged-all-to-all", "send", "recv", "all-reduce-scatter")
#: Async forms: the ``-start`` half carries the operation, the ``-done`` half is not counted.
_ASYNC = {f"{op}-start": op for op in (*MODELLED, *OTHER)}
_FUSED_REDUCE_SCATTER = re.compile(r"all-reduce-scatter(\.|$)")
"""XLA:TPU's name for the computation of a reduce-scatter fused as an all-reduce and its partition's slice."""
_CHAIN = re.compile(r'\bchannel_id=(\d+).*?\bchain_id=\\?"(\d+)')
"""A collective's channel and its async chain (XLA:TPU's async collective fusion: one collective in pieces)."""


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
    """``S`` of the ring formulas: in_bytes, except all-gather and recv (out_bytes); for
    ragged-all-to-all the data operand only (not the offset and size arrays)."""
    replica_groups: str | None
    """Groups as printed (None for collective-permute, which has pairs)."""
    group_mode: str | None
    """How XLA reads the printed ids: 'cross-replica', 'cross-partition',
    'cross-replica-and-partition' or 'flattened-id' (None where the module states neither
    replica_count nor num_partitions, or for the mesh-axis form, whose ids are device ids)."""
    groups: tuple[tuple[int, ...], ...]
    """Device groups, device = replica * num_partitions + partition (collective-permute: each
    source/target pair as printed)."""
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
    unsized: int = 0
    """Collectives left out of ``records`` because they move arrays of unbounded dynamic size."""

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
            "unsized": self.unsized,
        }


def hlo_text(x: Any) -> str:
    """HLO text of a Compiled, a Lowered (compiled first) or a string."""
    if isinstance(x, str):
        return x
    import jax  # only for compiled programs: reading HLO text needs no JAX

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
    import jax

    for s in jax.tree.leaves(shardings):
        mesh = getattr(s, "mesh", None)
        if mesh is not None and getattr(mesh, "shape", None):
            return tuple((str(k), int(v)) for k, v in mesh.shape.items())
    return None


def communication(x: Any, mesh: MeshShape | Any | None = None, devices: int | None = None) -> CommLedger:
    """Read every collective of a compiled program.

    ``x``: ``jax.stages.Compiled``, ``jax.stages.Lowered`` or HLO text. ``mesh``: a
    ``jax.sharding.Mesh`` or ``(("data", 4), ("model", 2))`` used to name the axes of replica
    groups; by default the mesh of the program's input shardings, or the one printed in the text.
    ``devices``: the device count where the text states neither ``replica_count`` nor
    ``num_partitions`` (so that ``replica_groups={}`` can be read).
    """
    text = hlo_text(x)
    gc_was_on = gc.isenabled()
    gc.disable()  # millions of small objects: cyclic GC passes would make parsing superlinear
    try:
        return _communication(x, text, mesh, devices)
    finally:
        if gc_was_on:
            gc.enable()


@dataclass(slots=True)
class _Context:
    """What every collective of one module is read against."""

    module: Module
    mesh: MeshShape | None
    n_dev: int | None
    counts: tuple[int, int] | None
    """(replica_count, num_partitions) where the header states either, else None."""
    groups: dict = field(default_factory=dict)
    """Resolved groups, group size, axes and warning by (printed text, mode)."""
    warned: set = field(default_factory=set)


def _communication(x: Any, text: str, mesh: Any, devices: int | None) -> CommLedger:
    if mesh is not None and hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
        mesh = tuple((str(k), int(v)) for k, v in mesh.shape.items())
    elif mesh is None and not isinstance(x, str) and "jax" in sys.modules:
        mesh = mesh_of(x)
    module = parse_module(text)
    freq = frequencies(module)
    counts = None
    if module.replica_count is not None or module.num_partitions is not None:
        counts = (module.replica_count or 1, module.num_partitions or 1)
    if mesh is None:
        mesh = _printed_mesh(module.instructions)
    n_dev = counts[0] * counts[1] if counts else devices
    if devices is not None and n_dev != devices:
        raise HloParseError(
            f"--devices {devices} disagrees with the module's replica_count x num_partitions = {n_dev}: "
            "drop --devices or fix the header"
        )
    if n_dev is None and mesh is not None:
        n_dev = 1
        for _, s in mesh:
            n_dev *= s
    ctx = _Context(module=module, mesh=tuple(mesh) if mesh else None, n_dev=n_dev, counts=counts)
    records, warnings, dead, unsized = [], [], [], []
    chains: set[tuple[str, ...]] = set()
    for inst in module.instructions:
        op, start = inst.opcode, False
        if op in _ASYNC:
            op, start = _ASYNC[op], True
        elif op not in MODELLED and op not in OTHER:
            continue
        if (chain := _CHAIN.search(inst.attrs)) is not None:
            if (op, *chain.groups()) in chains:
                continue  # another piece of a collective already counted
            chains.add((op, *chain.groups()))
            start = True
        f = freq.get(inst.computation)
        if f is None:
            dead.append(inst)  # in a computation the entry never calls: it never runs
            continue
        try:
            rec, warning = _record(ctx, inst, op, start, f)
            if op == "all-reduce" and _FUSED_REDUCE_SCATTER.match(inst.computation):
                rec = _as_reduce_scatter(rec)
        except UnboundedDimension as e:
            unsized.append((inst, e))  # its bytes are unknown: said below, not counted as 0
            continue
        except HloParseError as e:
            raise HloParseError(f"{inst.label}: {e}") from None
        if warning and warning not in ctx.warned:
            ctx.warned.add(warning)
            warnings.append(warning)
        if not rec.exact:
            warnings.append(
                f"{rec.op} {rec.name} runs inside a loop whose trip count the compiler does not state; counted once"
            )
        records.append(rec)
    if unsized:
        inst, e = unsized[0]
        warnings.append(
            f"{len(unsized)} collective(s) move arrays of unbounded dynamic size and are not counted: their "
            f"bytes are unknown (first: %{inst.name} in %{inst.computation}, line {inst.line}: {e})"
        )
    if dead:
        warnings.append(
            f"{len(dead)} collective(s) sit in computations the entry never calls and are not counted "
            f"(first: %{dead[0].name} in %{dead[0].computation}, line {dead[0].line})"
        )
    return CommLedger(
        module=module.name,
        num_devices=n_dev,
        mesh=ctx.mesh,
        records=tuple(records),
        warnings=tuple(warnings),
        unsized=len(unsized),
    )


def _printed_mesh(instructions: list[Instruction]) -> MeshShape | None:
    for inst in instructions:
        if "mesh[" in inst.attrs and (text := groups_text(inst.attrs)) and text.startswith("mesh["):
            try:
                return expand_groups(text).mesh
            except HloParseError as e:
                raise HloParseError(f"{inst.label}: {e}") from None
    return None


def _resolve(ctx: _Context, text: str | None, mode: str) -> tuple:
    """(device groups, group size, mesh axes, warning or None, mode used or None) for printed
    groups ``text`` (None: no replica_groups attribute) read in ``mode``; cached per (text, mode)."""
    key = (text, mode)
    if key in ctx.groups:
        return ctx.groups[key]
    rg = expand_groups(text) if text is not None else ReplicaGroups("", ())
    warning = None
    used_mode: str | None = mode
    if rg.device_ids:
        groups, used_mode = rg.groups, None
    elif ctx.counts is not None:
        groups = device_groups(rg.groups, mode, *ctx.counts)
        if groups is None:
            r, p = ctx.counts
            warning = (
                f"replica_groups={text} names ids beyond {mode} mode's range (replica_count={r}, "
                f"num_partitions={p}); read as device ids"
            )
            groups, used_mode = rg.groups, None
        elif ctx.counts[1] > 1 and all(len(g) == 1 for g in groups):
            warning = (
                f"replica_groups={text or '{}'} without a channel_id is cross-replica, and with "
                f"replica_count={ctx.counts[0]} every device is alone (no communication): XLA reads it so"
            )
    elif rg.groups:
        groups, used_mode = rg.groups, None
    elif ctx.n_dev is not None:
        groups, used_mode = (tuple(range(ctx.n_dev)),), None
    else:
        raise HloParseError(
            "replica_groups={} (or none) means every device, but the device count is unknown: "
            "pass --devices N (or devices=N)"
        )
    n = len(groups[0]) if groups else 1
    if rg.axes is not None and (ctx.mesh is None or rg.mesh == ctx.mesh):
        axes = rg.axes
    elif ctx.mesh is not None and groups:
        axes = match_axes(groups, ctx.mesh)
    else:
        axes = None
    ctx.groups[key] = out = (groups, n, axes, warning, used_mode)
    return out


def _as_reduce_scatter(rec: Collective) -> Collective:
    """An all-reduce that XLA:TPU fused with its partition's slice: the reduce-scatter of its input it runs."""
    n = rec.group_size
    return dataclasses.replace(
        rec,
        op="reduce-scatter",
        out_bytes=rec.in_bytes // n,
        traffic_bytes=ring_traffic("reduce-scatter", rec.size_bytes, n),
    )


def _record(ctx: _Context, inst: Instruction, op: str, start: bool, f) -> tuple[Collective, str | None]:
    mode = group_mode(op, inst.attrs)
    warning = None
    rg_text = None
    if op in ("collective-permute", "send", "recv"):
        pairs = source_target_pairs(inst.attrs)
        groups: tuple = pairs
        n = 2
        axes = pair_axes(pairs, ctx.mesh) if ctx.mesh and pairs else None
        used_mode = mode if ctx.counts is not None else None
    else:
        rg_text = groups_text(inst.attrs)
        groups, n, axes, warning, used_mode = _resolve(ctx, rg_text, mode)
    arrays, in_b, out_b, size = operand_arrays(ctx.module, inst, op, start, n)
    rec = Collective(
        op=op,
        name=inst.name,
        computation=inst.computation,
        line=inst.line,
        dtypes=tuple(a.dtype for a in arrays),
        shapes=tuple(a.dims for a in arrays),
        operand_bytes=tuple(a.nbytes for a in arrays),
        in_bytes=in_b,
        out_bytes=out_b,
        size_bytes=size,
        replica_groups=rg_text,
        group_mode=used_mode,
        groups=groups,
        group_size=n,
        axes=tuple(axes) if axes is not None else None,
        executions=f.count,
        exact=f.exact,
        in_loop=f.loops > 0,
        in_conditional=f.conditional,
        is_async=start or f.async_wrapped,
        traffic_bytes=ring_traffic(op, size, n) if op in MODELLED else None,
    )
    return rec, warning
