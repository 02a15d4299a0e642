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

Preference pairs (a chosen document, then its rejected one: ``ChatSource.pairs``) are not packed:
row ``i`` of :class:`PairRows` holds pair ``i`` alone, the chosen document (segment 1) then the rejected
one (segment 2), then padding, so a DPO loss reads each side's log-probabilities from one row. A pair
longer than the row is cut, and counted (``truncated``), by one rule: each document keeps its
beginning, and the row's ``seq_len + 1`` ids are shared out so that neither side is cut where it fits in
half a row: the shorter document whole where it fits in ``(seq_len + 1) // 2`` ids, the longer one the
rest; else the chosen one ``seq_len + 1 - (seq_len + 1) // 2`` ids and the rejected one ``(seq_len + 1)
// 2``. Segment ids, positions and the target mask are as for packed rows.

Prompts (``ChatSource.prompts``: :mod:`meshkit.data.prompts`, for GRPO) have nothing to learn and are
neither packed nor laid out in pair rows: both refuse them in one line.

``documents_layout`` gives the same segment ids and positions for plain token windows, from the
end-of-text ids that close their documents.
"""

from __future__ import annotations

import numpy as np

from meshkit.data.source import DataError, TokenSource


class ChatSource:
    """Documents with a loss mask: the token stream, the mask stream beside it (a byte per id), and
    each document's ``[start, end)`` in them; a view holds some of the documents. With ``pairs`` they
    are preference pairs, documents ``2k`` (chosen) and ``2k + 1`` (rejected) pair ``k``; with ``prompts``
    they are prompts to answer (all masks 0), which no run learns from as conversations."""

    def __init__(
        self,
        tokens: TokenSource,
        masks: TokenSource,
        starts: np.ndarray,
        ends: np.ndarray,
        pairs: bool = False,
        prompts: bool = False,
    ) -> None:
        self.tokens, self.masks, self.pairs, self.prompts = tokens, masks, pairs, prompts
        self.starts, self.ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        if pairs and len(self.starts) % 2:
            raise DataError(
                f"preference data holds {len(self.starts)} documents, not a chosen and a rejected one per pair: "
                "prepare it again (meshkit data prepare --chat)"
            )

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
        """Documents ``[first, stop)`` (whole pairs: even bounds, for pairs)."""
        return ChatSource(
            self.tokens,
            self.masks,
            self.starts[first:stop],
            self.ends[first:stop],
            pairs=self.pairs,
            prompts=self.prompts,
        )

    def split(self, held_tokens: int) -> tuple[ChatSource, ChatSource]:
        """Training and held-out documents: the held-out ones, at the end, hold about ``held_tokens``;
        each part at least one document (pair, for pairs: a pair is never split)."""
        step = 2 if self.pairs else 1
        units = (self.ends - self.starts).reshape(-1, step).sum(1)
        tail = np.cumsum(units[::-1])
        held = int(np.searchsorted(tail, held_tokens)) + 1 if held_tokens > 0 else 0
        cut = step * max(len(units) - min(held, len(units) - 1), 1)
        return self.view(0, cut), self.view(cut, self.documents)


def _not_prompts(source: ChatSource) -> None:
    """Prompts are answered (``--task grpo``), not learnt as conversations or pairs."""
    if source.prompts:
        raise DataError(
            "the data holds prompts to answer (prompt rows, nothing to learn from them as they are): train on them "
            "with --task grpo, or prepare conversations or preference pairs"
        )


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


class _Rows:
    """Rows of ``source``'s documents, ``seq_len + 1`` ids each: a subclass says which documents row ``i``
    holds (``_docs``) and how many ids of each (``lengths``)."""

    source: ChatSource
    width: int
    pad_id: int
    lengths: np.ndarray
    """Each document's ids in its row (its length, or less where it was cut)."""
    rows: int

    def _docs(self, i: int) -> np.ndarray:
        raise NotImplementedError

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


class Packing(_Rows):
    """The rows of ``source``'s documents for windows of ``seq_len + 1`` ids (module docstring)."""

    def __init__(self, source: ChatSource, seq_len: int, pad_id: int) -> None:
        _not_prompts(source)
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


def pair_cut(chosen: np.ndarray, rejected: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids each side of each pair keeps in a row of ``width`` (module docstring): both whole where
    they fit; else the shorter whole where it fits in ``width // 2``, the longer the rest; else the
    chosen ``width - width // 2`` and the rejected ``width // 2``."""
    half = width // 2
    fit, short = chosen + rejected <= width, np.minimum(chosen, rejected)
    one_cut = ~fit & (short <= half)  # the shorter whole, the longer the rest of the row
    rest = width - short
    keep_c = np.where(
        fit, chosen, np.where(one_cut, np.where(chosen <= rejected, chosen, rest), width - half)
    )
    keep_r = np.where(fit, rejected, np.where(one_cut, np.where(chosen <= rejected, rest, rejected), half))
    return keep_c, keep_r


class PairRows(_Rows):
    """The rows of ``source``'s preference pairs (``source.pairs``): row ``i`` holds pair ``i``, its chosen
    document (segment 1) then its rejected one (segment 2), then padding (module docstring). The same
    interface as :class:`Packing`: ``lengths`` per document, ``rows``, ``tokens``, ``layout``,
    ``target_mask``, ``summary``."""

    def __init__(self, source: ChatSource, seq_len: int, pad_id: int) -> None:
        _not_prompts(source)
        if source.documents == 0:
            raise DataError(
                "the data holds no preference pairs: prepare some with meshkit data prepare --chat"
            )
        self.source, self.width, self.pad_id = source, seq_len + 1, pad_id
        pairs = (source.ends - source.starts).reshape(-1, 2)
        self.rows = len(pairs)
        self.truncated = int((pairs.sum(1) > self.width).sum())
        """Pairs longer than a row, cut by the rule (module docstring)."""
        self.lengths = np.stack(pair_cut(pairs[:, 0], pairs[:, 1], self.width), axis=1).reshape(-1)

    @property
    def summary(self) -> dict[str, float]:
        """What the run's log says of the rows: pairs (rows) and their documents, cut pairs, share of ids
        used."""
        used = float(self.lengths.sum()) / (self.rows * self.width)
        return {
            "pairs": self.rows,
            "documents": self.source.documents,
            "rows": self.rows,
            "truncated": self.truncated,
            "fill": round(used, 4),
        }

    def _docs(self, i: int) -> np.ndarray:
        return np.array([2 * i, 2 * i + 1])


def documents_layout(window: np.ndarray, eot_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions of a plain window: a new document starts after each end-of-text id."""
    ends = (window == eot_id).astype(np.int32)
    seg = np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int32)
    starts = np.flatnonzero(np.diff(seg, prepend=seg[0] - 1))
    pos = np.arange(len(window), dtype=np.int32) - np.repeat(starts, np.diff(np.append(starts, len(window))))
    return seg, pos.astype(np.int32)
