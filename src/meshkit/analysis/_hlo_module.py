"""A parsed HLO module: its instructions (name, result type, opcode, operands and attribute text,
and the computation holding each), the result types by name, and the calls between computations."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshkit.analysis._hlo_shapes import Array, parse_type
from meshkit.analysis._hlo_text import _split_top


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
