"""A batch of token sequences, as every token model, data stream and plan reads it: the one owner of
its fields and their order.

A plain ``(inputs, targets)`` pair is a batch (pretraining on whole windows); ``TokenBatch`` adds what
fine-tuning and packed documents need, each optional (``None``: absent):

- ``weights`` ``(B, T)`` float: each target's weight in the loss. The loss is the *mean over every
  token of the global batch* of ``token_loss * weights``; the data stream scales a mask (1: learn this
  target, 0: a prompt or padding token) by ``tokens / masked tokens`` of the global batch, so that mean
  is the masked mean over the global batch under every plan: data and context shards, pipeline
  micro-batches and accumulation steps all average equal-sized pieces of one mean.
- ``segment_ids`` ``(B, T)`` int: packed documents; a query attends to keys of its own segment only.
- ``positions`` ``(B, T)`` int: each token's position within its document (reset at each document
  start), for rotary or learned position embeddings; absent: ``0..T-1`` of the row.
- ``reference`` ``(B, 2)`` float: preference tuning's pairs (one per row, ``meshkit.models.preference``):
  the frozen reference model's log-probs of the row's chosen and rejected answers, filled before each
  step; no model reads it.

It is a ``NamedTuple``, so a pytree whose leaves the plans split like any batch's (rows on the data
axis, the sequence on the context axis), and ``batch[0]``, ``batch[1]`` stay the inputs and targets.
"""

from __future__ import annotations

from typing import Any, NamedTuple

BATCH_FIELDS = ("inputs", "targets", "weights", "segment_ids", "positions", "reference")
"""The fields of a token batch, in order (a plain pair holds the first two)."""


class TokenBatch(NamedTuple):
    inputs: Any
    targets: Any
    weights: Any = None
    segment_ids: Any = None
    positions: Any = None
    reference: Any = None


def extras(batch: Any) -> tuple[Any, Any, Any]:
    """``(weights, segment_ids, positions)`` of a batch, ``None`` where absent (a plain pair: all)."""
    rest = tuple(batch[2:]) + (None,) * (len(BATCH_FIELDS) - len(batch))
    return rest[0], rest[1], rest[2]


def pipeline_refusal(what: str) -> str:
    """Why pipeline plans refuse packed documents (``what``: what the run or batch gives), naming the
    plans that take them."""
    from meshkit.spec.plans import PIPELINE_PLANS, PLANS

    others = ", ".join(p for p in PLANS if p not in PIPELINE_PLANS)
    return (
        f"pipeline plans ({', '.join(PIPELINE_PLANS)}) do not take {what} (packed documents' masks and "
        f"positions) yet: use a plan without a stage axis ({others})"
    )
