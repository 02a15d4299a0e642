"""How the Trainer's keyword arguments are read before anything is built: ``mesh=`` as the spec's
text, ``compute_dtype=`` as one of the spec's precisions, and whether the loss takes the key that
``rng=`` passes (one line naming the fix, not a TypeError from inside the trace)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshkit.mesh import parse_mesh_spec
from meshkit.spec import PRECISIONS, PlanError


def _mesh_text(mesh: Any) -> str | None:
    """The spec's text of ``mesh=``: a spec such as 'data=4,model=2' (or a mapping or pairs), or a
    ``jax.sharding.Mesh``'s axes."""
    if mesh is None:
        return None
    if isinstance(mesh, Mesh):
        return ",".join(f"{k}={v}" for k, v in mesh.shape.items())
    if isinstance(mesh, str | Mapping | list | tuple):
        return ",".join(f"{k}={v}" for k, v in parse_mesh_spec(mesh))
    raise PlanError(
        f"mesh must be a spec such as 'data=4,model=2' or a jax.sharding.Mesh, got {type(mesh).__name__}"
    )


def _precision(compute_dtype: Any) -> str | None:
    """The spec's precision of ``compute_dtype=`` (None: the parameters' dtype)."""
    if compute_dtype is None:
        return None
    try:
        dtype = jnp.dtype(compute_dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise PlanError(f"compute_dtype must be a floating dtype such as 'bfloat16', got {compute_dtype!r}")
    names = {jnp.dtype(d or "float32"): name for name, d in PRECISIONS.items()}
    if dtype not in names:
        raise PlanError(
            f"compute_dtype {dtype} is not one of {', '.join(map(str, names))}: pick one of those"
        )
    return names[dtype]


def _check_key_argument(loss_fn: Callable, adapted: Any, stateful: bool, rng: bool) -> None:
    """``rng=`` passes a key as the loss's last argument: a loss that takes none (or one that needs
    a key while no ``rng=`` is given) is one line here, not a TypeError from inside the trace."""
    from meshkit.plans import Stages

    if isinstance(loss_fn, Stages):
        return  # a pipeline's model: its own check names what it takes
    if adapted is not None:
        stateful = adapted.framework == "equinox" and bool(jax.tree.leaves(adapted.state))
    names = ["model" if adapted is not None else "params", *(["state"] if stateful else []), "batch"]
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return  # not inspectable (a builtin, a Stages model): the step says what it gets

    def binds(n: int) -> bool:
        try:
            sig.bind(*range(n))
            return True
        except TypeError:
            return False

    n = len(names)
    form = f"loss_fn({', '.join(names)})"
    if rng and binds(n) and not binds(n + 1):
        raise PlanError(
            f"rng= passes a key as the loss's last argument but {form} takes none: write "
            f"loss_fn({', '.join(names)}, key), or drop rng="
        )
    if not rng and binds(n + 1) and not binds(n):
        raise PlanError(
            f"loss_fn takes a key after {', '.join(names)} but no rng= is given: pass rng=0 (a seed or key)"
        )
