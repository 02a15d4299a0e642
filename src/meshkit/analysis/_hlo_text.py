"""The text under HLO statements: comments removed and string contents blanked (so that brackets
are counted outside strings, at the same positions in both), one instruction a line, bracket depth
and matching, and splitting at top-level commas."""

from __future__ import annotations

import re

from meshkit.analysis._hlo_shapes import _BLOCK_COMMENT

_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_BRACKET = re.compile(r"[()\[\]{}]")
_CLOSE = {"(": ")", "[": "]", "{": "}"}


def _blank(m: re.Match) -> str:
    s = m.group(0)
    return s[0] + " " * (len(s) - 2) + s[-1]


def _spaces(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


_MIDLINE_HEAD = re.compile(r"(?<=[)\]}\w.\-])(?<!ROOT)\s+(?=(?:ROOT\s+)?%?[\w.\-]+\s*=\s*[^=\s])")
"""Where an instruction starts after another's end on the same line (``...) name = ...``, ``... ROOT x =``):
text reflowed by a formatter, which XLA's parser reads as two instructions (not after a ``,``: an attribute)."""


def _lines(text: str) -> tuple[list[str], list[str]]:
    """Lines of ``text`` without comments, and the same lines with string contents blanked, so
    that brackets are counted outside strings and positions agree between the two; a line holding the
    start of a second instruction is split there (``_MIDLINE_HEAD``)."""
    if "/*" in text:
        text = _BLOCK_COMMENT.sub(_spaces, text)
    bare = _STRING.sub(_blank, text) if '"' in text else text
    lines, bares = text.split("\n"), bare.split("\n")
    for i, b in enumerate(bares):
        if "//" in b:
            cut = b.index("//")
            lines[i], bares[i] = lines[i][:cut], b[:cut]
    if any(_MIDLINE_HEAD.search(b) for b in bares):
        return _split_instructions(lines, bares)
    return lines, bares


def _split_instructions(lines: list[str], bares: list[str]) -> tuple[list[str], list[str]]:
    """The lines with each instruction that starts mid-line (inside a computation's braces, at its top
    level: depth 1) moved to a line of its own."""
    out, out_bare, depth = [], [], 0
    for line, bare in zip(lines, bares, strict=True):
        cuts = [m.end() for m in _MIDLINE_HEAD.finditer(bare) if depth + _depth(bare[: m.start()]) == 1]
        for start, stop in zip([0, *cuts], [*cuts, len(bare)], strict=True):
            out.append(line[start:stop])
            out_bare.append(bare[start:stop])
        depth += _depth(bare)
    return out, out_bare


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
