"""MK022: any other name under ``jax`` that JAX 0.12 does not have, so the file would not import or run.

The specific rules name the replacement for the APIs legacy code used most; this one asks the
installed JAX (the version meshkit pins) about every other ``jax.*`` name a module imports or
reads, so ``--check`` fails on any file that would not import because of a removed API. It is a
fallback: the engine drops its finding where a specific rule already reported the same place.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import libcst as cst

from meshkit.migrate._context import Context, code
from meshkit.migrate._model import Hit, rule

_RECIPE = "find its JAX 0.12 replacement in the JAX changelog (https://docs.jax.dev/en/latest/changelog.html)"


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


@functools.cache
def missing(name: str) -> bool:
    """Whether dotted ``name`` (``jax.a.b``) does not resolve in the installed JAX."""
    parts = name.split(".")
    obj = _import("jax")
    for i in range(1, len(parts)):
        if isinstance(obj, str):  # a module that exists but could not be imported here: stop asking
            return False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = getattr(obj, parts[i])
        except AttributeError:
            obj = _import(".".join(parts[: i + 1]))
            if obj is None:
                return True
        except Exception:
            return False
    return False


def _jax_name(name: str | None) -> bool:
    return name is not None and name.startswith("jax.") and all(p.isidentifier() for p in name.split("."))


def _dotted(node: cst.BaseExpression) -> bool:
    """Whether ``node`` is a plain dotted name (``a.b.c``), not an attribute of a call's result."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)


def _hit(name: str) -> Hit:
    return Hit(message=f"{name} does not exist in JAX 0.12 (removed API)", fix=_RECIPE)


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
