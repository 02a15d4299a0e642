"""The batch stream of a run: a grain pipeline over a token source, and global arrays from it.

Windows of ``seq_len + 1`` tokens (inputs and the targets shifted by one) are cut from the source:
*packed* (token shards: documents, each followed by the end-of-text token, concatenated and split
into consecutive windows that overlap by the one target token, so every token of every document is
an input exactly once per epoch; the last window is padded with end-of-text) or at *every start*
(character-level text and ``.npy`` ids, as before token data existed). Window ``i`` of the run is
``grain.MapDataset.range(windows).shuffle(seed).repeat()[i]``: a global shuffle reseeded each epoch
and a pure function of ``(seed, i)``. Global batch ``b`` is windows ``[b*G, (b+1)*G)``; process ``p`` of
``P`` reads only rows ``[b*G + p*L, b*G + (p+1)*L)`` with ``L = G / P`` (its slice of the global batch,
as ``grain.sharding.ShardByJaxProcess`` names it), read ahead on threads by grain's prefetch.

So the stream's position is one number, the global batch count (grain's ``next_index``), whatever
the number of processes: ``state`` saves it with what fixes the order, ``restore`` continues at the
exact next batch, also with another process count or device count.

Fine-tuning data (a :class:`meshkit.data.packing.ChatSource`: conversations with a loss mask) is packed
into rows of whole conversations (:class:`meshkit.data.packing.Packing`), shuffled and dealt out as the
windows are, and each batch is a :class:`meshkit.spec.batch.TokenBatch` with segment ids, positions and
weights: each target's mask scaled by ``tokens / masked tokens`` of the *global* batch, which every
process computes from the masks of all the batch's rows (a byte per id; it reads only its own rows' ids),
so the plain mean of ``token_loss * weights`` is the global masked mean under every plan (all zeros where
the global batch has no target to learn). ``document_masks=True`` gives plain token windows segment ids
and positions from their end-of-text ids (weights ``None``).

Preference pairs (a ``ChatSource`` with ``pairs``) are rows of one pair each
(:class:`meshkit.data.packing.PairRows`), shuffled and dealt out as packed rows are, and their weights
are the 0/1 target mask itself, not scaled: a DPO loss sums each side's log-probabilities per row, and
the global batch's count of targets would change its value. Their state says ``preference``, so that a
resume on other data is refused.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Sharding

from meshkit.data.packing import ChatSource, Packing, PairRows, documents_layout
from meshkit.data.source import DataError, TokenSource
from meshkit.spec.batch import TokenBatch

_STATE_KEYS = ("seed", "seq_len", "global_batch", "num_tokens")
_PACKED_KEYS = ("packed", "data", "chat", "preference")


def _process() -> tuple[int, int]:
    options = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    return options.shard_index, options.shard_count


class Batches:
    """Deterministic, resumable, process-aware stream of ``(inputs, targets)`` int32 arrays: this process's
    rows of each global batch, ``(global_batch / process_count, seq_len)`` by default, or ``rows``
    (``process_rows``: the rows the process's devices hold, all of them where the batch axis lies
    within each process, as when a pipeline's stages span the processes). A
    :class:`meshkit.spec.batch.TokenBatch` instead for fine-tuning data (``source`` a ``ChatSource``) and
    with ``document_masks`` (module docstring)."""

    def __init__(
        self,
        source: TokenSource,
        *,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
        packed: bool = False,
        pad_id: int = 0,
        digest: str | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        threads: int = 0,
        rows: tuple[int, int] | None = None,
        document_masks: bool = False,
    ) -> None:
        if isinstance(source, np.ndarray):
            from meshkit.data.source import ArraySource

            source = ArraySource(np.asarray(source, dtype=np.int32))
        self.source, self.seq_len, self.global_batch, self.seed = source, seq_len, global_batch, seed
        self.packed, self.pad_id, self.digest, self.threads = packed, pad_id, digest, threads
        mine = (
            _process() if process_index is None or process_count is None else (process_index, process_count)
        )
        self.process_index, self.process_count = mine
        self._check()
        self.local_batch = global_batch // self.process_count
        self.first_row = self.process_index * self.local_batch
        if rows is not None:
            self.first_row, self.local_batch = rows[0], rows[1] - rows[0]
        self.document_masks = document_masks
        """Segment ids and positions of plain windows from their end-of-text ids (``pad_id``)."""
        self.packing: Packing | PairRows | None = None
        """The rows of whole conversations, or of preference pairs (fine-tuning data), else None."""
        if isinstance(source, ChatSource):
            self.packing = (PairRows if source.pairs else Packing)(source, seq_len, pad_id)
        if self.packing is not None:
            self.windows = self.packing.rows
        else:
            self.windows = -(-(len(source) - 1) // seq_len) if packed else len(source) - seq_len
        self._order = grain.MapDataset.range(self.windows).shuffle(seed=seed).repeat()
        self._iter: Any = None
        self._start = 0

    def _check(self) -> None:
        tokens = len(self.source)
        if self.seq_len < 1 or self.global_batch < 1:
            raise DataError(
                f"sequence length and global batch must be positive, got {self.seq_len} and {self.global_batch}"
            )
        if self.seq_len + 1 > tokens and not isinstance(
            self.source, ChatSource
        ):  # rows of conversations: padded
            raise DataError(
                f"sequence length {self.seq_len} needs at least {self.seq_len + 1} tokens but the data has "
                f"{tokens}; use a shorter --seq-len or more data"
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

    # -- what one element is ----------------------------------------------------------------------
    @property
    def chat(self) -> bool:
        """Rows of whole conversations with weights (fine-tuning data)."""
        return self.packing is not None

    @property
    def preference(self) -> bool:
        """Rows of one preference pair each (chosen, then rejected), with 0/1 weights (module docstring)."""
        return isinstance(self.packing, PairRows)

    @property
    def packing_summary(self) -> dict[str, float] | None:
        """For the run's log (fine-tuning data): conversations, rows, conversations cut to a row, share
        of the rows' ids that are conversations; None for plain data."""
        return None if self.packing is None else self.packing.summary

    def window(self, i: int) -> np.ndarray:
        """Window ``i`` of the run (``seq_len + 1`` ids)."""
        w = int(self._order[i])
        if self.packing is not None:
            return self.packing.tokens(w)
        if not self.packed:
            return np.asarray(self.source.read(w, w + self.seq_len + 1), np.int32)
        ids = self.source.read(w * self.seq_len, (w + 1) * self.seq_len + 1)
        if len(ids) <= self.seq_len:  # the last window of an epoch: padded with end-of-text
            ids = np.concatenate([ids, np.full(self.seq_len + 1 - len(ids), self.pad_id, np.int32)])
        return np.asarray(ids, np.int32)

    def _row(self, k: int) -> int:
        """This process's ``k``-th row of the run -> its window index in the run."""
        batch, j = divmod(k, self.local_batch)
        return batch * self.global_batch + self.first_row + j

    def layout(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment ids and positions of window ``i``'s ``seq_len + 1`` ids."""
        if self.packing is not None:
            return self.packing.layout(int(self._order[i]))
        return documents_layout(self.window(i), self.pad_id)

    def target_mask(self, i: int) -> np.ndarray:
        """Window ``i``'s targets to learn (``seq_len``, 0/1; fine-tuning data only)."""
        assert self.packing is not None
        return self.packing.target_mask(int(self._order[i]))

    def batch_at(self, b: int) -> TokenBatch:
        """This process's rows of global batch ``b`` with segment ids, positions and (fine-tuning data)
        weights scaled over the whole global batch, or (preference pairs) the 0/1 target mask
        (module docstring)."""
        first = b * self.global_batch
        mine = range(first + self.first_row, first + self.first_row + self.local_batch)
        rows = np.stack([self.window(i) for i in mine])
        seg, pos = (np.stack(a)[:, :-1] for a in zip(*(self.layout(i) for i in mine), strict=True))
        weights = None
        if self.preference:
            weights = np.stack([self.target_mask(i) for i in mine]).astype(np.float32)
        elif self.chat:
            masks = np.stack([self.target_mask(i) for i in range(first, first + self.global_batch)])
            learnt = int(masks.sum())
            scale = masks.size / learnt if learnt else 0.0
            weights = (masks[self.first_row : self.first_row + self.local_batch] * scale).astype(np.float32)
        return TokenBatch(rows[:, :-1], rows[:, 1:], weights, seg, pos)

    def dataset(self) -> grain.MapDataset:
        """This process's local batches as a grain ``MapDataset`` (element ``b``: global batch ``b``'s slice)."""
        if self.chat or self.document_masks:
            return grain.MapDataset.range(sys.maxsize).map(self.batch_at)
        rows = grain.MapDataset.range(sys.maxsize).map(self._row).map(self.window)
        return rows.batch(self.local_batch, drop_remainder=True).map(lambda w: (w[:, :-1], w[:, 1:]))

    def _iterator(self) -> Any:
        if self._iter is None:
            options = grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=2 * self.threads)
            self._iter = self.dataset().to_iter_dataset(options).__iter__()
            if self._start:
                self._iter.set_state({"next_index": self._start})
        return self._iter

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray] | TokenBatch:
        return next(self._iterator())

    next = __next__

    def close(self) -> None:
        """Stop the prefetch threads (the stream can go on: they start again on the next batch)."""
        if self._iter is not None:
            self._start = self.batch
            self._iter.close()
            self._iter = None

    @property
    def batch(self) -> int:
        """Global batches drawn so far (grain's ``next_index``: the same on every process)."""
        return self._start if self._iter is None else int(self._iter.get_state()["next_index"])

    def delivered(self, batch: int) -> dict[str, int]:
        """Metrics of what each source gave global batch ``batch`` (a mixture's:
        :class:`meshkit.data.mixture.MixedBatches`); one source has none."""
        return {}

    @property
    def state(self) -> dict[str, Any]:
        """JSON-able position of the stream: the next global batch and what fixes the order."""
        state: dict[str, Any] = {
            "batch": self.batch,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_tokens": len(self.source),
        }
        if self.packed:
            state |= {"packed": True, "data": self.digest}
        if self.chat:
            state |= {"chat": True}
        if self.preference:
            state |= {"preference": True}
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (as given by ``state``) exactly where that stream left off."""
        if not isinstance(state, dict) or not isinstance(state.get("batch"), int) or state["batch"] < 0:
            raise DataError(f"data state {state!r} has no batch count: give the state saved with the run")
        mine = self.state
        for key in (*_STATE_KEYS, *_PACKED_KEYS):
            if state.get(key) != mine.get(key):
                raise DataError(
                    f"data state was saved with {key}={state.get(key)} but this run has {key}={mine.get(key)}; "
                    "resume with the same data (as prepared then), seed, sequence length and global batch"
                )
        self.close()
        self._start = state["batch"]


def global_batch(sharding: Sharding, local: tuple[Any, ...], examples: int | None = None) -> tuple[Any, ...]:
    """Global arrays of ``examples`` rows (default: inferred) from each process's rows of the batch
    (``process_rows``), placed with ``sharding``; a ``TokenBatch`` stays one, its absent fields ``None``."""
    arrays = [
        None
        if a is None
        else jax.make_array_from_process_local_data(
            sharding, a, None if examples is None else (examples, *np.shape(a)[1:])
        )
        for a in local
    ]
    return TokenBatch(*arrays) if isinstance(local, TokenBatch) else tuple(arrays)


def process_rows(sharding: Sharding, examples: int) -> tuple[int, int]:
    """The rows ``[first, stop)`` of a global batch of ``examples`` that this process's devices hold under
    ``sharding``: its share of the data axis, or every row where that axis lies within each process
    (the processes then hold the same rows, and each reads them)."""
    spans = {
        (s.start or 0, examples if s.stop is None else s.stop)
        for s in (index[0] for index in sharding.addressable_devices_indices_map((examples, 1)).values())
    }
    first, stop = min(a for a, _ in spans), max(b for _, b in spans)
    covered = sorted(spans)
    if any(b[0] > a[1] for a, b in itertools.pairwise(covered)):
        raise DataError(
            f"this process's devices hold rows {covered} of the batch, not one range: order the mesh's devices "
            "by process along its batch axis"
        )
    return first, stop
