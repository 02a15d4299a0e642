"""Context parallelism: the sequence split over the ``context`` mesh axis, and causal attention over it.

The one owner of causal attention for the reference models (every family of ``models.registry``
calls ``causal_attention`` and ``positions``): with no split in force it is the plain dense attention
(``plans.attention``: fused or written out, as ``ParallelSpec.attention`` asks); while a context plan traces the loss (``split_sequence``) each device holds ``T / N`` tokens of
every sequence and the attention runs in one of two forms (``meshkit.spec.CONTEXT_ATTENTION``):

- **ring**: the queries stay; the key/value block travels round the ring by ``ppermute``, N - 1
  passes per layer forward, and N - 1 passes of its gradient backward (a ppermute's transpose is
  the ppermute the other way), each one device's K and V: ``2 x b x T/N x kv_heads x head_dim``
  elements. An online softmax (running max and sum, in at least float32) folds in each block.
- **all-to-all** (Ulysses): ``all_to_all`` trades the sequence split for a head split, each
  device attends over the whole sequence for ``heads / N`` heads, and one more ``all_to_all`` trades
  back: 4 per layer forward (q, k, v, out) and 4 backward, each ``(N-1)/N x S`` per device with
  ``S = b x T/N x heads x head_dim`` elements for q and the output; keys and values move their own
  ``kv_heads`` where those divide over N (each device takes the kv heads of its query heads), else
  they are repeated to ``heads`` first (``exchanged_kv_heads``).

Causal load balancing: the sequence is cut into 2N chunks and device i holds chunks i and 2N-1-i
(``balanced_order``), so every device has the same number of unmasked query-key pairs. In the ring,
after the first (diagonal) block, a device's visiting block is either wholly before both its
chunks (all its queries see the visitor's first chunk) or between them (its second chunk sees the
whole visitor): half a block of work either way, chosen by ``lax.cond``, and no device idles.

A sliding ``window`` masks by global positions in both forms (the ring still computes the blocks
wholly outside it: their weight comes out zero); a ``softcap`` caps each block's scores before its mask
(the ring's blocks) or goes with the whole sequence to each device's attention (all-to-all). A window
that applies in some layers only, their kind scanned as data (``windowed``, Gemma's local and global
layers under ``lax.scan``), keeps every collective outside any ``lax.cond`` (the ledger counts a
collective under a conditional in each branch): the ring masks by a traced window, all-to-all chooses
between the two static calls after its exchange. Per-document ``segment_ids`` (packed documents, split
along the sequence like the tokens) travel with the keys: round the ring beside each K/V block (``C - 1``
more ppermutes of ``b x T/C`` integers per layer, forward only), or all-gathered over the axis for
all-to-all's whole sequences. ``exchange_segments`` does that once per forward pass, before the layers
(the reference models call it: ``C - 1`` ppermutes of ``b x T/C`` integers, or one all-gather, per
micro-batch, forward only, none again under remat), and every layer's attention masks by the result.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.sharding import get_abstract_mesh

from meshkit.plans import attention
from meshkit.spec import CONTEXT, PlanError, plans_of


@dataclass(frozen=True, slots=True)
class Split:
    """The sequence split in force while a context plan traces the loss."""

    axis: str
    size: int
    form: str
    heads_axis: str | None = None
    """The mesh axis the attention heads are split on by tensor parallelism (tp+cp), where they are:
    the ring then runs on each device's own heads (``_on_own_heads``)."""
    attended: list = field(default_factory=list)
    """One entry per ``causal_attention`` traced under this split: a loss that never calls it attends
    within each device's own chunks only, and the plan refuses it (``check_attended``)."""


_SPLIT: contextvars.ContextVar[Split | None] = contextvars.ContextVar("meshkit_context_split", default=None)


@contextlib.contextmanager
def split_sequence(
    size: int, form: str, axis: str = CONTEXT, heads_axis: str | None = None
) -> Iterator[Split]:
    """Trace the loss with its sequences split over ``axis`` (``size`` devices) in ``form``, the heads
    over ``heads_axis`` where tensor parallelism splits them."""
    split = Split(axis, size, form, heads_axis)
    token = _SPLIT.set(split)
    try:
        yield split
    finally:
        _SPLIT.reset(token)


