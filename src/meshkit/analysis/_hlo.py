"""A small, linear-time reader of XLA's HLO text: computations, instructions, shapes, call graph.

Only what the ledgers need is read: each instruction's name, result type, opcode, operands and
attribute text, which computation holds it, and how often each computation runs (while loops
with a trip count the compiler states, conditionals, async wrappers, calls).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from meshkit._errors import HloParseError

# Bits per element of XLA primitive types (sub-byte types round up per array).
_BITS = {
    "pred": 8,
    "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8,
    "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8,
    "token": 0, "opaque": 0,
}  # fmt: skip

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(
    r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$|^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\{\s*$"
)
_INSTR_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-_]*)\(")
_CALLS = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation|branch_computations|called_computations)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)')
_NUM_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_REPLICA_COUNT = re.compile(r"\breplica_count=(\d+)")


@dataclass(frozen=True, slots=True)
class Array:
    """One array type: element type and dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        bits = _BITS.get(self.dtype)
        if bits is None:
            raise HloParseError(f"unknown HLO element type {self.dtype!r}: meshkit cannot size it")
        return math.ceil(math.prod(self.dims) * bits / 8)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_type(text: str) -> tuple[Array, ...]:
    """All array types in a (possibly tuple) HLO type, in order; layouts and comments ignored."""
    out = []
    for dtype, dims in _ARRAY.findall(_COMMENT.sub("", text)):
        if dtype not in _BITS:
            continue  # e.g. a layout tile such as T(8,128) never matches; unknown words are skipped
        sizes = tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
        out.append(Array(dtype, sizes))
    for dtype in re.findall(r"\b(token|opaque)\[\]", text):
        out.append(Array(dtype, ()))
    return tuple(out)


@dataclass(slots=True)
class Instruction:
    """One HLO instruction, lightly parsed."""

    name: str
    type_text: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str
    line: int


@dataclass(slots=True)
class Edge:
    """A call from an instruction in one computation to another computation."""

    callee: str
    kind: str  # 'while-body', 'while-condition', 'conditional', 'async', 'call', 'apply'
    trip_count: int | None = None


@dataclass(slots=True)
class Module:
    """A parsed HLO module."""

    name: str
    entry: str | None
    instructions: list[Instruction]
    types: dict[tuple[str, str], str]
    """Result type text by (computation, name); names are module-unique in XLA's own output, but
    hand-written or edited text may reuse them across computations."""
    edges: dict[str, list[Edge]] = field(default_factory=dict)
    num_partitions: int | None = None
    replica_count: int | None = None

    def operand_types(self, inst: Instruction) -> tuple[Array, ...] | None:
        """Array types of an instruction's operands, or None where an operand is not defined here."""
        out: list[Array] = []
        for op in inst.operands:
            text = op.strip()
            name = text.rsplit(None, 1)[-1].lstrip("%") if text else ""
            if " " in text or "[" in text.split("%")[0]:
                out.extend(parse_type(text))  # older HLO printed the type beside each operand
            elif (inst.computation, name) in self.types:
                out.extend(parse_type(self.types[(inst.computation, name)]))
            elif ("", name) in self.types:
                out.extend(parse_type(self.types[("", name)]))
            else:
                return None
        return tuple(out)


def _split_top(text: str, sep: str = ",") -> tuple[list[str], int]:
    """Split ``text`` at top-level separators up to the closing parenthesis; return parts and end index."""
    depth, start, parts = 0, 0, []
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                piece = text[start:i].strip()
                if piece:
                    parts.append(piece)
                return parts, i
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    raise HloParseError("unbalanced parentheses in HLO operand list")


def _read_type(text: str) -> tuple[str, str]:
    """Split the result type off the front of ``text``; return (type, rest)."""
    text = text.lstrip()
    if text.startswith("("):
        depth = 0
        for i, ch in enumerate(text):
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    return text[: i + 1], text[i + 1 :]
        raise HloParseError("unbalanced tuple type in HLO text")
    m = re.match(r"\S+", text)
    if not m:
        raise HloParseError("missing result type in HLO instruction")
    return m.group(0), text[m.end() :]


