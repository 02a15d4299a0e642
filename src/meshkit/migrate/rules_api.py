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
    """Raw uint32 keys are legacy: ``jax.random.key`` makes a typed key with the same random bits.

    Fixed only where the key is used solely through jax.random calls (see ``_keys``).
    """
    message = "jax.random.PRNGKey makes a legacy raw uint32 key"
    recipe = (
        "jax.random.key where the key only feeds jax.random calls; where it is converted, indexed "
        "or passed on, keep PRNGKey or convert there with jax.random.key_data(key)"
    )
    if isinstance(node, cst.ImportFrom):
        found = _from_import(node, "jax.random", {"PRNGKey": ("jax.random", "key")}, message)
        if found is None or ctx.all_keys_safe:
            return found
        return Hit(message=f"{message}; not fixed: a key is used outside jax.random calls", fix=recipe)
    if ctx.qname(node) != "jax.random.PRNGKey" or node.attr.value != "PRNGKey":
        return None
    if not any(c.func is node for c in ctx.safe_keys):
        return Hit(message=f"{message}; not fixed: the key is used outside jax.random calls", fix=recipe)
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


@rule("MK004", "jax.experimental.maps removed", cst.Import, cst.ImportFrom, cst.Attribute)
def experimental_maps(node: cst.Import | cst.ImportFrom | cst.Attribute, ctx: Context) -> Hit | None:
    """``jax.experimental.maps`` (Mesh, xmap) is gone: build meshes with jax.make_mesh, map with jax.shard_map."""
    if isinstance(node, cst.Attribute):
        found = ctx.qname(node) == "jax.experimental.maps" and node.attr.value == "maps"
    elif isinstance(node, cst.Import):
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
        return updated.with_changes(args=args)

    return Hit(
        message="jax.shard_map takes mesh, in_specs, out_specs by keyword and check_vma, not check_rep",
        fix="mesh=, in_specs=, out_specs=, check_vma= keywords",
        rewrite=rewrite,
    )


@rule("MK006", "jax_cpu_device_count is not a config option", cst.SimpleString)
def cpu_device_count(node: cst.SimpleString, ctx: Context) -> Hit | None:
    """The option is ``jax_num_cpu_devices`` (set before the backend starts)."""
    if "jax_cpu_device_count" not in node.value or node.value.strip("\"'") != "jax_cpu_device_count":
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


@rule("MK016", "tree_multimap removed", cst.Attribute, cst.ImportFrom)
def tree_multimap(node: cst.Attribute | cst.ImportFrom, ctx: Context) -> Hit | None:
    """``tree_multimap(f, t, *rest)`` was ``tree_map(f, t, *rest)`` before it was removed (AttributeError)."""
    message = "tree_multimap was removed (AttributeError); tree_map takes several trees"
    if isinstance(node, cst.ImportFrom):
        renames = {"tree_multimap": ("jax.tree_util", "tree_map")}
        return _from_import(node, "jax.tree_util", renames, message) or _from_import(
            node, "jax", {"tree_multimap": ("jax.tree", "map")}, message
        )
    name = ctx.qname(node)
    if name not in ("jax.tree_multimap", "jax.tree_util.tree_multimap") or node.attr.value != "tree_multimap":
        return None
    if code(node) in ("jax.tree_multimap", "jax.tree_util.tree_multimap"):
        return Hit(message=message, fix="jax.tree.map", rewrite=_absolute("jax.tree.map"))
    # tree_util.tree_multimap with tree_util imported under its own name: keep the module's alias.
    return Hit(message=message, fix="tree_map", rewrite=_relative("tree_map"))


_PARTITION_SPEC = ("jax.experimental", "jax.experimental.pjit", "jax.interpreters.pxla")


