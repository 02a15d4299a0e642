"""The next-token loss every token family uses (``gpt``, ``llama``, ``gemma``), and the token batch's
optional fields (``meshkit.spec.batch``) checked as the models read them: one owner of both.

``cross_entropy`` is the mean over every token of ``token_loss * weights`` (no weights: of
``token_loss``). The weights already carry the global normalisation (``spec.batch``: the data stream
scales a mask by ``tokens / masked tokens`` of the global batch), so the mean is the masked mean under
every plan, and nothing here divides by a count of masked tokens: a batch of all-zero weights gives a
loss of 0 and zero gradients, not a 0/0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
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
