"""A weighted mixture of prepared corpora, ``meshkit train --data web:0.7,code:0.3``: which source each
row of the run comes from, the batch stream over them, and what the mixture delivered.

The rule keeps the stream's position one number, the global batch count, as for one source
(:mod:`meshkit.data.pipeline`), so that a resume, also with another process count, continues with
exactly the rows of an uninterrupted run. The weights become integer proportions ``p_s`` (exact to
1e-6) and the rows of the run are dealt out by grain's mixing rule (``MapDataset.mix``): of the first
``n`` rows, source 0 gets ``ceil(n p_0 / P)`` and the others share the rest by the same rule, so each
source's count is within one row of its share at every point, and is a closed form of ``n``. Global
batch ``b`` takes the mixture's rows ``[b G, (b + 1) G)``, their places within the batch permuted by
the seed (grain's ``index_shuffle``), so the seed decides which rows of the batch each source fills.
A source's ``k``-th row is window ``k`` of its own windows, shuffled and repeated as one source's are
(seeded by the run's seed and the source's place): a source smaller than its share is repeated
sooner, each epoch reshuffled.

Every source's position, its rows so far, follows from the batch count; the checkpoint's data state
holds it beside the count (with each source's preparation and weight), and a restore checks both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from grain.experimental import index_shuffle

from meshkit.data.packing import ChatSource
from meshkit.data.pipeline import Batches
from meshkit.data.source import ConcatSource, DataError, TokenSource

DENOMINATOR = 10**6
"""The weights are rounded to fractions of at most this denominator (integer proportions)."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Part:
    """One source of a mixture: a prepared directory and its weight."""

    name: str
    """Its directory's name: metrics are named by it (``mix/NAME/rows``, ``eval_loss/NAME``)."""
    path: str
    """The directory as given to ``--data``."""
    weight: float
    """Its share of the rows, the weights normalised to sum to 1."""
    train: TokenSource
    held_out: TokenSource
    digest: str
    """Names its preparation (:func:`meshkit.data.shards.digest`); checked on resume."""


def parse(spec: str) -> list[tuple[str, float | None]]:
    """``--data``'s sources: ``PATH`` (one source, no weight), or ``PATH:WEIGHT,PATH:WEIGHT,...``. A path
    that exists is one source, whatever it holds (a ``:`` or ``,`` in its name)."""
    if Path(spec).exists() or ("," not in spec and ":" not in spec):
        return [(spec, None)]
    out: list[tuple[str, float | None]] = []
    for item in spec.split(","):
        path, sep, weight = item.strip().rpartition(":")
        if not sep:
            out.append((weight, None))
            continue
        try:
            value = float(weight)
        except ValueError:
            out.append((item.strip(), None))
            continue
        if not (math.isfinite(value) and value > 0):
            raise DataError(
                f"--data: the weight of '{path}' is {weight}: give a positive number (web:0.7,code:0.3)"
            )
        out.append((path, value))
    if len(out) > 1 and (missing := [p for p, w in out if w is None]):
        raise DataError(
            f"--data: source '{missing[0]}' has no weight: give every source of a mixture one, as web:0.7,code:0.3"
        )
    if len({p for p, _ in out}) < len(out):
        raise DataError(f"--data names a source twice ({spec}): give each directory once, with its weight")
    return out


def shares(sources: list[tuple[str, float | None]]) -> list[float]:
    """The weights of ``sources`` (path, weight) normalised to sum to 1; where their sum overflows
    (``1e308`` twice), each is divided by the largest first (the same shares; any other sum is divided
    as it is, so a resumed run's saved weights still match). A share that rounds to 0 at the mixture's
    resolution (``1 / DENOMINATOR``) is refused: :func:`proportions` gives every source at least one
    part, so it would be drawn far more often than asked (1e-9 beside 1 would be half the rows)."""
    weights = [w or 0.0 for _, w in sources]
    if not math.isfinite(sum(weights)):
        top = max(weights)
        weights = [w / top for w in weights]
    total = sum(weights)
    out = [w / total for w in weights]
    for (path, weight), share in zip(sources, out, strict=True):
        if Fraction(share).limit_denominator(DENOMINATOR) == 0:
            raise DataError(
                f"--data: '{path}' has the weight {weight:g}, a share of {share:.2g} of the mixture, below its "
                f"resolution of {1 / DENOMINATOR:g}: give it a larger weight, or leave it out"
            )
    return out


