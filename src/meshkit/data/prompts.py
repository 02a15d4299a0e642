"""Prompts for GRPO (``meshkit train --task grpo``): the prompt documents of a prepared directory, each
one's row for the reward functions, the training/held-out split, and the order a run takes them in.

``meshkit data prepare --chat`` on prompt rows (TRL's GRPO format: ``prompt`` a string or a list of
messages, no answer; :func:`meshkit.data.chat.read_prompt`) writes a document per row, the ids the model
is given to answer, and ``rows.jsonl`` beside the shards: each document's row as read, one JSON object a
line in the documents' order (``prompt`` as given, and every other column). A reward function is given
what TRL gives it: the prompts as given (a string, or the messages) and the other columns, each a list
over the batch (:mod:`meshkit.rewards`). So the rows must be JSON: a value JSON cannot hold (a date,
bytes, NaN) is refused in one line when prepared, as is a column named as an argument a reward
function is given itself (``prompts``, ``completions``, ``completion_ids``).

:class:`Prompts` reads them back: ``ids(i)``, ``row(i)`` (the columns but ``prompt``), ``prompt(i)``;
``split`` holds out the last tenth (at least one prompt each side where there are two or more), and
``batch(step, n, seed)`` is rollout ``step``'s ``n`` prompts: positions ``[step*n, (step+1)*n)`` of
``grain.MapDataset.range(len).shuffle(seed).repeat()``, the run's batch stream's order
(:mod:`meshkit.data.pipeline`): every prompt once per epoch, reshuffled each epoch, a pure function of
``(seed, step, n)``, so a resumed run takes what the run it continues would have.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.data.source import DataError, TokenSource

ROWS = "rows.jsonl"
"""The prompts' rows, beside the shards."""
RESERVED = ("prompts", "completions", "completion_ids")
"""Arguments a reward function is given itself (TRL's): no column may be named so."""
HELD_OUT = 0.1
"""The share of the prompts held out, at the end (the corpus's ``EVAL_FRACTION``)."""


