"""Data for training: a BPE tokenizer (Hugging Face ``tokenizers``), token shards written once by
``meshkit data prepare``, and the grain pipeline a run draws its batches from (global shuffle by
seed, packing, each process's slice, prefetch on threads, a position saved in every checkpoint);
character-level text and ``.npy`` ids too.

Modules: ``corpus`` (a run's data: ``load``), ``pipeline`` (``Batches``, ``global_batch``),
``mixture`` (weighted mixtures of prepared directories), ``shards`` (the on-disk format), ``prepare``
(text to shards), ``readers`` (its inputs: text, JSONL, Parquet, datasets directories), ``tokenizer``,
``text`` (character-level), ``source`` (token streams in memory or on disk); for fine-tuning,
``chat_template`` (a model's chat template, rendered as transformers does), ``chat`` (conversations to
ids and an assistant-only loss mask), ``prepare_chat`` (``meshkit data prepare --chat``) and ``packing``
(whole conversations packed into rows).

Names are imported on first use, so that ``meshkit data prepare`` (the tokenizer and the shards)
starts without JAX and grain, which only the pipeline needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshkit.data.corpus import Corpus, load
    from meshkit.data.pipeline import Batches, global_batch, process_rows
    from meshkit.data.source import DataError

_WHERE = {
    "Corpus": "meshkit.data.corpus",
    "load": "meshkit.data.corpus",
    "Batches": "meshkit.data.pipeline",
    "global_batch": "meshkit.data.pipeline",
    "process_rows": "meshkit.data.pipeline",
    "DataError": "meshkit.data.source",
}
__all__ = ["Batches", "Corpus", "DataError", "global_batch", "load", "process_rows"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'meshkit.data' has no attribute {name!r}")