@rule("MK017", "PartitionSpec moved to jax.sharding", cst.Attribute, cst.ImportFrom)
def partition_spec(node: cst.Attribute | cst.ImportFrom, ctx: Context) -> Hit | None:
    """``jax.experimental.PartitionSpec`` (and pjit's, pxla's) is gone: ``jax.sharding.PartitionSpec``."""
    message = "PartitionSpec moved to jax.sharding (ImportError)"
    if isinstance(node, cst.ImportFrom):
        renames = {"PartitionSpec": ("jax.sharding", "PartitionSpec")}
        return next(filter(None, (_from_import(node, m, renames, message) for m in _PARTITION_SPEC)), None)
    if ctx.qname(node) not in {f"{m}.PartitionSpec" for m in _PARTITION_SPEC}:
        return None
    return Hit(
        message=message,
        fix="jax.sharding.PartitionSpec",
        rewrite=_absolute("jax.sharding.PartitionSpec"),
        imports=(("jax", None, None),),
    )


@rule("MK018", "jax.experimental.pjit removed", cst.Import, cst.ImportFrom, cst.Attribute)
def experimental_pjit(node: cst.Import | cst.ImportFrom | cst.Attribute, ctx: Context) -> Hit | None:
    """``jax.experimental.pjit`` keeps only a deprecated ``pjit`` alias of ``jax.jit``; the rest is gone.

    Not fixed: pjit's ``in_axis_resources`` (TypeError under jax.jit) were specs resolved against the
    mesh of a ``with mesh:`` block, and jax.jit needs NamedShardings (or ``jax.set_mesh``) instead;
    ``with_sharding_constraint`` and the other names raise ImportError.
    """
    message = (
        "jax.experimental.pjit is gone: pjit is a deprecated alias of jax.jit, the rest raises ImportError"
    )
    recipe = (
        "jax.jit(f, in_shardings=NamedSharding(mesh, spec), out_shardings=...) for "
        "pjit(f, in_axis_resources=spec, out_axis_resources=...); "
        "with_sharding_constraint is jax.lax.with_sharding_constraint"
    )
    if isinstance(node, cst.ImportFrom):
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return None
        module = code(node.module)
        names = {code(a.name) for a in node.names}
        if module == "jax.experimental.pjit" and names - {"PartitionSpec"}:
            return Hit(message=message, fix=recipe)
        if module == "jax.experimental" and "pjit" in names:
            return Hit(message=message, fix=recipe)
        return None
    if isinstance(node, cst.Attribute):
        if ctx.qname(node) not in (
            "jax.experimental.pjit.pjit",
            "jax.experimental.pjit.with_sharding_constraint",
        ):
            return None
        return Hit(message=message, fix=recipe)
    return None


@rule("MK019", "jax.random.shuffle removed", cst.Call)
def random_shuffle(node: cst.Call, ctx: Context) -> Hit | None:
    """``shuffle(key, x, axis)`` was ``permutation(key, x, axis, independent=True)`` (same ``_shuffle``)."""
    if ctx.qname(node.func) != "jax.random.shuffle" or not isinstance(node.func, cst.Attribute):
        return None
    message = "jax.random.shuffle was removed (AttributeError)"
    fix = "jax.random.permutation(key, x, axis, independent=True): shuffle shuffled each slice along axis"
    if any(a.star for a in node.args) or keyword(node, "independent") is not None or len(node.args) < 2:
        return Hit(message=message, fix=fix)
    x = keyword(node, "x") or node.args[1]
    if isinstance(x.value, cst.Integer | cst.UnaryOperation):
        # permutation(key, n) permutes range(n); shuffle(key, n) did not.
        return Hit(message=message, fix=fix)

    def rewrite(updated: cst.Call) -> cst.Call:
        flag = cst.Arg(
            keyword=cst.Name("independent"),
            value=cst.Name("True"),
            equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
            ),
        )
        args = list(updated.args)
        if args[-1].comma is cst.MaybeSentinel.DEFAULT:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        else:
            flag = flag.with_changes(comma=args[-1].comma)
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        func = updated.func.with_changes(attr=cst.Name("permutation"))
        return updated.with_changes(func=func, args=[*args, flag])

    return Hit(message=message, fix=fix, rewrite=rewrite)


_INDEX_OPS = {f"jax.ops.index_{op}": op for op in ("update", "add", "mul", "min", "max")}
_INDEX_KEYWORDS = frozenset({"indices_are_sorted", "unique_indices"})
_ATOMIC = (cst.Name, cst.Attribute, cst.Call, cst.Subscript)


