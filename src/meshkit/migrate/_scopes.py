"""Which binding a name reads, and where a node sits in its module.

libcst's scopes give every binding a name may read (``referents``); where a scope holds several
(``x = f(x)``, a notebook reusing a name), ``ModuleIndex`` decides from the module's blocks which
one a read gets (``last_binding``). The index also holds each node's parent, the statements of each
block and every name used, which the inline form needs to place its mesh and name it.
"""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst
from libcst.metadata import ScopeProvider


class ModuleIndex:
    """A module's parents (by id), the names it uses, and its bindings by an assignment target or a
    def (by id): built only for modules that need them (a name bound twice, a pmap written inline)."""

    def __init__(self, module: cst.Module) -> None:
        self.parents: dict[int, cst.CSTNode] = {}
        self.names: set[str] = set()
        self.bindings: dict[int, cst.CSTNode] = {}
        module.visit(_Indexer(self))
        self.meshes: dict[int, str] = {}

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.parents.get(id(node))

    def statement(self, node: cst.CSTNode) -> cst.CSTNode:
        """The innermost statement holding ``node`` (a def for its decorators)."""
        while not isinstance(node, cst.SimpleStatementLine | cst.BaseCompoundStatement):
            node = self.parent(node)
        return node

    def suite(self, stmt: cst.CSTNode) -> tuple[list[cst.CSTNode], int, cst.CSTNode | None]:
        """The statements of ``stmt``'s block, its place there, and the block (Module or IndentedBlock)."""
        holder = self.parent(stmt)
        if not isinstance(holder, cst.Module | cst.IndentedBlock):
            return [stmt], 0, holder
        body = list(holder.body)
        return body, next(i for i, s in enumerate(body) if s is stmt), holder

    def deferred(self, node: cst.CSTNode, stmt: cst.CSTNode) -> bool:
        """Whether ``node`` is read later than ``stmt`` runs: in a lambda or a generator expression."""
        while node is not stmt and (node := self.parent(node)) is not None:
            if isinstance(node, cst.Lambda | cst.GeneratorExp):
                return True
        return False

    def in_loop(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` is in a loop's body within its function (or module)."""
        while (node := self.parent(node)) is not None:
            if isinstance(node, cst.For | cst.While):
                return True
            if isinstance(node, cst.FunctionDef | cst.Lambda):
                return False
        return False

    def last_binding(self, name: cst.Name, bound: set[int]) -> int | None:
        """Of the bindings ``bound`` (ids) that ``name`` may read, the one it reads; None where unsure.

        That is the last before ``name``'s statement when all of them are plain statements of that
        statement's own block (``x = f(x)`` reads the x bound before it), none after it can reach it
        through a loop, and ``name`` is read when its statement runs (not in a lambda).
        """
        use = self.statement(name)
        body, at, holder = self.suite(use)
        if not isinstance(holder, cst.Module | cst.IndentedBlock) or self.deferred(name, use):
            return None
        where: dict[int, int] = {}
        for b in bound:
            node = self.bindings.get(b)
            stmt = None if node is None else self.statement(node)
            if stmt is None or self.parent(stmt) is not holder:
                return None
            where[b] = next(i for i, s in enumerate(body) if s is stmt)
        before = {b: i for b, i in where.items() if i < at}
        if not before or (len(before) < len(where) and self.in_loop(use)):
            return None
        last = max(before.values())
        found = [b for b, i in before.items() if i == last]
        return found[0] if len(found) == 1 else None

    def mesh_name(self, anchor: cst.CSTNode) -> str:
        """A name no other in the module uses, one per pmap written inline."""
        if id(anchor) not in self.meshes:
            taken = self.names | set(self.meshes.values())
            candidates = ("mesh", *(f"mesh_{k}" for k in range(2, 10_000)))
            self.meshes[id(anchor)] = next(n for n in candidates if n not in taken)
        return self.meshes[id(anchor)]


class _Indexer(cst.CSTVisitor):
    """Fills a ModuleIndex in one visit."""

    def __init__(self, index: ModuleIndex) -> None:
        self.index = index
        self.stack: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.stack:
            self.index.parents[id(node)] = self.stack[-1]
        self.stack.append(node)
        index = self.index
        if isinstance(node, cst.Name):
            index.names.add(node.value)
        elif isinstance(node, cst.Assign | cst.AnnAssign):
            one = isinstance(node, cst.Assign) and len(node.targets) == 1
            target = node.targets[0].target if one else getattr(node, "target", None)
            if node.value is not None and isinstance(target, cst.Name):
                index.bindings[id(target)] = target
        elif isinstance(node, cst.FunctionDef):
            index.bindings[id(node)] = node
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.stack.pop()


def referents(get_metadata: Callable, name: cst.Name) -> set[int] | None:
    """The ids of the nodes that bind what ``name`` reads, through libcst's scopes; None where unknown."""
    scope = get_metadata(ScopeProvider, name, None)
    accesses = None if scope is None else scope.accesses[name]
    if not accesses:
        return None
    return {id(getattr(a, "node", None)) for access in accesses for a in access.referents}
