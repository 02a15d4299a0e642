"""Data for training: a BPE tokenizer (Hugging Face ``tokenizers``), token shards written once by
``meshkit data prepare``, and the grain pipeline a run draws its batches from (global shuffle by
seed, packing, each process's slice, prefetch on threads, a position saved in every checkpoint);
character-level text and ``.npy`` ids too.

Modules: ``corpus`` (a run's data: ``load``), ``pipeline`` (``Batches``, ``global_batch``),
``shards`` (the on-disk format), ``prepare`` (text to shards), ``tokenizer``, ``text``
(character-level), ``source`` (token streams in memory or on disk).
"""

from meshkit.data.corpus import Corpus, load
from meshkit.data.pipeline import Batches, global_batch, process_rows
from meshkit.data.source import DataError

__all__ = ["Batches", "Corpus", "DataError", "global_batch", "load", "process_rows"]