def _index_slice(idx: cst.BaseExpression, ctx: Context) -> str:
    """The subscript text for ``x.at[...]``: ``jax.ops.index[a, b]`` gives ``a, b``, any other index itself."""
    if isinstance(idx, cst.Subscript) and ctx.qname(idx.value) == "jax.ops.index":
        text = code(idx.with_changes(lpar=[], rpar=[]))[len(code(idx.value)) :].strip()
        return text.removeprefix("[").removesuffix("]").strip()
    return code(idx)


@rule("MK020", "jax.ops.index_* removed", cst.Call)
def index_ops(node: cst.Call, ctx: Context) -> Hit | None:
    """``jax.ops.index_update(x, idx, y)`` is ``x.at[idx].set(y)`` (``index_add`` -> ``.add``, ...)."""
    op = _INDEX_OPS.get(ctx.qname(node.func) or "")
    if op is None:
        return None
    method = "set" if op == "update" else op
    message = f"jax.ops.index_{op} was removed (AttributeError)"
    fix = f"x.at[idx].{method}(y)"
    positional = [a for a in node.args if a.keyword is None]
    keywords = {a.keyword.value: a for a in node.args if a.keyword is not None}
    if any(a.star for a in node.args) or len(positional) != 3 or set(keywords) - _INDEX_KEYWORDS:
        return Hit(message=message, fix=fix)

    index = _index_slice(positional[1].value, ctx)

    def rewrite(updated: cst.Call) -> cst.BaseExpression:
        x, _, y = (a.value for a in updated.args if a.keyword is None)
        base = code(x) if isinstance(x, _ATOMIC) and not x.lpar else f"({code(x).strip()})"
        extra = "".join(f", {k}={code(v.value)}" for k, v in keywords.items())
        text = f"{base}.at[{index}].{method}({code(y)}{extra})"
        return cst.parse_expression(text).with_changes(lpar=updated.lpar, rpar=updated.rpar)

    return Hit(message=message, fix=fix, rewrite=rewrite)


# jax.api.NAME is jax.NAME for these; anything else under jax.api has no public home to move to.
_API_MOVED = frozenset(
    [
        "jit",
        "grad",
        "value_and_grad",
        "vmap",
        "pmap",
        "jvp",
        "vjp",
        "linearize",
        "hessian",
        "jacfwd",
        "jacrev",
        "jacobian",
        "eval_shape",
        "make_jaxpr",
        "device_put",
        "device_get",
        "devices",
        "local_devices",
        "device_count",
        "local_device_count",
        "process_index",
        "process_count",
        "custom_jvp",
        "custom_vjp",
        "checkpoint",
        "remat",
        "named_call",
        "block_until_ready",
        "ShapeDtypeStruct",
        "pure_callback",
        "disable_jit",
    ]
)


@rule("MK021", "jax.api removed", cst.Attribute, cst.ImportFrom, cst.Import)
def jax_api(node: cst.Attribute | cst.ImportFrom | cst.Import, ctx: Context) -> Hit | None:
    """The ``jax.api`` module is gone (ModuleNotFoundError): its public functions live on ``jax``."""
    message = "jax.api was removed (ModuleNotFoundError)"
    if isinstance(node, cst.Import):
        if not any(code(a.name) == "jax.api" for a in node.names):
            return None
        return Hit(message=message, fix="import jax and use jax.jit, jax.grad, ... directly")
    if isinstance(node, cst.ImportFrom):
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return None
        if code(node.module) != "jax.api":
            return None
        renames = {n: ("jax", n) for n in _API_MOVED}
        return _from_import(node, "jax.api", renames, message) or Hit(
            message=message, fix="import from jax; names not public there have no replacement"
        )
    name = ctx.qname(node) or ""
    attr = name.removeprefix("jax.api.")
    if not name.startswith("jax.api.") or "." in attr or node.attr.value != attr:
        return None
    if attr not in _API_MOVED or not isinstance(node.value, cst.Attribute) or code(node.value) != "jax.api":
        return Hit(message=message, fix=f"jax.{attr} if it is public there")
    return Hit(message=message, fix=f"jax.{attr}", rewrite=_absolute(f"jax.{attr}"))
