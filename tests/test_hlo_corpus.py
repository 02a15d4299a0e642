"""The ledger on a corpus of real HLO modules from XLA's own tests: no collective lost, none twice.

``tests/fixtures/hlo_corpus/modules`` holds every module with a collective that XLA's test sources
contain and XLA's parser accepts (``SOURCES.tsv`` names each one's repository, commit and path;
``collect.py`` rebuilt them). Each module is read by the ledger and, independently, by the small
tokenizer below, which knows nothing of lines: it walks the token stream with XLA's grammar,
counts collective opcodes per computation, and multiplies by the call sites of each computation
(while bodies by their stated trip counts). A third count comes from XLA's own parser (per
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


def independent_count(text: str) -> Counter:
    """Executions of each collective opcode per computation, from the token stream alone."""
    t = Tokens(text)
    assert t.take() == "HloModule"
    t.take()
    while t.peek() == ",":
        t.take(), t.take(), t.take()
        t.atom()
    ops: dict[str, Counter] = {}
    calls: list[tuple[str, str, int]] = []  # (caller, callee, multiplier)
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
        while t.peek() != "}":
            if t.peek() == "ROOT":
                t.take()
            t.take(), t.take()  # name '='
            if t.peek() == "(":
                t.group()  # tuple type
            elif t.peek(1) == "[":
                t.take(), t.group()
                if t.peek() == "{":
                    t.group()  # layout
            opcode = t.take()
            t.group()  # operands
            attrs: dict[str, list[str]] = {}
            while t.peek() == ",":
                t.take()
                key = t.take()
                t.take()  # '='
                attrs[key] = t.value()
            base = opcode.removesuffix("-start")
            if base in OPS:
                ops[comp][base] += 1
            if opcode.endswith(("-done", "-update")):
                continue
            trip = trip_count(attrs.get("backend_config", []))
            for key, value in attrs.items():
                if key not in CALL_KEYS or (key == "to_apply" and opcode != "call"):
                    continue
                mult = 1
                if opcode == "while" and trip is not None:
                    mult = trip + 1 if key == "condition" else trip
                for name in value:
                    if name not in "{},":
                        calls.append((comp, name.lstrip("%"), mult))
        t.take()  # '}'
        if t.peek() == ",":  # , execution_thread="..."
            t.take(), t.take(), t.take(), t.take()
    entry = entry or order[-1]  # XLA: without ENTRY, the last computation is the entry

    @cache
    def runs(comp: str) -> int:
        return (comp == entry) + sum(runs(a) * m for a, b, m in calls if b == comp)

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
