"""The BPE tokenizer of token data: Hugging Face ``tokenizers``, byte level, with an end-of-text token.

``train_bpe`` learns one from texts; ``load_tokenizer`` reads an existing ``tokenizer.json``. The one
saved beside the shards (``tokenizer.json``) is what every later command encodes and decodes with.
Byte level means every text round-trips exactly (``decode(encode(t)) == t``), and each id stands for a
fixed string of bytes, which gives bits per byte (:meth:`Tokenizer.token_bytes`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from meshkit.data.source import DataError

EOT = "<|endoftext|>"
"""The end-of-text token that separates documents in the shards."""
MIN_VOCAB = 257
"""The 256 byte symbols and the end-of-text token."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the end-of-text id, encoding special tokens' text as plain text
    (a document that contains ``<|endoftext|>`` keeps it as characters, not as a boundary)."""

    def __init__(self, tok, source: str) -> None:
        self._tok, self.source = tok, source
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise DataError(
                f"tokenizer {source} has no {EOT} token: add it as a special token, or let "
                "meshkit data prepare train one (leave out --tokenizer)"
            )
        self.eot_id: int = eot
        self.vocab_size: int = tok.get_vocab_size()
        tok.encode_special_tokens = True

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode ``texts`` in parallel (the library's own threads)."""
        return [
            np.asarray(e.ids, np.int32)
            for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)  # no offsets: 2x
        ]

    def decode(self, ids) -> str:
        return self._tok.decode(np.asarray(ids).reshape(-1).tolist(), skip_special_tokens=False)

    def vocabulary(self) -> dict[str, int]:
        """Every token's string and id (two tokenizers with the same one encode alike)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def to_str(self) -> str:
        return self._tok.to_str()

    def special(self, i: int) -> str | None:
        """The string of id ``i`` if it is one of the tokenizer's special tokens, else None."""
        token = self._tok.get_added_tokens_decoder().get(i)
        return token.content if token is not None and token.special else None

    @functools.cached_property
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each id stands for (0 for special tokens), as int64 of length ``vocab_size``."""
        from tokenizers import decoders

        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        counts = np.zeros(self.vocab_size, np.int64)
        byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        table = _byte_level_table() if byte_level else {}
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if token in special or i >= self.vocab_size:
                continue
            if byte_level and all(c in table for c in token):
                counts[i] = len(token)  # each symbol is one byte
            else:
                counts[i] = len(self._tok.decode([i], skip_special_tokens=False).encode("utf-8"))
        return counts


@functools.cache
def _byte_level_table() -> frozenset[str]:
    from tokenizers import pre_tokenizers

    return frozenset(pre_tokenizers.ByteLevel.alphabet())


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` ids (``EOT`` is id 0) learnt from ``texts``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size} is below {MIN_VOCAB} (256 bytes and {EOT}): give a larger one"
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return Tokenizer(tok, "trained by meshkit data prepare")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A ``tokenizer.json`` saved by Hugging Face ``tokenizers``; one line naming the fix if it is not one."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    if not path.is_file():
        raise DataError(f"no tokenizer file '{path}': give a tokenizer.json saved by Hugging Face tokenizers")
    try:
        tok = HFTokenizer.from_str(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, Exception) as e:  # tokenizers raises a bare Exception
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(
            f"'{path}' is not a tokenizer.json ({first}): give one saved by Hugging Face tokenizers "
            "(Tokenizer.save)"
        ) from None
    return Tokenizer(tok, f"'{path}'")
