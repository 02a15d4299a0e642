"""Removed names (MK022), removed keyword arguments (MK023) and removed ``jax.Array`` members (MK024).

MK022: the specific rules name the replacement for the APIs legacy code used most; this one asks
the installed JAX (the version meshkit pins) about every other ``jax.*`` name a module imports or
reads, so ``--check`` fails on any file that would not import because of a removed API. It is a
fallback: the engine drops its finding where a specific rule already reported the same place.

MK023: a call of a ``jax.*`` function that JAX 0.12's own signature refuses (a keyword argument
removed or renamed, an argument that became keyword-only or positional-only) would raise
TypeError. Renamed keywords with the same meaning are fixed; the rest get a recipe.

MK024: members of arrays that JAX removed (``x.device_buffers``, ``x.to_py()``, ...). The type of
``x`` cannot be proven from the source, so these are reported with the replacement, not fixed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings

import libcst as cst

from meshkit.migrate._context import Context, code, keyword
from meshkit.migrate._model import Hit, rule

_RECIPE = "find its JAX 0.12 replacement in the JAX changelog (https://docs.jax.dev/en/latest/changelog.html)"
_STACKED = (
    "jax.device_put(np.stack([x] * len(devices)), NamedSharding(Mesh(np.array(devices), ('x',)), P('x')))"
)
# Removed names with a known replacement (the JAX docs' migrate_pmap drop-in replacements).
_RECIPES = {
    "jax.device_put_replicated": f"{_STACKED}, or NamedSharding(mesh, P()) to replicate without a device axis",
    "jax.device_put_sharded": "jax.device_put(np.stack(shards), NamedSharding(Mesh(np.array(devices), ('x',)), P('x')))",
}


def _import(module: str) -> object | None:
    """The module, or None when it does not exist (an import error from inside it counts as existing)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ModuleNotFoundError as e:
        return (
            None if e.name is not None and module.startswith(e.name) and e.name.startswith("jax") else module
        )
    except Exception:
        return module


_UNKNOWN, _MISSING = object(), object()


@functools.cache
def _resolve(name: str) -> object:
    """What dotted ``name`` (``jax.a.b``) is in the installed JAX: ``_MISSING`` when it does not
    exist, ``_UNKNOWN`` when that cannot be told here (a module that fails to import). ``jnp.newaxis``
    exists and is None."""
    parts = name.split(".")
    obj = _import("jax")
    for i in range(1, len(parts)):
        if isinstance(obj, str):  # a module that exists but could not be imported here: stop asking
            return _UNKNOWN
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = getattr(obj, parts[i])
        except AttributeError:
            obj = _import(".".join(parts[: i + 1]))
            if obj is None:
                return _MISSING
        except Exception:
            return _UNKNOWN
    return _UNKNOWN if isinstance(obj, str) else obj


def missing(name: str) -> bool:
    """Whether dotted ``name`` (``jax.a.b``) does not resolve in the installed JAX."""
    return _resolve(name) is _MISSING


def _jax_name(name: str | None) -> bool:
    return name is not None and name.startswith("jax.") and all(p.isidentifier() for p in name.split("."))


