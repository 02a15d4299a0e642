"""MK015: rewrite ``jax.pmap`` into ``jax.jit(jax.shard_map(jax.vmap(f), ...))`` over a 1D mesh.

Under pmap each device sees ``x[i]`` (the leading axis removed); under shard_map it sees a block
that keeps its rank (shape ``(1, ...)``). ``jax.vmap`` with pmap's own ``in_axes`` maps the body
over that block of one, so the body sees exactly what pmap showed it, collectives over the mesh
axis reduce the same values, and the outputs come back stacked along axis 0 as pmap stacked them.
The rewrite is made only when it is mechanical; otherwise the finding carries a recipe.
"""

from __future__ import annotations

import libcst as cst

from meshkit.migrate._context import Context, PmapSite, code, pmap_arguments
from meshkit.migrate._model import Hit, rule
from meshkit.migrate.rules_misuse import all_none, pmap_params, site_of

_DEFAULT_AXIS = '"i"'
_MESH = "jax.make_mesh((jax.device_count(),), ({axis},), axis_types=(jax.sharding.AxisType.Auto,))"
_HANDLED = frozenset({"fun", "axis_name", "in_axes", "out_axes", "jit"})
_IMPORTS = (("jax", None, None), ("jax.sharding", "PartitionSpec", "P"))
_UNUSED = (("jax", "pmap"), ("functools", "partial"))
_MESSAGE = "pmap is the old way of doing parallel map; use jax.shard_map"


def in_specs(in_axes: cst.BaseExpression, axis: str) -> str | None:
    """The shard_map in_specs for a literal pmap in_axes: ``k`` -> ``P(None * k, axis)``, None -> ``P()``."""
    if isinstance(in_axes, cst.Integer) and in_axes.evaluated_value >= 0:
        return "P(" + "None, " * in_axes.evaluated_value + f"{axis})"
    if isinstance(in_axes, cst.Name) and in_axes.value == "None":
        return "P()"
    if not isinstance(in_axes, cst.Tuple | cst.List):
        return None
    specs = [in_specs(e.value, axis) for e in in_axes.elements]
    if None in specs:
        return None
    body = ", ".join(specs) + ("," if len(specs) == 1 and isinstance(in_axes, cst.Tuple) else "")
    return f"({body})" if isinstance(in_axes, cst.Tuple) else f"[{body}]"


def _blocker(site: PmapSite, args: dict[str, cst.Arg], ctx: Context) -> tuple[str, str] | None:
    """Why the rewrite would not be mechanical, and the recipe to do it by hand; None when it is."""
    out_axes = args.get("out_axes")
    in_axes = args.get("in_axes")
    extra = sorted(set(args) - _HANDLED)
    if ctx.is_nested(site):
        return (
            "nested pmap",
            "one 2D mesh jax.make_mesh((a, b), ('x', 'y')) and one jax.shard_map over both axes",
        )
    if "static_broadcasted_argnums" in extra:
        return (
            "static_broadcasted_argnums",
            "close over the static arguments with functools.partial, then rewrite",
        )
    if out_axes is not None and not (
        isinstance(out_axes.value, cst.Integer) and out_axes.value.evaluated_value == 0
    ):
        return "out_axes != 0", "out_specs=P(None, axis) for out_axes=1, with vmap(out_axes=1) in the body"
    if "axis_name" not in args and site.fn is not None and ctx.uses_collectives(site.fn):
        return (
            "collectives but no axis_name",
            "give pmap axis_name= and use it in the collectives, then rewrite",
        )
    if extra:
        return f"pmap argument {extra[0]}=", "jax.jit takes donate_argnums; the devices come from the mesh"
    if in_axes is not None and all_none(in_axes.value):
        return "every in_axes is None", "replicate instead (see MK013)"
    if in_axes is not None and in_specs(in_axes.value, "a") is None:
        return (
            "in_axes not a literal of 0s and Nones",
            "in_specs=P(axis) per mapped input, P() per broadcast one",
        )
    if not site.decorator and (site.offset != 0 or "fun" not in args):
        return "pmap applied through partial", "apply jax.pmap(f, ...) directly, then rewrite"
    if pmap_params(site.anchor, ctx) is not None:
        return "params mapped by default", "decide in_axes first (see MK012), then rewrite"
    return None


def _parts(args: dict[str, cst.Arg]) -> tuple[str, str, str]:
    """The mesh axis name, the shard_map in_specs, and the vmap ``in_axes=`` keyword (or "")."""
    axis = code(args["axis_name"].value) if "axis_name" in args else _DEFAULT_AXIS
    in_axes = args.get("in_axes")
    specs = f"P({axis})" if in_axes is None else in_specs(in_axes.value, axis)
    return axis, specs, "" if in_axes is None else f", in_axes={code(in_axes.value)}"


def _shard_map_keywords(axis: str, specs: str) -> str:
    return f"mesh={_MESH.format(axis=axis)}, in_specs={specs}, out_specs=P({axis})"


def _rewrite_call(updated: cst.Call) -> cst.BaseExpression:
    args = pmap_arguments(updated, 0) or {}
    axis, specs, vmap = _parts(args)
    fun = code(args["fun"].value)
    expr = cst.parse_expression(
        f"jax.jit(jax.shard_map(jax.vmap({fun}{vmap}), {_shard_map_keywords(axis, specs)}))"
    )
    return expr.with_changes(lpar=updated.lpar, rpar=updated.rpar)


def _rewrite_decorator(updated: cst.Decorator) -> cst.FlattenSentinel[cst.Decorator]:
    call = updated.decorator if isinstance(updated.decorator, cst.Call) else None
    args = {} if call is None else pmap_arguments(call, 1) or {}
    axis, specs, vmap = _parts(args)
    vmap_line = f"@{code(call.func)}(jax.vmap{vmap})" if vmap else "@jax.vmap"
    shard = _shard_map_keywords(axis, specs)
    stub = cst.parse_statement(f"@jax.jit\n@jax.shard_map({shard})\n{vmap_line}\ndef _(): pass\n")
    first, middle, last = stub.decorators
    return cst.FlattenSentinel(
        [
            first.with_changes(leading_lines=updated.leading_lines),
            middle,
            last.with_changes(trailing_whitespace=updated.trailing_whitespace),
        ]
    )


@rule("MK015", "pmap -> jax.shard_map", cst.Call, cst.Decorator)
def pmap_to_shard_map(node: cst.Call | cst.Decorator, ctx: Context) -> Hit | None:
    """Every pmap becomes jit(shard_map(vmap(f))) over a 1D mesh when that is mechanical."""
    found = site_of(node, ctx)
    if found is None:
        return None
    site, args = found
    blocker = _blocker(site, args, ctx)
    if blocker is not None:
        reason, recipe = blocker
        return Hit(message=f"{_MESSAGE}; not rewritten: {reason}", fix=recipe)
    axis, specs, vmap = _parts(args)
    fix = f"jax.jit(jax.shard_map(jax.vmap(f{vmap}), mesh=<1D mesh {axis}>, in_specs={specs}, out_specs=P({axis})))"
    rewrite = _rewrite_decorator if site.decorator else _rewrite_call
    return Hit(message=_MESSAGE, fix=fix, rewrite=rewrite, imports=_IMPORTS, unused=_UNUSED)