def check_attended(split: Split) -> None:
    """A loss traced under a context plan must attend through ``causal_attention`` (and take its
    positions from ``positions``/``position_rows``): any other attention would see only the device's
    own chunks of each sequence, a silently wrong result. (Positions cannot be checked: a loss
    that attends here but numbers its tokens itself is the user's to get right; the docs say so.)"""
    if not split.attended:
        raise PlanError(
            f"context plans ({', '.join(plans_of('context'))}) need the loss's attention through meshkit.plans.causal_attention "
            "and its positions through meshkit.plans.sequence_positions or position_rows (as meshkit's model families "
            "do); this loss never called it: use another plan"
        )


def check_sequence(t: int, n: int) -> None:
    """A sequence of ``t`` tokens must cut into 2 x context chunks (causal load balancing)."""
    if t % (2 * n):
        raise PlanError(
            f"sequence of {t} tokens does not split into 2 x context={n} equal chunks (causal load "
            f"balancing): use a sequence length that is a multiple of {2 * n}"
        )


def check_heads(heads: int, n: int, form: str) -> None:
    """All-to-all attention gives each device ``heads / n`` whole heads."""
    if form == "all-to-all" and heads % n:
        fits = [d for d in range(1, heads + 1) if heads % d == 0]
        raise PlanError(
            f"all-to-all attention needs heads divisible by context={n}, but the model has {heads} heads: "
            f"use context_attention='ring', or a context axis of {', '.join(map(str, fits))}"
        )


def check_context(seq_len: int, heads: int, n: int, form: str) -> None:
    """Both checks of a context split, before anything is traced (``meshkit train`` asks this)."""
    if n > 1:
        check_sequence(seq_len, n)
        check_heads(heads, n, form)


def balanced_order(t: int, n: int) -> np.ndarray:
    """Indices of the ``t`` positions in the order the devices hold them: chunks i and 2n-1-i on device i."""
    check_sequence(t, n)
    c = t // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def to_balanced(batch: Any, n: int) -> Any:
    """Every leaf of ``batch`` (``(B, T, ...)``) with its sequence dim in ``balanced_order``."""
    for a in jax.tree.leaves(batch):
        if a.ndim < 2:
            raise PlanError(
                f"context plans split dim 1 of every batch leaf (the sequence); got a leaf of shape {a.shape}"
            )
        check_sequence(a.shape[1], n)
    return jax.tree.map(lambda a: a[:, balanced_order(a.shape[1], n)], batch)


def positions(t: int) -> jax.Array:
    """Global positions of the ``t`` tokens this device holds: ``0..t-1`` with no split."""
    split = _SPLIT.get()
    if split is None:
        return jnp.arange(t)
    return _device_positions(t, lax.axis_index(split.axis), split.size)


def position_rows(table: jax.Array, t: int) -> jax.Array:
    """The rows of a learned position table for this device's ``t`` tokens (``table[:t]`` with no split)."""
    return table[:t] if _SPLIT.get() is None else table[positions(t)]


def _device_positions(t: int, i: jax.Array | int, n: int) -> jax.Array:
    c = t // 2
    return jnp.concatenate([i * c + jnp.arange(c), (2 * n - 1 - i) * c + jnp.arange(c)])


class Segments(NamedTuple):
    """Packed documents' segment ids under a sequence split, exchanged once per forward pass
    (``exchange_segments``): this device's, and the keys' it attends over (ring: the ``C - 1``
    visiting blocks' in the order they arrive, ``(C-1, b, T/C)``; all-to-all: the whole sequences' in
    their natural order, ``(b, T)``)."""

    local: jax.Array
    keys: jax.Array


def exchange_segments(segment_ids: jax.Array | None) -> Any:
    """The segment ids every layer's ``causal_attention`` takes: as they are with no split in force,
    else ``Segments`` (one exchange over the context axis for all the layers)."""
    split = _SPLIT.get()
    if segment_ids is None or split is None or split.size == 1 or isinstance(segment_ids, Segments):
        return segment_ids
    n = split.size
    if split.form == "ring":
        perm = [(d, (d + 1) % n) for d in range(n)]
        visitors = [segment_ids]
        for _ in range(1, n):
            visitors.append(lax.ppermute(visitors[-1], split.axis, perm))
        return Segments(segment_ids, jnp.stack(visitors[1:]))
    natural = np.argsort(balanced_order(segment_ids.shape[1] * n, n))
    return Segments(segment_ids, lax.all_gather(segment_ids, split.axis, axis=1, tiled=True)[:, natural])


