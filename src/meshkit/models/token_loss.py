"""The next-token loss every token family uses (``gpt``, ``llama``, ``gemma``), and the token batch's
optional fields (``meshkit.spec.batch``) checked as the models read them: one owner of both.

``cross_entropy`` is the mean over every token of ``token_loss * weights`` (no weights: of
``token_loss``). The weights already carry the global normalisation (``spec.batch``: the data stream
scales a mask by ``tokens / masked tokens`` of the global batch), so the mean is the masked mean under
every plan, and nothing here divides by a count of masked tokens: a batch of all-zero weights gives a
loss of 0 and zero gradients, not a 0/0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshkit._errors import MeshkitError
from meshkit.spec.batch import extras, pipeline_refusal


class BatchError(MeshkitError):
    """A token batch whose fields do not fit together."""


def cross_entropy(
    logits_btv: jax.Array, targets_bt: jax.Array, weights_bt: jax.Array | None = None
) -> jax.Array:
    """Mean next-token cross-entropy (each token's weighted by ``weights_bt`` where given), written so that
    logits split over the vocabulary stay split: every reduction over the vocabulary (the max, the sum
    of exponentials, the target's logit picked by a comparison rather than a gather) is elementwise work
    plus a reduction, which the compiler turns into an all-reduce of one number per token."""
    token = -token_logprobs(logits_btv, targets_bt)
    return jnp.mean(token if weights_bt is None else token * weights_bt.astype(token.dtype))


def whole_logits(head: Callable[[jax.Array], jax.Array], x_btd: jax.Array) -> jax.Array:
    """What a family's forward returns of its last hidden states by default: the head's logits of every
    position (``head_loss``, given instead, returns the loss)."""
    return head(x_btd)


def head_loss(
    head: Callable[[jax.Array], jax.Array],
    x_btd: jax.Array,
    targets_bt: jax.Array,
    weights_bt: jax.Array | None = None,
    chunk: int = 0,
) -> jax.Array:
    """``cross_entropy(head(x), targets, weights)``: the model's head (its final norm, the output matrix, a
    cap) and the loss. With ``chunk`` (``--loss-chunk``), ``chunk`` positions of every row at a time, as
    fused linear cross-entropy kernels do: each piece's logits are made, reduced to its summed loss and, in
    the same pass, to its gradients (of the piece's hidden states, and added up over the pieces for the
    head's parameters), then dropped; the backward pass only scales what the forward kept. No more than
    ``B x chunk x V`` logits exist at once instead of ``B x T x V`` (at a vocabulary of 128 k the whole
    float32 logits are the largest activation), and none is made twice. Equal to the whole form to
    rounding (``tests/test_loss_chunk.py``)."""
    if not chunk:
        return cross_entropy(head(x_btd), targets_bt, weights_bt)
    b, t = x_btd.shape[:2]
    if t % chunk:
        raise MeshkitError(
            f"--loss-chunk {chunk} does not divide the sequence of {t} positions: give a divisor of {t}"
        )
    weights = jnp.ones((b, t), x_btd.dtype) if weights_bt is None else weights_bt
    fn, consts = jax.closure_convert(head, x_btd[:, :chunk])  # the head's parameters as arguments
    return _pieces(fn, chunk, consts, x_btd, targets_bt, weights)


def _split(a: jax.Array, chunk: int) -> jax.Array:
    """``(B, T, ...)`` as ``(T / chunk, B, chunk, ...)``: the pieces, scanned over."""
    b, t = a.shape[:2]
    return jnp.swapaxes(a.reshape(b, t // chunk, chunk, *a.shape[2:]), 0, 1)


def _summed(fn: Callable, consts: list, x: jax.Array, target: jax.Array, weight: jax.Array) -> jax.Array:
    token = -token_logprobs(fn(x, *consts), target)
    return jnp.sum(token * weight.astype(token.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pieces(fn, chunk, consts, x_btd, targets_bt, weights_bt):
    b, t = x_btd.shape[:2]
    per = lambda xs: _summed(fn, consts, *xs)  # noqa: E731
    return jnp.sum(lax.map(per, tuple(_split(a, chunk) for a in (x_btd, targets_bt, weights_bt)))) / (b * t)


def _pieces_fwd(fn, chunk, consts, x_btd, targets_bt, weights_bt):
    b, t = x_btd.shape[:2]
    grad = jax.value_and_grad(lambda c, x, tg, w: _summed(fn, c, x, tg, w), argnums=(0, 1))

    def piece(carry, xs):
        total, g_consts = carry
        value, (g_c, g_x) = grad(consts, *xs)
        return (total + value, jax.tree.map(jnp.add, g_consts, g_c)), g_x

    pieces = tuple(_split(a, chunk) for a in (x_btd, targets_bt, weights_bt))
    kind = jax.eval_shape(
        lambda: _summed(fn, consts, *(a[0] for a in pieces))
    ).dtype  # the logits' (>= float32)
    zeros = (jnp.zeros((), kind), jax.tree.map(jnp.zeros_like, consts))
    (total, g_consts), g_x = lax.scan(piece, zeros, pieces)
    g_x = jnp.swapaxes(g_x, 0, 1).reshape(x_btd.shape)
    return total / (b * t), (g_consts, g_x, targets_bt, weights_bt, b * t)


def _pieces_bwd(fn, chunk, residuals, g):
    g_consts, g_x, targets_bt, weights_bt, n = residuals
    scale = g / n
    return (
        jax.tree.map(lambda a: (a * scale).astype(a.dtype), g_consts),
        (g_x * scale).astype(g_x.dtype),
        np.zeros(targets_bt.shape, jax.dtypes.float0),
        jnp.zeros_like(weights_bt),  # the weights are data: no gradient flows to them
    )


_pieces.defvjp(_pieces_fwd, _pieces_bwd)


def token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """Each target's log-probability ``(B, T)`` (in at least float32), every reduction over the vocabulary
    elementwise work plus a reduction (``cross_entropy``): the one place meshkit reads a token's log-prob
    from logits for training (the preference losses sum it per sequence)."""
    logits = logits_btv.astype(jnp.promote_types(logits_btv.dtype, jnp.float32))
    peak = lax.stop_gradient(jnp.max(logits, -1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(logits - peak), -1)) + peak[..., 0]
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    picked = jnp.sum(jnp.where(vocab == targets_bt[..., None], logits, 0.0), -1)
    return picked - lse


def batch_extras(batch: Any) -> tuple[Any, Any, Any]:
    """``(weights, segment_ids, positions)`` of a token batch (``None`` where absent), each checked to be
    ``(B, T)`` like the inputs and of its kind (weights float, ids and positions integer)."""
    inputs = batch[0]
    fields = dict(zip(("weights", "segment_ids", "positions"), extras(batch), strict=True))
    for name, value in fields.items():
        if value is None:
            continue
        if tuple(value.shape) != tuple(inputs.shape):
            raise BatchError(
                f"batch {name} has shape {tuple(value.shape)} but the inputs {tuple(inputs.shape)}: give one "
                f"{name[:-1] if name != 'positions' else 'position'} per token"
            )
        floating = jnp.issubdtype(value.dtype, jnp.floating)
        if floating != (name == "weights"):
            kind = "floats" if name == "weights" else "integers"
            raise BatchError(f"batch {name} must be {kind}, got dtype {value.dtype}")
    return fields["weights"], fields["segment_ids"], fields["positions"]


def loss_of(logits_btv: jax.Array, batch: Any) -> jax.Array:
    """``cross_entropy`` of a batch's logits: its targets, weighted by its weights where it has them."""
    return cross_entropy(logits_btv, batch[1], batch_extras(batch)[0])


def stage_extras(batch: Any) -> None:
    """Pipeline stages pass one activation between devices: a batch's segment ids and positions cannot
    reach the blocks there (its weights can, in the loss). Refused by name."""
    _, segment_ids, positions = batch_extras(batch)
    given = [n for n, v in (("segment_ids", segment_ids), ("positions", positions)) if v is not None]
    if given:
        raise BatchError(
            pipeline_refusal(f"a batch's {' and '.join(given)}") + ", or batches without them (weights work)"
        )