def parse_module(text: str) -> Module:
    """Parse HLO text (one module, as printed by ``Compiled.as_text()`` or ``--xla_dump_to``)."""
    if not isinstance(text, str) or not text.strip():
        raise HloParseError("empty HLO text: pass the output of compiled.as_text() or an .hlo/.txt dump file")
    instructions: list[Instruction] = []
    types: dict[tuple[str, str], str] = {}
    module_name, entry, current = "", None, None
    num_partitions = replica_count = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("//") or line.startswith("#"):
            continue
        if line.startswith("HloModule"):
            module_name = line.split()[1].rstrip(",") if len(line.split()) > 1 else ""
            if m := _NUM_PARTITIONS.search(line):
                num_partitions = int(m.group(1))
            if m := _REPLICA_COUNT.search(line):
                replica_count = int(m.group(1))
            continue
        if line == "}":
            current = None
            continue
        if current is None or (line.endswith("{") and "=" not in line.split("(")[0]):
            h = _HEADER.match(line)
            if h:
                is_entry = bool(h.group(1) or h.group(4))
                current = h.group(2) or h.group(5)
                if is_entry:
                    entry = current
                continue
        if "/*" in line:
            line = _COMMENT.sub("", line)
        head = _INSTR_HEAD.match(line)
        if not head:
            continue
        name = head.group(1)
        type_text, rest = _read_type(line[head.end() :])
        op = _OPCODE.match(rest)
        if not op:
            continue
        operands, end = _split_top(rest[op.end() :])
        attrs = rest[op.end() + end + 1 :]
        types[(current or "", name)] = type_text
        instructions.append(
            Instruction(
                name=name,
                type_text=type_text,
                opcode=op.group(1),
                operands=operands,
                attrs=attrs,
                computation=current or "",
                line=lineno,
            )
        )
    if not instructions:
        raise HloParseError(
            "no HLO instructions found: the text is not HLO (expected lines like '%x = f32[8] all-reduce(...)')"
        )
    module = Module(
        name=module_name,
        entry=entry,
        instructions=instructions,
        types=types,
        num_partitions=num_partitions,
        replica_count=replica_count,
    )
    module.edges = _call_edges(instructions)
    return module


def _call_edges(instructions: list[Instruction]) -> dict[str, list[Edge]]:
    edges: dict[str, list[Edge]] = {}
    for inst in instructions:
        if "=" not in inst.attrs:
            continue
        trip = None
        if inst.opcode == "while" and (m := _TRIP.search(inst.attrs)):
            trip = int(m.group(1))
        for key, value in _CALLS.findall(inst.attrs):
            callees = [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]
            if key == "body":
                kind = "while-body"
            elif key == "condition":
                kind = "while-condition"
            elif key in ("true_computation", "false_computation", "branch_computations"):
                kind = "conditional"
            elif key == "to_apply" and inst.opcode not in ("call",):
                kind = "apply"
            elif inst.opcode.endswith("-start") or inst.opcode == "async-start":
                kind = "async"
            else:
                kind = "call"
            for callee in callees:
                edges.setdefault(inst.computation, []).append(Edge(callee, kind, trip))
    return edges


@dataclass(frozen=True, slots=True)
class Frequency:
    """How many times a computation runs per execution of the entry computation."""

    count: int
    """Executions, multiplying the known trip counts of enclosing loops."""
    exact: bool
    """False where an enclosing loop's trip count is not stated by the compiler."""
    loops: int
    """How many while loops enclose the computation."""
    conditional: bool
    """Whether it runs under a conditional branch (at most ``count`` times)."""
    async_wrapped: bool
    """Whether it is the body of an async-start."""


def frequencies(module: Module) -> dict[str, Frequency]:
    """Execution frequency of every computation reachable from the entry (or from uncalled roots).

    Counts are pushed along the call graph in topological order, so a computation called from
    several places gets the sum of its callers' executions.
    """
    callees = {e.callee for es in module.edges.values() for e in es}
    comps = {i.computation for i in module.instructions}
    roots = [module.entry] if module.entry else sorted(comps - callees)
    # Reachable sub-graph (reducers excluded: no collectives live there) and in-degrees.
    indegree: dict[str, int] = {r: 0 for r in roots}
    stack, seen = list(roots), set(roots)
    while stack:
        comp = stack.pop()
        for e in module.edges.get(comp, ()):
            if e.kind == "apply":
                continue
            indegree[e.callee] = indegree.get(e.callee, 0) + 1
            if e.callee not in seen:
                seen.add(e.callee)
                stack.append(e.callee)
    freq = {r: Frequency(1, True, 0, False, False) for r in roots}
    ready = list(roots)
    while ready:
        comp = ready.pop()
        f = freq[comp]
        for e in module.edges.get(comp, ()):
            if e.kind == "apply":
                continue
            count, exact, loops = f.count, f.exact, f.loops
            if e.kind in ("while-body", "while-condition"):
                loops += 1
                if e.trip_count is None:
                    exact = False
                else:
                    count *= e.trip_count + (1 if e.kind == "while-condition" else 0)
            new = Frequency(
                count,
                exact,
                loops,
                f.conditional or e.kind == "conditional",
                f.async_wrapped or e.kind == "async",
            )
            if (old := freq.get(e.callee)) is not None:
                new = Frequency(
                    old.count + new.count,
                    old.exact and new.exact,
                    max(old.loops, new.loops),
                    old.conditional or new.conditional,
                    old.async_wrapped or new.async_wrapped,
                )
            freq[e.callee] = new
            indegree[e.callee] -= 1
            if indegree[e.callee] == 0:
                ready.append(e.callee)
    return freq