def causal_attention(
    q_bthk: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    softcap: float | None = None,
    windowed: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention ``(B, T, H, h)`` of queries over keys and values with ``H / K`` query heads per
    key/value head (grouped-query); scores and softmax in at least float32, result in q's dtype.
    ``window``: each query sees its last ``window`` positions only (itself included); ``segment_ids``
    ``(B, T)``: only the keys of its own segment (under a context split: this device's tokens', or their
    ``exchange_segments`` done once for every layer);
    ``softcap``: each score capped to ``(-softcap, softcap)`` by ``tanh(s / softcap) * softcap`` before
    the mask (Gemma 2; always written out: the fused call takes no cap); ``windowed``: a traced boolean
    (a layer's kind, scanned beside its parameters): the window applies only where it is true, each
    device's attention still one of two static calls; ``sinks`` ``(H,)``: each head's logit in every
    softmax, with no value (GPT-OSS's; refused under a context split). Each device's attention runs by the
    implementation in force (``plans.attention``)."""
    split = _SPLIT.get()
    if split is not None:
        split.attended.append(split.form)
    if split is None or split.size == 1:
        call = functools.partial(
            attention.causal, q_bthk, k_bskh, v_bskh, segment_ids=segment_ids, softcap=softcap, sinks=sinks
        )
        return _windowed(call, window, windowed)
    if sinks is not None:
        raise PlanError(
            f"attention sinks (GPT-OSS's) under a context split of {split.size}: the split attention takes none "
            f"yet; use a plan without a context axis"
        )
    attention.check_window(window)
    attention.check_softcap(softcap)
    segment_ids = exchange_segments(segment_ids)
    if segment_ids is not None and segment_ids.local.shape != q_bthk.shape[:2]:
        raise PlanError(
            f"segment_ids must be (batch, sequence) = {q_bthk.shape[:2]}, one id per token, got {segment_ids.local.shape}"
        )
    check_heads(q_bthk.shape[2], split.size, split.form)
    attend = functools.partial(
        _ring if split.form == "ring" else _all_to_all, window=window, softcap=softcap, windowed=windowed
    )
    own = (
        _on_own_heads(attend, q_bthk, k_bskh, v_bskh, segment_ids, split)
        if split.heads_axis is not None
        else None
    )
    return attend(q_bthk, k_bskh, v_bskh, segment_ids, split) if own is None else own


def _windowed(call, window: int | None, windowed: jax.Array | None) -> jax.Array:
    """``call(window=window)``, or with ``windowed`` (traced) a ``lax.cond`` of it and ``call(window=None)``:
    two static calls, so that a fused kernel still takes either."""
    if windowed is None or window is None:
        return call(window=window)
    return lax.cond(windowed, lambda: call(window=window), lambda: call(window=None))


def exchanged_kv_heads(heads: int, kv_heads: int, n: int) -> int:
    """The key/value heads all-to-all attention moves over a context axis of ``n``: their own where they
    divide over it (device d's query heads ``d H/n ..`` read exactly its kv heads ``d K/n ..``, as
    ``attention.repeat_kv`` pairs them), else one per query head (``heads``, which divide)."""
    return kv_heads if kv_heads % n == 0 else heads


def _all_to_all(
    q_bthk: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    seg: Segments | None,
    split: Split,
    window: int | None = None,
    softcap: float | None = None,
    windowed: jax.Array | None = None,
) -> jax.Array:
    """Ulysses: sequence split -> head split, attention over the whole sequence, and back. Grouped
    key/value heads go as they are where they divide over the axis (each device pairs its own with its
    query heads), else repeated to one per query head first. Between the exchanges the sequence is put
    back in its natural order (a local gather): each device's attention is then one device's, by either
    implementation (cuDNN's and splash's causal masks skip the masked blocks; a balanced-order mask
    would hide the causal structure from them)."""
    n, heads = split.size, q_bthk.shape[2]
    kv = exchanged_kv_heads(heads, k_bskh.shape[2], n)
    k_bskh, v_bskh = attention.repeat_kv(k_bskh, kv), attention.repeat_kv(v_bskh, kv)

    def to_heads(x):  # (b, T/n, H, h) -> (b, T, H/n, h), then the natural order
        return lax.all_to_all(x, split.axis, 2, 1, tiled=True)[:, natural]

    order = balanced_order(q_bthk.shape[1] * n, n)
    natural = np.argsort(order)
    call = functools.partial(
        attention.causal,
        to_heads(q_bthk),
        to_heads(k_bskh),
        to_heads(v_bskh),
        softcap=softcap,
        segment_ids=None if seg is None else seg.keys,  # the whole sequences', in the natural order
    )
    out = _windowed(call, window, windowed)  # between the exchanges: no collective under the cond
    return lax.all_to_all(out[:, order], split.axis, 1, 2, tiled=True)


def _block(q_bthk, k_bshk, v_bshk, mask=None, softcap=None):
    """Unnormalized attention of one block: ``(o, m, l)``, o ``(b, t, H, h)``, m and l ``(b, H, t)``."""
    w = attention.wide(q_bthk.dtype)
    scores = attention.capped_scores(q_bthk, k_bshk, softcap)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(w).min)
    m = scores.max(-1)
    p = jnp.exp(scores - m[..., None])
    o = jnp.einsum("bhts,bshk->bthk", p, v_bshk.astype(w))
    return o, m, p.sum(-1)


def _merge(acc, blk):
    """Fold a block's ``(o, m, l)`` into the running ones (online softmax)."""
    o, m, total = acc
    ob, mb, total_b = blk
    new = jnp.maximum(m, mb)
    a, b = jnp.exp(m - new), jnp.exp(mb - new)
    return o * _heads_last(a) + ob * _heads_last(b), new, total * a + total_b * b


def _segments(mask: jax.Array | None, q_seg: jax.Array | None, k_seg: jax.Array | None) -> jax.Array | None:
    """``mask`` (``(1, 1, t, s)`` or None) and, with segment ids, each query's own segment's keys only."""
    if q_seg is None:
        return mask
    same = q_seg[:, None, :, None] == k_seg[:, None, None, :]
    return same if mask is None else mask & same


def _ring(
    q_bthk: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    seg: Segments | None,
    split: Split,
    window: int | None = None,
    softcap: float | None = None,
    windowed: jax.Array | None = None,
) -> jax.Array:
    """Ring attention with causal load balancing (see the module docstring); with ``window``, each block
    masked by its tokens' global positions (with ``windowed``, a traced window: the whole sequence where
    it is false). Its blocks are written out (einsum) whatever the
    implementation asked: the online softmax needs each block's running max and sum, and
    ``jax.nn.dot_product_attention`` returns a normalised output only; its ``return_residual``
    log-sum-exp (jax 0.12) is under ``stop_gradient`` and in the inputs' dtype, so merging blocks by it
    would drop part of the gradient and, in bf16, round the blocks' weights to 8 bits."""
    n, heads = split.size, q_bthk.shape[2]
    t = q_bthk.shape[1]
    c = t // 2
    if windowed is not None and window is not None:
        window = jnp.where(windowed, window, t * n)  # t * n: farther than any key
    i = lax.axis_index(split.axis)
    perm = [(d, (d + 1) % n) for d in range(n)]
    pos = _device_positions(t, i, n)
    kv = (k_bskh, v_bskh)
    # step 0: the device's own block (its chunks' order is the same on every device, so is the causal mask)
    local = np.concatenate([np.arange(c), (2 * n - 1) * c + np.arange(c)])
    diagonal = attention.allowed(local, local) if window is None else attention.allowed(pos, pos, window)
    seg_bt = None if seg is None else seg.local
    diagonal = _segments(diagonal, seg_bt, seg_bt)
    acc = _block(
        q_bthk, attention.repeat_kv(k_bskh, heads), attention.repeat_kv(v_bskh, heads), diagonal, softcap
    )
    first, second = _halves(acc, c)
    for s in range(1, n):
        kv = tuple(lax.ppermute(x, split.axis, perm) for x in kv)  # now the block of device i - s
        visitor = None if seg is None else seg.keys[s - 1]  # its segment ids (None: no segments)
        k, v = attention.repeat_kv(kv[0], heads), attention.repeat_kv(kv[1], heads)
        seen = _device_positions(t, (i - s) % n, n)

        def before(
            first, second, k=k, v=v, seen=seen, vis=visitor
        ):  # chunks j < i: every query sees its first
            mask = None if window is None else attention.allowed(pos, seen[:c], window)
            mask = _segments(mask, seg_bt, None if vis is None else vis[:, :c])
            both = _halves(_block(q_bthk, k[:, :c], v[:, :c], mask, softcap), c)
            return _merge(first, both[0]), _merge(second, both[1])

        def between(first, second, k=k, v=v, seen=seen, vis=visitor):  # j > i: the second chunk sees it whole
            mask = None if window is None else attention.allowed(pos[c:], seen, window)
            mask = _segments(mask, None if seg_bt is None else seg_bt[:, c:], vis)
            return first, _merge(second, _block(q_bthk[:, c:], k, v, mask, softcap))

        first, second = lax.cond(i >= s, before, between, first, second)
    out = jnp.concatenate([first[0] / _heads_last(first[2]), second[0] / _heads_last(second[2])], axis=1)
    attention.note("einsum")
    return out.astype(q_bthk.dtype)


def _on_own_heads(
    attend, q_bthk: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, seg: Segments | None, split: Split
) -> jax.Array | None:
    """``attend`` (the ring or all-to-all) on this device's heads only, in a region manual over the axis
    tensor parallelism splits them on (``Split.heads_axis``: tp+cp, fsdp+tp+cp), or None where there is
    none or the query and key/value heads do not both divide over it. Heads attend independently, so
    nothing moves over that axis. Left to the partitioner instead (JAX 0.12, XLA:CPU), the ring's
    ``lax.cond`` on a context axis of 2 devices came out with its accumulators split another way in the
    backward pass, moved there and back by 10 all-to-alls over the model axis per step (the 2-layer
    GPT, tp+cp context=2; pinning the accumulators' heads by sharding constraints made it 50), and
    all-to-all attention gathered the heads over the model axis and exchanged all of them over
    context (the Llama, tp+cp context=4,model=2: 8 all-gathers, twice the all-to-all bytes)."""
    mesh = get_abstract_mesh()
    m = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get(split.heads_axis, 1)
    heads = q_bthk.shape[2]
    if m == 1 or heads % m or k_bskh.shape[2] % m:
        return None
    if split.form == "all-to-all" and heads // m % split.size:
        raise PlanError(
            f"all-to-all attention under tensor parallelism splits each model shard's {heads}/{m} heads over "
            f"context={split.size}: use context_attention='ring', or axes whose product divides {heads} heads"
        )
    spec = P(None, None, split.heads_axis, None)
    if seg is None:
        own = jax.shard_map(
            lambda q, k, v: attend(q, k, v, None, split),
            mesh=mesh,
            in_specs=(spec, spec, spec),
            out_specs=spec,
            axis_names={split.heads_axis},
            check_vma=False,
        )
        return own(q_bthk, k_bskh, v_bskh)
    own = jax.shard_map(
        lambda q, k, v, s: attend(q, k, v, s, split),
        mesh=mesh,
        in_specs=(spec, spec, spec, P()),
        out_specs=spec,
        axis_names={split.heads_axis},
        check_vma=False,
    )
    return own(q_bthk, k_bskh, v_bskh, seg)


def _halves(acc, c):
    return tuple(x[:, :c] for x in acc[:1]) + tuple(x[..., :c] for x in acc[1:]), tuple(
        x[:, c:] for x in acc[:1]
    ) + tuple(x[..., c:] for x in acc[1:])


def _heads_last(x_bht: jax.Array) -> jax.Array:
    """``(b, H, t)`` -> ``(b, t, H, 1)``, to scale an output ``(b, t, H, h)``."""
    return jnp.swapaxes(x_bht, 1, 2)[..., None]
