"""The ground the inline checks share (``_inline``): ``NotInline``, the reason any of them gives for
keeping the helper, and how they read one expression of the module as written: a literal number,
the dotted name a call applies, the value one plain assignment gave a name.

They read only what the source says for certain: where it leaves an expression open (a name whose
binding is unsure, a method of a computed value), the readers answer None or empty, and the check
that asked keeps the helper.
"""

from __future__ import annotations

import libcst as cst

from meshkit.migrate._context import Context

# Calls that count the devices, and calls that list them (a mesh over all of them).
DEVICE_COUNTS = frozenset({"jax.device_count", "jax.local_device_count"})
DEVICE_LISTS = frozenset({"jax.devices", "jax.local_devices"})
# How far the checks follow names, nested expressions and calls of the module's defs.
MAX_DEPTH = 8


class NotInline(Exception):
    """Why a pmap keeps the helper (the message is the reason, for the finding)."""


def literal_int(node: cst.BaseExpression) -> int | None:
    """``8`` or ``8.0``: the int a literal number states, None for anything else."""
    if isinstance(node, cst.Integer):
        return int(node.evaluated_value)
    if isinstance(node, cst.Float) and float(node.evaluated_value).is_integer():
        return int(node.evaluated_value)
    return None


def negative_int(node: cst.BaseExpression) -> int | None:
    """``-1``: the negative int a literal states, None for anything else."""
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        n = literal_int(node.expression)
        return None if n is None else -n
    return None


def is_number(node: cst.BaseExpression) -> bool:
    """Whether ``node`` is a literal int or float, signed or not."""
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus | cst.Plus):
        node = node.expression
    return isinstance(node, cst.Integer | cst.Float)


def dotted_name(ctx: Context, func: cst.BaseExpression) -> str:
    """The dotted name a call's function refers to; empty for a method of a computed value
    (libcst names ``jnp.arange(8).reshape`` ``jax.numpy.arange.reshape``)."""
    base = func
    while isinstance(base, cst.Attribute):
        base = base.value
    return (ctx.qname(func) or "") if isinstance(base, cst.Name) else ""


def bound_value(ctx: Context, name: cst.Name) -> cst.BaseExpression | None:
    """The value ``name`` was given where one plain assignment (``n = ...``) binds every use of it."""
    target = ctx.binding(name)
    return None if target is None else ctx.assigned.get(target)
