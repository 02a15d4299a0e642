"""What the module's calls of a pmapped function show, the evidence for the inline form's mesh.

The mesh of the inline form is built once, where pmap was applied, over the devices pmap would use
at the call: the first ``n``, ``n`` the length of the mapped axis. Only the calls state ``n``, so
the function must be used by nothing but calls with positional arguments that this module makes
(``pmapped_calls``; a public module-level name must also be called when the module runs, since other
modules' calls are not seen), and each call's mapped arguments must say their leading length, the
same at every call (``call_shapes``, ``mapped_length``): ``jnp.arange(n)``, ``x.reshape(n, ...)``,
``jnp.ones((n, ...))``, ``jax.random.split(key, n)``, through plain assignments, ``n`` an int or
``jax.device_count()`` (``DEVICES``). The same expressions give the arguments' ranks and dict keys,
which the body check (``_inline_body``) needs where a mapped value meets a replicated one.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from meshkit.migrate._context import Context, PmapSite
from meshkit.migrate._inline_exprs import (
    DEVICE_COUNTS,
    DEVICE_LISTS,
    MAX_DEPTH,
    NotInline,
    bound_value,
    dotted_name,
    is_number,
    literal_int,
)
from meshkit.migrate._scopes import ModuleIndex

DEVICES = "devices"  # a length: as many as jax.devices()
_NP = ("jax.numpy.", "numpy.")
_FILLED = frozenset({"ones", "zeros", "empty", "full"})
_RANDOM_SHAPED = frozenset(f"jax.random.{n}" for n in ("normal", "uniform", "bernoulli", "truncated_normal"))
_REPLICATE = frozenset({"flax.jax_utils.replicate", "jax.device_put_replicated"})


@dataclass(frozen=True, slots=True)
class Shape:
    """What a call's argument expression says: its leading length (an int or DEVICES), rank, dict parts."""

    size: int | str | None = None
    rank: int | None = None
    fields: tuple[tuple[str, Shape], ...] | None = None


def pmapped_calls(site: PmapSite, ctx: Context) -> list[cst.Call]:
    """The calls of the function ``site`` makes; NotInline where it is used otherwise, or not at all."""
    called = ctx.call_of.get(id(site.anchor))
    if not site.decorator and called is not None and called.func is site.anchor:
        return [called]
    if site.member or site.target is None or site.name is None:
        raise NotInline(
            "the pmapped function is passed on or bound to an attribute, so its calls cannot be followed"
        )
    if site.decorator and len(site.fn.decorators) != 1:
        raise NotInline("other decorators wrap the def besides pmap")
    scope = ctx.get_metadata(ScopeProvider, site.target, None)
    if scope is None:
        raise NotInline(f"the scope of {site.name} is unknown")
    uses = [
        access.node
        for assignment in scope.assignments[site.name]
        if getattr(assignment, "node", None) is site.target
        for access in assignment.references
    ]
    # A use that certainly reads another binding of the name (``f`` before ``f = jax.pmap(...)``) is not one.
    uses = [u for u in uses if not isinstance(u, cst.Name) or ctx.binding(u) in (None, id(site.target))]
    if not uses:
        raise NotInline(
            f"nothing in this module calls {site.name}, so the length of its mapped axis (the mesh's size) "
            "is unknown"
        )
    calls = []
    for use in sorted(uses, key=lambda u: _line(ctx, u)):
        call = ctx.call_of.get(id(use))
        if call is None or call.func is not use:
            raise NotInline(f"{site.name} is used at line {_line(ctx, use)} other than by a call")
        calls.append(call)
    index = ctx.index()
    if exported(site, index) and not any(_at_top_level(u, index) for u in uses):
        raise NotInline(
            f"{site.name} is a module-level name other modules may call with another number of rows, and "
            "this module calls it only from functions (a script would call it when it runs)"
        )
    return calls


def exported(site: PmapSite, index: ModuleIndex) -> bool:
    """Whether the pmapped function is a public module-level name (which other modules may call)."""
    if site.target is None or not site.name or site.name.startswith("_"):
        return False
    return isinstance(index.parent(index.statement(site.target)), cst.Module)


def _at_top_level(node: cst.CSTNode, index: ModuleIndex) -> bool:
    """Whether ``node`` runs when the module runs: outside every def, lambda and class."""
    while (node := index.parent(node)) is not None:
        if isinstance(node, cst.FunctionDef | cst.Lambda | cst.ClassDef):
            return False
    return True


def call_shapes(
    calls: list[cst.Call], mapped: tuple[bool, ...], ctx: Context
) -> tuple[list[list[Shape]], list[tuple[int, set[int | str]]]]:
    """What every call passes for each parameter, and each call's line and the lengths its mapped
    arguments state; NotInline where a call passes keyword or * arguments, or another count."""
    shapes = _Shapes(ctx)
    per_param: list[list[Shape]] = [[] for _ in mapped]
    lengths = []
    for call in calls:
        line = _line(ctx, call)
        if any(a.star or a.keyword is not None for a in call.args):
            raise NotInline(
                f"the call at line {line} passes keyword or * arguments (pmap maps keywords, shard_map takes none)"
            )
        if len(call.args) != len(mapped):
            raise NotInline(
                f"the call at line {line} passes {len(call.args)} arguments for {len(mapped)} parameters"
            )
        found = [shapes.shape(a.value) for a in call.args]
        lengths.append(
            (line, {s.size for s, m in zip(found, mapped, strict=True) if m and s.size is not None})
        )
        for i, s in enumerate(found):
            per_param[i].append(s)
    return per_param, lengths


