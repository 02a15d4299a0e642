"""Rules for APIs JAX removed or renamed (MK001-MK007)."""

from __future__ import annotations

import libcst as cst

from meshkit.migrate._context import Context, code, keyword
from meshkit.migrate._model import Hit, rule

_TREE = {
    f"tree_{n}": n
    for n in ("map", "leaves", "flatten", "unflatten", "structure", "transpose", "reduce", "all")
}
_DEVICE_ARRAY = ("jax.numpy", "jax.interpreters.xla", "jax.xla")
_SHARD_MAP = "jax.experimental.shard_map.shard_map"
_SHARD_MAP_POSITIONAL = ("mesh", "in_specs", "out_specs", "check_vma")


def _relative(chain: str):
    """A rewrite replacing the last attribute of ``a.b.old`` by ``chain`` (``a.b.tree.map``)."""

    def rewrite(node: cst.Attribute) -> cst.Attribute:
        value: cst.BaseExpression = node.value
        *inner, last = chain.split(".")
        for part in inner:
            value = cst.Attribute(value=value, attr=cst.Name(part))
        return node.with_changes(value=value, attr=cst.Name(last))

    return rewrite


def _absolute(expr: str):
    """A rewrite replacing the whole expression by ``expr``, keeping its parentheses."""
    return lambda node: cst.parse_expression(expr).with_changes(lpar=node.lpar, rpar=node.rpar)


def _import_text(module: str, name: str, local: str) -> str:
    return f"from {module} import {name}" + ("" if name == local else f" as {local}")


def _from_import(
    node: cst.ImportFrom, module: str, renames: dict[str, tuple[str, str]], message: str
) -> Hit | None:
    """``from module import old [as x]`` -> ``from new_module import new as old_or_x``.

    Fixed only when every imported name moves to the same module; otherwise a finding to fix by hand.
    """
    if (
        node.relative
        or node.module is None
        or code(node.module) != module
        or isinstance(node.names, cst.ImportStar)
    ):
        return None
    moved = [a for a in node.names if code(a.name) in renames]
    if not moved:
        return None
    targets = {renames[code(a.name)][0] for a in moved}
    fix = ", ".join(
        f"from {renames[code(a.name)][0]} import {renames[code(a.name)][1]} as {code(a.name)}" for a in moved
    )
    if len(moved) != len(node.names) or len(targets) > 1:
        return Hit(message=message, fix=f"split the import: {fix}")

    def rewrite(updated: cst.ImportFrom) -> cst.ImportFrom:
        names = []
        for a in updated.names:
            local = a.asname.name.value if a.asname else code(a.name)
            new = renames[code(a.name)][1]
            asname = None if new == local else cst.AsName(name=cst.Name(local))
            names.append(a.with_changes(name=cst.Name(new), asname=asname))
        return updated.with_changes(module=cst.parse_expression(next(iter(targets))), names=names)

    return Hit(message=message, fix=fix, rewrite=rewrite)


@rule("MK001", "jax.tree_* aliases removed", cst.Attribute, cst.ImportFrom)
def tree_aliases(node: cst.Attribute | cst.ImportFrom, ctx: Context) -> Hit | None:
    """``jax.tree_map`` and friends raise AttributeError: use ``jax.tree.map`` (jax.tree_util stays valid)."""
    if isinstance(node, cst.ImportFrom):
        renames = {old: ("jax.tree", new) for old, new in _TREE.items()}
        return _from_import(node, "jax", renames, "jax.tree_* aliases were removed (AttributeError)")
    name = ctx.qname(node) or ""
    old = name.removeprefix("jax.")
    if old not in _TREE or node.attr.value != old:
        return None
    new = f"tree.{_TREE[old]}"
    return Hit(message=f"{name} was removed (AttributeError)", fix=f"jax.{new}", rewrite=_relative(new))


@rule("MK002", "jax.random.PRNGKey is legacy", cst.Attribute, cst.ImportFrom)
def prng_key(node: cst.Attribute | cst.ImportFrom, ctx: Context) -> Hit | None:
    """Raw uint32 keys are legacy: ``jax.random.key`` makes a typed key with the same random bits."""
    message = "jax.random.PRNGKey makes a legacy raw uint32 key"
    if isinstance(node, cst.ImportFrom):
        return _from_import(node, "jax.random", {"PRNGKey": ("jax.random", "key")}, message)
    if ctx.qname(node) != "jax.random.PRNGKey" or node.attr.value != "PRNGKey":
        return None
    return Hit(message=message, fix="jax.random.key (typed key, same bits)", rewrite=_relative("key"))


@rule("MK003", "x.device() is an attribute", cst.Call)
def device_call(node: cst.Call, ctx: Context) -> Hit | None:
    """``x.device`` is a property of jax.Array: calling it raises TypeError (``self.device()`` is skipped)."""
    func = node.func
    if node.args or not isinstance(func, cst.Attribute) or func.attr.value != "device":
        return None
    if isinstance(func.value, cst.Name) and func.value.value in ("self", "cls"):
        return None
    return Hit(
        message="x.device is an attribute; x.device() raises TypeError",
        fix=code(func),
        rewrite=lambda updated: updated.func.with_changes(lpar=updated.lpar, rpar=updated.rpar),
    )


