"""MK015: rewrite ``jax.pmap`` into ``jax.shard_map`` where that provably keeps pmap's results.

A pmap is rewritten into ``_pmap_via_shard_map``, a helper the fix adds to the module once
(``PMAP_HELPER``): ``jax.jit(jax.shard_map(jax.vmap(f), ...))`` over a 1D mesh named after
pmap's axis. Under pmap each device sees ``x[i]`` (the leading axis removed); under shard_map it
sees a block of one that keeps its rank, and ``jax.vmap`` with pmap's own ``in_axes`` maps the
body over that block, so the body sees exactly what pmap showed it, collectives over the mesh
axis reduce the same values, and outputs come back stacked on axis 0 as pmap stacked them.

What pmap decided at call time the helper decides at call time too, which an inline rewrite
cannot: the mesh spans the first ``n`` devices, ``n`` the mapped axis's length (pmap allowed
fewer than the device count); it is built at the first call, never at import (a module-level
pmap rewritten inline would start the backend before the program configures devices or calls
``jax.distributed.initialize()``); keyword arguments at call sites are mapped over axis 0, as
pmap mapped them (shard_map itself takes none). Everything else is left as is with a recipe:
multi-host modules (pmap's leading axes are host-local there), pmap named but not applied where
the module can follow it, and arguments the helper does not reproduce.
"""

from __future__ import annotations

import libcst as cst

from meshkit.migrate._context import Context, PmapSite, code, drop_keyword, keyword
from meshkit.migrate._model import Hit, rule
from meshkit.migrate.rules_misuse import all_none, site_of

HELPER = "_pmap_via_shard_map"
PMAP_HELPER = f'''

def {HELPER}(fun, axis_name=None, *, in_axes=0, donate_argnums=()):
    """What pmap(fun, axis_name, in_axes=...) did, written with jax.shard_map (added by meshkit migrate).

    As under pmap, the body sees one entry of each mapped argument (keyword arguments are
    mapped over axis 0) and the outputs come back stacked on axis 0. The 1D mesh spans the
    first n devices, n the mapped axis's length (pmap allowed fewer than the device count);
    it is built at the first call, not at import, and one compiled function is kept per n.
    """
    axis = "_pmap" if axis_name is None else axis_name
    compiled = {{}}

    def spec(a):
        return jax.sharding.PartitionSpec() if a is None else jax.sharding.PartitionSpec(*[None] * a, axis)

    def mapped(*args, **kwargs):
        axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        sizes = {{jax.numpy.shape(leaf)[a] for x, a in zip(args, axes) if a is not None for leaf in jax.tree.leaves(x)}}
        sizes |= {{jax.numpy.shape(leaf)[0] for leaf in jax.tree.leaves(kwargs)}}
        if len(sizes) != 1:
            raise ValueError(f"pmapped function: mapped axes have lengths {{sorted(sizes)}}; they need one length")
        n = sizes.pop()
        if (n, axes) not in compiled:
            types = (jax.sharding.AxisType.Auto,)
            mesh = jax.make_mesh((n,), (axis,), axis_types=types, devices=jax.devices()[:n])
            body = jax.vmap(lambda a, k: fun(*a, **k), in_axes=(axes, 0))
            specs = (tuple(spec(a) for a in axes), spec(0))
            sharded = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec(0))
            compiled[n, axes] = jax.jit(lambda *a, **k: sharded(a, k), donate_argnums=donate_argnums)
        return compiled[n, axes](*args, **kwargs)

    return mapped
'''
_HANDLED = frozenset({"fun", "axis_name", "in_axes", "out_axes", "jit", "donate_argnums"})
_DROPPED = ("jit", "out_axes")
_UNUSED = (("jax", "pmap"), ("jax.api", "pmap"))
_MESSAGE = "pmap is the old way of doing parallel map; use jax.shard_map"
_FIX = (
    f"{HELPER}(f, ...), added to the module: jax.jit(jax.shard_map(jax.vmap(f))) over a 1D mesh of "
    "the mapped axis's length, built at the first call"
)


def _literal_axes(in_axes: cst.BaseExpression) -> bool:
    """Whether ``in_axes`` is a literal the helper reproduces: a non-negative int, None, or a tuple/list of them."""
    if isinstance(in_axes, cst.Tuple | cst.List):
        return all(
            _literal_axes(e.value) and not isinstance(e.value, cst.Tuple | cst.List) for e in in_axes.elements
        )
    if isinstance(in_axes, cst.Integer):
        return True
    return isinstance(in_axes, cst.Name) and in_axes.value == "None"