def mapped_length(lengths: list[tuple[int, set[int | str]]]) -> int | str:
    """The one length every call maps; NotInline where a call's is unknown or they differ."""
    for line, known in lengths:
        if len(known) != 1:
            raise NotInline(
                f"the length of the mapped axis at the call at line {line} is not known here (the mesh needs it)"
            )
    sizes = {n for _, known in lengths for n in known}
    if len(sizes) != 1:
        raise NotInline("the calls map axes of different lengths: one mesh cannot serve them")
    return sizes.pop()


def _line(ctx: Context, node: cst.CSTNode) -> int:
    return ctx.get_metadata(PositionProvider, node).start.line


class _Shapes:
    """Leading lengths and ranks of call arguments, from the expressions that make them."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def size(self, node: cst.BaseExpression, depth: int = 0) -> int | str | None:
        if depth > MAX_DEPTH:
            return None
        n = literal_int(node)
        if n is not None:
            return n if n > 0 else None
        if isinstance(node, cst.Name):
            value = bound_value(self.ctx, node)
            return None if value is None else self.size(value, depth + 1)
        if not isinstance(node, cst.Call):
            return None
        name = self.ctx.qname(node.func)
        if not node.args:
            return DEVICES if name in DEVICE_COUNTS else None
        if name == "len" and len(node.args) == 1:
            inner = node.args[0].value
            if isinstance(inner, cst.Call) and not inner.args and self.ctx.qname(inner.func) in DEVICE_LISTS:
                return DEVICES
        return None

    def _shape_arg(self, node: cst.BaseExpression | None, depth: int) -> Shape:
        """A shape argument: ``n`` or ``(n, ...)``/``[n, ...]``."""
        if node is None:
            return Shape()
        if isinstance(node, cst.Tuple | cst.List):
            if not node.elements or any(isinstance(e, cst.StarredElement) for e in node.elements):
                return Shape()
            return Shape(self.size(node.elements[0].value, depth + 1), len(node.elements))
        return Shape(self.size(node, depth + 1), 1)

    def shape(self, node: cst.BaseExpression, depth: int = 0) -> Shape:
        if depth > MAX_DEPTH:
            return Shape()
        if is_number(node):
            return Shape(rank=0)
        if isinstance(node, cst.Name):
            value = bound_value(self.ctx, node)
            return Shape() if value is None else self.shape(value, depth + 1)
        if isinstance(node, cst.UnaryOperation) and not isinstance(node.operator, cst.Not):
            return self.shape(node.expression, depth + 1)
        if isinstance(node, cst.BinaryOperation) and not isinstance(node.operator, cst.MatrixMultiply):
            # ``x - 5.0``, ``2 * x``: a number broadcasts, the array keeps its shape.
            if is_number(node.right):
                return self.shape(node.left, depth + 1)
            if is_number(node.left):
                return self.shape(node.right, depth + 1)
            return Shape()
        if isinstance(node, cst.Dict):
            fields = []
            for e in node.elements:
                if not isinstance(e, cst.DictElement) or not isinstance(e.key, cst.SimpleString):
                    return Shape()
                fields.append((str(e.key.evaluated_value), self.shape(e.value, depth + 1)))
            sizes = {s.size for _, s in fields if s.size is not None}
            return Shape(size=sizes.pop() if len(sizes) == 1 else None, fields=tuple(fields))
        if isinstance(node, cst.Call) and not any(a.star for a in node.args):
            return self._call(node, depth)
        return Shape()

    def _call(self, node: cst.Call, depth: int) -> Shape:
        name = dotted_name(self.ctx, node.func)
        positional = [a.value for a in node.args if a.keyword is None]
        keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        short = name.rsplit(".", 1)[-1]
        numpy = name.startswith(_NP)
        if numpy and short == "arange" and len(positional) == 1:
            return Shape(self.size(positional[0], depth + 1), 1)
        if numpy and short in _FILLED:
            return self._shape_arg(positional[0] if positional else keywords.get("shape"), depth)
        if numpy and short in ("array", "asarray") and positional:
            return _literal_array(positional[0])
        if numpy and short == "reshape" and len(positional) == 2:
            return self._shape_arg(positional[1], depth)
        if name in _RANDOM_SHAPED:
            return self._shape_arg(positional[1] if len(positional) > 1 else keywords.get("shape"), depth)
        if name == "jax.random.split":
            num = positional[1] if len(positional) > 1 else keywords.get("num")
            return Shape(None if num is None else self.size(num, depth + 1))
        if name in _REPLICATE:
            devices = positional[1] if len(positional) > 1 else keywords.get("devices")
            default = devices is None and name == "flax.jax_utils.replicate"
            listed = isinstance(devices, cst.Call) and not devices.args
            listed = listed and self.ctx.qname(devices.func) in DEVICE_LISTS
            return Shape(DEVICES) if default or listed else Shape()
        if name == "jax.device_put" and positional:
            return self.shape(positional[0], depth + 1)
        if isinstance(node.func, cst.Attribute) and not name.startswith(("jax.", "numpy.")):
            method = node.func.attr.value
            if method == "reshape" and len(positional) == 1:
                return self._shape_arg(positional[0], depth)
            if method == "reshape" and positional:
                return Shape(self.size(positional[0], depth + 1), len(positional))
            if method == "astype":
                return self.shape(node.func.value, depth + 1)
        return Shape()


def _literal_array(node: cst.BaseExpression) -> Shape:
    """``jnp.array([2.0, 5.0, 1.0])``: a list of numbers has its length and rank 1."""
    if not isinstance(node, cst.List | cst.Tuple) or not node.elements:
        return Shape()
    numbers = all(isinstance(e, cst.Element) and is_number(e.value) for e in node.elements)
    return Shape(len(node.elements), 1) if numbers else Shape()
