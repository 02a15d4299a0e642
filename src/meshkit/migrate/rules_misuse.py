"""Rules for legacy patterns that fail or mislead under JAX 0.12 (MK008-MK014)."""

from __future__ import annotations

import libcst as cst

from meshkit.migrate._context import Context, PmapSite, code, drop_keyword, keyword
from meshkit.migrate._model import Hit, rule

_SHAPED = frozenset(f"jax.numpy.{n}" for n in ("ones", "zeros", "empty", "full"))
_NEEDS_AXIS = frozenset(
    f"jax.lax.{n}" for n in ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter")
)
_PARAM_NAMES = frozenset({"params", "p", "state", "weights"})
_DEFAULT_DEVICE = frozenset({"jax.devices", "jax.local_devices"})


def site_of(node: cst.CSTNode, ctx: Context) -> tuple[PmapSite, dict[str, cst.Arg]] | None:
    """The pmap site anchored at ``node`` and its arguments by name, if pmap is applied there."""
    site = ctx.sites.get(node)
    args = None if site is None else site.arguments()
    return None if args is None else (site, args)


def _is_default_device(expr: cst.BaseExpression, ctx: Context) -> bool:
    """``jax.devices()[0]`` or ``jax.local_devices()[0]``: where jit puts work anyway."""
    if not (isinstance(expr, cst.Subscript) and isinstance(expr.value, cst.Call) and not expr.value.args):
        return False
    index = expr.slice[0].slice if len(expr.slice) == 1 else None
    return (
        ctx.qname(expr.value.func) in _DEFAULT_DEVICE
        and isinstance(index, cst.Index)
        and isinstance(index.value, cst.Integer)
        and index.value.evaluated_value == 0
    )


@rule("MK008", "jax.jit(device=...) deprecated", cst.Call)
def jit_device(node: cst.Call, ctx: Context) -> Hit | None:
    """jit's ``device=`` is deprecated: put the inputs on the device and the computation follows."""
    arg = keyword(node, "device")
    if ctx.callee(node)[0] != "jax.jit" or arg is None:
        return None
    message = "jax.jit(device=...) is deprecated"
    recipe = "device_put the inputs instead; computation follows data"
    if not _is_default_device(arg.value, ctx):
        return Hit(message=message, fix=recipe)
    return Hit(
        message=message,
        fix=f"drop device= ({code(arg.value)} is the default device); {recipe}",
        rewrite=lambda updated: drop_keyword(updated, "device"),
    )


@rule("MK009", "pmap has no jit argument", cst.Call, cst.Decorator)
def pmap_jit(node: cst.Call | cst.Decorator, ctx: Context) -> Hit | None:
    """``pmap(..., jit=True)`` raises TypeError: pmap always compiles."""
    found = site_of(node, ctx)
    if found is None or "jit" not in found[1]:
        return None

    def rewrite(updated: cst.Call | cst.Decorator) -> cst.CSTNode:
        if isinstance(updated, cst.Decorator):
            return updated.with_changes(decorator=drop_keyword(updated.decorator, "jit"))
        return drop_keyword(updated, "jit")

    return Hit(message="pmap has no jit argument (TypeError)", fix="remove jit=", rewrite=rewrite)


def _float_shape(expr: cst.BaseExpression) -> list[cst.Float]:
    items = [e.value for e in expr.elements] if isinstance(expr, cst.Tuple | cst.List) else [expr]
    return [e for e in items if isinstance(e, cst.Float)]


@rule("MK010", "float shape", cst.Call)
def float_shape(node: cst.Call, ctx: Context) -> Hit | None:
    """``jnp.ones(16.)`` raises TypeError: shapes are ints (fixed when every float is a whole number)."""
    if ctx.qname(node.func) not in _SHAPED:
        return None
    arg = keyword(node, "shape") or next((a for a in node.args if a.keyword is None), None)
    floats = [] if arg is None else _float_shape(arg.value)
    if not floats:
        return None
    message = f"float in shape {code(arg.value)} (TypeError)"
    if not all(float(f.evaluated_value).is_integer() for f in floats):
        return Hit(message=message, fix="shapes are ints: choose the int size")
    index = node.args.index(arg)

    def rewrite(updated: cst.Call) -> cst.Call:
        shape = updated.args[index]

        class _Ints(cst.CSTTransformer):
            def leave_Float(self, original: cst.Float, new: cst.Float) -> cst.BaseExpression:
                return cst.Integer(str(int(float(new.evaluated_value))), lpar=new.lpar, rpar=new.rpar)

        args = list(updated.args)
        args[index] = shape.with_changes(value=shape.value.visit(_Ints()))
        return updated.with_changes(args=args)

    return Hit(message=message, fix="int literal", rewrite=rewrite)


