"""A small, linear-time reader of XLA's HLO text: computations, instructions, shapes, call graph.

It reads instructions, not lines: XLA's parser ignores line breaks, so an instruction may be
continued on the following lines (operands, attributes, ``calls=``, a loop's ``backend_config``),
shapes and layouts may hold spaces (``f32[64, 128]{1, 0}``) and the result type may be omitted
(``w = while(init), condition=c, body=b``). Only what the ledgers need is kept: each instruction's
name, result type, opcode, operands and attribute text, which computation holds it, and how often
each computation runs (while loops with a trip count the compiler states, conditionals, async
wrappers, calls). A statement that mentions a collective or a called computation and cannot be
read is an error naming it, never dropped.

The reader is this module (statements joined across lines, then read as a module header, a
computation header or an instruction); the rest is one module per concept, its names re-exported
here: ``_hlo_shapes`` (array types and their bytes), ``_hlo_text`` (comments, strings, brackets),
``_hlo_module`` (the parsed module), ``_hlo_calls`` (the call graph and how often each computation
runs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshkit._errors import HloParseError
from meshkit.analysis._groups import check_devices
from meshkit.analysis._hlo_calls import Frequency, _call_edges, frequencies
from meshkit.analysis._hlo_module import Edge, Instruction, Module
from meshkit.analysis._hlo_shapes import Array, Shape, UnboundedDimension, leaves, parse_shape, parse_type
from meshkit.analysis._hlo_text import _closing, _depth, _lines

__all__ = [
    "Array",
    "Edge",
    "Frequency",
    "Instruction",
    "Module",
    "Shape",
    "UnboundedDimension",
    "frequencies",
    "leaves",
    "parse_module",
    "parse_shape",
    "parse_type",
]

_INSTR_HEAD = re.compile(r"(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_DTYPE = re.compile(r"[a-z][a-z0-9]*\[")
_SIMPLE_TYPE = re.compile(r"[a-z][a-z0-9]*\[[^\[\](){}]*\](?: *\{[^{}()\[\]]*\})?")
_FLAT_OPERANDS = re.compile(r"\([^()\[\]{}]*\)")
_OPCODE = re.compile(r"([a-z][a-z0-9\-_]*)\s*\(")
_COMP_HEAD = re.compile(r"(ENTRY\s+)?%?([\w.\-]+)")
_NUM_PARTITIONS = re.compile(r"\bnum_partitions\s*=\s*(\d+)")
_REPLICA_COUNT = re.compile(r"\breplica_count\s*=\s*(\d+)")
#: A statement that names a cross-device opcode or a called computation must be understood.
_MENTION = re.compile(
    r"\b(?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|collective-broadcast"
    r"|ragged-all-to-all|send|recv|async)(?:-start)?\s*\("
    r"|\b(?:calls|body|condition|branch_computations|true_computation|false_computation)\s*="
)


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
    return _Reader(*_lines(text)).read()


class _Reader:
    """One pass over a module's lines (and their bare twins, string contents blanked): each statement
    joined across lines until its brackets balance and no attribute follows, then read as the module
    header, a computation header, the end of a computation or an instruction."""

    def __init__(self, lines: list[str], bares: list[str]) -> None:
        self.lines, self.bares, self.n, self.i = lines, bares, len(lines), 0
        self.instructions: list[Instruction] = []
        self.types: dict[tuple[str, str], str] = {}
        self.module_name, self.entry, self.current, self.last = "", None, None, None
        self.num_partitions = self.replica_count = None

    def next_starts_with_comma(self, j: int) -> bool:
        n, bares = self.n, self.bares
        while j < n and not bares[j].strip():
            j += 1
        return j < n and bares[j].lstrip().startswith(",")

    def keep(self, inst: Instruction) -> None:
        self.types[(inst.computation, inst.name)] = inst.type_text
        self.instructions.append(inst)

    def read(self) -> Module:
        lines, bares, n = self.lines, self.bares, self.n
        while self.i < n:
            bare = bares[self.i].strip()
            if not bare or bare.startswith("#"):
                self.i += 1
                continue
            depth = _depth(bare)
            self.i += 1
            i, current = self.i, self.current
            head = _INSTR_HEAD.match(bare)
            if (
                head
                and current
                and not depth
                and not bare.endswith((",", "="))
                and not self.next_starts_with_comma(i)
            ):
                try:  # the common case: a whole instruction on one line
                    self.keep(_instruction(lines[i - 1].strip(), bare, head, current, i))
                    continue
                except _Incomplete:
                    pass  # its opcode may be on the next line: read it below
            st = _Statement(i, [lines[i - 1].strip()], [bare], depth)
            if bare.startswith("HloModule"):
                self.module_header(st)
            elif bare.startswith("}"):
                self.current = None
            elif head is None:
                self.computation_header(st)
            else:
                self.instruction(st, head)
        return self.module()

    def extend(self, st: _Statement, more) -> None:
        """Join the following lines to ``st`` while ``more(st)``."""
        while self.i < self.n and more(st):
            st.add(self.lines[self.i].strip(), self.bares[self.i].strip())
            self.i += 1

    def module_header(self, st: _Statement) -> None:
        self.extend(
            st, lambda s: s.depth > 0 or s.bares[-1].endswith(",") or self.next_starts_with_comma(self.i)
        )
        header = st.text
        self.module_name = header.split(None, 1)[1].split(",")[0].strip() if len(header.split()) > 1 else ""
        if m := _NUM_PARTITIONS.search(header):
            self.num_partitions = check_devices(int(m.group(1)), "the module's num_partitions")
        if m := _REPLICA_COUNT.search(header):
            self.replica_count = check_devices(int(m.group(1)), "the module's replica_count")
        check_devices(
            (self.num_partitions or 1) * (self.replica_count or 1),
            "the module's replica_count x num_partitions",
        )

    def computation_header(self, st: _Statement) -> None:
        """A computation header, possibly spread over lines: ends with the body's '{'."""
        self.extend(st, lambda s: s.depth >= 1 and not (s.depth == 1 and s.bares[-1].endswith("{")))
        joined = st.bare
        h = _COMP_HEAD.match(joined)
        if st.depth == 1 and joined.endswith("{") and h:
            self.current = self.last = h.group(2)
            if h.group(1):
                self.entry = self.current
            return
        if _MENTION.search(joined):
            raise HloParseError(
                f"line {st.start}: cannot read {joined[:80]!r} (expected 'name = type opcode(...)')"
            )
        # else not HLO we need (and names no collective or computation)

    def instruction(self, st: _Statement, head: re.Match) -> None:
        """An instruction: join lines until its brackets balance and no attribute follows."""
        lines, bares, n = self.lines, self.bares, self.n
        inst = None
        while True:
            while self.i < n and (
                st.depth > 0 or st.bares[-1].endswith((",", "=")) or self.next_starts_with_comma(self.i)
            ):
                if bares[self.i].strip():
                    st.add(lines[self.i].strip(), bares[self.i].strip())
                self.i += 1
            jbare = st.bare
            try:
                match = head if len(st.lines) == 1 else _INSTR_HEAD.match(jbare)
                inst = _instruction(st.text, jbare, match, self.current or "", st.start)
                break
            except _Incomplete:
                # The opcode may follow on the next line (e.g. after a long tuple type).
                nxt = bares[self.i].strip() if self.i < n else ""
                if st.depth == 0 and nxt and not _INSTR_HEAD.match(nxt) and not nxt.startswith("}"):
                    st.add(lines[self.i].strip(), nxt)
                    self.i += 1
                    continue
                break
        if inst is None:
            if _MENTION.search(jbare) or st.depth != 0:
                raise HloParseError(
                    f"instruction %{head.group(1)} (line {st.start}): cannot read it "
                    "(expected 'name = type opcode(operands), attributes')"
                )
            return
        if st.depth != 0:
            raise HloParseError(f"{inst.label}: unbalanced brackets")
        if self.current is None:
            if _MENTION.search(jbare):
                raise HloParseError(f"{inst.label}: outside any computation (a missing '{{' line?)")
            return
        self.keep(inst)

    def module(self) -> Module:
        if not self.instructions:
            raise HloParseError(
                "no HLO instructions found: the text is not HLO (expected lines like '%x = f32[8] all-reduce(...)')"
            )
        module = Module(
            name=self.module_name,
            entry=self.entry or self.last,  # XLA: without ENTRY, the last computation is the entry
            instructions=self.instructions,
            types=self.types,
            num_partitions=self.num_partitions,
            replica_count=self.replica_count,
        )
        module.edges = _call_edges(self.instructions)
        return module
