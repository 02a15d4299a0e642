"""The input pipeline of ``meshkit train``: text or token ids in, process-local batches out.

``load_text`` reads the corpus (by default the text of Python's own ``pydoc_data.topics``, so
training needs no download), ``split`` holds out its tail for evaluation, ``Batches`` streams
windows of ``seq_len + 1`` tokens in a shuffled order that is a pure function of
``(seed, example index)`` -- so every process reads only its own examples and a run resumes
exactly from a small JSON-able state -- and ``global_batch`` assembles the per-process slices
into global ``jax.Array``\\s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Sharding

from meshkit._errors import MeshkitError
from meshkit.train.lock import file_kind

_DEFAULT_SOURCE = "pydoc_data.topics (CPython reference docs)"
_STATE_KEYS = ("seed", "seq_len", "global_batch", "num_tokens")


class DataError(MeshkitError):
    """The training data cannot be read or batched as asked."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TextData:
    """A corpus as 1-D int32 token ids, with its character vocabulary when it came from text."""

    tokens: np.ndarray
    vocab: tuple[str, ...] | None
    vocab_size: int
    source: str


# -- loading ---------------------------------------------------------------------------------
def _default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


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
        return _from_text(_default_text(), _DEFAULT_SOURCE)
    file = Path(path)
    if not file.is_file():
        kind = file_kind(file, follow=True)
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


# -- batches ---------------------------------------------------------------------------------
class Batches:
    """Deterministic, resumable, process-aware stream of ``(inputs, targets)`` token windows.

    Example ``i`` of the run is the window of ``seq_len + 1`` tokens starting at the ``i``-th
    position of a shuffled order of all valid starts (reshuffled each epoch), so the stream is
    a pure function of ``(seed, i)``. ``next(batches)`` returns this process's slice of the next
    global batch: examples ``[b*G + p*L, b*G + (p+1)*L)`` of global batch ``b`` for process
    ``p``, with ``L = G // process_count``, as int32 arrays of shape ``(L, seq_len)``; the
    targets are the inputs shifted by one token.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int32)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        self._check()
        self.local_batch = global_batch // self.process_count
        self._batch = 0
        num_starts = len(self.tokens) - seq_len
        self._examples = (
            grain.MapDataset.range(num_starts)
            .shuffle(seed=seed)
            .repeat()
            .map(lambda start: self.tokens[start : start + seq_len + 1])
        )

    def _check(self) -> None:
        if self.tokens.ndim != 1:
            raise DataError(f"tokens must be a 1-D array of ids, got shape {self.tokens.shape}")
        if self.seq_len < 1 or self.global_batch < 1:
            raise DataError(
                f"sequence length and global batch must be positive, got {self.seq_len} and {self.global_batch}"
            )
        if self.seq_len + 1 > len(self.tokens):
            raise DataError(
                f"sequence length {self.seq_len} needs at least {self.seq_len + 1} tokens but the data has "
                f"{len(self.tokens)}; use a shorter --seq-len or more data"
            )
        if not 0 <= self.seed < 2**32:
            raise DataError(f"data seed must be in [0, 2**32), got {self.seed}")
        if not 0 <= self.process_index < self.process_count:
            raise DataError(f"process index {self.process_index} is not in [0, {self.process_count})")
        if self.global_batch % self.process_count:
            raise DataError(
                f"global batch {self.global_batch} does not divide over {self.process_count} processes; "
                f"use a --batch-size that is a multiple of {self.process_count}"
            )

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        first = self._batch * self.global_batch + self.process_index * self.local_batch
        windows = np.stack([self._examples[i] for i in range(first, first + self.local_batch)])
        self._batch += 1
        return windows[:, :-1], windows[:, 1:]

    next = __next__

    @property
    def state(self) -> dict[str, int]:
        """JSON-able position of the stream: the next global batch and what fixes the order."""
        return {
            "batch": self._batch,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_tokens": len(self.tokens),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (as given by ``state``) exactly where that stream left off."""
        if not isinstance(state, dict) or not isinstance(state.get("batch"), int) or state["batch"] < 0:
            raise DataError(f"data state {state!r} has no batch count: give the state saved with the run")
        mine = self.state
        for key in _STATE_KEYS:
            if state.get(key) != mine[key]:
                raise DataError(
                    f"data state was saved with {key}={state.get(key)} but this run has {key}={mine[key]}; "
                    f"resume with the same data, seed, sequence length and global batch"
                )
        self._batch = state["batch"]


def global_batch(sharding: Sharding, local: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
    """Global arrays from each process's slice of the batch, placed with ``sharding``."""
    return tuple(jax.make_array_from_process_local_data(sharding, a) for a in local)
