"""The ledger on a corpus of real HLO modules from XLA's own tests: no collective lost, none twice.

``tests/fixtures/hlo_corpus/modules`` holds every module with a collective that XLA's test sources
contain and XLA's parser accepts (``SOURCES.tsv`` names each one's repository, commit and path;
``collect.py`` rebuilt them). Each module is read by the ledger and, independently, by the small
tokenizer below, which knows nothing of lines: it walks the token stream with XLA's grammar,
counts collective opcodes per computation, and multiplies by the call sites of each computation
(while bodies by their stated trip counts, else by the trip count of a canonical loop: a counter from a
constant, compared less-than a constant, stepped by 1). A third count comes from XLA's own parser (per
computation), and the ledger must read XLA's canonical re-print of each module exactly as the
original text.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from jax._src.lib import xla_client as xc

from meshkit import HloParseError
from meshkit.analysis import communication
from meshkit.analysis._hlo import parse_module

CORPUS = Path(__file__).parent / "fixtures" / "hlo_corpus"
MODULES = sorted((CORPUS / "modules").glob("*.hlo"))
OPS = {
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-broadcast", "ragged-all-to-all", "send", "recv",
}  # fmt: skip
CALL_KEYS = {"calls", "body", "condition", "to_apply", "branch_computations", "true_computation",
             "false_computation", "called_computations"}  # fmt: skip
_TOKEN = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'[^']*'|/\*.*?\*/|//[^\n]*|->|<=|[%\w.\-]+|\S", re.S)
_OPEN = {"(": ")", "[": "]", "{": "}"}


class Tokens:
    """A token stream (comments dropped) with balanced-group skipping."""

    def __init__(self, text: str):
        self.toks = [t for t in _TOKEN.findall(text) if not t.startswith(("/*", "//"))]
        self.i = 0

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else ""

    def take(self) -> str:
        self.i += 1
        return self.toks[self.i - 1]

    def group(self) -> list[str]:
        """Consume a balanced group starting at the current opening bracket; return its tokens."""
        start, stack = self.i, []
        while True:
            t = self.take()
            if t in _OPEN:
                stack.append(_OPEN[t])
            elif stack and t == stack[-1]:
                stack.pop()
            if not stack:
                return self.toks[start : self.i]

    def value(self) -> list[str]:
        """An attribute value: atoms until ',' or the end of the instruction or computation."""
        out: list[str] = []
        while self.peek() and self.peek() not in (",", "}") and not self.instruction_starts():
            out.extend(self.group() if self.peek() in _OPEN else [self.take()])
        return out

    def instruction_starts(self) -> bool:
        """Within a value, 'ROOT' or a name followed by '=' (not after a ',') is the next instruction."""
        return self.peek() == "ROOT" or self.peek(1) == "="

    def atom(self) -> list[str]:
        return self.group() if self.peek() in _OPEN else [self.take()]


def trip_count(value: list[str]) -> int | None:
    text = "".join(value)
    try:
        data = json.loads(json.loads(text) if text.startswith('"') else text)
        return int(data["known_trip_count"]["n"])
    except (ValueError, KeyError, TypeError):
        return None


def split_top(tokens: list[str]) -> list[list[str]]:
    """Tokens split at the commas outside any bracket."""
    out, depth = [[]], 0
    for tok in tokens:
        if tok in _OPEN:
            depth += 1
        elif tok in _OPEN.values():
            depth -= 1
        if tok == "," and depth == 0:
            out.append([])
        else:
            out[-1].append(tok)
    return out


def canonical_trips(insts: dict[str, dict[str, tuple]], loops: list[tuple]) -> dict[tuple, int]:
    """Trip counts of the ``loops`` (caller, condition, body, init operand) in canonical form: the condition's
    one compare is ``gte(param, i) LT constant N``, the init tuple's operand i a constant K, the body adds
    the constant 1 to ``gte(param, i)``: N - K (a copy or bitcast in between is looked through)."""

    def find(comp: str, name: str) -> tuple | None:
        inst = insts[comp].get(name.lstrip("%"))
        while inst is not None and inst[0] in ("copy", "bitcast", "convert") and inst[1]:
            inst = insts[comp].get(inst[1][0].lstrip("%"))
        return inst

    def const(inst) -> int | None:
        return (
            int(inst[3][0])
            if inst and inst[0] == "constant" and inst[3][:1] and inst[3][0].lstrip("-").isdigit()
            else None
        )

    def index(inst) -> int | None:
        return (
            int(inst[2]["index"][0])
            if inst and inst[0] == "get-tuple-element" and "index" in inst[2]
            else None
        )

    out = {}
    for caller, condition, body, init in loops:
        compares = [i for i in insts.get(condition, {}).values() if i[0] == "compare"]
        if len(compares) != 1 or compares[0][2].get("direction") != ["LT"] or len(compares[0][1]) != 2:
            continue
        counter, bound = index(find(condition, compares[0][1][0])), const(find(condition, compares[0][1][1]))
        tup = find(caller, init) if init else None
        if counter is None or bound is None or not tup or tup[0] != "tuple" or counter >= len(tup[1]):
            continue
        start = const(find(caller, tup[1][counter]))
        adds = [i for i in insts.get(body, {}).values() if i[0] == "add" and len(i[1]) == 2]
        steps = any(
            sorted([(index(find(body, a)), const(find(body, a))) for a in i[1]], key=str)
            == sorted([(counter, None), (None, 1)], key=str)
            for i in adds
        )
        if start is not None and steps and bound >= start:
            out[(caller, condition, body)] = bound - start
    return out


def independent_count(text: str) -> Counter:
    """Executions of each collective opcode per computation, from the token stream alone."""
    t = Tokens(text)
    assert t.take() == "HloModule"
    t.take()
    while t.peek() == ",":
        t.take(), t.take(), t.take()
        t.atom()
    ops: dict[str, Counter] = {}
    calls: list[tuple[str, str, int | None, tuple]] = []  # (caller, callee, multiplier, the loop it is of)
    insts: dict[str, dict[str, tuple]] = {}  # computation -> name -> (opcode, operands, attributes, literal)
    loops: list[tuple] = []
    order, entry = [], None
    while t.peek():
        is_entry = t.peek() == "ENTRY"
        if is_entry:
            t.take()
        comp = t.take().lstrip("%")
        order.append(comp)
        entry = comp if is_entry else entry
        while True:  # skip the signature up to the body's '{'
            if t.peek() == "{":
                save = t.i
                t.group()
                if t.toks[save - 1] == "]" and t.peek() == "{":
                    continue  # that was the result type's layout
                t.i = save
                break
            t.atom()
        t.take()
        ops[comp] = Counter()
        insts[comp] = {}
        while t.peek() != "}":
            if t.peek() == "ROOT":
                t.take()
            name = t.take().lstrip("%")
            t.take()  # '='
            if t.peek() == "(":
                t.group()  # tuple type
            elif t.peek(1) == "[":
                t.take(), t.group()
                if t.peek() == "{":
                    t.group()  # layout
            opcode = t.take()
            operand_tokens = t.group()[1:-1]
            attrs: dict[str, list[str]] = {}
            while t.peek() == ",":
                t.take()
                key = t.take()
                t.take()  # '='
                attrs[key] = t.value()
            operands = [
                piece[-1] for piece in split_top(operand_tokens) if piece
            ]  # each operand's name, last
            insts[comp][name] = (opcode, operands, attrs, operand_tokens)
            base = opcode.removesuffix("-start")
            if base in OPS:
                ops[comp][base] += 1
            if opcode.endswith(("-done", "-update")):
                continue
            trip = trip_count(attrs.get("backend_config", []))
            loop = ()
            if opcode == "while" and trip is None:  # its count read below, where its form is canonical
                cond, body = (attrs[k][0].lstrip("%") for k in ("condition", "body"))
                loop = (comp, cond, body)
                loops.append((*loop, operands[0] if operands else None))
            for key, value in attrs.items():
                if key not in CALL_KEYS or (key == "to_apply" and opcode != "call"):
                    continue
                mult = 1
                if opcode == "while" and trip is not None:
                    mult = trip + 1 if key == "condition" else trip
                for callee in value:
                    if callee not in "{},":
                        calls.append((comp, callee.lstrip("%"), mult, (key, loop)))
        t.take()  # '}'
        if t.peek() == ",":  # , execution_thread="..."
            t.take(), t.take(), t.take(), t.take()
    entry = entry or order[-1]  # XLA: without ENTRY, the last computation is the entry
    trips = canonical_trips(insts, loops)

    def mult(m: int, key: str, loop: tuple) -> int:
        if loop in trips:
            return trips[loop] + 1 if key == "condition" else trips[loop]
        return m

    @cache
    def runs(comp: str) -> int:
        return (comp == entry) + sum(runs(a) * mult(m, *how) for a, b, m, how in calls if b == comp)

    total = Counter()
    for comp, counter in ops.items():
        for op, k in counter.items():
            if runs(comp):
                total[(comp, op)] += k * runs(comp)
    return total


def static_count(xla_module) -> Counter:
    """Collective instructions per opcode in every computation, as XLA's own parser sees them
    (async wrappers XLA builds around ``reduce-scatter-start`` and the like are not counted twice)."""
    total = Counter()
    for comp in xla_module.computations():
        for inst in comp.instructions():
            op = re.sub(r"(?<!^)(?=[A-Z])", "-", str(inst.opcode).rsplit(".k", 1)[-1]).lower()
            if op.removesuffix("-start") in OPS:
                total[op.removesuffix("-start")] += 1
    return total


def ledger_count(led) -> Counter:
    total = Counter()
    for r in led.records:
        total[(r.computation, r.op)] += r.executions
    return total


def devices_for(text: str) -> int | None:
    """Where the header states no device counts, XLA's tests set one in code: the largest id + 1."""
    if re.search(r"\b(replica_count|num_partitions)\s*=", text.split("\n", 1)[0]):
        return None
    ids = [int(i) for m in re.finditer(r"(?:replica_groups|source_target_pairs)=(\{[{}\d,\s]*\})", text)
           for i in re.findall(r"\d+", m.group(1))]  # fmt: skip
    return max(ids, default=0) + 1


