"""A user's code named ``module:function`` (``module`` may be ``path/to/file.py``): found and called here, the
one place for every command that takes one (``meshkit verify``'s model, the ledgers' programs, the
planner's model shape, ``--reward``'s function); their failures are one line naming the target.
Imports nothing of meshkit but its errors, and no JAX."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from meshkit._errors import TargetError


def _import(module: str):
    if module.endswith(".py") or "/" in module:
        path = Path(module)
        if not path.is_file():
            raise TargetError(f"no file {module!r}: give module:function or path/to/file.py:function")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
        return mod
    _cwd_importable()
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        parts = module.split(".")
        if e.name not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            raise TargetError(
                f"module {module!r} imports {e.name!r}, which is not installed: install it, or import it lazily"
            ) from None
        raise TargetError(
            f"cannot import module {module!r} from the current folder '{os.getcwd()}' or the installed "
            f"packages: check the name, or run from the folder that holds {parts[0]}.py (or {parts[0]}/)"
        ) from None


def _cwd_importable() -> None:
    """Put the current folder first on ``sys.path``, as ``python -m`` does (a console script puts its
    own bin folder there instead), so that ``mymodule:fn`` finds ``./mymodule.py``."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()


def resolve(target: str, *, what: str = "target", example: str = "meshkit.examples:dp_mlp_adam") -> Any:
    """The object ``module:name`` names (``module`` may be ``path/to/file.py``)."""
    module, sep, attr = target.rpartition(":")
    if not sep or not module or not attr:
        raise TargetError(f"bad {what} {target!r}: write module:function, e.g. {example}")
    fn = getattr(_import(module), attr, None)
    if fn is None:
        raise TargetError(f"module {module!r} has no attribute {attr!r}: check the function name")
    return fn


def call(target: str, fn: Any) -> Any:
    """``fn()``, where a failure in the user's code is one line naming the target."""
    try:
        return fn()
    except Exception as e:  # the user's code: say where it failed, in one line
        raise TargetError(
            f"{target}() raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
