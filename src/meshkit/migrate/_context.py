"""What the rules know about a module: the facts they share (``Context``), every place ``jax.pmap`` is
applied (``PmapSite``), and the readers of call syntax they all use (``code``, ``keyword``, ...).

``_scan.build_context`` fills a Context in one pass over the module before the rewrite pass;
``_scopes`` answers which binding a name reads (``Context.binding``, ``Context.index``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import QualifiedNameProvider

from meshkit.migrate._scopes import ModuleIndex, referents

COLLECTIVES = frozenset(
    f"jax.lax.{n}" for n in ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute")
)
_PMAP_POSITIONAL = ("fun", "axis_name")
# pmap as JAX 0.12 code or old code may name it (``from jax.api import pmap`` was common).
PMAP_NAMES = frozenset({"jax.pmap", "jax.api.pmap", "jax._src.api.pmap"})
# What a pmapped function's attributes may be read for and still be rewritten: the helper copies them.
WRAPPED = frozenset({"__name__", "__qualname__", "__doc__", "__module__", "__wrapped__", "__dict__"})
# Bases that name the object a class-body member is bound on, in the class's methods.
_OWN_BASES = ("self", "cls")
_EMPTY = cst.Module(body=[])


def code(node: cst.CSTNode) -> str:
    """The source text of ``node``."""
    return _EMPTY.code_for_node(node)


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    """The ``name=...`` argument of ``call``, if given."""
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def drop_keyword(call: cst.Call, name: str) -> cst.Call:
    """``call`` without its ``name=...`` argument; the comma of the last argument is kept as it was."""
    args = list(call.args)
    i = next(i for i, a in enumerate(args) if a.keyword is not None and a.keyword.value == name)
    removed = args.pop(i)
    if i == len(args) and args:
        args[-1] = args[-1].with_changes(comma=removed.comma)
    return call.with_changes(args=args)


def pmap_arguments(call: cst.Call, offset: int) -> dict[str, cst.Arg] | None:
    """pmap's arguments by name (``fun``, ``axis_name`` may be positional); None with ``*``/``**``."""
    named: dict[str, cst.Arg] = {}
    for i, a in enumerate(call.args[offset:]):
        if a.star:
            return None
        if a.keyword is not None:
            named[a.keyword.value] = a
        elif i < len(_PMAP_POSITIONAL):
            named[_PMAP_POSITIONAL[i]] = a
        else:
            return None
    return named


@dataclass(frozen=True, kw_only=True, slots=True)
class PmapSite:
    """One application of ``jax.pmap``: a call ``jax.pmap(f, ...)`` or a decorator on a ``def``.

    ``anchor`` is the Call or Decorator node; ``call`` carries pmap's arguments (None for a bare
    ``@jax.pmap``) from ``offset`` on; ``fn`` is the mapped function where this module defines it;
    ``name`` is the name the pmapped function is bound to (``step`` for ``obj.step = jax.pmap(...)``);
    ``target`` is what binds it as a variable (the assigned Name, the decorated def), for scope
    look-ups; ``member`` says it is also read as an attribute (``obj.step``, or bound in a class body);
    ``base`` is the object it is bound on (``obj``), None in a class body; ``owner`` the innermost
    class around the binding.
    """

    anchor: cst.CSTNode
    call: cst.Call | None
    offset: int
    fn: cst.FunctionDef | cst.Lambda | None
    name: str | None
    decorator: bool
    target: cst.CSTNode | None = None
    member: bool = False
    base: str | None = None
    owner: cst.ClassDef | None = None

    def arguments(self) -> dict[str, cst.Arg] | None:
        return {} if self.call is None else pmap_arguments(self.call, self.offset)


