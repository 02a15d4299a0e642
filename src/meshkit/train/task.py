"""What ``meshkit train --task`` asks of the run (issue 37): the one place a task becomes the data
stream's options, the checks of its batches, and what a step logs of them.

- ``pretrain``: the next-token loss on every token; with ``--document-masks`` the token windows carry
  segment ids and positions from their end-of-text ids (``spec.batch``: no weights), so no token
  attends across a document boundary and each document's positions start at 0.
- ``sft``: the data is conversations (``meshkit data prepare --chat``: a loss mask beside the ids); its batches
  carry weights (the assistant's tokens, scaled by ``tokens / masked tokens`` of the global batch),
  segment ids and positions: conversations are always packed with a mask per document.
- ``dpo``: the data is preference pairs (``meshkit data prepare --chat`` on rows of prompt, chosen and
  rejected), one pair per row (:mod:`meshkit.models.preference`); the loss is ``--preference-loss``
  against the frozen starting model, whose log-probs of each batch's pairs (``reference_step``) fill the
  batch's ``reference`` before each step.

The model reads whichever fields a batch has (``models.token_loss``), so the task changes what the data
stream yields and what is checked and logged here; the step and the held-out loss are the same code.
"""

from __future__ import annotations

from typing import Any

from meshkit._errors import MeshkitError
from meshkit.spec import TASKS, one_of
from meshkit.spec.batch import extras, pipeline_refusal


class TaskError(MeshkitError):
    """The run's data does not give what its ``--task`` trains on."""


def problem(cfg: Any) -> str | None:
    """Why the run's ``--task`` and ``--document-masks`` cannot train as given (one line naming the fix),
    or None. Checked with the other options, before anything is read."""
    if cfg.data.task not in TASKS:
        return f"unknown --task {cfg.data.task!r}: use {one_of(TASKS, notes={k: '' for k in TASKS})}"
    if cfg.data.task == "sft" and cfg.data.data is None:
        return "--task sft needs --data: a directory of conversations prepared with their loss mask"
    from meshkit.train.objective import problem as objective_problem

    if (said := objective_problem(cfg)) is not None:
        return said
    packs = cfg.data.task != "pretrain" or cfg.data.document_masks
    if packs and cfg.parallel.plan_info.pipeline:
        what = f"--task {cfg.data.task}" if cfg.data.task != "pretrain" else "--document-masks"
        return pipeline_refusal(what) + f", or drop {what}"
    return None


def batch_options(cfg: Any) -> dict[str, Any]:
    """The options of the run's data stream (``Corpus.batches``, ``Batches``) that its task sets:
    ``document_masks`` for
    pretraining with ``--document-masks``; none for fine-tuning, whose prepared conversations make the
    stream yield weights, segment ids and positions themselves. The training and the held-out streams
    both take these, so the held-out loss is weighted as the training loss is."""
    if cfg.data.task == "pretrain" and cfg.data.document_masks:
        return {"document_masks": True}
    return {}


def check_data(cfg: Any, data: Any) -> None:
    """The run's data (a ``Corpus``) is what its task trains on: conversations with a loss mask for
    ``sft`` (``Corpus.chat``: ``meshkit data prepare --chat``), and no such mask, which a pretraining run
    would silently train on, for ``pretrain``; raises ``TaskError`` naming the fix."""
    preference = bool(getattr(data, "preference", False))
    if cfg.data.task == "dpo" and not preference:
        raise TaskError(
            f"--task dpo trains on preference pairs, and {data.source} holds none: prepare rows of prompt, chosen "
            "and rejected with meshkit data prepare --chat, or drop --task dpo"
        )
    if cfg.data.task != "dpo" and preference:
        raise TaskError(
            f"{data.source} holds preference pairs (chosen, rejected): pass --task dpo to train on them"
        )
    if cfg.data.task == "sft" and not data.chat:
        raise TaskError(
            f"--task sft trains on conversations with a loss mask, and {data.source} holds none: prepare them with "
            f"meshkit data prepare --chat, or drop --task sft"
        )
    if cfg.data.task == "pretrain" and data.chat:
        raise TaskError(
            f"{data.source} holds conversations with a loss mask: pass --task sft to train on them"
        )
    if cfg.data.document_masks and data.tokenizer != "BPE":  # text and ids have no end-of-text id to split at
        raise TaskError(
            f"--document-masks splits documents at the end-of-text id of token shards, and {data.source} "
            f"({data.tokenizer}) has none: give --data a directory from meshkit data prepare, or drop "
            f"--document-masks"
        )