@rule("MK004", "jax.experimental.maps removed", cst.Import, cst.ImportFrom)
def experimental_maps(node: cst.Import | cst.ImportFrom, ctx: Context) -> Hit | None:
    """``jax.experimental.maps`` (Mesh, xmap) is gone: build meshes with jax.make_mesh, map with jax.shard_map."""
    if isinstance(node, cst.Import):
        found = any(code(a.name).startswith("jax.experimental.maps") for a in node.names)
    elif node.module is None or node.relative:
        found = False
    else:
        module = code(node.module)
        names = () if isinstance(node.names, cst.ImportStar) else [code(a.name) for a in node.names]
        found = module.startswith("jax.experimental.maps") or (
            module == "jax.experimental" and "maps" in names
        )
    if not found:
        return None
    return Hit(
        message="jax.experimental.maps was removed (ModuleNotFoundError)",
        fix="use jax.make_mesh / jax.sharding.Mesh for meshes and jax.shard_map instead of xmap",
    )


@rule("MK005", "jax.experimental.shard_map deprecated", cst.Attribute, cst.ImportFrom, cst.Call)
def experimental_shard_map(node: cst.Attribute | cst.ImportFrom | cst.Call, ctx: Context) -> Hit | None:
    """``jax.experimental.shard_map.shard_map`` -> ``jax.shard_map`` (mesh and specs by keyword, check_vma)."""
    message = "jax.experimental.shard_map is deprecated"
    if isinstance(node, cst.ImportFrom):
        return _from_import(node, "jax.experimental.shard_map", {"shard_map": ("jax", "shard_map")}, message)
    if isinstance(node, cst.Attribute):
        if ctx.qname(node) != _SHARD_MAP:
            return None
        rewrite = _absolute("jax.shard_map")
        unused = (("jax.experimental", "shard_map"),)
        return Hit(
            message=message,
            fix="jax.shard_map",
            rewrite=rewrite,
            imports=(("jax", None, None),),
            unused=unused,
        )
    return _shard_map_keywords(node, ctx)


def _shard_map_keywords(node: cst.Call, ctx: Context) -> Hit | None:
    """The old shard_map took mesh and specs by position and ``check_rep``; jax.shard_map takes keywords."""
    if ctx.qname(node.func) != _SHARD_MAP:
        return None
    if any(a.star for a in node.args) or any(a.keyword and a.keyword.value == "auto" for a in node.args):
        return Hit(
            message="jax.shard_map takes mesh, in_specs, out_specs by keyword",
            fix="pass them by keyword; auto= becomes axis_names= (the manual axes)",
        )
    positional = [a for a in node.args[1:] if a.keyword is None]
    if not positional and keyword(node, "check_rep") is None:
        return None

    def rewrite(updated: cst.Call) -> cst.Call:
        args = [updated.args[0]]
        for i, a in enumerate(updated.args[1:]):
            name = _SHARD_MAP_POSITIONAL[i] if a.keyword is None else a.keyword.value
            name = "check_vma" if name == "check_rep" else name
            args.append(
                a.with_changes(
                    keyword=cst.Name(name),
                    equal=cst.AssignEqual(
                        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                    ),
                )
            )
        return updated.with_changes(args=args)  # fmt: skip

    return Hit(
        message="jax.shard_map takes mesh, in_specs, out_specs by keyword and check_vma, not check_rep",
        fix="mesh=, in_specs=, out_specs=, check_vma= keywords",
        rewrite=rewrite,
    )


@rule("MK006", "jax_cpu_device_count is not a config option", cst.SimpleString)
def cpu_device_count(node: cst.SimpleString, ctx: Context) -> Hit | None:
    """The option is ``jax_num_cpu_devices`` (set before the backend starts)."""
    if node.evaluated_value != "jax_cpu_device_count":
        return None
    return Hit(
        message="jax_cpu_device_count is not a config option (AttributeError)",
        fix="jax_num_cpu_devices, set before the backend starts",
        rewrite=lambda s: s.with_changes(
            value=s.value.replace("jax_cpu_device_count", "jax_num_cpu_devices")
        ),
    )


@rule("MK007", "DeviceArray removed", cst.Attribute, cst.ImportFrom)
def device_array(node: cst.Attribute | cst.ImportFrom, ctx: Context) -> Hit | None:
    """``DeviceArray`` is gone: every array is a ``jax.Array``."""
    message = "DeviceArray was removed"
    if isinstance(node, cst.ImportFrom):
        renames = {"DeviceArray": ("jax", "Array")}
        return next(filter(None, (_from_import(node, m, renames, message) for m in _DEVICE_ARRAY)), None)
    if ctx.qname(node) not in {f"{m}.DeviceArray" for m in _DEVICE_ARRAY}:
        return None
    return Hit(
        message=message, fix="jax.Array", rewrite=_absolute("jax.Array"), imports=(("jax", None, None),)
    )
