"""Where the inline form's mesh may go: building it starts JAX's backend, which a module must not do
earlier than it did under pmap.

The mesh statement goes just before the statement that applied pmap. That is safe only where the
program already started the backend by then (a statement that runs before it creates arrays or asks
for devices), or starts it right after with nothing in between that could configure JAX (set a
flag, call ``jax.distributed.initialize()``): defs under JAX's transforms, imports of jax and numpy,
assignments of literals and transforms (``backend_started``). Elsewhere the helper stays, which
builds its mesh at the first call.
"""

from __future__ import annotations

import libcst as cst

from meshkit.migrate._context import Context, code
from meshkit.migrate._inline_exprs import DEVICE_COUNTS, DEVICE_LISTS, dotted_name
from meshkit.migrate._scopes import ModuleIndex

# jax.numpy functions that make no array (so do not start JAX's backend).
_NO_ARRAY = frozenset(
    f"jax.numpy.{n}"
    for n in ("dtype", "finfo", "iinfo", "issubdtype", "promote_types", "result_type", "can_cast")
)
# Calls that build functions, not arrays: a statement of only these starts no backend.
_TRANSFORMS = frozenset(
    {
        "jax.jit",
        "jax.pmap",
        "jax.vmap",
        "jax.grad",
        "jax.value_and_grad",
        "jax.checkpoint",
        "jax.remat",
        "jax.shard_map",
        "functools.partial",
    }
)
_QUIET_IMPORTS = frozenset({"jax", "numpy", "functools", "typing", "math", "dataclasses", "collections"})


def _calls_in(node: cst.CSTNode) -> list[cst.Call]:
    found: list[cst.Call] = []

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

        def visit_Lambda(self, lam: cst.Lambda) -> bool:
            return False

    node.visit(_Calls())
    return found


def _starts_backend(stmt: cst.CSTNode, ctx: Context) -> bool:
    """Whether a simple statement certainly creates arrays or asks for devices (which starts JAX's backend)."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for call in _calls_in(stmt):
        name = dotted_name(ctx, call.func)
        if name in _NO_ARRAY:
            continue
        if name in DEVICE_COUNTS or name in DEVICE_LISTS or name.startswith(("jax.numpy.", "jax.random.")):
            return True
        if name.startswith("jax.device_put"):
            return True
    return False


def _quiet(stmt: cst.CSTNode, ctx: Context) -> bool:
    """Whether a statement certainly neither configures JAX nor runs code that could: a def whose
    decorators are JAX's transforms, imports of jax and numpy, assignments of literals and transforms.
    (A class body runs when it is defined, a decorator is a call: neither counts.)"""
    if isinstance(stmt, cst.FunctionDef):
        return all(_transform(d.decorator, ctx) for d in stmt.decorators)
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for s in stmt.body:
        if isinstance(s, cst.Pass):
            continue
        if isinstance(s, cst.Expr) and isinstance(s.value, cst.SimpleString | cst.ConcatenatedString):
            continue
        if isinstance(s, cst.Import) and all(code(a.name).split(".")[0] in _QUIET_IMPORTS for a in s.names):
            continue
        quiet_from = isinstance(s, cst.ImportFrom) and not s.relative and s.module is not None
        if quiet_from and code(s.module).split(".")[0] in _QUIET_IMPORTS:
            continue
        if isinstance(s, cst.Assign | cst.AnnAssign) and s.value is not None and _quiet_expr(s.value, ctx):
            continue
        return False
    return True


def _quiet_expr(node: cst.CSTNode, ctx: Context) -> bool:
    return all(ctx.callee(c)[0] in _TRANSFORMS for c in _calls_in(node))


def _transform(decorator: cst.BaseExpression, ctx: Context) -> bool:
    """``@jax.jit``, ``@partial(jax.pmap, axis_name="i")``: a decorator that only wraps the function."""
    if isinstance(decorator, cst.Call):
        return ctx.callee(decorator)[0] in _TRANSFORMS and _quiet_expr(decorator, ctx)
    return dotted_name(ctx, decorator) in _TRANSFORMS or ctx.callee(cst.Call(decorator))[0] in _TRANSFORMS


def backend_started(stmt: cst.CSTNode, ctx: Context, index: ModuleIndex) -> bool:
    """Whether a mesh built just before ``stmt`` starts JAX's backend no earlier than the program does.

    It does if a statement that runs before ``stmt`` (earlier in its block, or in the blocks around
    it up to the enclosing def) creates arrays, or if ``stmt`` or a later one of its block does with
    only quiet statements (defs, imports of jax and numpy, function transforms) in between.
    """
    node = stmt
    while True:
        body, at, holder = index.suite(node)
        if any(_starts_backend(s, ctx) for s in body[:at]):
            return True
        owner = index.parent(holder) if isinstance(holder, cst.IndentedBlock) else None
        while owner is not None and not isinstance(owner, cst.BaseStatement):
            owner = index.parent(owner)  # an else/except clause: up to its statement
        if owner is None or isinstance(owner, cst.FunctionDef | cst.ClassDef):
            break
        node = owner
    body, at, _ = index.suite(stmt)
    for s in body[at:]:
        if _starts_backend(s, ctx):
            return True
        if not _quiet(s, ctx):
            return False
    return False