def row_line(row: dict[str, Any], where: str) -> bytes:
    """``row`` as a line of ``rows.jsonl``; a column JSON cannot hold, or named as a reward function's own
    argument, is one line naming the row and the column."""
    if named := [k for k in row if k in RESERVED]:
        raise DataError(
            f"'{where}' has a column '{named[0]}', the name of an argument a reward function is given itself "
            f"({', '.join(RESERVED)}): rename or drop the column"
        )
    try:
        return (json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    except (TypeError, ValueError) as e:  # ValueError: NaN or infinity; TypeError: no JSON type
        key = next((k for k in row if not _json(row[k])), None)
        said = "NaN or infinity" if isinstance(e, ValueError) else str(e).removeprefix("Object of type ")
        raise DataError(
            f"'{where}': column '{key}' holds a value JSON cannot hold ({said}), and rows.jsonl gives each "
            "prompt's row to the reward functions: make it text or a number, or drop the column"
        ) from None


def _json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


class RowWriter:
    """Writes ``rows.jsonl`` into a preparation's directory (opened at the first prompt row)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / ROWS
        self.count = 0
        self._file: Any = None
        self._hash = hashlib.sha256()

    def add(self, rows: list[tuple[dict[str, Any], str]]) -> None:
        """Appends ``(row, where)`` rows, each a line."""
        if self._file is None:
            self._file = open(self.path, "xb")  # noqa: SIM115 (closed by close)
        for row, where in rows:
            line = row_line(row, where)
            self._file.write(line)
            self._hash.update(line)
            self.count += 1

    def close(self) -> dict[str, Any] | None:
        """Closes the file; the manifest's ``prompts`` entry (None where no row was written)."""
        if self._file is None:
            return None
        self._file.close()
        self._file = None
        return {"count": self.count, "rows": ROWS, "rows_sha256": self._hash.hexdigest()}


def held_out(n: int, fraction: float = HELD_OUT) -> int:
    """How many of ``n`` prompts are held out: about ``fraction`` of them, at least one each side where
    there are two or more."""
    return 0 if n < 2 else min(max(round(n * fraction), 1), n - 1)


def _scan(path: Path, again: str) -> tuple[np.ndarray, str]:
    """Each line's byte offset in ``rows.jsonl`` (and the end), and its sha256."""
    offsets, digest, at = [0], hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            for line in f:
                digest.update(line)
                at += len(line)
                offsets.append(at)
    except OSError as e:
        raise DataError(f"cannot read '{path}' ({e.strerror or e}): {again}") from None
    return np.asarray(offsets, np.int64), digest.hexdigest()


class Prompts:
    """Prompt documents of a prepared directory (module docstring), ``first`` to ``first + len`` of them:
    their ids in ``tokens`` (``[starts[i], ends[i])``) and their rows' lines in ``rows`` (byte
    ``offsets[i]`` to ``offsets[i + 1]``). ``i`` counts from this part's first prompt."""

    def __init__(self, tokens: TokenSource, starts: Any, ends: Any, rows: Path, offsets: Any) -> None:
        self.tokens, self.rows = tokens, rows
        self.starts, self.ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        self.offsets = np.asarray(offsets, np.int64)
        self._orders: dict[int, Any] = {}

    @classmethod
    def open(cls, directory: Path | str, *, manifest: dict | None = None, stream: Any = None) -> Prompts:
        """All the prompts of ``directory`` (its ``manifest`` and token ``stream`` where already opened:
        :func:`meshkit.data.shards.open_shards`, which checks them); ``rows.jsonl`` checked against the
        manifest's sha256 and count."""
        from meshkit.data import shards

        directory = Path(directory)
        if manifest is None or stream is None:
            manifest, stream, _ = shards.open_shards(directory)
        said = (manifest.get("chat") or {}).get("prompts")
        if not isinstance(said, dict):
            raise DataError(
                f"'{directory}' holds no prompts: prepare rows of 'prompt' alone (TRL's GRPO format) with meshkit "
                "data prepare --chat"
            )
        ends = shards.documents(directory, len(stream))
        again = f"prepare '{directory}' again with meshkit data prepare --chat"
        offsets, digest = _scan(directory / ROWS, again)
        if digest != said.get("rows_sha256") or not len(offsets) - 1 == len(ends) == said.get("count"):
            raise DataError(
                f"'{directory / ROWS}' is not the rows the prompts were prepared with ({len(offsets) - 1} rows for "
                f"{len(ends)} prompts, or another sha256 than the manifest's): {again}"
            )
        return cls(stream, np.concatenate([[0], ends[:-1]]), ends, directory / ROWS, offsets)

    def __len__(self) -> int:
        return len(self.starts)

    def view(self, first: int, stop: int) -> Prompts:
        """Prompts ``[first, stop)`` of these."""
        return Prompts(
            self.tokens,
            self.starts[first:stop],
            self.ends[first:stop],
            self.rows,
            self.offsets[first : stop + 1],
        )

    def split(self, fraction: float = HELD_OUT) -> tuple[Prompts, Prompts]:
        """The training prompts and the held-out ones after them (:func:`held_out`)."""
        cut = len(self) - held_out(len(self), fraction)
        return self.view(0, cut), self.view(cut, len(self))

    def _at(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(f"prompt {i} of {len(self)}")
        return int(i)

    def ids(self, i: int) -> np.ndarray:
        """Prompt ``i``'s ids (int32): what the model is given to answer."""
        i = self._at(i)
        return np.asarray(self.tokens.read(int(self.starts[i]), int(self.ends[i])), np.int32)

    def _line(self, i: int) -> dict[str, Any]:
        i = self._at(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        with open(self.rows, "rb") as f:
            f.seek(a)
            return json.loads(f.read(b - a))

    def row(self, i: int) -> dict[str, Any]:
        """Prompt ``i``'s row but its ``prompt``: the columns a reward function is given (``**row``)."""
        return {k: v for k, v in self._line(i).items() if k != "prompt"}

    def prompt(self, i: int) -> str | list[dict[str, Any]]:
        """Prompt ``i`` as given: a string, or a list of messages (what TRL gives a reward function)."""
        return self._line(i)["prompt"]

    def epoch(self, step: int, n: int) -> int:
        """The epoch (from 0) rollout batch ``step`` of ``n`` prompts begins in."""
        return step * n // max(len(self), 1)

    def batch(self, step: int, n: int, seed: int) -> list[int]:
        """The indices of the ``n`` prompts of rollout batch ``step`` (from 0), in order: positions
        ``[step*n, (step+1)*n)`` of a global shuffle of the prompts reseeded each epoch (module docstring;
        a batch may span two epochs)."""
        if len(self) == 0:
            raise DataError("the data holds no prompts here: prepare more prompt rows")
        if n < 1 or step < 0:
            raise DataError(
                f"a rollout batch needs 1 or more prompts and a step from 0, got {n} and step {step}"
            )
        if not 0 <= seed < 2**32:
            raise DataError(f"data seed must be in [0, 2**32), got {seed}")
        if seed not in self._orders:
            import grain

            self._orders[seed] = grain.MapDataset.range(len(self)).shuffle(seed=seed).repeat()
        order = self._orders[seed]
        return [int(order[p]) for p in range(step * n, (step + 1) * n)]
