"""Character-level data: a UTF-8 text (by default Python's own ``pydoc_data.topics``, so training
needs no download) tokenised per character, or a ``.npy`` of token ids, held in memory.

``load_text`` reads it, ``encode``/``decode`` map text to ids and back under the sorted character
vocabulary, ``split`` holds out the tail for evaluation. Token data made by ``meshkit data
prepare`` (BPE, shards on disk) is :mod:`meshkit.data.shards`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.data.source import DataError
from meshkit.files import path_kind

DEFAULT_SOURCE = "pydoc_data.topics (CPython reference docs)"


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TextData:
    """A corpus as 1-D int32 token ids, with its character vocabulary when it came from text."""

    tokens: np.ndarray
    vocab: tuple[str, ...] | None
    vocab_size: int
    source: str


# -- loading ---------------------------------------------------------------------------------
def default_documents() -> list[str]:
    """The embedded default corpus: the topics of Python's ``pydoc_data.topics``, sorted by name."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _default_text() -> str:
    return "\n\n".join(default_documents())


def _from_text(text: str, source: str) -> TextData:
    vocab = tuple(sorted(set(text)))
    return TextData(tokens=encode(text, vocab), vocab=vocab, vocab_size=len(vocab), source=source)


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file '{path}' ({e.strerror or e}): fix its permissions") from None
    if not data:
        raise DataError(f"data file '{path}' is empty: give a UTF-8 text file or a .npy of token ids")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data file '{path}' is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
            "save it as UTF-8, or give a .npy of token ids"
        ) from None


def _read_ids(path: Path) -> TextData:
    try:
        ids = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"cannot read '{path}' as a .npy array ({e}): save it with numpy.save") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size == 0:
        raise DataError(
            f"'{path}' holds a {ids.dtype} array of shape {ids.shape}: "
            "give a non-empty 1-D array of integer token ids"
        )
    if ids.min() < 0 or ids.max() >= 2**31:
        raise DataError(f"'{path}' has token ids outside [0, 2**31): give non-negative int32 ids")
    return TextData(tokens=ids.astype(np.int32), vocab=None, vocab_size=int(ids.max()) + 1, source=str(path))


def load_text(path: str | None = None) -> TextData:
    """Load the training corpus.

    ``None`` gives the text of Python's ``pydoc_data.topics`` (about 490k characters of the
    CPython reference docs); a path ending in ``.npy`` gives its 1-D integer token ids (no
    vocabulary, ``vocab_size = max id + 1``); any other path is read as UTF-8 text. Text is
    tokenised per character, with the sorted set of its characters as the vocabulary.
    """
    if path is None:
        return _from_text(_default_text(), DEFAULT_SOURCE)
    file = Path(path)
    if not file.is_file():
        kind = path_kind(file)
        if kind == "missing":
            raise DataError(f"no data file '{path}': give a UTF-8 text file or a .npy of token ids")
        hint = "name a file inside it" if kind == "a directory" else "copy what it streams into a file first"
        raise DataError(
            f"data '{path}' is {kind}, not a file: give a UTF-8 text file or a .npy of token ids ({hint})"
        )
    if file.suffix == ".npy":
        return _read_ids(file)
    return _from_text(_read_text(file), str(path))


# -- tokens ----------------------------------------------------------------------------------
def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def encode(text: str, vocab: tuple[str, ...] | None) -> np.ndarray:
    """Character ids of ``text`` under the sorted character ``vocab``, as a 1-D int32 array."""
    if vocab is None:
        raise DataError("this data is token ids with no vocabulary: give text data to encode text")
    codes, points = _code_points("".join(vocab)), _code_points(text)
    ids = np.searchsorted(codes, points).clip(max=len(codes) - 1)
    unknown = codes[ids] != points
    if unknown.any():
        char = text[int(np.argmax(unknown))]
        raise DataError(
            f"character {char!r} is not in the vocabulary: use text made of the training characters"
        )
    return ids.astype(np.int32)


def decode(ids: Any, vocab: tuple[str, ...] | None) -> str:
    """Text of character ``ids`` under ``vocab``; with no vocabulary, the ids joined by spaces."""
    ids = np.asarray(ids).reshape(-1)
    if vocab is None:
        return " ".join(map(str, ids.tolist()))
    return "".join(vocab[i] for i in ids.tolist())


def split(tokens: np.ndarray, eval_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)``: the last ``eval_fraction`` of ``tokens`` held out for evaluation."""
    if not 0 <= eval_fraction < 1:
        raise DataError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    n_train = len(tokens) - round(len(tokens) * eval_fraction)
    return tokens[:n_train], tokens[n_train:]
