"""MK015: rewrite ``jax.pmap`` into ``jax.shard_map`` where that provably keeps pmap's results.

Where the module shows that a direct ``jax.shard_map`` computes what pmap did (the body elementwise
in its mapped arguments, every call stating how many rows it maps), the pmap is written inline, in
the modern form: a mesh and ``jax.jit(jax.shard_map(f, mesh=..., in_specs=..., out_specs=...))``
(``_inline``, whose docstring says what it proves). Everywhere else it can be rewritten, the finding
says why not inline, and a pmap is rewritten into ``_pmap_via_shard_map``, a helper the fix adds to
the module once
(``PMAP_HELPER``). It is the program JAX 0.12's own pmap runs (``jax/_src/pmap.py``):
``jax.jit(jax.shard_map(body, check_vma=False))`` over a 1D mesh named after pmap's axis, where
``body`` removes each argument's mapped axis (``lax.squeeze``), calls the function, and puts
the axis back on each output (``lax.expand_dims``). So the body sees exactly what pmap showed
it, collectives reduce the same values, outputs come back stacked on axis 0, and what pmap
allows the helper allows: no replication check (a loop carry that starts as a constant and
becomes per-device), no ``vmap`` (a ``pure_callback`` without ``vmap_method``), the function's
``__name__`` and docstring.

What pmap decided at call time the helper decides at call time too, which an inline rewrite
cannot: the mesh spans the first ``n`` devices, ``n`` the mapped axis's length (pmap allowed
fewer than the device count); it is built at the first call, never at import (a module-level
pmap rewritten inline would start the backend before the program configures devices or calls
``jax.distributed.initialize()``); keyword arguments at call sites are mapped over axis 0, as
pmap mapped them (shard_map itself takes none). Everything else is left as is with a recipe:
multi-host modules (pmap's leading axes are host-local there), nested pmaps, pmap named but not
applied where the module can follow it, pmapped functions whose attributes (``.lower``) are
read, and arguments the helper does not reproduce. A module fixed by an earlier meshkit, whose
helper used ``vmap`` and the replication check, gets the current helper instead.
"""

from __future__ import annotations

import hashlib

import libcst as cst

from meshkit.migrate import _inline
from meshkit.migrate._context import Context, PmapSite, code, drop_keyword, keyword
from meshkit.migrate._model import Hit, rule
from meshkit.migrate.rules_misuse import all_none, site_of

