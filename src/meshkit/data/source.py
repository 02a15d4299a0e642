"""Token streams a run reads: an array in memory, or token shards on disk.

A source is a 1-D stream of token ids with random access by position (``read(start, stop)``) and a
length; ``view(start, stop)`` is a part of it (the training and held-out splits). Shards are read
with ``os.pread`` into a fresh buffer: nothing is mapped, so neither the address space nor the
resident memory grows with the corpus (a corpus larger than the memory given to the process
trains), and reads from several prefetch threads need no lock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshkit import files
from meshkit._errors import MeshkitError


class DataError(MeshkitError):
    """The training data cannot be read, prepared or batched as asked."""


def inside(directory: Path, name: object, *, named_by: Path, fix: str) -> Path:
    """``directory / name``, where ``name`` is a file name read from ``named_by`` (a manifest, a datasets
    ``state.json``): refused in one line unless it stays inside ``directory`` (``meshkit.files.inside``).
    A directory names its own files; one that named ``../other/shard.bin``, an absolute path or a link out
    would have a run read another directory's files under this one's name."""
    return files.inside(
        directory,
        name,
        named_by=named_by,
        fix=f"a directory's files must lie inside it; {fix}",
        error=DataError,
    )


@dataclass(frozen=True, slots=True, eq=False)
class ArraySource:
    """A stream held in memory (character-level text, a ``.npy`` of ids)."""

    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]

    def view(self, start: int, stop: int) -> ArraySource:
        return ArraySource(self.tokens[start:stop])


class ShardSource:
    """Positions ``[start, stop)`` of the stream stored in ``files`` (raw little-endian ids of ``dtype``,
    one after another); ``sizes`` are their lengths in tokens."""

    def __init__(
        self, files: list[Path], sizes: list[int], dtype: str, start: int = 0, stop: int | None = None
    ):
        self.files, self.sizes, self.dtype = list(files), list(sizes), np.dtype(dtype)
        self._ends = np.cumsum(self.sizes, dtype=np.int64)
        total = int(self._ends[-1]) if len(self._ends) else 0
        self.start, self.stop = start, total if stop is None else stop
        self._fds: list[int] | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def view(self, start: int, stop: int) -> ShardSource:
        return ShardSource(self.files, self.sizes, self.dtype.str, self.start + start, self.start + stop)

    def _open(self) -> list[int]:
        if self._fds is None:
            try:
                self._fds = [os.open(f, os.O_RDONLY) for f in self.files]
            except OSError as e:
                raise DataError(
                    f"cannot open token shard '{e.filename}' ({e.strerror}): prepare the data again"
                ) from None
        return self._fds

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids at positions ``[start, stop)`` of this view, as int32 (one ``pread`` per shard touched)."""
        start, stop = self.start + max(start, 0), self.start + min(stop, len(self))
        fds, size = self._open(), self.dtype.itemsize
        parts, pos = [], start
        shard = int(np.searchsorted(self._ends, pos, side="right"))
        while pos < stop:
            first = int(self._ends[shard - 1]) if shard else 0
            end = min(stop, int(self._ends[shard]))
            raw = os.pread(fds[shard], (end - pos) * size, (pos - first) * size)
            if len(raw) != (end - pos) * size:
                raise DataError(
                    f"token shard '{self.files[shard]}' is shorter than its manifest says: prepare the data again"
                )
            parts.append(np.frombuffer(raw, self.dtype))
            pos, shard = end, shard + 1
        if not parts:
            return np.zeros(0, np.int32)
        return np.concatenate(parts).astype(np.int32)

    def close(self) -> None:
        for fd in self._fds or ():
            os.close(fd)
        self._fds = None

    def __del__(self) -> None:
        self.close()


class ConcatSource:
    """Streams one after another: a mixture's sources, for what reads all of its tokens (the vocabulary
    check, a sample's prompt); its batches are drawn from each source apart."""

    def __init__(self, parts: list[ArraySource | ShardSource]) -> None:
        self.parts = list(parts)
        self._ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def read(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(start, 0), min(stop, len(self))
        out, first = [], 0
        for part, end in zip(self.parts, self._ends.tolist(), strict=True):
            if start < end and stop > first:
                out.append(np.asarray(part.read(max(start - first, 0), min(stop, end) - first), np.int32))
            first = end
        return np.concatenate(out) if out else np.zeros(0, np.int32)


TokenSource = ArraySource | ShardSource | ConcatSource
