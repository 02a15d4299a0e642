"""A small, linear-time reader of XLA's HLO text: computations, instructions, shapes, call graph.

It reads instructions, not lines: XLA's parser ignores line breaks, so an instruction may be
continued on the following lines (operands, attributes, ``calls=``, a loop's ``backend_config``),
shapes and layouts may hold spaces (``f32[64, 128]{1, 0}``) and the result type may be omitted
(``w = while(init), condition=c, body=b``). Only what the ledgers need is kept: each instruction's
name, result type, opcode, operands and attribute text, which computation holds it, and how often
each computation runs (while loops with a trip count the compiler states, conditionals, async
wrappers, calls). A statement that mentions a collective or a called computation and cannot be
read is an error naming it, never dropped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from meshkit._errors import HloParseError
from meshkit.analysis._groups import check_devices

# Bits per element of XLA primitive types (sub-byte types round up per array).
_BITS = {
    "pred": 8,
    "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8,
    "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8,
    "token": 0, "opaque": 0,
}  # fmt: skip

_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_BRACKET = re.compile(r"[()\[\]{}]")
_CLOSE = {"(": ")", "[": "]", "{": "}"}
_LAYOUT = re.compile(r"\{[^{}]*\}")
_SHAPE_TOKEN = re.compile(r"\(|\)|([a-z][a-z0-9]*)\[([^\]]*)\]")
_INSTR_HEAD = re.compile(r"(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_DTYPE = re.compile(r"[a-z][a-z0-9]*\[")
_SIMPLE_TYPE = re.compile(r"[a-z][a-z0-9]*\[[^\[\](){}]*\](?: *\{[^{}()\[\]]*\})?")
_FLAT_OPERANDS = re.compile(r"\([^()\[\]{}]*\)")
_OPCODE = re.compile(r"([a-z][a-z0-9\-_]*)\s*\(")
_COMP_HEAD = re.compile(r"(ENTRY\s+)?%?([\w.\-]+)")
_CALLS = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)\s*=\s*(\{[^}]*\}|%?[\w.\-]+)"
)
_CALL_KEY = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)\s*="
)
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)')
_NUM_PARTITIONS = re.compile(r"\bnum_partitions\s*=\s*(\d+)")
_REPLICA_COUNT = re.compile(r"\breplica_count\s*=\s*(\d+)")
#: A statement that names a cross-device opcode or a called computation must be understood.
_MENTION = re.compile(
    r"\b(?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|collective-broadcast"
    r"|ragged-all-to-all|send|recv|async)(?:-start)?\s*\("
    r"|\b(?:calls|body|condition|branch_computations|true_computation|false_computation)\s*="
)
_NO_CALLS = ("-done", "-update")  # async-done/-update repeat the start's calls=: not a second call


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


Shape = Array | tuple  # a tuple holds Shapes


class UnboundedDimension(HloParseError):
    """A dimension of unbounded dynamic size (``f32[?,8]``, as XLA prints one): the array cannot be
    sized. The ledger leaves such a collective out of its totals and says so."""


def _dims(dtype: str, text: str) -> tuple[int, ...]:
    out = []
    for d in text.split(","):
        d = d.strip()
        if not d:
            continue
        d = d.removeprefix("<=").strip()  # bounded dynamic dimension: its bound
        if d == "?":
            raise UnboundedDimension(f"dimension '?' of {dtype}[{text}] has no bound: its size is unknown")
        if not d.isdigit():
            raise HloParseError(f"dimension {d!r} of {dtype}[{text}] is not a number")
        out.append(int(d))
    return tuple(out)


def parse_shape(text: str) -> Shape:
    """A (possibly nested tuple) HLO type as a tree of ``Array``; layouts and comments ignored."""
    text = _LAYOUT.sub("", _BLOCK_COMMENT.sub("", text) if "/*" in text else text)
    stack: list[list] = [[]]
    for m in _SHAPE_TOKEN.finditer(text):
        tok = m.group(0)
        if tok == "(":
            stack.append([])
        elif tok == ")":
            if len(stack) == 1:
                raise HloParseError(f"unbalanced parentheses in type {text.strip()!r}")
            done = tuple(stack.pop())
            stack[-1].append(done)
        else:
            stack[-1].append(Array(m.group(1), _dims(m.group(1), m.group(2))))
    if len(stack) != 1:
        raise HloParseError(f"unbalanced parentheses in type {text.strip()!r}")
    top = stack[0]
    return top[0] if len(top) == 1 else tuple(top)


def leaves(shape: Shape) -> tuple[Array, ...]:
    """Arrays of a shape tree in order."""
    if isinstance(shape, Array):
        return (shape,)
    return tuple(a for s in shape for a in leaves(s))


def parse_type(text: str) -> tuple[Array, ...]:
    """All array types in a (possibly tuple) HLO type, in order; layouts and comments ignored."""
    return leaves(parse_shape(text)) if text.strip() else ()


@dataclass(slots=True)
class Instruction:
    """One HLO instruction, lightly parsed."""

    name: str
    type_text: str
    """Result type as printed ('' where the text omits it)."""
    opcode: str
    operand_text: tuple[str, str]
    """The operand list as printed, and the same with string contents blanked (split on demand:
    most instructions' operands are never needed)."""
    attrs: str
    computation: str
    line: int
    """Line where the instruction starts."""

    @property
    def operands(self) -> list[str]:
        return _split_top(*self.operand_text)

    @property
    def label(self) -> str:
        return f"instruction %{self.name} ({self.opcode}, line {self.line})"


@dataclass(slots=True)
class Edge:
    """A call from an instruction in one computation to another computation."""

    callee: str
    kind: str  # 'while-body', 'while-condition', 'conditional', 'async', 'call', 'apply'
    trip_count: int | None = None
    caller: str = ""
    """Label of the calling instruction."""


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

    def operand_types(self, inst: Instruction, first: int | None = None) -> tuple[Array, ...] | None:
        """Array types of an instruction's operands (of its ``first`` operands only, if given), or
        None where an operand is not defined here."""
        out: list[Array] = []
        for op in inst.operands[:first]:
            text = op.strip()
            name = text.rsplit(None, 1)[-1].lstrip("%") if text else ""
            if " " in text or "[" in text.split("%")[0]:
                out.extend(parse_type(text.rsplit(None, 1)[0]))  # older HLO: the type beside the name
            else:
                known = self.types.get((inst.computation, name)) or self.types.get(("", name))
                if not known:
                    return None  # not defined here, or its type omitted (inferred by XLA)
                out.extend(parse_type(known))
        return tuple(out)


def _blank(m: re.Match) -> str:
    s = m.group(0)
    return s[0] + " " * (len(s) - 2) + s[-1]


def _spaces(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


def _lines(text: str) -> tuple[list[str], list[str]]:
    """Lines of ``text`` without comments, and the same lines with string contents blanked, so
    that brackets are counted outside strings and positions agree between the two."""
    if "/*" in text:
        text = _BLOCK_COMMENT.sub(_spaces, text)
    bare = _STRING.sub(_blank, text) if '"' in text else text
    lines, bares = text.split("\n"), bare.split("\n")
    for i, b in enumerate(bares):
        if "//" in b:
            cut = b.index("//")
            lines[i], bares[i] = lines[i][:cut], b[:cut]
    return lines, bares


def _depth(bare: str) -> int:
    return (
        bare.count("(")
        + bare.count("[")
        + bare.count("{")
        - bare.count(")")
        - bare.count("]")
        - bare.count("}")
    )


def _closing(bare: str, start: int) -> int:
    """Index of the bracket closing the one at ``bare[start]``, or -1."""
    stack = []
    for m in _BRACKET.finditer(bare, start):
        ch = m.group(0)
        if ch in _CLOSE:
            stack.append(_CLOSE[ch])
        elif not stack or stack.pop() != ch:
            return -1
        if not stack:
            return m.start()
    return -1


def _split_top(text: str, bare: str) -> list[str]:
    """Split ``text`` at top-level commas (structure read from ``bare``)."""
    if not any(c in bare for c in "([{"):
        return [p.strip() for p in text.split(",")] if text.strip() else []
    parts, depth, start = [], 0, 0
    for m in re.finditer(r"[()\[\]{},]", bare):
        ch = m.group(0)
        if ch == ",":
            if depth == 0:
                parts.append(text[start : m.start()].strip())
                start = m.end()
        elif ch in "([{":
            depth += 1
        else:
            depth -= 1
    last = text[start:].strip()
    if last or parts:
        parts.append(last)
    return parts


class _Incomplete(Exception):
    """The statement needs the next line (no opcode yet)."""


def _instruction(text: str, bare: str, head: re.Match, computation: str, line: int) -> Instruction:
    name = head.group(1)
    where = f"instruction %{name} (line {line})"
    pos = head.end()
    type_text = ""
    if bare.startswith("(", pos):  # tuple type
        end = _closing(bare, pos)
        if end < 0:
            raise HloParseError(f"{where}: unbalanced parentheses in its result type")
        type_text, pos = text[pos : end + 1], end + 1
    elif (simple := _SIMPLE_TYPE.match(bare, pos)) and not bare[simple.end() :].lstrip().startswith("{"):
        # f32[8,4]{1,0}: no nesting (a layout with tiles, {1,0:T(8,128)}, takes the path below)
        type_text, pos = text[pos : simple.end()], simple.end()
    elif _DTYPE.match(bare, pos):
        end = _closing(bare, bare.index("[", pos))
        if end < 0:
            raise HloParseError(f"{where}: unbalanced brackets in its result type")
        stop = end + 1
        while stop < len(bare) and bare[stop] == " ":
            stop += 1
        if bare.startswith("{", stop):  # layout
            close = _closing(bare, stop)
            if close < 0:
                raise HloParseError(f"{where}: unbalanced braces in its layout")
            end = close
        type_text, pos = text[pos : end + 1], end + 1
    while pos < len(bare) and bare[pos] == " ":
        pos += 1
    op = _OPCODE.match(bare, pos)
    if not op:
        raise _Incomplete
    paren = op.end() - 1
    flat = _FLAT_OPERANDS.match(bare, paren)
    close = flat.end() - 1 if flat else _closing(bare, paren)
    if close < 0:
        raise HloParseError(f"{where}: unbalanced parentheses in its operand list")
    return Instruction(
        name=name,
        type_text=type_text.strip(),
        opcode=op.group(1),
        operand_text=(text[paren + 1 : close], bare[paren + 1 : close]),
        attrs=text[close + 1 :],
        computation=computation,
        line=line,
    )


@dataclass(slots=True)
class _Statement:
    """Lines joined into one statement, with its bracket depth so far."""

    start: int
    lines: list[str]
    bares: list[str]
    depth: int = 0

    def add(self, line: str, bare: str) -> None:
        self.lines.append(line)
        self.bares.append(bare)
        self.depth += _depth(bare)

    @property
    def text(self) -> str:
        return " ".join(self.lines)

    @property
    def bare(self) -> str:
        return " ".join(self.bares)


def parse_module(text: str) -> Module:
    """Parse HLO text (one module, as printed by ``Compiled.as_text()``, an XLA dump, or written by
    hand in any layout XLA's parser accepts)."""
    if not isinstance(text, str) or not text.strip():
        raise HloParseError("empty HLO text: pass the output of compiled.as_text() or an .hlo/.txt dump file")
    lines, bares = _lines(text)
    instructions: list[Instruction] = []
    types: dict[tuple[str, str], str] = {}
    module_name, entry, current, last = "", None, None, None
    num_partitions = replica_count = None
    n, i = len(lines), 0

    def next_starts_with_comma(j: int) -> bool:
        while j < n and not bares[j].strip():
            j += 1
        return j < n and bares[j].lstrip().startswith(",")

    while i < n:
        bare = bares[i].strip()
        if not bare or bare.startswith("#"):
            i += 1
            continue
        depth = _depth(bare)
        i += 1
        head = _INSTR_HEAD.match(bare)
        if head and current and not depth and not bare.endswith((",", "=")) and not next_starts_with_comma(i):
            try:  # the common case: a whole instruction on one line
                inst = _instruction(lines[i - 1].strip(), bare, head, current, i)
                types[(current, inst.name)] = inst.type_text
                instructions.append(inst)
                continue
            except _Incomplete:
                pass  # its opcode may be on the next line: read it below
        st = _Statement(i, [lines[i - 1].strip()], [bare], depth)
        if bare.startswith("HloModule"):
            while i < n and (st.depth > 0 or st.bares[-1].endswith(",") or next_starts_with_comma(i)):
                st.add(lines[i].strip(), bares[i].strip())
                i += 1
            header = st.text
            module_name = header.split(None, 1)[1].split(",")[0].strip() if len(header.split()) > 1 else ""
            if m := _NUM_PARTITIONS.search(header):
                num_partitions = check_devices(int(m.group(1)), "the module's num_partitions")
            if m := _REPLICA_COUNT.search(header):
                replica_count = check_devices(int(m.group(1)), "the module's replica_count")
            check_devices(
                (num_partitions or 1) * (replica_count or 1), "the module's replica_count x num_partitions"
            )
            continue
        if bare.startswith("}"):
            current = None
            continue
        if head is None:
            # A computation header, possibly spread over lines: ends with the body's '{'.
            while i < n and st.depth >= 1 and not (st.depth == 1 and st.bares[-1].endswith("{")):
                st.add(lines[i].strip(), bares[i].strip())
                i += 1
            joined = st.bare
            h = _COMP_HEAD.match(joined)
            if st.depth == 1 and joined.endswith("{") and h:
                current = last = h.group(2)
                if h.group(1):
                    entry = current
                continue
            if _MENTION.search(joined):
                raise HloParseError(
                    f"line {st.start}: cannot read {joined[:80]!r} (expected 'name = type opcode(...)')"
                )
            continue  # not HLO we need (and names no collective or computation)
        # An instruction: join lines until its brackets balance and no attribute follows.
        inst = None
        while True:
            while i < n and (st.depth > 0 or st.bares[-1].endswith((",", "=")) or next_starts_with_comma(i)):
                if bares[i].strip():
                    st.add(lines[i].strip(), bares[i].strip())
                i += 1
            jbare = st.bare
            try:
                match = head if len(st.lines) == 1 else _INSTR_HEAD.match(jbare)
                inst = _instruction(st.text, jbare, match, current or "", st.start)
                break
            except _Incomplete:
                # The opcode may follow on the next line (e.g. after a long tuple type).
                nxt = bares[i].strip() if i < n else ""
                if st.depth == 0 and nxt and not _INSTR_HEAD.match(nxt) and not nxt.startswith("}"):
                    st.add(lines[i].strip(), nxt)
                    i += 1
                    continue
                break
        if inst is None:
            if _MENTION.search(jbare) or st.depth != 0:
                raise HloParseError(
                    f"instruction %{head.group(1)} (line {st.start}): cannot read it "
                    "(expected 'name = type opcode(operands), attributes')"
                )
            continue
        if st.depth != 0:
            raise HloParseError(f"{inst.label}: unbalanced brackets")
        if current is None:
            if _MENTION.search(jbare):
                raise HloParseError(f"{inst.label}: outside any computation (a missing '{{' line?)")
            continue
        types[(current, inst.name)] = inst.type_text
        instructions.append(inst)
    if not instructions:
        raise HloParseError(
            "no HLO instructions found: the text is not HLO (expected lines like '%x = f32[8] all-reduce(...)')"
        )
    module = Module(
        name=module_name,
        entry=entry or last,  # XLA: without ENTRY, the last computation is the entry
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
        if inst.opcode == "while" and not ("body" in inst.attrs and "condition" in inst.attrs):
            raise HloParseError(f"{inst.label}: a while needs condition= and body=")
        if "=" not in inst.attrs or inst.opcode.endswith(_NO_CALLS) or not _CALL_KEY.search(inst.attrs):
            continue
        trip = None
        if inst.opcode == "while" and (m := _TRIP.search(inst.attrs)):
            trip = int(m.group(1))
        bare = _STRING.sub('""', inst.attrs) if '"' in inst.attrs else inst.attrs
        found = _CALLS.findall(bare)
        named = _CALL_KEY.findall(bare)
        if len(found) != len(named):
            missing = sorted(set(named) - {k for k, _ in found}) or named
            raise HloParseError(
                f"{inst.label}: cannot read its {missing[0]}= value (expected a computation name)"
            )
        for key, value in found:
            callees = [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]
            if key == "body":
                kind = "while-body"
            elif key == "condition":
                kind = "while-condition"
            elif key in ("true_computation", "false_computation", "branch_computations"):
                kind = "conditional"
            elif key == "to_apply" and inst.opcode not in ("call",):
                kind = "apply"
            elif inst.opcode.endswith("-start"):
                kind = "async"
            else:
                kind = "call"
            for callee in callees:
                edges.setdefault(inst.computation, []).append(Edge(callee, kind, trip, inst.label))
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
            if e.callee not in comps:
                raise HloParseError(
                    f"{e.caller} calls computation %{e.callee}, which the module does not define"
                )
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
    if stuck := sorted(c for c, d in indegree.items() if d > 0):
        raise HloParseError(
            f"the call graph has a cycle through computation %{stuck[0]}: HLO does not allow recursion"
        )
    return freq
