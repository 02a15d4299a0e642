"""JAX's persistent compilation cache for meshkit's commands: on by default, in one documented place.

A second start of the same run (a resume, a repeated experiment, every process of a launched job)
reads its compiled programs from disk instead of compiling them again. Where the cache is, first
match wins:

1. ``--compile-cache DIR`` (``meshkit train``), else ``MESHKIT_COMPILE_CACHE=DIR``; ``off`` turns
   the cache off (also one the user configured for JAX);
2. a cache the user configured for JAX (``JAX_COMPILATION_CACHE_DIR``, or ``jax.config``): used as it
   is, with its own thresholds;
3. ``$XDG_CACHE_HOME/meshkit/jax``, by default ``~/.cache/meshkit/jax``.

Where meshkit picks the directory it also caches every program, however fast it compiled (JAX's
default skips those under a second, which on a CPU is most of a small run), unless
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise. The settings go into the environment
too, so that the processes a command starts (``meshkit launch``'s) share the cache. Only the
commands call :func:`configure`, before anything compiles: the library (``Trainer``...) leaves JAX's
configuration to its caller.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from meshkit._errors import MeshkitError

ENV = "MESHKIT_COMPILE_CACHE"
"""The environment variable that names the cache directory, or ``off``."""
OFF = "off"

_DIR, _ENABLE, _MIN_TIME = (
    "jax_compilation_cache_dir",
    "jax_enable_compilation_cache",
    "jax_persistent_cache_min_compile_time_secs",
)


class CompileCacheError(MeshkitError):
    """The compilation cache directory asked for cannot be used."""


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/meshkit/jax``, or ``~/.cache/meshkit/jax`` where XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshkit" / "jax"


def configure(choice: str | None = None) -> Path | None:
    """Set up JAX's persistent compilation cache (see the module's docstring); returns the directory
    in use, None when the cache is off. ``choice``: a directory or ``off`` (``--compile-cache``);
    None for ``MESHKIT_COMPILE_CACHE``, the user's JAX cache or the default. Raises
    :class:`CompileCacheError` for a directory asked for that cannot be created or written; an unusable
    default turns the cache off with one warning line."""
    choice = choice or os.environ.get(ENV) or None
    if choice == OFF:
        _apply({_ENABLE: False})
        return None
    if choice is None and (user := _user_dir()):
        return Path(user)
    where = default_dir() if choice is None else Path(choice).expanduser()
    if problem := _unusable(where):
        if choice is not None:
            raise CompileCacheError(
                f"compilation cache '{where}' {problem}: give a directory you can write, or {OFF}"
            )
        sys.stderr.write(f"warning: compilation cache '{where}' {problem}: compiling without it\n")
        _apply({_ENABLE: False})
        return None
    settings: dict[str, bool | float | str] = {_ENABLE: True, _DIR: str(where.absolute())}
    if _MIN_TIME.upper() not in os.environ:
        settings[_MIN_TIME] = 0.0
    _apply(settings)
    return where


def _user_dir() -> str | None:
    """The cache directory the user configured for JAX (its environment variable, or jax.config)."""
    if os.environ.get(_DIR.upper()):
        return os.environ[_DIR.upper()]
    jax = sys.modules.get("jax")
    return jax.config.jax_compilation_cache_dir if jax is not None else None


def _unusable(where: Path) -> str | None:
    """Why ``where`` cannot hold the cache, or None. A missing directory is not created here (JAX
    creates it at its first compile, so ``meshkit --help`` leaves no trace): its nearest existing
    ancestor must be a directory we may write."""
    if not where.exists():
        ancestor = next(p for p in where.absolute().parents if p.exists())
        if not ancestor.is_dir():
            return f"cannot be used ({ancestor} is not a directory)"
        if not os.access(ancestor, os.W_OK | os.X_OK):
            return f"cannot be used ({ancestor} is not writable)"
        return None
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        return f"cannot be used ({e.strerror or e})"
    return None


def _apply(settings: dict[str, bool | float | str]) -> None:
    """JAX's options, into the environment (read by JAX when it is imported, and by the processes a
    command starts) and, where JAX is imported already, into its configuration."""
    for name, value in settings.items():
        os.environ[name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    if (jax := sys.modules.get("jax")) is not None:
        for name, value in settings.items():
            jax.config.update(name, value)