@rule("MK011", "collective without axis name", cst.Call)
def collective_axis(node: cst.Call, ctx: Context) -> Hit | None:
    """``lax.psum(x)`` raises TypeError: a collective needs the axis it reduces over."""
    name = ctx.qname(node.func)
    if name not in _NEEDS_AXIS or keyword(node, "axis_name") is not None:
        return None
    if len(node.args) != 1 or node.args[0].star:
        return None
    short = name.removeprefix("jax.lax.")
    return Hit(
        message=f"{short} without an axis name (TypeError)",
        fix=f'name the mapped axis: {short}(x, "i") with pmap(axis_name="i") or a mesh axis "i"',
    )


@rule("MK012", "params not broadcast to pmap", cst.Call, cst.Decorator)
def pmap_params(node: cst.Call | cst.Decorator, ctx: Context) -> Hit | None:
    """Heuristic: pmap maps every argument over axis 0, so a first argument named params is split, not shared.

    Silent where the module gives arrays a device axis first (``jax_utils.replicate``,
    ``jax.device_put_replicated``, ``broadcast_to``, ``[x] * n``) or where another pmap may have made
    the params (an init pmap returns one copy per device): in_axes=0 then hands each device its copy.
    """
    found = site_of(node, ctx)
    if found is None or "in_axes" in found[1] or found[0].fn is None or ctx.replicates:
        return None
    if len(ctx.sites) > 1:
        return None
    params = found[0].fn.params.params
    if not params or params[0].name.value not in _PARAM_NAMES:
        return None
    axes = ", ".join(["None"] + ["0"] * (len(params) - 1)) + ("," if len(params) == 1 else "")
    return Hit(
        message=f"pmap splits {params[0].name.value!r} over devices (in_axes defaults to 0)",
        fix=f"in_axes=({axes}) to broadcast it, or replicate with NamedSharding(mesh, P())",
    )


def all_none(in_axes: cst.BaseExpression) -> bool:
    """Whether a literal in_axes maps nothing (None, or a tuple/list of Nones)."""
    if isinstance(in_axes, cst.Tuple | cst.List):
        return bool(in_axes.elements) and all(all_none(e.value) for e in in_axes.elements)
    return isinstance(in_axes, cst.Name) and in_axes.value == "None"


@rule("MK013", "pmap(in_axes=None) to replicate", cst.Call, cst.Decorator)
def pmap_replicate(node: cst.Call | cst.Decorator, ctx: Context) -> Hit | None:
    """pmap with every in_axes None raises ValueError: there is nothing to map over."""
    found = site_of(node, ctx)
    arg = None if found is None else found[1].get("in_axes")
    if arg is None or not all_none(arg.value):
        return None
    return Hit(
        message="pmap with every in_axes None maps nothing (ValueError)",
        fix="replicate with jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), params) "
        "or jax.device_put(params, NamedSharding(mesh, P()))",
    )


@rule("MK014", "nested pmap", cst.Call, cst.Decorator)
def nested_pmap(node: cst.Call | cst.Decorator, ctx: Context) -> Hit | None:
    """A pmap inside a pmap raises ValueError in JAX 0.12: a pmapped function called inside
    another pmapped function, or pmap applied to what is pmapped already (stacked decorators)."""
    fix = "one 2D mesh, jax.make_mesh((a, b), ('x', 'y')), and one jax.shard_map over both axes"
    mapped = ctx.stacked.get(node)
    if mapped is not None:
        return Hit(message=f"pmap applied to {mapped} (nested pmap: ValueError)", fix=fix)
    outer = ctx.nested.get(node) if isinstance(node, cst.Call) else None
    if outer is None:
        return None
    return Hit(
        message=f"pmapped {code(node.func)} called inside pmapped {outer.name or 'function'} (ValueError)",
        fix=fix,
    )
