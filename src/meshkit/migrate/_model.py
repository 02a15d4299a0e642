"""Findings, rules and the rule registry of ``meshkit migrate``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import libcst as cst

# (module, object or None, alias or None): an import a fix needs, as libcst's AddImportsVisitor takes it.
Import = tuple[str, str | None, str | None]


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    """One place in one file where legacy JAX was found."""

    path: str
    line: int
    col: int
    rule: str
    message: str
    fix: str
    fixable: bool

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col} {self.rule} {self.message} (fix: {self.fix})"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "line": self.line,
            "col": self.col,
            "rule": self.rule,
            "message": self.message,
            "fix": self.fix,
            "fixable": self.fixable,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Hit:
    """What a rule says about one node: the message, the fix or recipe, and the rewrite when it is safe.

    ``rewrite`` takes the node as already updated by rules run on its children and returns its
    replacement; ``imports`` are added to the module and ``unused`` imports removed if the fix
    leaves them unused; ``helpers`` are top-level definitions the rewrite calls, added once after
    the module's imports; ``before`` are statements the rewrite needs run first, each as (the
    original statement to put it before, its source, the blank lines then kept before that statement).
    """

    message: str
    fix: str
    rewrite: Callable[[Any], cst.CSTNode] | None = None
    imports: tuple[Import, ...] = ()
    unused: tuple[tuple[str, str], ...] = ()
    helpers: tuple[str, ...] = ()
    before: tuple[tuple[cst.CSTNode, str, int], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """A check run on every node of the given types; ``check(node, ctx)`` returns a Hit or None.

    A ``fallback`` rule's finding is dropped where another rule reported a node that contains it.
    """

    id: str
    title: str
    nodes: tuple[type[cst.CSTNode], ...]
    check: Callable[[Any, Any], Hit | None]
    fallback: bool = False


REGISTRY: dict[str, Rule] = {}

PARSE_ERROR = Rule(id="MK000", title="file cannot be parsed", nodes=(), check=lambda node, ctx: None)


def rule(rule_id: str, title: str, *nodes: type[cst.CSTNode], fallback: bool = False) -> Callable:
    """Register the decorated ``check(node, ctx)`` as rule ``rule_id`` run on ``nodes``."""

    def register(check: Callable[[Any, Any], Hit | None]) -> Callable[[Any, Any], Hit | None]:
        if rule_id in REGISTRY:
            raise ValueError(f"rule id {rule_id} registered twice: give each rule its own id")
        REGISTRY[rule_id] = Rule(id=rule_id, title=title, nodes=nodes, check=check, fallback=fallback)
        return check

    return register
