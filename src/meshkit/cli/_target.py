"""Load a user's ``module:function`` target: a compiled program for the ledgers, a model shape for
the planner, a model for ``meshkit verify``, found and run by ``meshkit.user_code`` (the one place a
target is found and run; their errors are one line)."""

from __future__ import annotations

from typing import Any

import jax

from meshkit._errors import TargetError
from meshkit.user_code import call, resolve

__all__ = ["call", "load_target", "resolve"]


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
