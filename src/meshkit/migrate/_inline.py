"""MK015's inline form: a pmap written as ``jax.jit(jax.shard_map(f, mesh=..., in_specs=..., out_specs=...))``.

pmap and a direct ``jax.shard_map`` over a 1D mesh run the same SPMD program but show the body
different shapes: pmap's body sees each mapped argument without its mapped axis (a slice, ``x[i]``),
shard_map's sees the device's block, which keeps that axis with length 1 (``x[i:i+1]``). The two
agree exactly when nothing in the body depends on that axis: when the body is elementwise in its
mapped arguments, a row of the block gives what the slice gave, and the block of outputs is the
slice's output with the axis put back, which is how pmap stacks it. The mesh must also be the one
pmap builds at the call: the first ``n`` devices, ``n`` the mapped axis's length, which only the
calls tell.

So a pmap is written inline only where this module shows all of it; ``plan`` puts the evidence
together, each part proved by its own module:

- the mapped function is a lambda or a def of this module whose body is elementwise in its mapped
  arguments (``_inline_body``): arithmetic and comparisons, elementwise ``jax.numpy``/``jax.nn``/
  ``jax.lax`` functions, ``jnp.dot`` and ``@`` with a replicated right side, ``psum``/``pmean``/
  ``pmax``/``pmin``/``ppermute`` over pmap's axis, dict entries, calls of such defs; a replicated
  (``in_axes=None``) value only where its rank is known and at most the mapped value's (NumPy
  broadcasting lines up trailing axes: a longer replicated value would meet the block's extra axis);
- every use of the pmapped function in the module is a call with positional arguments only, and
  the mapped arguments of each call have a length the module states (``_inline_calls``:
  ``jnp.arange(n)``, ``x.reshape(n, ...)``, ``jnp.ones((n, ...))``, ``jax.random.split(key, n)``,
  ``n`` an int or ``jax.device_count()``), the same for every call: the mesh is
  ``jax.devices()[:n]``, the devices pmap uses; the calls also give the arguments' ranks;
- the mesh, built just before the statement that applied pmap, starts JAX's backend no earlier than
  the program did (``_inline_backend``): a statement before it already creates arrays, or the next
  ones do with nothing that could configure JAX in between.

This module owns the decision itself: what pmap maps (a lambda, a def, or an elementwise function
such as ``jnp.add``), which arguments (``in_axes`` of 0 and None only), how the calls' evidence
becomes the body's view of each parameter, and, where all of it holds, the ``Plan`` that
``_inline_form`` writes out. Everything else keeps the helper
(``rules_pmap.PMAP_HELPER``), which reproduces pmap's slices, mesh size and keyword arguments at
call time; the finding says why (``NotInline``, ``_inline_exprs``).
"""

from __future__ import annotations

import contextlib

import libcst as cst

from meshkit.migrate._context import Context, PmapSite, code
from meshkit.migrate._inline_backend import backend_started
from meshkit.migrate._inline_body import ELEMENTWISE, Body, RankUnknown, Value
from meshkit.migrate._inline_calls import DEVICES, Shape, call_shapes, exported, mapped_length, pmapped_calls
from meshkit.migrate._inline_exprs import NotInline, dotted_name
from meshkit.migrate._inline_form import Plan


def _in_axes(args: dict[str, cst.Arg], count: int) -> tuple[bool, ...]:
    """Per positional parameter, whether it is mapped; NotInline for axes other than 0 and None."""
    arg = args.get("in_axes")
    value = None if arg is None else arg.value
    if value is None or (isinstance(value, cst.Integer) and value.evaluated_value == 0):
        return (True,) * count
    other = NotInline(
        "in_axes maps an axis other than 0: shard_map's block keeps it where pmap's slice dropped it"
    )
    if not isinstance(value, cst.Tuple | cst.List):
        raise other
    mapped = []
    for e in value.elements:
        if isinstance(e.value, cst.Integer) and e.value.evaluated_value == 0:
            mapped.append(True)
        elif isinstance(e.value, cst.Name) and e.value.value == "None":
            mapped.append(False)
        else:
            raise other
    if len(mapped) != count:
        raise NotInline(f"in_axes has {len(mapped)} entries for {count} parameters")
    return tuple(mapped)