def proportions(weights: list[float]) -> tuple[int, ...]:
    """Integer proportions of ``weights`` (each rounded to a fraction of the sum, ``DENOMINATOR``)."""
    total = sum(weights)
    fracs = [Fraction(w / total).limit_denominator(DENOMINATOR) for w in weights]
    common = math.lcm(*(f.denominator for f in fracs))
    parts = [max(1, int(f * common)) for f in fracs]
    g = math.gcd(*parts)
    return tuple(p // g for p in parts)


def counts(n: int, parts: tuple[int, ...]) -> list[int]:
    """Rows of each source among the mixture's first ``n`` (grain's ``MapDataset.mix`` rule)."""
    out, remaining = [], sum(parts)
    for p in parts:
        rest = n * (remaining - p) // remaining
        out.append(n - rest)
        n, remaining = rest, remaining - p
    return out


def pick(m: int, parts: tuple[int, ...]) -> tuple[int, int]:
    """The source of the mixture's row ``m`` and that row's place in the source."""
    before, after = counts(m, parts), counts(m + 1, parts)
    s = next(i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b)
    return s, before[s]


def _seed(seed: int, s: int) -> int:
    """Source ``s``'s shuffle seed, from the run's."""
    return int(np.random.SeedSequence([seed, s]).generate_state(1)[0])


def check_kinds(parts) -> None:
    """A mixture's sources are of one kind: conversations (prepared with ``--chat``) or plain tokens."""
    chat = [p.name for p in parts if isinstance(p.train, ChatSource)]
    if chat and len(chat) < len(parts):
        raise DataError(
            f"--data mixes conversations ({', '.join(chat)}, prepared with --chat) with plain text: "
            "mix sources of one kind"
        )


class MixedBatches(Batches):
    """The batch stream of a mixture: :class:`Batches`, its windows drawn from ``parts`` by their weights."""

    def __init__(self, parts: tuple[Part, ...], *, held_out: bool = False, **kw: Any) -> None:
        self.parts, self.ratio = parts, proportions([p.weight for p in parts])
        streams = [p.held_out if held_out else p.train for p in parts]
        alone = {
            "threads": 0,
            "rows": None,
            "process_index": 0,
            "process_count": 1,
        }  # only its windows are read
        self.sources = [
            Batches(s, **{**kw, **alone, "seed": _seed(kw.get("seed", 0), i), "digest": p.digest})
            for i, (p, s) in enumerate(zip(parts, streams, strict=True))
        ]
        check_kinds(parts)
        super().__init__(ConcatSource(streams), **kw)

    @property
    def chat(self) -> bool:
        return self.sources[0].chat

    @property
    def packing_summary(self) -> dict[str, float] | None:
        """The sources' packings together (fine-tuning data), else None."""
        each = [s.packing.summary for s in self.sources if s.packing is not None]
        if not each:
            return None
        out = {k: sum(e[k] for e in each) for k in ("documents", "rows", "truncated")}
        return out | {"fill": round(sum(e["fill"] * e["rows"] for e in each) / out["rows"], 4)}

    def _pick(self, i: int) -> tuple[Batches, int]:
        """Window ``i`` of the run: row ``i`` of its global batch, placed by the seed, and dealt out to a
        source's window."""
        g = self.global_batch
        b, j = divmod(i, g)
        place = index_shuffle(j, max_index=g - 1, seed=(self.seed + b * 0x9E3779B1) % 2**32, rounds=4)
        s, k = pick(b * g + int(place), self.ratio)
        return self.sources[s], k

    def window(self, i: int) -> np.ndarray:
        source, k = self._pick(i)
        return source.window(k)

    def layout(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        source, k = self._pick(i)
        return source.layout(k)

    def target_mask(self, i: int) -> np.ndarray:
        source, k = self._pick(i)
        return source.target_mask(k)

    def rows(self, batches: int) -> list[int]:
        """Rows each source gave the first ``batches`` global batches."""
        return counts(batches * self.global_batch, self.ratio)

    def delivered(self, batch: int) -> dict[str, int]:
        """Rows and input tokens of each source in global batch ``batch`` (counted from 1) and up to it."""
        now, before = self.rows(batch), self.rows(batch - 1)
        out: dict[str, int] = {}
        for part, a, b in zip(self.parts, before, now, strict=True):
            out |= {
                f"mix/{part.name}/rows": b - a,
                f"mix/{part.name}/rows_total": b,
                f"mix/{part.name}/tokens": (b - a) * self.seq_len,
                f"mix/{part.name}/tokens_total": b * self.seq_len,
            }
        return out

    @property
    def state(self) -> dict[str, Any]:
        """The next global batch, what fixes the order, and each source's preparation, weight and rows."""
        return self._state(self.batch)

    def _state(self, batch: int) -> dict[str, Any]:
        sources = [
            {"name": p.name, "data": p.digest, "num_tokens": len(s.source), "weight": p.weight, "rows": r}
            for p, s, r in zip(self.parts, self.sources, self.rows(batch), strict=True)
        ]
        return {
            "batch": batch,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "sources": sources,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the same sources (preparations, weights), seed and shapes; each source's
        rows must be those its batch count gives."""
        if not isinstance(state, dict) or not isinstance(state.get("batch"), int) or state["batch"] < 0:
            raise DataError(f"data state {state!r} has no batch count: give the state saved with the run")
        mine = self._state(state["batch"])
        fix = "resume with the same --data (as prepared then, with the same weights), seed, sequence length and batch"
        for key in ("seed", "seq_len", "global_batch"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"data state was saved with {key}={state.get(key)} but this run has {key}={mine[key]}; {fix}"
                )
        theirs = state.get("sources")
        theirs = theirs if isinstance(theirs, list) and all(isinstance(t, dict) for t in theirs) else None
        keys = ("name", "data", "num_tokens", "weight")
        if theirs is None or [[t.get(k) for k in keys] for t in theirs] != [
            [m[k] for k in keys] for m in mine["sources"]
        ]:
            said = "one source" if theirs is None else f"the sources {[t.get('name') for t in theirs]}"
            names = [m["name"] for m in mine["sources"]]
            raise DataError(
                f"data state was saved with {said}, not this mixture of {names} as prepared now; {fix}"
            )
        if [t.get("rows") for t in theirs] != [m["rows"] for m in mine["sources"]]:
            raise DataError(
                f"data state's rows per source {[t.get('rows') for t in theirs]} are not those its batch count "
                f"{state['batch']} gives ({[m['rows'] for m in mine['sources']]}): give the state saved with the run"
            )
        self.close()
        self._start = state["batch"]


def realised(parts: tuple[Part, ...], row: dict[str, Any], seq_len: int) -> list[dict[str, Any]]:
    """What the mixture delivered up to a metrics ``row`` (its ``mix/NAME/rows_total``): per source its
    rows and tokens, their share beside its weight, and the epochs of its windows they took."""
    totals = [int(row.get(f"mix/{p.name}/rows_total", 0)) for p in parts]
    out = []
    for part, rows in zip(parts, totals, strict=True):
        windows = -(-(len(part.train) - 1) // seq_len)
        out.append(
            {
                "name": part.name,
                "weight": part.weight,
                "rows": rows,
                "tokens": rows * seq_len,
                "share": rows / max(sum(totals), 1),
                "epochs": rows / windows,
            }
        )
    return out