def _dotted(node: cst.BaseExpression) -> bool:
    """Whether ``node`` is a plain dotted name (``a.b.c``), not an attribute of a call's result."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)


def _hit(name: str) -> Hit:
    return Hit(message=f"{name} does not exist in JAX 0.12 (removed API)", fix=_RECIPES.get(name, _RECIPE))


@rule("MK022", "removed JAX API", cst.Attribute, cst.Import, cst.ImportFrom, fallback=True)
def removed_api(node: cst.Attribute | cst.Import | cst.ImportFrom, ctx: Context) -> Hit | None:
    """Reported once per name, at its first component JAX 0.12 lacks."""
    if isinstance(node, cst.Import):
        gone = [code(a.name) for a in node.names if code(a.name).startswith("jax.") and missing(code(a.name))]
        return _hit(gone[0]) if gone else None
    if isinstance(node, cst.ImportFrom):
        module = "" if node.relative or node.module is None else code(node.module)
        if module != "jax" and not module.startswith("jax."):
            return None
        if module != "jax" and missing(module):
            return _hit(module)
        names = [] if isinstance(node.names, cst.ImportStar) else [code(a.name) for a in node.names]
        gone = [f"{module}.{n}" for n in names if missing(f"{module}.{n}")]
        return _hit(gone[0]) if gone else None
    name = ctx.qname(node)
    if not _dotted(node) or not _jax_name(name) or name.rsplit(".", 1)[1] != node.attr.value:
        return None
    parent = name.rsplit(".", 1)[0]
    if missing(name) and (parent == "jax" or not missing(parent)):
        return _hit(name)
    return None


# Keyword arguments JAX renamed, meaning the same under the new name: fixed.
_RENAMED = {
    "jax.numpy.clip": {"a_min": "min", "a_max": "max"},
    "jax.numpy.reshape": {"newshape": "shape"},
    **{
        f"jax.numpy.{f}": {"interpolation": "method"}
        for f in ("percentile", "quantile", "nanpercentile", "nanquantile")
    },
}
# Keyword arguments whose literal values map onto a new keyword: (new keyword, {old literal: new literal}).
_RELABELLED = {
    ("jax.pure_callback", "vectorized"): (
        "vmap_method",
        {"True": '"legacy_vectorized"', "False": '"sequential"'},
    ),
    ("jax.scipy.linalg.solve", "sym_pos"): ("assume_a", {"True": '"pos"', "False": None}),
}
# Keyword arguments the signature still lists but JAX 0.12 refuses; dropping them keeps what JAX
# of the pmap era computed (its sort was stable whatever ``kind`` said).
_DROPPED = {"jax.numpy.sort": "kind", "jax.numpy.argsort": "kind"}
# Keywords refused though the signature would bind them (listed, or taken by ``**kwargs``).
_REFUSED = frozenset({*_DROPPED.items(), ("jax.pure_callback", "vectorized")})
# Positional arguments whose meaning changed: (function, position, what it was, what it is).
_MOVED = {"jax.scipy.linalg.solve": (2, "sym_pos", "lower")}


@functools.cache
def _signature(name: str) -> inspect.Signature | None:
    obj = _resolve(name)
    if obj is _MISSING or obj is _UNKNOWN or not callable(obj):
        return None
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def _refused(sig: inspect.Signature, node: cst.Call) -> str | None:
    """The TypeError JAX 0.12 raises on ``node``'s arguments, or None when its signature takes them."""
    if any(a.star for a in node.args):
        return None
    positional = [None for a in node.args if a.keyword is None]
    keywords = {a.keyword.value: None for a in node.args if a.keyword is not None}
    try:
        sig.bind(*positional, **keywords)
    except TypeError as e:
        return str(e)
    return None


def _renamed_keywords(name: str, node: cst.Call) -> dict[str, tuple[str, str | None]] | None:
    """Each old keyword of ``node`` -> (new keyword, or "" to drop it; new value text, or None to keep it).

    None when one of them has no mapping (a relabelled keyword with a value that is not a literal).
    """
    changes: dict[str, tuple[str, str | None]] = {}
    for a in node.args:
        if a.keyword is None:
            continue
        old = a.keyword.value
        if old in _RENAMED.get(name, {}):
            changes[old] = (_RENAMED[name][old], None)
        elif (name, old) in _RELABELLED:
            new, values = _RELABELLED[name, old]
            value = code(a.value).strip()
            if value not in values or keyword(node, new) is not None:
                return None
            changes[old] = (new, values[value]) if values[value] is not None else ("", None)
        elif _DROPPED.get(name) == old:
            changes[old] = ("", None)
    return changes


def _apply_keywords(call: cst.Call, changes: dict[str, tuple[str, str | None]]) -> cst.Call:
    args = []
    for a in call.args:
        old = a.keyword.value if a.keyword is not None else None
        if old not in changes:
            args.append(a)
            continue
        new, value = changes[old]
        if new:  # renamed, its value relabelled where given; an empty name drops the argument
            args.append(
                a.with_changes(keyword=cst.Name(new), value=cst.parse_expression(value) if value else a.value)
            )
    if args and args[-1] is not call.args[-1]:
        args[-1] = args[-1].with_changes(comma=call.args[-1].comma)
    return call.with_changes(args=args)