def _mapped_function(
    site: PmapSite, args: dict[str, cst.Arg], ctx: Context
) -> cst.FunctionDef | cst.Lambda | str:
    """What pmap maps: a def or lambda of this module, or the name of an elementwise function (jnp.add)."""
    if site.decorator:
        return site.fn
    fun = args.get("fun")
    value = None if fun is None or site.offset else fun.value
    if isinstance(value, cst.Lambda):
        return value
    if isinstance(value, cst.Name):
        bound = ctx.binding(value)
        found = ctx.def_nodes.get(bound)
        if found is not None and not found.decorators:
            return found
        if isinstance(ctx.assigned.get(bound), cst.Lambda):
            return ctx.assigned[bound]
    if value is not None and dotted_name(ctx, value) in ELEMENTWISE:
        return dotted_name(ctx, value)
    if isinstance(value, cst.Name | cst.Attribute) and dotted_name(ctx, value).startswith(("jax.", "numpy.")):
        raise NotInline(f"pmap maps `{code(value)}`, which the checker does not know to be elementwise")
    raise NotInline(
        "the mapped function is not a lambda or def of this module, so its body cannot be checked"
    )


def _argument_values(
    calls: list[cst.Call], mapped: tuple[bool, ...], ctx: Context
) -> tuple[list[Value], list[tuple[int, set[int | str]]]]:
    """The body's view of each parameter, from every call, and each call's line and mapped lengths."""
    shapes, lengths = call_shapes(calls, mapped, ctx)
    return [_merge(s, m) for s, m in zip(shapes, mapped, strict=True)], lengths


def _merge(shapes: list[Shape], mapped: bool) -> Value:
    """A parameter's value in the body: mapped or not, with the rank and dict keys every call agrees on."""
    ranks = {s.rank for s in shapes}
    rank = ranks.pop() if len(ranks) == 1 else None
    if mapped and rank is not None:
        rank = rank - 1 if rank >= 1 else None
    fields = None
    keys = {None if s.fields is None else tuple(k for k, _ in s.fields) for s in shapes}
    if len(keys) == 1 and (only := keys.pop()) is not None:
        fields = tuple((k, _merge([dict(s.fields)[k] for s in shapes], mapped)) for k in only)
    return Value(mapped, rank, fields=fields)


def plan(site: PmapSite, args: dict[str, cst.Arg], ctx: Context) -> Plan:
    """How to write ``site`` inline; NotInline (its message the reason) where the helper must stay."""
    if "donate_argnums" in args:
        raise NotInline("donate_argnums: the helper donates what pmap donated")
    fn = _mapped_function(site, args, ctx)
    axis_arg = args.get("axis_name")
    axis = None if axis_arg is None else axis_arg.value
    if axis is not None and not isinstance(axis, cst.SimpleString | cst.Name | cst.Attribute):
        raise NotInline("axis_name is neither a string nor a name")
    body = Body(ctx, axis)
    if not isinstance(fn, str):
        mapped = _in_axes(args, len(fn.params.posonly_params) + len(fn.params.params))
        with contextlib.suppress(RankUnknown):  # first without ranks: what the calls cannot settle
            body.function(fn, [Value(m) for m in mapped])
    calls = pmapped_calls(site, ctx)
    if isinstance(fn, str):
        mapped = _in_axes(args, len(calls[0].args))
    if not any(mapped):
        raise NotInline("no argument is mapped")
    values, lengths = _argument_values(calls, mapped, ctx)
    if isinstance(fn, str):  # an elementwise function applied to the arguments
        out = values[0]
        for v in values[1:]:
            out = body.combine(out, v, site.anchor)
    else:
        out = body.function(fn, values)
    if not out.mapped:
        raise NotInline(
            "an output is not computed from the mapped arguments: pmap stacks a copy per device where "
            "shard_map would split it"
        )
    size = mapped_length(lengths)
    index = ctx.index()
    stmt = index.statement(site.anchor)
    if not backend_started(stmt, ctx, index):
        raise NotInline(
            "the mesh would be built before the program first creates an array (at import, or before it "
            "may configure JAX); the helper builds it at the first call"
        )
    bound = ctx.module_names.get("P")
    ours = isinstance(bound, cst.ImportFrom) and "PartitionSpec as P" in code(bound)
    _, _, holder = index.suite(stmt)
    gap = 0
    if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
        gap = 2 if isinstance(holder, cst.Module) else 1
    devices = "all the devices" if size == DEVICES else f"{size} devices"
    seen = " (calls from other modules are not seen)" if exported(site, index) else ""
    return Plan(
        axis=code(axis) if axis is not None else '"i"',
        mapped=None if all(mapped) else mapped,
        devices=size,
        mesh=index.mesh_name(site.anchor),
        spec="P" if ours or "P" not in index.names else "jax.sharding.PartitionSpec",
        statement=stmt,
        gap=gap,
        why=(
            "the body is elementwise in its mapped arguments, so shard_map's block of one row gives pmap's "
            f"slice with its axis kept, and every call in this module maps {devices}{seen}"
        ),
    )
