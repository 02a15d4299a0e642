"""HLO array types: an element type and dimensions (``f32[8,128]``), nested in tuples, sized in
bytes (sub-byte types rounded up per array); layouts and comments in the type text are ignored."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from meshkit._errors import HloParseError

# Bits per element of XLA primitive types (sub-byte types round up per array).
_BITS = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "f4e2m1fn": 4,
    "f8e3m4": 8,
    "f8e4m3": 8,
    "f8e4m3fn": 8,
    "f8e4m3b11fnuz": 8,
    "f8e4m3fnuz": 8,
    "f8e5m2": 8,
    "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8,
    "token": 0,
    "opaque": 0,
}

_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_LAYOUT = re.compile(r"\{[^{}]*\}")
_SHAPE_TOKEN = re.compile(r"\(|\)|([a-z][a-z0-9]*)\[([^\]]*)\]")


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
