"""What the rules know about a module: resolved names, and every place ``jax.pmap`` is applied."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider, ScopeProvider

from meshkit.migrate._keys import safe_prng_keys

COLLECTIVES = frozenset(
    f"jax.lax.{n}" for n in ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute")
)
_PMAP_POSITIONAL = ("fun", "axis_name")
# pmap as JAX 0.12 code or old code may name it (``from jax.api import pmap`` was common).
PMAP_NAMES = frozenset({"jax.pmap", "jax.api.pmap", "jax._src.api.pmap"})
# Calls that make code multi-host: a pmap's leading axis is then host-local, not global.
_MULTIHOST = frozenset(
    f"jax.{n}" for n in ("process_index", "process_count", "host_id", "host_count", "distributed.initialize")
)
# Ways legacy code gives arrays a device axis before pmap: besides these, any function whose name
# says it replicates or broadcasts (flax's ``jax_utils.replicate``, a project's own ``replicate_state``).
_REPLICATE = frozenset({"jax.device_put_sharded", "jax.api.device_put_sharded"})
_REPLICATE_WORDS = ("replicat", "broadcast")
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
            return _canonical(self.qname(call.args[0].value)), 1
        return _canonical(name), 0

    def index(self) -> ModuleIndex:
        """Parents, bindings and names of the module (built on first need: one more visit)."""
        if self._index is None:
            self._index = ModuleIndex(self.module)
        return self._index

    def binding(self, name: cst.Name) -> int | None:
        """The id of the binding (an assignment's target, a def) that ``name`` reads; None where unsure.

        libcst's scopes give every binding of the name in its scope. Where there are several, the
        one read is the last before ``name``'s statement when all of them are plain statements of
        that statement's own block (``x = f(x)`` reads the x bound before it), none after it can
        reach it through a loop, and ``name`` is read when its statement runs (not in a lambda);
        else None.
        """
        bound = referents(self.get_metadata, name)
        if not bound or len(bound) == 1:
            return next(iter(bound)) if bound else None
        index = self.index()
        use = index.statement(name)
        body, at, holder = index.suite(use)
        if not isinstance(holder, cst.Module | cst.IndentedBlock) or index.deferred(name, use):
            return None
        where: dict[int, int] = {}
        for b in bound:
            node = index.bindings.get(b)
            stmt = None if node is None else index.statement(node)
            if stmt is None or index.parent(stmt) is not holder:
                return None
            where[b] = next(i for i, s in enumerate(body) if s is stmt)
        before = {b: i for b, i in where.items() if i < at}
        if not before or (len(before) < len(where) and index.in_loop(use)):
            return None
        last = max(before.values())
        found = [b for b, i in before.items() if i == last]
        return found[0] if len(found) == 1 else None

    def uses_collectives(self, fn: cst.CSTNode) -> bool:
        """Whether the body of ``fn`` calls a ``jax.lax`` collective."""
        return any(self.qname(c.func) in COLLECTIVES for c in _calls(fn))

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


def _may_differ(attr: str) -> bool:
    """Whether ``attr`` may read otherwise on pmap's function than on the helper's: ``.lower``, a dunder."""
    return attr == "lower" or (attr.startswith("__") and attr.endswith("__"))


def _class_name(owner: cst.ClassDef | None) -> tuple[str, ...]:
    return () if owner is None else (owner.name.value,)


def referents(get_metadata: Callable, name: cst.Name) -> set[int] | None:
    """The ids of the nodes that bind what ``name`` reads, through libcst's scopes; None where unknown."""
    scope = get_metadata(ScopeProvider, name, None)
    accesses = None if scope is None else scope.accesses[name]
    if not accesses:
        return None
    return {id(getattr(a, "node", None)) for access in accesses for a in access.referents}


def _canonical(name: str | None) -> str | None:
    """``jax.pmap`` for every name pmap goes by; other names unchanged."""
    return "jax.pmap" if name in PMAP_NAMES else name


def _calls(node: cst.CSTNode) -> list[cst.Call]:
    found: list[cst.Call] = []

    class _Collect(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

    node.visit(_Collect())
    return found


class _SiteFinder(cst.CSTVisitor):
    """Collects functions by name, assignments of calls, and the pmap sites of a module."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.defs: dict[str, cst.FunctionDef] = {}
        # A call's value bound by an assignment: (name, the Name bound or None, read as a member,
        # the text of the object it is bound on or None).
        self.assigned: dict[cst.Call, tuple[str, cst.Name | None, bool, str | None]] = {}
        # The enclosing definitions, a class or None for a def (names bound in a class body are members).
        self.enclosing: list[cst.ClassDef | None] = []
        self.decorators: set[int] = set()
        self.applied: set[int] = set()
        self.refs: list[cst.CSTNode] = []
        self.key_refs: list[cst.CSTNode] = []

    def in_class(self) -> bool:
        return bool(self.enclosing) and self.enclosing[-1] is not None

    def owner(self) -> cst.ClassDef | None:
        """The innermost class around the node visited."""
        return next((c for c in reversed(self.enclosing) if c is not None), None)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.enclosing.append(node)

    def leave_ClassDef(self, node: cst.ClassDef) -> None:
        self.enclosing.pop()

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.enclosing.pop()

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Name(self, node: cst.Name) -> None:
        self._reference(node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._reference(node)
        base = node.value
        if isinstance(base, cst.Name):
            self.ctx.attribute_reads.setdefault(base.value, []).append((base, node.attr.value))
        elif isinstance(base, cst.Attribute):
            read = (code(base.value), self.owner(), node.attr.value)
            self.ctx.member_reads.setdefault(base.attr.value, []).append(read)
        elif isinstance(base, cst.Call):
            self.ctx.attribute_calls.setdefault(id(base), set()).add(node.attr.value)

    def _reference(self, node: cst.Name | cst.Attribute) -> None:
        name = self.ctx.qname(node)
        if name in PMAP_NAMES:
            self.refs.append(node)
        elif name in _MULTIHOST or (name or "").startswith("jax.experimental.multihost_utils."):
            if self.ctx.multihost is None:
                line = self.ctx.get_metadata(PositionProvider, node).start.line
                self.ctx.multihost = (name, line)
        elif name in _REPLICATE or any(
            w in (name or "").rsplit(".", 1)[-1].lower() for w in _REPLICATE_WORDS
        ):
            self.ctx.replicates = True
        elif name == "jax.random.PRNGKey":
            self.key_refs.append(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.defs[node.name.value] = node
        self.ctx.def_nodes[id(node)] = node
        self.ctx.def_names[node.name.value] += 1
        pmapped = []
        bound = (node.name.value, node, self.in_class(), None)
        for d in node.decorators:
            self.decorators.add(id(d.decorator))
            expr = d.decorator
            if _canonical(self.ctx.qname(expr)) == "jax.pmap":
                self.applied.add(id(expr))
                pmapped.append(d)
                self._add(d, None, 0, node, bound, True)
            elif isinstance(expr, cst.Call) and self.ctx.callee(expr) == ("jax.pmap", 1):
                self.applied.add(id(expr.args[0].value))
                pmapped.append(d)
                self._add(d, expr, 1, node, bound, True)
        self.enclosing.append(None)
        for outer in pmapped[:-1]:  # stacked: each decorator maps what the one below it pmapped
            self.ctx.stacked[outer] = f"{node.name.value}, pmapped by the decorator below"

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None and isinstance(node.target, cst.Name):
            self.ctx.assigned[id(node.target)] = node.value

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
            self.ctx.assigned[id(node.targets[0].target)] = node.value
        if isinstance(node.value, cst.Call) and len(node.targets) == 1:
            target = node.targets[0].target
            if isinstance(target, cst.Name):
                self.assigned[node.value] = (target.value, target, self.in_class(), None)
            elif isinstance(target, cst.Attribute):  # ``self.step = jax.pmap(...)``: followed by its name
                self.assigned[node.value] = (target.attr.value, None, True, code(target.value))

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        # ``[x] * n_devices``: the docs' way to stack one copy per device.
        if isinstance(node.operator, cst.Multiply) and isinstance(node.left, cst.List):
            self.ctx.replicates = True

    def visit_Call(self, node: cst.Call) -> None:
        self.ctx.call_of[id(node.func)] = node
        if self.ctx.qname(node.func) == "jax.random.PRNGKey":
            self.ctx.key_calls.append(node)
        if id(node) in self.decorators:
            return
        name, offset = self.ctx.callee(node)
        if name == "jax.pmap":
            self.applied.add(id(node.args[0].value if offset else node.func))
            self._add(node, node, offset, None, self.assigned.get(node), False)

    def _add(self, anchor, call, offset, fn, bound, decorator) -> None:
        name, target, member, base = bound or (None, None, False, None)
        self.ctx.sites[anchor] = PmapSite(
            anchor=anchor,
            call=call,
            offset=offset,
            fn=fn,
            name=name,
            decorator=decorator,
            target=target,
            member=member,
            base=base,
            owner=self.owner(),
        )

    def resolve(self, site: PmapSite) -> PmapSite:
        """The site with ``fn`` filled in when the mapped function is a lambda or a def of this module."""
        if site.fn is not None or site.call is None or site.offset != 0:
            return site
        fun = (site.arguments() or {}).get("fun")
        value = None if fun is None else fun.value
        if isinstance(value, cst.Lambda):
            return replace(site, fn=value)
        if isinstance(value, cst.Name) and value.value in self.defs:
            fn = self.defs[value.value]  # the last def of that name, or where several are, the one read
            if self.ctx.def_names[value.value] > 1:
                fn = self.ctx.def_nodes.get(self.ctx.binding(value), fn)
            return replace(site, fn=fn)
        return site


class _Bindings:
    """Which pmap sites a variable may be, through the module's scopes.

    A variable (``forward(x)``, ``jax.pmap(g)``) is a pmap site only where a binding it can reach
    is one (``forward = jax.pmap(...)``, a pmapped def): not a member of the same name
    (``self.forward = jax.pmap(forward)``), not a variable of another function. A member
    (``obj.step(x)``) is not followed: which object it is cannot be known, and a pmap the rewrite
    nests by mistake fails as loudly as pmap does (shard_map's mesh mismatch, a ValueError).
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.get_metadata = ctx.get_metadata
        self.targets: dict[int, list[PmapSite]] = {}
        self.names: dict[str, list[PmapSite]] = {}
        for site in ctx.sites.values():
            if site.target is not None:
                self.targets.setdefault(id(site.target), []).append(site)
                self.names.setdefault(site.name, []).append(site)

    def sites(self, ref: cst.CSTNode) -> list[PmapSite]:
        """The pmap sites ``ref`` may refer to (a variable with no scope known: every one of its name)."""
        if not isinstance(ref, cst.Name):
            return []
        bound = referents(self.get_metadata, ref)
        if bound is None:
            return self.names.get(ref.value, [])
        found = [s for key in bound for s in self.targets.get(key, ())]
        if found and len(bound) > 1:
            # ``f`` read before ``f`` is rebound to a pmap (a notebook reusing names) is not that pmap.
            one = self.ctx.binding(ref)
            found = found if one is None else self.targets.get(one, [])
        return found


def build_context(module: cst.Module, get_metadata: Callable) -> Context:
    """Resolve every pmap site of ``module`` and find pmapped functions called inside pmapped functions."""
    ctx = Context(get_metadata=get_metadata, module=module)
    finder = _SiteFinder(ctx)
    module.visit(finder)
    ctx.pmap_refs = {r for r in finder.refs if id(r) not in finder.applied}
    ctx.module_names, ctx.imports_jax = _module_names(module)
    ctx.uses_jax = any(_from_jax(n) for n in ctx.module_names.values())
    if ctx.key_calls:
        ctx.safe_keys = safe_prng_keys(module, ctx.key_calls, get_metadata, ctx.qname)
    safe_funcs = {id(c.func) for c in ctx.safe_keys}
    ctx.all_keys_safe = all(id(r) in safe_funcs for r in finder.key_refs)
    ctx.sites = {anchor: finder.resolve(s) for anchor, s in ctx.sites.items()}
    bindings = _Bindings(ctx)
    _find_stacked(ctx, bindings)
    for outer in ctx.sites.values():
        if outer.fn is None:
            continue
        for call in _calls(outer.fn):
            inner = [s for s in bindings.sites(call.func) if s is not outer]
            if inner:
                ctx.nested[call] = outer
                ctx.nested_sites.update([id(outer), *map(id, inner)])
    return ctx


def _find_stacked(ctx: Context, bindings: _Bindings) -> None:
    """Mark pmaps applied to what is pmapped already as nested (JAX 0.12 raises ValueError on them).

    That is stacked decorators, ``jax.pmap(jax.pmap(f))``, and ``jax.pmap(g)`` for a pmapped ``g``.
    """
    by_anchor = {id(a): s for a, s in ctx.sites.items()}
    by_def: dict[int, list[PmapSite]] = {}
    for anchor, site in ctx.sites.items():
        if site.decorator:
            by_def.setdefault(id(site.fn), []).append(site)
            continue
        fun = (site.arguments() or {}).get("fun")
        value = None if fun is None else fun.value
        if isinstance(value, cst.Call) and id(value) in by_anchor:
            ctx.stacked[anchor] = f"{code(value.func)}(...), a pmap"
            ctx.nested_sites.update((id(site), id(by_anchor[id(value)])))
        elif isinstance(value, cst.Name):
            # ``step = jax.pmap(step)`` maps the plain def it rebinds, not itself.
            inner = [s for s in bindings.sites(value) if s is not site]
            if inner:
                ctx.stacked[anchor] = f"{code(value)}, pmapped already"
                ctx.nested_sites.update([id(site), *map(id, inner)])
    for sites in by_def.values():
        if len(sites) > 1:
            ctx.nested_sites.update(id(s) for s in sites)


def _from_jax(node: cst.CSTNode) -> bool:
    """Whether ``node`` is an import from the jax package."""
    if isinstance(node, cst.Import):
        return any(code(a.name).split(".")[0] == "jax" for a in node.names)
    return (
        isinstance(node, cst.ImportFrom)
        and not node.relative
        and node.module is not None
        and code(node.module).split(".")[0] == "jax"
    )


def _bound(target: cst.BaseExpression) -> list[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, cst.Tuple | cst.List):
        return [n for e in target.elements for n in _bound(e.value)]
    return []


def _module_names(module: cst.Module) -> tuple[dict[str, cst.CSTNode], bool]:
    """Top-level bindings by name, and whether ``import jax`` binds ``jax`` to the jax package."""
    names: dict[str, cst.CSTNode] = {}
    imports_jax = False
    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
            names[stmt.name.value] = stmt
            continue
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Import):
                for a in small.names:
                    local = a.asname.name.value if a.asname else code(a.name).split(".")[0]
                    names[local] = small
                    imports_jax |= local == "jax" and code(a.name).split(".")[0] == "jax"
            elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                for a in small.names:
                    names[a.asname.name.value if a.asname else code(a.name)] = small
            elif isinstance(small, cst.Assign):
                for t in small.targets:
                    names.update(dict.fromkeys(_bound(t.target), small))
            elif isinstance(small, cst.AnnAssign | cst.AugAssign):
                names.update(dict.fromkeys(_bound(small.target), small))
    if names.get("jax") is not None and not isinstance(names["jax"], cst.Import):
        imports_jax = False
    return names, imports_jax
