"""A user's loss in the one form every plan's step differentiates:
``(params, state, batch, key) -> (loss, (aux, new_state))``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from meshkit.spec import PlanError

LossFn = Callable[..., tuple[jax.Array, tuple[dict, object]]]
"""``(params, state, batch, key) -> (loss, (aux, new_state))``."""


def step_loss(
    loss_fn: Callable, *, stateful: bool = False, rng: bool = False, has_aux: bool = False
) -> LossFn:
    """The user's loss in the plans' form ``(params, state, batch, key) -> (loss, (aux, state))``.

    User forms: ``loss_fn(params, batch)``; with ``state=``, ``loss_fn(params, state, batch)``
    returning ``(out, new_state)``; with ``rng=``, the step's key as a last argument; with
    ``has_aux``, ``out`` is ``(loss, aux)``, ``aux`` a dict of metrics.
    """
    form = "loss_fn(params, " + ("state, " if stateful else "") + "batch" + (", key" if rng else "") + ")"

    def inner(params, state, batch, key):
        args = (params, state, batch) if stateful else (params, batch)
        out = loss_fn(*args, *((key,) if rng else ()))
        out, new_state = _new_state(out, state, form) if stateful else (out, state)
        loss, aux = _aux(out, form) if has_aux else (out, {})
        if not has_aux and isinstance(out, tuple):
            raise PlanError(f"{form} returned a tuple: pass has_aux=True if it is (loss, aux)")
        loss = jnp.asarray(loss)
        if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
            raise PlanError(
                f"{form} must return a float scalar loss, got shape {loss.shape} dtype {loss.dtype}"
            )
        return loss, (aux, new_state)

    return inner


def _new_state(out, state, form: str):
    if not (isinstance(out, tuple) and len(out) == 2):
        raise PlanError(f"with state=, {form} must return (loss, new_state), got {type(out).__name__}")
    out, new_state = out
    if jax.tree.structure(new_state) != jax.tree.structure(state):
        raise PlanError(
            f"{form} returned a new state structured unlike state=: return the updated state, "
            f"same leaves ({jax.tree.structure(state)} vs {jax.tree.structure(new_state)})"
        )
    return out, jax.tree.map(lambda a, b: jnp.asarray(a, jnp.asarray(b).dtype), new_state, state)


def _aux(out, form: str):
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
        raise PlanError(f"with has_aux=True, {form} must return (loss, aux) with aux a dict of metrics")
    loss, aux = out
    if clash := {"loss", "grad_norm"} & set(aux):
        raise PlanError(f"aux metric name(s) {sorted(clash)} are taken by the trainer: rename them")
    return loss, aux