@dataclass(kw_only=True, slots=True)
class Context:
    """Per-module facts the rules share, built once before the rewrite pass."""

    get_metadata: Callable
    sites: dict[cst.CSTNode, PmapSite] = field(default_factory=dict)
    nested: dict[cst.Call, PmapSite] = field(default_factory=dict)
    nested_sites: set[int] = field(default_factory=set)
    # pmap applied to what is pmapped already (stacked decorators, ``jax.pmap(jax.pmap(f))``):
    # the outer site's anchor and what it maps.
    stacked: dict[cst.CSTNode, str] = field(default_factory=dict)
    # pmap named but not applied where this module can follow it (``p = jax.pmap``, ``g(jax.pmap)``).
    pmap_refs: set[cst.CSTNode] = field(default_factory=set)
    # The attributes the module reads on each variable (``step.lower``: the Name ``step`` and
    # ``lower``, under ``step``), on each member (``self.step.lower``: the base's text ``self``, the
    # innermost class around the read and ``lower``, under ``step``) and on each call's result: a
    # pmapped function's own methods (``.lower``) have no counterpart on the rewritten one.
    attribute_reads: dict[str, list[tuple[cst.Name, str]]] = field(default_factory=dict)
    member_reads: dict[str, list[tuple[str, cst.ClassDef | None, str]]] = field(default_factory=dict)
    attribute_calls: dict[int, set[str]] = field(default_factory=dict)
    # The first call that makes the module multi-host, as (dotted name, line), if any.
    multihost: tuple[str, int] | None = None
    # Names bound at module level (imports, assignments, defs), for helpers and imports a fix adds.
    module_names: dict[str, cst.CSTNode] = field(default_factory=dict)
    # Whether the module binds ``jax`` to the jax package at top level (``import jax``), and
    # whether it imports anything from jax at top level (``import jax.numpy as jnp`` too).
    imports_jax: bool = False
    uses_jax: bool = False
    # Whether the module replicates arrays over devices first (the standard pmap idiom for params).
    replicates: bool = False
    # PRNGKey: every call of it, those safe to make typed keys (see _keys), and whether all uses are.
    key_calls: list[cst.Call] = field(default_factory=list)
    safe_keys: set[cst.Call] = field(default_factory=set)
    all_keys_safe: bool = True
    module: cst.Module | None = None
    # Plain assignments (``n = value``) by the id of the Name bound, every def by id (what a name's
    # binding is), how many defs have each name, and each call by the id of its function expression.
    assigned: dict[int, cst.BaseExpression] = field(default_factory=dict)
    def_nodes: dict[int, cst.FunctionDef] = field(default_factory=dict)
    def_names: Counter = field(default_factory=Counter)
    call_of: dict[int, cst.Call] = field(default_factory=dict)
    _index: ModuleIndex | None = None
    _qnames: dict[int, str | None] = field(default_factory=dict)

    def qname(self, node: cst.CSTNode) -> str | None:
        """The dotted name ``node`` refers to through the module's imports (``jnp.ones`` -> ``jax.numpy.ones``).

        Only names and attributes have one: the value a call returns is not the function it calls.
        """
        if not isinstance(node, cst.Name | cst.Attribute):
            return None
        key = id(node)
        if key not in self._qnames:
            names = self.get_metadata(QualifiedNameProvider, node, set())
            self._qnames[key] = min((q.name for q in names), default=None)
        return self._qnames[key]

    def callee(self, call: cst.Call) -> tuple[str | None, int]:
        """The function a call applies, seen through ``functools.partial``, and where its arguments start."""
        name = self.qname(call.func)
        if name == "functools.partial" and call.args and call.args[0].keyword is None:
            return canonical(self.qname(call.args[0].value)), 1
        return canonical(name), 0

    def index(self) -> ModuleIndex:
        """Parents, bindings and names of the module (built on first need: one more visit)."""
        if self._index is None:
            self._index = ModuleIndex(self.module)
        return self._index

    def binding(self, name: cst.Name) -> int | None:
        """The id of the binding (an assignment's target, a def) that ``name`` reads; None where unsure.

        libcst's scopes give every binding of the name in its scope; where there are several, the
        module's blocks decide which one is read (``ModuleIndex.last_binding``).
        """
        bound = referents(self.get_metadata, name)
        if not bound or len(bound) == 1:
            return next(iter(bound)) if bound else None
        return self.index().last_binding(name, bound)

    def uses_collectives(self, fn: cst.CSTNode) -> bool:
        """Whether the body of ``fn`` calls a ``jax.lax`` collective."""
        return any(self.qname(c.func) in COLLECTIVES for c in all_calls(fn))

    def is_nested(self, site: PmapSite) -> bool:
        return id(site) in self.nested_sites

    def attributes_read(self, site: PmapSite) -> set[str]:
        """The attributes the module reads on the function ``site`` makes, beyond those the helper copies.

        A read is of that function where a variable's name resolves through the module's scopes to
        the site's binding (not another function's local, a loop's or a comprehension's variable),
        or a member is read on the object it is bound on (``self.loss.<attr>`` in its class; never
        a variable named ``loss``). A read that may be of it (a name whose scope is unknown, another
        object's ``.loss``) counts where the attribute may differ after the rewrite (``.lower``,
        the function's dunders): any other (``.shape``) fails on pmap's function as on the helper's.
        """
        read = set(self.attribute_calls.get(id(site.anchor), set()))
        if site.target is not None:
            for name, attr in self.attribute_reads.get(site.name, ()):
                bound = referents(self.get_metadata, name)
                sure = bound is not None and id(site.target) in bound
                if sure or (bound is None and _may_differ(attr)):
                    read.add(attr)
        if site.member:
            own = {site.base} if site.base is not None else {*_OWN_BASES, *_class_name(site.owner)}
            for base, owner, attr in self.member_reads.get(site.name, ()):
                if (base in own and owner is site.owner) or _may_differ(attr):
                    read.add(attr)
        return read - WRAPPED


def _may_differ(attr: str) -> bool:
    """Whether ``attr`` may read otherwise on pmap's function than on the helper's: ``.lower``, a dunder."""
    return attr == "lower" or (attr.startswith("__") and attr.endswith("__"))


def _class_name(owner: cst.ClassDef | None) -> tuple[str, ...]:
    return () if owner is None else (owner.name.value,)


def canonical(name: str | None) -> str | None:
    """``jax.pmap`` for every name pmap goes by; other names unchanged."""
    return "jax.pmap" if name in PMAP_NAMES else name


def all_calls(node: cst.CSTNode) -> list[cst.Call]:
    """Every call in ``node``, lambdas' too."""
    found: list[cst.Call] = []

    class _Collect(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

    node.visit(_Collect())
    return found
