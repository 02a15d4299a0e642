"""Load a user's ``module:function`` target: a compiled program for the ledgers, a model shape for
the planner, a model for ``meshkit verify``. ``resolve`` and ``call`` are the one place a target is
found and run; their errors are one line."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import jax

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


def load_target(target: str) -> jax.stages.Compiled:
    """Resolve ``module:function``; the function returns ``(jitted, args)``, ``(jitted, args, kwargs)``,
    a ``Lowered`` or a ``Compiled``; the result is compiled."""
    fn = resolve(target)
    compiled = isinstance(fn, jax.stages.Compiled | jax.stages.Lowered)
    made: Any = call(target, fn) if callable(fn) and not compiled else fn
    if isinstance(made, jax.stages.Compiled):
        return made
    if isinstance(made, jax.stages.Lowered):
        return made.compile()
    if isinstance(made, tuple) and len(made) in (2, 3) and hasattr(made[0], "lower"):
        args = made[1] if isinstance(made[1], tuple | list) else (made[1],)
        kwargs = made[2] if len(made) == 3 else {}
        return made[0].lower(*args, **kwargs).compile()
    raise TargetError(
        f"{target} returned {type(made).__name__}: it must return (jitted_fn, args), a Lowered or a Compiled"
    )
