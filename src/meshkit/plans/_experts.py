"""Mixture of experts: routing, capacity, dispatch and combine, on one device or over the ``expert`` axis.

The one owner of the MoE MLP for the reference models (the families with experts, the GPT and the
Llama's, call ``moe`` with their own expert function). Per layer, for each sequence of ``T`` tokens (the routing group: a sequence is
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
    (the ledger's all_to_all size, ``axes.expert``); dropless: of its tokens ``(B, T, D)``."""
    dropless: list = field(default_factory=list)
    """One entry per dropless MoE layer traced under this split (its rows are gathered, not sent)."""
    k: list = field(default_factory=list)
    """Each MoE layer's top-k."""


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


def top_k(
    x_btd: jax.Array,
    router_de: jax.Array,
    k: int,
    *,
    renormalize: bool = False,
    bias: Any = None,
    sigmoid: bool = False,
    choice_bias: Any = None,
    groups: tuple[int, int] = (1, 1),
    scale: float = 1.0,
) -> tuple:
    """``(probs_bte, choice_btk, gate_btk)``: the router's probabilities (softmax in at least float32 of
    ``x router``, plus ``bias`` ``(E,)`` where given: GPT-OSS's; with ``sigmoid`` each expert's sigmoid score,
    DeepSeek-V3's, the probabilities then those scores over their sum), each token's top ``k`` experts (ties to
    the lower index: a stable sort) and their gates (divided by their sum where ``renormalize``: the softmax of
    the top ``k`` logits, GPT-OSS's form; times ``scale``). DeepSeek-V3's choice (its gates stay the scores):
    by the scores plus ``choice_bias`` ``(E,)`` (its ``e_score_correction_bias``, held: no gradient), among the
    top ``groups[1]`` of ``groups[0]`` groups of experts, each group ranked by its two best (``_top_groups``)."""
    wide = jnp.promote_types(x_btd.dtype, jnp.float32)
    logits = jnp.einsum("btd,de->bte", x_btd, router_de, preferred_element_type=wide)
    if bias is not None:
        logits = logits + bias.astype(wide)
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choosing = lax.stop_gradient(scores)
    if choice_bias is not None:
        choosing = choosing + lax.stop_gradient(choice_bias.astype(wide))
    if groups[0] > 1:
        choosing = _top_groups(choosing, *groups)
    choice_btk = jnp.argsort(-choosing, axis=-1, stable=True)[..., :k]
    gate_btk = jnp.take_along_axis(scores, choice_btk, axis=-1)
    if renormalize:  # DeepSeek-V3's sum carries transformers' 1e-20 (sigmoid scores may all be near 0)
        gate_btk = gate_btk / (gate_btk.sum(-1, keepdims=True) + (1e-20 if sigmoid else 0.0))
    if scale != 1.0:
        gate_btk = gate_btk * scale
    probs_bte = scores / scores.sum(-1, keepdims=True) if sigmoid else scores
    return probs_bte, choice_btk, gate_btk


