"""Mixture of experts: routing, capacity, dispatch and combine, on one device or over the ``expert`` axis.

The one owner of the MoE MLP for the reference models (the GPT and the Llama call ``moe`` with their
own expert function). Per layer, for each sequence of ``T`` tokens (the routing group: a sequence is
never split by the plans that run MoE, so routing is the same on one device and under any batch split):

- **router**: ``probs = softmax(x @ router)`` (in at least float32); each token's top ``k`` experts
  by probability, ties broken by the lower expert index (a stable sort); the gate of a slot is its
  probability (not renormalized, so the router is trained by the main loss for any ``k``).
- **capacity**: an expert takes at most ``C = ceil(capacity_factor x T x k / E)`` slots of a
  sequence. Slots are taken in a fixed order: every token's first choice (in token order), then every
  second choice, ... (GShard's priority); a slot past its expert's capacity is **dropped** (the token
  keeps its residual for that slot), counted, and reported.
- **auxiliary loss** (Switch/GShard load balancing): ``E x sum_e f_e P_e`` with ``f_e`` the share of
  the sequence's ``T x k`` slots routed to ``e`` (before capacity) and ``P_e`` its mean router
  probability; averaged over sequences and layers, added to the loss with the model's weight.
- **dispatch / combine**: one-hot ``(B, T, E, C)`` tensors gather each expert's ``C`` rows
  ``(B, E, C, D)`` and scatter the gated outputs back (exact: each row is one token times 1).

With no split in force the experts run here. While a plan traces the loss with an expert split
(``split_experts``), each device holds ``E / N`` experts' weights and its own sequences; the
``(B, E, C, D)`` rows go to the experts' devices by one ``all_to_all`` (dispatch: split over E,
concatenated over B) and come back by another (combine), ``(N-1)/N x S`` bytes per device each with
``S = B_local x E x C x D`` elements; their transposes move as much again in the backward pass.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshkit.plans import _context
from meshkit.spec import AXIS_RULES, EXPERT, PlanError, one_of, plans_of

EXPERT_DIM = next(rule.logical for rule in AXIS_RULES if rule.axis == EXPERT)
"""The logical axis name of a leaf's expert dim (the reference models' leaves under ``"moe"``), which
expert-parallel plans split over the ``expert`` mesh axis (its row's ``AxisRule.logical``)."""

ExpertFn = Callable[[Any, jax.Array], jax.Array]
"""``expert_fn(params, x_ncd) -> y_ncd``: ``n`` experts (params with a leading expert dim) on their rows."""


@dataclass(frozen=True, slots=True)
class ExpertSplit:
    """The expert split in force while an expert-parallel plan traces the loss."""

    axis: str
    size: int
    rows: list = field(default_factory=list)
    """Bytes per device of each MoE layer's dispatched rows ``(B, E, C, D)`` traced under this split
    (the ledger's all_to_all size, ``_expected``)."""


_SPLIT: contextvars.ContextVar[ExpertSplit | None] = contextvars.ContextVar(
    "meshkit_expert_split", default=None
)


@contextlib.contextmanager
def split_experts(size: int, axis: str = EXPERT) -> Iterator[ExpertSplit]:
    """Trace the loss with the experts split over ``axis`` (``size`` devices)."""
    split = ExpertSplit(axis, size)
    token = _SPLIT.set(split)
    try:
        yield split
    finally:
        _SPLIT.reset(token)


def capacity(tokens: int, experts: int, k: int, factor: float) -> int:
    """Slots an expert takes per routing group of ``tokens`` tokens: ``ceil(factor x tokens x k / experts)``."""
    return max(1, math.ceil(factor * tokens * k / experts))


def check_whole_sequences(context: int) -> None:
    """Routing's capacity is per whole sequence: a context split of more than one device is refused."""
    if context > 1:
        raise PlanError(
            f"a mixture of experts routes whole sequences and context plans ({', '.join(plans_of('context'))}) "
            f"split them: use {one_of(plans_of('expert'))}"
        )


@dataclass(frozen=True, slots=True)
class Routing:
    """One layer's routing of a batch ``(B, T)``: dispatch and combine ``(B, T, E, C)``, the
    load-balancing loss (mean over sequences) and the dropped slots (a count)."""

    dispatch: jax.Array
    combine: jax.Array
    aux: jax.Array
    dropped: jax.Array


def route(x_btd: jax.Array, router_de: jax.Array, k: int, factor: float) -> Routing:
    """Top-``k`` routing with capacity (see the module docstring)."""
    b, t, _ = x_btd.shape
    e = router_de.shape[-1]
    c = capacity(t, e, k, factor)
    wide = jnp.promote_types(x_btd.dtype, jnp.float32)
    logits = jnp.einsum("btd,de->bte", x_btd, router_de, preferred_element_type=wide)
    probs_bte = jax.nn.softmax(logits, axis=-1)
    choice_btk = jnp.argsort(-lax.stop_gradient(probs_bte), axis=-1, stable=True)[..., :k]
    gate_btk = jnp.take_along_axis(probs_bte, choice_btk, axis=-1)
    # slots in priority order: all first choices (token order), then all second choices, ...
    chosen_bkte = jax.nn.one_hot(jnp.swapaxes(choice_btk, 1, 2), e, dtype=jnp.int32)
    flat = chosen_bkte.reshape(b, k * t, e)
    position_bkte = (jnp.cumsum(flat, axis=1) - 1).reshape(b, k, t, e) * chosen_bkte
    kept_bkte = chosen_bkte * (position_bkte < c)
    slot_bktec = kept_bkte[..., None] * jax.nn.one_hot(position_bkte, c, dtype=jnp.int32)
    dispatch_btec = slot_bktec.sum(1).astype(x_btd.dtype)
    gates_bkt = jnp.swapaxes(gate_btk, 1, 2).astype(x_btd.dtype)
    combine_btec = jnp.einsum("bktec,bkt->btec", slot_bktec.astype(x_btd.dtype), gates_bkt)
    share_be = chosen_bkte.sum((1, 2)).astype(wide) / (t * k)
    aux = (e * jnp.sum(share_be * probs_bte.mean(1), axis=-1)).mean()
    dropped = (chosen_bkte.sum() - kept_bkte.sum()).astype(wide)
    return Routing(dispatch=dispatch_btec, combine=combine_btec, aux=aux, dropped=dropped)


def moe(
    expert_fn: ExpertFn,
    experts: Any,
    router_de: jax.Array,
    x_btd: jax.Array,
    *,
    k: int,
    capacity_factor: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The MoE MLP of ``x_btd``: ``(y_btd, aux, dropped)`` (aux: the load-balancing loss of this layer,
    dropped: the slots past capacity). ``experts``: the experts' parameters, leading dim E (E / N
    under an expert split)."""
    sequence = _context._SPLIT.get()
    check_whole_sequences(sequence.size if sequence is not None else 1)
    r = route(x_btd, router_de, k, capacity_factor)
    rows_becd = jnp.einsum("btec,btd->becd", r.dispatch, x_btd)
    split = _SPLIT.get()
    if split is not None:
        split.rows.append(rows_becd.size * rows_becd.dtype.itemsize)
    out_becd = _run_experts(expert_fn, experts, rows_becd, split)
    y_btd = jnp.einsum("btec,becd->btd", r.combine, out_becd)
    return y_btd, r.aux, r.dropped


def _run_experts(
    expert_fn: ExpertFn, experts: Any, rows_becd: jax.Array, split: ExpertSplit | None
) -> jax.Array:
    """Each expert on its rows; under a split, the rows travel to the experts' devices and back."""
    if split is not None and split.size > 1:
        # dispatch: (B, E, C, D) -> (N B, E/N, C, D): every device's rows for this device's experts
        rows_becd = lax.all_to_all(rows_becd, split.axis, 1, 0, tiled=True)
    b, e, c, d = rows_becd.shape
    x_ncd = jnp.swapaxes(rows_becd, 0, 1).reshape(e, b * c, d)
    y_ncd = expert_fn(experts, x_ncd)
    out_becd = jnp.swapaxes(y_ncd.reshape(e, b, c, d), 0, 1)
    if split is not None and split.size > 1:  # combine: back to the rows' devices
        out_becd = lax.all_to_all(out_becd, split.axis, 0, 1, tiled=True)
    return out_becd
