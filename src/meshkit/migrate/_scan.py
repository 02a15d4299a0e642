"""The pass that fills a module's ``Context``, once, before the rules run: every place ``jax.pmap`` is
applied and what it maps, pmaps applied inside or on other pmaps, the names bound at module level,
the attributes read on each name, calls that make the module multi-host or replicate arrays, and
the ``PRNGKey`` calls safe to make typed keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import libcst as cst
from libcst.metadata import PositionProvider

from meshkit.migrate._context import PMAP_NAMES, Context, PmapSite, all_calls, canonical, code
from meshkit.migrate._keys import safe_prng_keys
from meshkit.migrate._scopes import referents

# Calls that make code multi-host: a pmap's leading axis is then host-local, not global.
_MULTIHOST = frozenset(
    f"jax.{n}" for n in ("process_index", "process_count", "host_id", "host_count", "distributed.initialize")
)
# Ways legacy code gives arrays a device axis before pmap: besides these, any function whose name
# says it replicates or broadcasts (flax's ``jax_utils.replicate``, a project's own ``replicate_state``).
_REPLICATE = frozenset({"jax.device_put_sharded", "jax.api.device_put_sharded"})
_REPLICATE_WORDS = ("replicat", "broadcast")


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
            if canonical(self.ctx.qname(expr)) == "jax.pmap":
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
        for call in all_calls(outer.fn):
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
