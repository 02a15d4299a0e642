"""Whole documents packed into rows, for fine-tuning on conversations: which document goes in which row,
and each row's ids, loss mask, segment ids and positions.

Documents (conversations, each with a per-token mask: 1 where the id is learnt) are placed first-fit,
in their order, into rows of ``seq_len + 1`` ids: each goes into the first row with room for it, so a
row holds whole documents only; one longer than a row is cut to a row's length and counted
(``truncated``). The layout is a pure function of the documents and ``seq_len``: every process
computes the same one. A row's ids are its documents one after another, then padding; each document
is a segment of its own (ids ``1, 2, ...``; padding ``0``), positions restart at 0 at each document,
and a target is learnt where its id's mask is 1 and it continues the input's document (padding and a
next document's first id never are).

``documents_layout`` gives the same segment ids and positions for plain token windows, from the
end-of-text ids that close their documents.
"""

from __future__ import annotations

import numpy as np

from meshkit.data.source import DataError, TokenSource


class ChatSource:
    """Documents with a loss mask: the token stream, the mask stream beside it (a byte per id), and
    each document's ``[start, end)`` in them; a view holds some of the documents."""

    def __init__(self, tokens: TokenSource, masks: TokenSource, starts: np.ndarray, ends: np.ndarray) -> None:
        self.tokens, self.masks = tokens, masks
        self.starts, self.ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)

    def __len__(self) -> int:
        return int((self.ends - self.starts).sum())

    @property
    def documents(self) -> int:
        return len(self.starts)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids ``[start, stop)`` of the documents one after another (what reads all of its tokens)."""
        offsets = np.concatenate([[0], np.cumsum(self.ends - self.starts)])
        stop = min(stop, int(offsets[-1]))
        first, last = np.searchsorted(offsets, [start, stop], side="right") - 1
        parts = [
            self.tokens.read(int(self.starts[d]), int(self.ends[d]))
            for d in range(first, min(last + 1, self.documents))
        ]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return ids[start - int(offsets[first]) : stop - int(offsets[first])]

    def view(self, first: int, stop: int) -> ChatSource:
        """Documents ``[first, stop)``."""
        return ChatSource(self.tokens, self.masks, self.starts[first:stop], self.ends[first:stop])

    def split(self, held_tokens: int) -> tuple[ChatSource, ChatSource]:
        """Training and held-out documents: the held-out ones, at the end, hold about ``held_tokens``."""
        tail = np.cumsum((self.ends - self.starts)[::-1])
        held = int(np.searchsorted(tail, held_tokens)) + 1 if held_tokens > 0 else 0
        cut = max(self.documents - min(held, self.documents - 1), 1)
        return self.view(0, cut), self.view(cut, self.documents)


def first_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each document (``lengths`` at most ``capacity``), placed in order into the first row
    with room (a max tree over the rows' room: O(n log n))."""
    n = len(lengths)
    size = 1 << max(int(n - 1).bit_length(), 0)
    room = [capacity] * (2 * size)
    rows = np.zeros(n, np.int64)
    for d, need in enumerate(lengths.tolist()):
        node = 1
        while node < size:  # the leftmost leaf with room >= need (the root has: there are n rows)
            node = 2 * node if room[2 * node] >= need else 2 * node + 1
        rows[d] = node - size
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return rows


class Packing:
    """The rows of ``source``'s documents for windows of ``seq_len + 1`` ids (module docstring)."""

    def __init__(self, source: ChatSource, seq_len: int, pad_id: int) -> None:
        if source.documents == 0:
            raise DataError("the data holds no conversations: prepare some with meshkit data prepare --chat")
        self.source, self.width, self.pad_id = source, seq_len + 1, pad_id
        lengths = source.ends - source.starts
        self.truncated = int((lengths > self.width).sum())
        """Documents longer than a row, cut to its length."""
        self.lengths = np.minimum(lengths, self.width)
        row = first_fit(self.lengths, self.width)
        self.order = np.argsort(row, kind="stable")
        """The documents, row by row (in their order within a row)."""
        self.rows = int(row.max()) + 1
        self.bounds = np.searchsorted(row[self.order], np.arange(self.rows + 1))
        """Row ``i`` holds documents ``order[bounds[i]:bounds[i + 1]]``."""

    @property
    def summary(self) -> dict[str, float]:
        """What the run's log says of the packing: documents, rows, cut documents, share of ids used."""
        used = float(self.lengths.sum()) / (self.rows * self.width)
        return {
            "documents": self.source.documents,
            "rows": self.rows,
            "truncated": self.truncated,
            "fill": round(used, 4),
        }

    def _docs(self, i: int) -> np.ndarray:
        return self.order[self.bounds[i] : self.bounds[i + 1]]

    def _read(self, stream: TokenSource, i: int, pad: int) -> np.ndarray:
        s = self.source
        parts = [stream.read(int(s.starts[d]), int(s.starts[d] + self.lengths[d])) for d in self._docs(i)]
        out = np.full(self.width, pad, np.int32)
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        out[: len(ids)] = ids
        return out

    def tokens(self, i: int) -> np.ndarray:
        """Row ``i``'s ids (``seq_len + 1``), padded with ``pad_id``."""
        return self._read(self.source.tokens, i, self.pad_id)

    def layout(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``i``'s segment ids (documents 1, 2, ...; padding 0) and positions."""
        seg, pos = np.zeros(self.width, np.int32), np.zeros(self.width, np.int32)
        at = 0
        for k, d in enumerate(self._docs(i), 1):
            n = int(self.lengths[d])
            seg[at : at + n], pos[at : at + n] = k, np.arange(n)
            at += n
        return seg, pos

    def target_mask(self, i: int) -> np.ndarray:
        """Row ``i``'s targets to learn (``seq_len``, 0/1): the id's mask, within the input's document."""
        mask = self._read(self.source.masks, i, 0)
        seg, _ = self.layout(i)
        return (mask[1:] * (seg[1:] == seg[:-1]) * (seg[1:] > 0)).astype(np.uint8)


def documents_layout(window: np.ndarray, eot_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions of a plain window: a new document starts after each end-of-text id."""
    ends = (window == eot_id).astype(np.int32)
    seg = np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int32)
    starts = np.flatnonzero(np.diff(seg, prepend=seg[0] - 1))
    pos = np.arange(len(window), dtype=np.int32) - np.repeat(starts, np.diff(np.append(starts, len(window))))
    return seg, pos.astype(np.int32)