HELPER = "_pmap_via_shard_map"
PMAP_HELPER = f'''

def {HELPER}(fun, axis_name=None, *, in_axes=0, donate_argnums=()):
    """pmap(fun, axis_name, in_axes=..., donate_argnums=...) as JAX 0.12 runs it (added by meshkit migrate).

    The same program as JAX 0.12's pmap: jax.jit of jax.shard_map, without the replication check,
    over a 1D mesh of the first n devices, n the mapped axis's length (built at the first call,
    not at import). The body sees each mapped argument without its mapped axis (keyword arguments
    are mapped over axis 0) and each output comes back stacked on axis 0. Like pmap, it carries
    the function's name and docstring (a partial is named after the function inside).
    """
    import functools

    axis = "_pmap" if axis_name is None else axis_name
    compiled = {{}}

    def spec(a):
        return jax.sharding.PartitionSpec() if a is None else jax.sharding.PartitionSpec(*[None] * a, axis)

    def unmapped(x, a):
        return x if a is None else jax.tree.map(lambda v: jax.lax.squeeze(v, [a]), x)

    def body(axes, args, kwargs):
        out = fun(*map(unmapped, args, axes), **unmapped(kwargs, 0))
        return jax.tree.map(lambda v: jax.lax.expand_dims(v, [0]), out)

    @functools.wraps(fun)
    def mapped(*args, **kwargs):
        axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        if len(axes) != len(args):
            raise ValueError(f"pmapped function: in_axes has {{len(axes)}} entries for {{len(args)}} arguments")
        sizes = {{jax.numpy.shape(leaf)[a] for x, a in zip(args, axes) if a is not None for leaf in jax.tree.leaves(x)}}
        sizes |= {{jax.numpy.shape(leaf)[0] for leaf in jax.tree.leaves(kwargs)}}
        if len(sizes) != 1:
            raise ValueError(f"pmapped function: mapped axes have lengths {{sorted(sizes)}}; they need one length")
        n = sizes.pop()
        if (n, axes) not in compiled:
            mesh = jax.sharding.Mesh(jax.devices()[:n], (axis,))
            specs = (tuple(spec(a) for a in axes), spec(0))
            sharded = jax.shard_map(
                functools.partial(body, axes), mesh=mesh, in_specs=specs, out_specs=spec(0), check_vma=False
            )
            compiled[n, axes] = jax.jit(lambda *a, **k: sharded(a, k), donate_argnums=donate_argnums)
        return compiled[n, axes](*args, **kwargs)

    inner = fun
    while isinstance(inner, functools.partial):
        inner = inner.func
    mapped.__name__ = getattr(fun, "__name__", getattr(inner, "__name__", "<unnamed function>"))
    mapped.__qualname__ = getattr(fun, "__qualname__", mapped.__name__)
    return mapped
'''
# sha256 of the helpers earlier meshkit versions added (text stripped): ``jax.vmap`` inside
# ``jax.shard_map`` with the replication check on, wrong where JAX 0.12's pmap is right.
_EARLIER_HELPERS = frozenset(
    {
        "f1fcfdd99afdd43ec1d66c520efe3818a7f0204c7d02c0c7533fcaa3d00e0b12",
        "25d54047da1208940e4c97079b98db36cb4c7c53ca779bd11fa00e68c69cef1f",
    }
)
_HANDLED = frozenset({"fun", "axis_name", "in_axes", "out_axes", "jit", "donate_argnums"})
_DROPPED = ("jit", "out_axes")
_UNUSED = (("jax", "pmap"), ("jax.api", "pmap"))
_MESSAGE = "pmap is the old way of doing parallel map; use jax.shard_map"
_FIX = (
    f"{HELPER}(f, ...), added to the module: what JAX 0.12's pmap runs, jax.jit(jax.shard_map(f)) over a "
    "1D mesh of the mapped axis's length, built at the first call"
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


def _earlier_helper(node: cst.CSTNode) -> bool:
    """Whether ``node`` is the helper as an earlier meshkit wrote it."""
    if not isinstance(node, cst.FunctionDef) or node.name.value != HELPER:
        return False
    return hashlib.sha256(code(node).strip().encode()).hexdigest() in _EARLIER_HELPERS


def _helper_taken(ctx: Context) -> bool:
    """Whether the module binds the helper's name to something other than the helper (now or earlier)."""
    bound = ctx.module_names.get(HELPER)
    if bound is None or _earlier_helper(bound):
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
    read = ctx.attributes_read(site)
    if read:
        return (
            f"the pmapped function's attributes are used (.{sorted(read)[0]})",
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


def _inline_hit(plan: _inline.Plan, ctx: Context) -> Hit:
    imports = () if ctx.imports_jax else (("jax", None, None),)
    if plan.spec == "P" and ctx.module_names.get("P") is None:
        imports += (("jax.sharding", "PartitionSpec", "P"),)
    return Hit(
        message=_MESSAGE,
        fix=plan.describe(),
        rewrite=plan.write,
        imports=imports,
        unused=_UNUSED,
        before=((plan.statement, plan.mesh_statement(), plan.gap),),
    )


def _upgrade(node: cst.FunctionDef) -> Hit:
    def rewrite(updated: cst.FunctionDef) -> cst.FunctionDef:
        (current,) = cst.parse_module(PMAP_HELPER.strip() + "\n").body
        return current.with_changes(leading_lines=updated.leading_lines)

    return Hit(
        message=f"{HELPER} is an earlier meshkit helper: jax.vmap inside jax.shard_map with the "
        "replication check, which breaks loops with per-device carries and callbacks",
        fix=f"the current {HELPER}, the program JAX 0.12's pmap runs",
        rewrite=rewrite,
    )


@rule("MK015", "pmap -> jax.shard_map", cst.Call, cst.Decorator, cst.Name, cst.Attribute, cst.FunctionDef)
def pmap_to_shard_map(node: cst.CSTNode, ctx: Context) -> Hit | None:
    """Every pmap the helper provably reproduces is rewritten into it; the rest get a recipe."""
    if isinstance(node, cst.FunctionDef):
        return _upgrade(node) if _earlier_helper(node) and ctx.module_names.get(HELPER) is node else None
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
    try:
        return _inline_hit(_inline.plan(site, found[1], ctx), ctx)
    except _inline.NotInline as why:
        reason = str(why)
    imports = () if ctx.imports_jax else (("jax", None, None),)
    return Hit(
        message=_MESSAGE,
        fix=f"{_FIX}; not inline: {reason}",
        rewrite=lambda updated: _rewrite(updated, site.offset),
        imports=imports,
        unused=_UNUSED,
        helpers=(PMAP_HELPER,),
    )