def _top_groups(choosing: jax.Array, groups: int, top: int) -> jax.Array:
    """``choosing`` ``(B, T, E)`` with the experts outside each token's ``top`` best of ``groups`` equal groups set
    to 0 (a group's rank: the sum of its two best; DeepSeek-V3's ``n_group``, ``topk_group``; 0, not minus
    infinity, as transformers masks them)."""
    b, t, e = choosing.shape
    grouped = choosing.reshape(b, t, groups, e // groups)
    rank = lax.top_k(grouped, 2)[0].sum(-1)
    kept = jax.nn.one_hot(lax.top_k(rank, top)[1], groups, dtype=bool).any(-2)
    return jnp.where(kept[..., None], grouped, 0.0).reshape(b, t, e)


def balance_loss(probs_bte: jax.Array, choice_btk: jax.Array) -> jax.Array:
    """Switch/GShard's load-balancing loss ``E x sum_e f_e P_e`` per sequence, averaged: ``f_e`` the
    share of a sequence's ``T x k`` slots routed to ``e`` (before any capacity), ``P_e`` its mean
    router probability."""
    _, t, e = probs_bte.shape
    share_be = jax.nn.one_hot(choice_btk, e, dtype=probs_bte.dtype).sum((1, 2)) / (t * choice_btk.shape[-1])
    return (e * jnp.sum(share_be * probs_bte.mean(1), axis=-1)).mean()


def route(
    x_btd: jax.Array,
    router_de: jax.Array,
    k: int,
    factor: float,
    **how: Any,
) -> Routing:
    """Top-``k`` routing with capacity (see the module docstring); ``how``: ``top_k``'s options."""
    b, t, _ = x_btd.shape
    e = router_de.shape[-1]
    c = capacity(t, e, k, factor)
    wide = jnp.promote_types(x_btd.dtype, jnp.float32)
    probs_bte, choice_btk, gate_btk = top_k(x_btd, router_de, k, **how)
    # slots in priority order: all first choices (token order), then all second choices, ...
    chosen_bkte = jax.nn.one_hot(jnp.swapaxes(choice_btk, 1, 2), e, dtype=jnp.int32)
    flat = chosen_bkte.reshape(b, k * t, e)
    position_bkte = (jnp.cumsum(flat, axis=1) - 1).reshape(b, k, t, e) * chosen_bkte
    kept_bkte = chosen_bkte * (position_bkte < c)
    slot_bktec = kept_bkte[..., None] * jax.nn.one_hot(position_bkte, c, dtype=jnp.int32)
    dispatch_btec = slot_bktec.sum(1).astype(x_btd.dtype)
    gates_bkt = jnp.swapaxes(gate_btk, 1, 2).astype(x_btd.dtype)
    combine_btec = jnp.einsum("bktec,bkt->btec", slot_bktec.astype(x_btd.dtype), gates_bkt)
    aux = balance_loss(probs_bte, choice_btk)
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
    renormalize: bool = False,
    router_bias: Any = None,
    **how: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The MoE MLP of ``x_btd``: ``(y_btd, aux, dropped)`` (aux: the load-balancing loss of this layer,
    dropped: the slots past capacity). ``experts``: the experts' parameters, leading dim E (E / N
    under an expert split); ``expert_fn`` multiplies them through ``expert_dot`` and ``expert_bias``.
    ``capacity_factor`` 0: dropless (``_dropless``: every slot runs, grouped by expert, as MaxText's -1);
    ``renormalize``: the top-k gates divided by their sum (Mixtral; Qwen3-MoE's ``norm_topk_prob``);
    ``router_bias`` ``(E,)``: added to the router's logits (GPT-OSS's); ``how``: ``top_k``'s other options
    (DeepSeek-V3's sigmoid scores, choice bias, groups and scale)."""
    how = {"renormalize": renormalize, "bias": router_bias, **how}
    if capacity_factor == 0:
        return _dropless(expert_fn, experts, router_de, x_btd, k=k, how=how)
    sequence = _context._SPLIT.get()
    check_whole_sequences(sequence.size if sequence is not None else 1)
    r = route(x_btd, router_de, k, capacity_factor, **how)
    rows_becd = jnp.einsum("btec,btd->becd", r.dispatch, x_btd)
    split = _SPLIT.get()
    if split is not None:
        split.rows.append(rows_becd.size * rows_becd.dtype.itemsize)
        split.k.append(k)
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


# -- dropless: every slot runs, its rows grouped by expert ----------------------------------------


@dataclass(frozen=True, slots=True)
class _Groups:
    """The rows in force while a dropless expert function runs: ``(M, D)`` rows sorted by expert,
    ``sizes[e]`` of them for (local) expert ``e``; ``expert_of_row`` each row's local expert."""

    sizes: jax.Array
    expert_of_row: jax.Array


_GROUPS: contextvars.ContextVar[_Groups | None] = contextvars.ContextVar(
    "meshkit_expert_groups", default=None
)


def expert_dot(x: jax.Array, w_ndf: jax.Array) -> jax.Array:
    """Each expert's rows times its matrix: ``(n, c, D) x (n, D, F) -> (n, c, F)`` in capacity mode, or
    one grouped matmul ``jax.lax.ragged_dot`` of rows sorted by expert ``(M, D) -> (M, F)`` in dropless
    mode. An expert function (``ExpertFn``) written with it runs in both."""
    groups = _GROUPS.get()
    if groups is None:
        return jnp.einsum("ncd,ndf->ncf", x, w_ndf)
    return lax.ragged_dot(x, w_ndf, groups.sizes)


def expert_bias(b_nf: jax.Array) -> jax.Array:
    """Each expert's bias, shaped to add to ``expert_dot``'s result in either mode."""
    groups = _GROUPS.get()
    return b_nf[:, None] if groups is None else b_nf[groups.expert_of_row]


def _dropless(
    expert_fn: ExpertFn,
    experts: Any,
    router_de: jax.Array,
    x_btd: jax.Array,
    *,
    k: int,
    how: dict[str, Any],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dropless MoE (MegaBlocks'): each token's ``k`` slots sorted by expert and multiplied in one
    grouped matmul per weight (``expert_dot``), no capacity and no slot dropped; the outputs back in
    token order, weighted by their gates. Under an expert split every device gathers the expert group's
    tokens (``all_gather`` over the axis: ``(N-1)/N x S`` per device, ``S = N B_local T D``), runs its
    own experts' rows, and the partial outputs are summed back to their tokens' devices
    (``psum_scatter``: as much again); their transposes move as much in the backward pass. Routing is
    per token, so a sequence split does not change it. The load-balancing loss is each device's own
    tokens'."""
    probs_bte, choice_btk, _ = top_k(x_btd, router_de, k, **how)
    aux = balance_loss(probs_bte, choice_btk)
    split = _SPLIT.get()
    spread = split is not None and split.size > 1
    if split is not None:
        split.rows.append(x_btd.size * x_btd.dtype.itemsize)
        split.dropless.append(True)
        split.k.append(k)
    x_all = lax.all_gather(x_btd, split.axis, axis=0, tiled=True) if spread else x_btd
    _, choice, gate = top_k(x_all, router_de, k, **how)
    b, t, d = x_all.shape
    e = router_de.shape[-1]
    slot_expert = choice.reshape(-1)  # (N k,), N = b t: token n's slots at n k .. n k + k - 1
    order = jnp.argsort(slot_expert, stable=True)
    rows = x_all.reshape(b * t, d)[order // k]
    counts = jnp.bincount(slot_expert, length=e)
    if spread:  # this device's experts' rows first, their counts the groups; the rest multiplied by none
        local = e // split.size
        first = lax.axis_index(split.axis) * local
        start = jnp.cumsum(counts)[first] - counts[first]
        sizes = lax.dynamic_slice(counts, (first,), (local,))
        rows = jnp.roll(rows, -start, axis=0)
    else:
        local, sizes = e, counts
    of_row = jnp.repeat(jnp.arange(local), sizes, total_repeat_length=rows.shape[0])
    token = _GROUPS.set(_Groups(sizes, of_row))
    try:
        out = expert_fn(experts, rows)
    finally:
        _GROUPS.reset(token)
    if spread:
        mine = jnp.arange(rows.shape[0]) < sizes.sum()
        out = jnp.roll(jnp.where(mine[:, None], out, jnp.zeros_like(out)), start, axis=0)
    slots = out[jnp.argsort(order)].reshape(b * t, k, d)
    y_btd = jnp.einsum("nkd,nk->nd", slots, gate.reshape(b * t, k).astype(slots.dtype)).reshape(b, t, d)
    if spread:
        y_btd = lax.psum_scatter(y_btd, split.axis, scatter_dimension=0, tiled=True)
    return y_btd, aux, jnp.zeros((), aux.dtype)