def _helper_taken(ctx: Context) -> bool:
    """Whether the module binds the helper's name to something other than the helper."""
    bound = ctx.module_names.get(HELPER)
    if bound is None:
        return False
    return not (isinstance(bound, cst.FunctionDef) and code(bound).strip() == PMAP_HELPER.strip())


def _blocker(site: PmapSite, args: dict[str, cst.Arg], ctx: Context) -> tuple[str, str] | None:
    """Why the rewrite would not provably keep behaviour, and the recipe to do it by hand; None when it would."""
    out_axes = args.get("out_axes")
    in_axes = args.get("in_axes")
    extra = sorted(set(args) - _HANDLED)
    if ctx.multihost is not None:
        name, line = ctx.multihost
        return (
            f"multi-host code ({name} at line {line}): pmap's leading axes are host-local there",
            "build global arrays with jax.make_array_from_process_local_data over a mesh of every "
            "process's devices and map with jax.shard_map; test under several processes",
        )
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
        return f"pmap argument {extra[0]}=", "the devices come from the mesh: jax.make_mesh(..., devices=...)"
    if in_axes is not None and all_none(in_axes.value):
        return "every in_axes is None", "replicate instead (see MK013)"
    if in_axes is not None and not _literal_axes(in_axes.value):
        return (
            "in_axes not a literal of non-negative ints and Nones",
            "in_specs=P(axis) per mapped input, P() per broadcast one",
        )
    if site.name in ctx.attribute_bases or id(site.anchor) in ctx.attribute_calls:
        return (
            "the pmapped function's attributes are used (.lower, ...)",
            "rewrite by hand with jax.jit(jax.shard_map(...)), whose .lower/.trace you can then use",
        )
    if _helper_taken(ctx):
        return f"the module already binds {HELPER}", f"rename the module's {HELPER}, then rewrite"
    if not ctx.imports_jax and "jax" in ctx.module_names:
        return "the module binds jax to something else", "import jax as jax at top level, then rewrite"
    return None


def _apply(call: cst.Call, offset: int) -> cst.Call:
    """``call`` with the pmap it applies replaced by the helper and the arguments it drops removed."""
    helper = cst.Name(HELPER)
    if offset:
        first = call.args[0]
        call = call.with_changes(args=[first.with_changes(value=helper), *call.args[1:]])
    else:
        call = call.with_changes(func=helper)
    for name in _DROPPED:
        if keyword(call, name) is not None:
            call = drop_keyword(call, name)
    return call


def _rewrite(updated: cst.Call | cst.Decorator, offset: int) -> cst.CSTNode:
    if isinstance(updated, cst.Call):
        return _apply(updated, offset)
    if isinstance(updated.decorator, cst.Call):
        return updated.with_changes(decorator=_apply(updated.decorator, 1))
    return updated.with_changes(decorator=cst.Name(HELPER))


@rule("MK015", "pmap -> jax.shard_map", cst.Call, cst.Decorator, cst.Name, cst.Attribute)
def pmap_to_shard_map(node: cst.CSTNode, ctx: Context) -> Hit | None:
    """Every pmap the helper provably reproduces is rewritten into it; the rest get a recipe."""
    if node in ctx.pmap_refs:
        return Hit(
            message=f"{_MESSAGE}; not rewritten: pmap is named here but not applied, so its uses "
            "cannot be followed",
            fix="apply jax.pmap(f, ...) where the function is mapped, then rewrite",
        )
    if not isinstance(node, cst.Call | cst.Decorator):
        return None
    site = ctx.sites.get(node)
    if site is None:
        return None
    found = site_of(node, ctx)
    if found is None:
        return Hit(
            message=f"{_MESSAGE}; not rewritten: pmap's arguments are passed with * or **",
            fix="pass pmap's arguments by name, then rewrite",
        )
    blocker = _blocker(site, found[1], ctx)
    if blocker is not None:
        reason, recipe = blocker
        return Hit(message=f"{_MESSAGE}; not rewritten: {reason}", fix=recipe)
    imports = () if ctx.imports_jax else (("jax", None, None),)
    return Hit(
        message=_MESSAGE,
        fix=_FIX,
        rewrite=lambda updated: _rewrite(updated, site.offset),
        imports=imports,
        unused=_UNUSED,
        helpers=(PMAP_HELPER,),
    )