@rule("MK023", "argument JAX 0.12 refuses", cst.Call)
def refused_arguments(node: cst.Call, ctx: Context) -> Hit | None:
    """A call whose keywords JAX 0.12 renamed or removed (``jnp.clip(a_min=...)``) raises TypeError."""
    name = ctx.qname(node.func)
    if name is None or not name.startswith("jax."):
        return None
    moved = _MOVED.get(name)
    if (
        moved is not None
        and sum(a.keyword is None for a in node.args) > moved[0]
        and not any(a.star for a in node.args)
    ):
        return Hit(
            message=f"{name}'s argument {moved[0] + 1} was {moved[1]}= and is {moved[2]}= in JAX 0.12",
            fix=f"pass {moved[1]}'s meaning by keyword (see the JAX changelog)",
        )
    sig = _signature(name)
    if sig is None:
        return None
    gone = [
        a.keyword.value for a in node.args if a.keyword is not None and (name, a.keyword.value) in _REFUSED
    ]
    why = _refused(sig, node) or (f"{gone[0]}= is no longer supported" if gone else None)
    changes = _renamed_keywords(name, node)
    if why is None or (why.startswith("missing a required argument") and not changes):
        return None  # an argument missing in every JAX version is not a removal (MK011's psum(x))
    message = f"{name} refuses this call in JAX 0.12 ({why})"
    fixed = None if not changes else _apply_keywords(node, changes)
    if (
        fixed is None
        or _refused(sig, fixed) is not None
        or any(keyword(fixed, k) is not None for f, k in _REFUSED if f == name)
    ):
        return Hit(
            message=message, fix="pass the arguments JAX 0.12's signature takes (see the JAX changelog)"
        )
    said = ", ".join(f"{old}= -> {new}=" if new else f"drop {old}=" for old, (new, _) in changes.items())
    return Hit(message=message, fix=said, rewrite=lambda updated: _apply_keywords(updated, changes))


# Members of arrays (and keys) that JAX removed, and what replaces each on a jax.Array ``x``.
_ARRAY_MEMBERS = {
    "device_buffer": "x.addressable_data(0)",
    "device_buffers": "[s.data for s in x.addressable_shards]",
    "to_py": "np.asarray(x)",
    "block_host_until_ready": "x.block_until_ready()",
    "unsafe_raw_array": "jax.random.key_data(key)",
    "broadcast_in_dim": "jax.lax.broadcast_in_dim(x, shape, broadcast_dimensions)",
}
_CLIP_KEYWORDS = _RENAMED["jax.numpy.clip"]  # the method took the function's keywords


def _on_import(node: cst.BaseExpression, ctx: Context) -> bool:
    """Whether ``node`` is a dotted name from the module's imports (``torch.distributed``: a module, not an array)."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name) and isinstance(
        ctx.module_names.get(node.value), cst.Import | cst.ImportFrom
    )


@rule("MK024", "jax.Array member removed", cst.Attribute, cst.Call)
def array_members(node: cst.Attribute | cst.Call, ctx: Context) -> Hit | None:
    """``x.device_buffers``, ``x.to_py()``, ``x.clip(a_min=...)``, ...: gone from jax.Array (AttributeError, TypeError).

    Only in modules that import jax, and never on a name the module imports (``torch.x.split``).
    """
    if not ctx.uses_jax:
        return None
    if isinstance(node, cst.Attribute):
        name = node.attr.value
        if name not in _ARRAY_MEMBERS or _on_import(node.value, ctx):
            return None
        return Hit(
            message=f"jax.Array.{name} was removed (AttributeError)",
            fix=f"{_ARRAY_MEMBERS[name]} if x is a jax.Array",
        )
    func = node.func
    if not isinstance(func, cst.Attribute) or _on_import(func.value, ctx):
        return None
    name = func.attr.value
    if name == "clip":
        old = [
            a.keyword.value for a in node.args if a.keyword is not None and a.keyword.value in _CLIP_KEYWORDS
        ]
        if not old:
            return None
        new = ", ".join(f"{_CLIP_KEYWORDS[k]}=" for k in old)
        return Hit(
            message=f"jax.Array.clip takes min=/max=, not {old[0]}= (TypeError)",
            fix=f"x.clip({new}) if x is a jax.Array",
        )
    if name == "broadcast" and node.args:
        return Hit(
            message="jax.Array.broadcast was removed (AttributeError)",
            fix="jax.lax.broadcast(x, sizes) if x is a jax.Array",
        )
    return None