def check_learns(cfg: Any, batches: Any) -> None:
    """Refuse a fine-tuning run whose rows hold no target to learn (every step would train on 0 tokens,
    its loss 0.0, and the run would end as a success having learnt nothing): every conversation's
    answer cut off by ``--seq-len``, or none with an answer at all (a template that never renders the
    assistant's turn). Stops at the first conversation that has one, so a run that can learn pays for
    one read."""
    packing = batches.packing
    if packing is None:
        return
    if getattr(batches, "preference", False):
        return _check_pairs_learn(cfg, packing)
    import numpy as np  # here: see trained_tokens

    source, first = packing.source, None
    for d in range(source.documents):
        start, cut = int(source.starts[d]), int(packing.lengths[d])
        mask = source.masks.read(start, int(source.ends[d]))
        if mask[1:cut].any():  # a document's first id is never a target
            return
        learnt = np.flatnonzero(mask[1:])
        if len(learnt) and (first is None or learnt[0] < first):
            first = int(learnt[0])
    if first is None:
        raise TaskError(
            f"no conversation in {cfg.data.data} has a token to learn: its chat template renders no assistant "
            f"turn to learn from; prepare it again with a template that does (meshkit data prepare --chat)"
        )
    raise TaskError(
        f"--seq-len {cfg.data.seq_len} cuts every conversation in {cfg.data.data} before its answer: nothing would "
        f"be learnt; use --seq-len {first + 1} or more (the shortest prompt before an answer is {first + 1} tokens)"
    )


def _check_pairs_learn(cfg: Any, rows: Any) -> None:
    """``check_learns`` for preference pairs (``PairRows``): some pair keeps a target of both its answers
    in its row (a side cut before its answer has a log-prob of 0, and a loss of such pairs alone would
    only push the other side). Stops at the first pair that does."""
    import numpy as np  # here: see trained_tokens

    source, need = rows.source, None
    for k in range(rows.rows):
        firsts = {}  # each side's first learnt target (it predicts id first + 1 of the document)
        for d in (2 * k, 2 * k + 1):
            learnt = np.flatnonzero(source.masks.read(int(source.starts[d]), int(source.ends[d]))[1:])
            firsts[d] = int(learnt[0]) if len(learnt) else None
        if all(f is not None and f + 1 < rows.lengths[d] for d, f in firsts.items()):
            return
        if None not in firsts.values():  # a row of twice the longer side's first answer id fits both
            width = 2 * (max(firsts.values()) + 2)
            need = width if need is None else min(need, width)
    if need is None:
        raise TaskError(
            f"no pair in {cfg.data.data} has an answer to learn on both sides: prepare it again from rows whose "
            "chosen and rejected answers are not empty"
        )
    raise TaskError(
        f"--seq-len {cfg.data.seq_len} cuts an answer of every pair in {cfg.data.data}: nothing would be learnt; "
        f"use --seq-len {need - 1} or more (a row holds a pair: both prompts and the start of both answers)"
    )


def trained_tokens(batch: Any, tokens: int) -> int | None:
    """Targets of the global batch of ``tokens`` tokens the loss learns (weight above 0), from this
    process's rows of a weighted batch (None: no weights, every token): every learnt target's weight is
    ``tokens / learnt`` (``spec.batch``), so one weight gives the global count."""
    weights = extras(batch)[0] if isinstance(batch, tuple) else None
    if weights is None:
        return None
    import numpy as np  # here: config imports this module, and `meshkit comm --hlo` imports no NumPy

    peak = np.asarray(np.max(weights), np.float64)
    import jax

    if jax.process_count() > 1:  # a process whose rows learn nothing still logs the global count
        from jax.experimental import multihost_utils

        peak = np.max(multihost_utils.process_allgather(peak))
    return round(tokens / float(peak)) if peak > 0 else 0
