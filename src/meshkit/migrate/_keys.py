"""Which ``jax.random.PRNGKey(...)`` calls can become ``jax.random.key(...)`` without changing the program.

A typed key and a raw uint32 key give the same bits to every ``jax.random`` function, but not to
anything else: ``np.asarray(key)``, ``key[0]``, ``key.shape``, a checkpoint, a user function that
does any of these. So a PRNGKey call is safe only when the key it makes, and every key split or
folded from it, is used solely as the key argument of ``jax.random`` calls, bound to plain names
whose every use is again such a call, indexed (one key of a split), or iterated. Anything else,
including a return or an argument to another function, makes it unsafe: the finding then carries
a recipe instead of a fix.
"""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst
from libcst.metadata import ScopeProvider

# jax.random functions that return keys (an array of keys for split), and ones that must not see keys.
_MAKES_KEYS = {"jax.random.split": True, "jax.random.fold_in": False, "jax.random.clone": False}
_NOT_SAMPLERS = frozenset({"jax.random.key_data", "jax.random.wrap_key_data", "jax.random.key_impl"})


class KeyUses:
    """Follows the keys a PRNGKey call makes through a module (flow-insensitive, so conservative)."""

    def __init__(
        self,
        get_metadata: Callable,
        qname: Callable[[cst.CSTNode], str | None],
        parents: dict[int, cst.CSTNode],
    ) -> None:
        self.meta = get_metadata
        self.qname = qname
        self.parents = parents
        self.seen: set[int] = set()

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.parents.get(id(node))

    def safe(self, expr: cst.BaseExpression, array: bool = False) -> bool:
        """Whether every use of the key (``array``: of keys) that ``expr`` evaluates to is safe."""
        parent = self.parent(expr)
        if isinstance(parent, cst.Arg):
            return self._argument(parent, array)
        if isinstance(parent, cst.Subscript) and parent.value is expr:
            return array and self._one_index(parent) and self.safe(parent, False)
        if isinstance(parent, cst.Assign) and parent.value is expr:
            return all(self._bound(t.target, array) for t in parent.targets)
        if isinstance(parent, cst.For | cst.CompFor) and parent.iter is expr:
            return array and self._bound(parent.target, False)
        return False

    def _argument(self, arg: cst.Arg, array: bool) -> bool:
        call = self.parent(arg)
        if not isinstance(call, cst.Call) or arg.star:
            return False
        name = self.qname(call.func) or ""
        if not name.startswith("jax.random.") or name in _NOT_SAMPLERS:
            return False
        positional = [a for a in call.args if a.keyword is None]
        is_key = (arg.keyword is not None and arg.keyword.value == "key") or (
            arg.keyword is None and positional and positional[0] is arg
        )
        if not is_key or (array and name != "jax.random.split"):
            # Samplers take one key; split also takes an array of keys only in newer JAX: stay strict.
            return False
        if name in _MAKES_KEYS:
            return self.safe(call, _MAKES_KEYS[name])
        return True

    @staticmethod
    def _one_index(sub: cst.Subscript) -> bool:
        return len(sub.slice) == 1 and isinstance(sub.slice[0].slice, cst.Index)

    def _bound(self, target: cst.BaseExpression, array: bool) -> bool:
        if isinstance(target, cst.Tuple | cst.List):
            # Unpacking a split gives keys; unpacking one raw key gives two uint32 words.
            return array and all(
                not isinstance(e, cst.StarredElement) and self._bound(e.value, False) for e in target.elements
            )
        if not isinstance(target, cst.Name):
            return False
        if id(target) in self.seen:
            return True
        self.seen.add(id(target))
        scope = self.meta(ScopeProvider, target, None)
        if scope is None:
            return False
        uses = [
            access.node
            for assignment in scope.assignments[target.value]
            if getattr(assignment, "node", None) is target
            for access in assignment.references
        ]
        return all(isinstance(u, cst.Name) and self.safe(u, array) for u in uses)


class _Parents(cst.CSTVisitor):
    """Each node's parent by id (built only for modules that call PRNGKey)."""

    def __init__(self) -> None:
        self.parents: dict[int, cst.CSTNode] = {}
        self.stack: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.stack:
            self.parents[id(node)] = self.stack[-1]
        self.stack.append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.stack.pop()


def safe_prng_keys(
    module: cst.Module, calls: list[cst.Call], get_metadata: Callable, qname: Callable
) -> set[cst.Call]:
    """The PRNGKey calls among ``calls`` whose keys are used only through jax.random.

    Each call is followed afresh: a name assumed safe while following it (a loop like
    ``rng = split(rng)[0]``) only stands if nothing else on the way is unsafe.
    """
    finder = _Parents()
    module.visit(finder)
    return {c for c in calls if KeyUses(get_metadata, qname, finder.parents).safe(c)}
