"""The call graph of an HLO module and how often each computation runs: while loops with a trip
count the compiler states, conditionals, async wrappers and calls, pushed from the entry in
topological order (a computation called from several places gets the sum of its callers').

A loop whose trip count the compiler does not state (XLA:TPU states none) is read from its canonical form,
as XLA's own loop analysis reads it: a counter at tuple index ``i`` that starts at a constant ``K``, the
condition ``counter < N`` against a constant, and the body adding the constant 1 to it: ``N - K`` trips.
Any other form is left unknown (and the ledger says so)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshkit._errors import HloParseError
from meshkit.analysis._hlo_module import Edge, Instruction, Module
from meshkit.analysis._hlo_text import _STRING

_CALLS = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)\s*=\s*(\{[^}]*\}|%?[\w.\-]+)"
)
_CALL_KEY = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)\s*="
)
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)')
_NO_CALLS = ("-done", "-update")  # async-done/-update repeat the start's calls=: not a second call


def _call_edges(instructions: list[Instruction]) -> dict[str, list[Edge]]:
    edges: dict[str, list[Edge]] = {}
    index: _Index | None = None  # built for the first loop without a stated count
    for inst in instructions:
        if inst.opcode == "while" and not ("body" in inst.attrs and "condition" in inst.attrs):
            raise HloParseError(f"{inst.label}: a while needs condition= and body=")
        if "=" not in inst.attrs or inst.opcode.endswith(_NO_CALLS) or not _CALL_KEY.search(inst.attrs):
            continue
        trip = None
        if inst.opcode == "while" and (m := _TRIP.search(inst.attrs)):
            trip = int(m.group(1))
        elif inst.opcode == "while":
            index = index if index is not None else _Index(instructions)
            trip = _inferred_trip(inst, index)
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


_DIRECTION = re.compile(r"\bdirection=(\w+)")
_PASS_THROUGH = ("copy", "bitcast", "convert")


class _Index:
    """The instructions by (computation, name), and each computation's instructions."""

    def __init__(self, instructions: list[Instruction]) -> None:
        self.by_name = {(i.computation, i.name): i for i in instructions}
        self.by_computation: dict[str, list[Instruction]] = {}
        for i in instructions:
            self.by_computation.setdefault(i.computation, []).append(i)

    def of(self, computation: str, opcode: str) -> list[Instruction]:
        return [i for i in self.by_computation.get(computation, ()) if i.opcode == opcode]


def _named(inst: Instruction, index: _Index, k: int) -> Instruction | None:
    """Operand ``k`` of ``inst`` (through copies and bitcasts), where it is an instruction of its computation."""
    operands = inst.operands
    if k >= len(operands):
        return None
    found = index.by_name.get((inst.computation, operands[k].strip().rsplit(None, 1)[-1].lstrip("%")))
    while found is not None and found.opcode in _PASS_THROUGH:
        found = _named(found, index, 0)
    return found


def _constant(inst: Instruction | None) -> int | None:
    if inst is None or inst.opcode != "constant":
        return None
    try:
        return int(inst.operand_text[0].strip())
    except ValueError:
        return None


def _counter(inst: Instruction | None) -> int | None:
    """The tuple index ``inst`` reads of its computation's parameter, where it is such a read."""
    if (
        inst is None
        or inst.opcode != "get-tuple-element"
        or not (m := re.search(r"\bindex=(\d+)", inst.attrs))
    ):
        return None
    return int(m.group(1))


def _steps_by_one(add: Instruction, index: _Index, counter: int) -> bool:
    """Whether ``add`` is the counter plus the constant 1 (either way round)."""
    a, b = _named(add, index, 0), _named(add, index, 1)
    return (_counter(a), _constant(b)) == (counter, 1) or (_counter(b), _constant(a)) == (counter, 1)


def _inferred_trip(loop: Instruction, index: _Index) -> int | None:
    """The trip count of a loop in XLA's canonical form (the module docstring), or None."""
    calls = dict(_CALLS.findall(loop.attrs))
    condition, body = calls.get("condition", "").lstrip("%"), calls.get("body", "").lstrip("%")
    compares = index.of(condition, "compare")
    if len(compares) != 1 or (m := _DIRECTION.search(compares[0].attrs)) is None or m.group(1) != "LT":
        return None
    counter, bound = _counter(_named(compares[0], index, 0)), _constant(_named(compares[0], index, 1))
    init = _named(loop, index, 0)
    if counter is None or bound is None or init is None or init.opcode != "tuple":
        return None
    start = _constant(_named(init, index, counter))
    if (
        start is None
        or bound < start
        or not any(_steps_by_one(a, index, counter) for a in index.of(body, "add"))
    ):
        return None
    return bound - start


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