def signature(led) -> list[tuple]:
    return sorted(
        (r.op, r.dtypes, r.shapes, r.in_bytes, r.out_bytes, r.size_bytes, r.group_size, r.executions)
        for r in led.records
    )


def test_the_corpus_is_real_and_named():
    rows = (CORPUS / "SOURCES.tsv").read_text().splitlines()[1:]
    assert len(MODULES) == len(rows) >= 300
    files = {r.split("\t")[0] for r in rows}
    assert files == {p.name for p in MODULES}
    assert all(r.split("\t")[1] and re.fullmatch(r"[0-9a-f]{40}", r.split("\t")[2]) for r in rows)
    assert sum(p.stat().st_size for p in MODULES) < 5e6


@pytest.mark.parametrize("chunk", range(4))
def test_every_corpus_module_counts_each_collective_once(chunk):
    counted = modules = 0
    for path in MODULES[chunk::4]:
        text = path.read_text()
        led = communication(text, devices=devices_for(text))
        expected = independent_count(text)
        assert ledger_count(led) == expected, path.name
        xla = xc.hlo.hlo_module_from_text(text)
        assert static_count(xla) == Counter(
            i.opcode.removesuffix("-start") for i in parse_module(text).instructions
            if i.opcode.removesuffix("-start") in OPS
        ), path.name  # fmt: skip
        reprint = communication(xla.to_string(), devices=devices_for(text))
        assert signature(reprint) == signature(led), path.name
        counted += led.count()
        modules += 1
    assert modules > 50 and counted > modules


def test_damaged_corpus_modules_read_or_fail_with_one_line():
    """Corpus modules cut, with characters dropped or inserted: either read or one HloParseError
    line, never another exception (a fixed seed: the same 300 damaged modules every run)."""
    rng = random.Random(0)
    texts = [p.read_text() for p in MODULES]
    inserts = [
        "(",
        ")",
        "{",
        "}",
        ",",
        "=",
        '"',
        "f32[a,2]",
        "replica_groups={",
        "calls=",
        " all-reduce(",
        "\n}",
    ]
    failed = 0
    for _ in range(300):
        t = rng.choice(texts)
        pos = rng.randrange(len(t))
        t = rng.choice(
            [t[:pos], t[:pos] + t[pos + rng.randint(1, 20) :], t[:pos] + rng.choice(inserts) + t[pos:]]
        )
        try:
            communication(t, devices=devices_for(t) if t.startswith("HloModule") else 8)
        except HloParseError as e:
            assert "\n" not in str(e)
            failed += 1
    assert 0 < failed < 300
