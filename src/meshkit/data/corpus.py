"""A run's data, whatever it came from: its token stream split into training and held-out parts, its
vocabulary, how its ids read as text, and the batch streams over it.

``load(path)``: ``None`` is the embedded character-level default (Python's reference docs); a
directory made by ``meshkit data prepare`` is token data (BPE ids in shards, packed windows); a
``.npy`` is token ids; any other file is UTF-8 text tokenised per character; ``DIR:WEIGHT,DIR:WEIGHT``
is a mixture of prepared directories sharing one tokenizer (:mod:`meshkit.data.mixture`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.data import mixture
from meshkit.data.pipeline import Batches
from meshkit.data.source import ArraySource, ConcatSource, DataError, TokenSource
from meshkit.data.tokenizer import Tokenizer

EVAL_FRACTION = 0.1
"""The tail of the stream held out for evaluation."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Corpus:
    """The training and held-out token streams of a run, and what reads them as text."""

    train: TokenSource
    held_out: TokenSource
    vocab_size: int
    source: str
    """Where it came from, for the run's report."""
    packed: bool
    """Documents packed into windows (token shards), or a window at every start (text, ids)."""
    pad_id: int = 0
    digest: str | None = None
    """Names the preparation (token shards); checked on resume."""
    decoder: Callable[[Any], str] | None = None
    """Ids to text; None for bare ids."""
    token_bytes: np.ndarray | None = None
    """UTF-8 bytes per id (bits per byte); None for bare ids."""
    tokenizer: str = "characters"
    """'BPE' (token shards), 'characters' or 'ids'."""
    chars: tuple[str, ...] | None = None
    """The character vocabulary (text data); None otherwise."""
    bpe: Tokenizer | None = None
    """The BPE tokenizer (token shards); None otherwise."""
    parts: tuple[mixture.Part, ...] = ()
    """A mixture's sources with their weights (``train`` and ``held_out`` are theirs one after another);
    empty for one source."""
    prompt_sets: tuple[Any, ...] = ()
    """Prompts (``meshkit data prepare --chat`` of prompt rows): the training and held-out
    :class:`meshkit.data.prompts.Prompts`, the documents of ``train`` and ``held_out``; empty otherwise."""

    @property
    def chat(self) -> bool:
        """Conversations with a loss mask (``meshkit data prepare --chat``): its batches are
        :class:`meshkit.spec.batch.TokenBatch` es with weights, segment ids and positions. Prompts
        (:attr:`prompts`) are chat data too, with nothing to learn."""
        from meshkit.data.packing import ChatSource

        return isinstance(self.train, ChatSource) or any(isinstance(p.train, ChatSource) for p in self.parts)

    @property
    def preference(self) -> bool:
        """Preference pairs (``meshkit data prepare --chat`` of rows with ``chosen`` and ``rejected``, its
        manifest's ``chat.preference``): conversations too (``chat``), whose batches hold a pair a row with
        0/1 weights (:class:`meshkit.data.packing.PairRows`), for DPO."""
        from meshkit.data.packing import ChatSource

        return isinstance(self.train, ChatSource) and self.train.pairs

    @property
    def prompts(self) -> bool:
        """Prompts to answer, for GRPO (its manifest's ``chat.prompts``): no conversations to learn (``train``
        and ``held_out`` are their documents, with masks of 0s, which :class:`Batches` refuses to pack);
        :meth:`prompt_set` reads them."""
        return bool(self.prompt_sets)

    def prompt_set(self, held_out: bool = False) -> Any:
        """The training (or held-out) :class:`meshkit.data.prompts.Prompts`: ids, rows, the order by seed."""
        if not self.prompt_sets:
            raise DataError(
                f"{self.source} holds no prompts: prepare rows of 'prompt' alone (TRL's GRPO format) with "
                "meshkit data prepare --chat"
            )
        return self.prompt_sets[1 if held_out else 0]

    @property
    def loss_unit(self) -> str:
        """The unit of the run's cross-entropy: nats per character for text read per character, per
        token for BPE shards and bare ids (the one owner: the plot, the log and the summary ask it)."""
        return "nats/char" if self.tokenizer == "characters" else "nats/token"

    @property
    def num_tokens(self) -> int:
        return len(self.train) + len(self.held_out)

    def batches(
        self,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        held_out: bool = False,
        part: int | None = None,
        **kw: Any,
    ) -> Batches:
        """The batch stream over the training (or held-out) tokens; a mixture's drawn from its sources by
        their weights, or from its source ``part`` alone; ``kw`` as :class:`Batches` takes."""
        kw |= {
            "seq_len": seq_len,
            "global_batch": global_batch,
            "seed": seed,
            "packed": self.packed,
            "pad_id": self.pad_id,
        }
        if part is not None:
            one = self.parts[part]
            return Batches(one.held_out if held_out else one.train, digest=one.digest, **kw)
        if self.parts:
            return mixture.MixedBatches(self.parts, held_out=held_out, digest=self.digest, **kw)
        return Batches(self.held_out if held_out else self.train, digest=self.digest, **kw)

    def encode(self, text: str) -> np.ndarray:
        """``text`` as the run's token ids (after the BOS id where the tokenizer prepends one); raises ``DataError`` for bare ids or characters outside the
        vocabulary."""
        if self.bpe is not None:  # as a document starts in the shards: with its BOS where it has one
            return np.concatenate([np.asarray(self.bpe.prefix, np.int32), self.bpe.encode(text)])
        if self.chars is None:
            raise DataError("this run trained on token ids with no tokenizer: give text data or token shards")
        missing = sorted(set(text) - set(self.chars))
        if missing:
            raise DataError(
                f"{len(missing)} character(s) outside the run's vocabulary (first {missing[0]!r}): "
                "use characters of its training data"
            )
        from meshkit.data import text as T

        return T.encode(text, self.chars)

    def decode(self, ids: Any) -> str:
        if self.decoder is None:
            return " ".join(map(str, np.asarray(ids).reshape(-1).tolist()))
        return self.decoder(ids)

    def target_bytes(self, ids: np.ndarray) -> int:
        """UTF-8 bytes of text that ``ids`` stand for (special tokens count none)."""
        if self.token_bytes is None:
            raise DataError("these token ids stand for no text: bits per byte needs text or token shards")
        return int(self.token_bytes[np.asarray(ids)].sum())

    @staticmethod
    def bits_per_byte(nats: float, nbytes: int) -> float | None:
        """Total loss in nats over the UTF-8 bytes it predicted, in bits per byte (None: no bytes)."""
        return nats / (math.log(2) * nbytes) if nbytes else None


def split_at(n: int) -> int:
    """Where the held-out tail of ``n`` tokens starts."""
    return n - round(n * EVAL_FRACTION)


def load(path: str | None) -> Corpus:
    """The corpus at ``path`` (see the module's docstring)."""
    from meshkit.data import shards, text

    if path is not None and len(sources := mixture.parse(path)) > 1:
        return _mixture(sources)
    if path is not None:
        path = mixture.parse(path)[0][0]  # one source: a weight, if given, changes nothing
    if path is not None and Path(path).is_dir():
        if not shards.is_prepared(Path(path)):
            raise DataError(
                f"data '{path}' is a directory without a {shards.MANIFEST}: prepare it with "
                f"'meshkit data prepare {path} --out DIR' and give --data DIR, or name a text file"
            )
        return _from_shards(Path(path))
    data = text.load_text(path)
    train, held = text.split(data.tokens, EVAL_FRACTION)
    vocab = data.vocab
    return Corpus(
        train=ArraySource(train),
        held_out=ArraySource(held),
        vocab_size=data.vocab_size,
        source=data.source,
        packed=False,
        decoder=None if vocab is None else (lambda ids: text.decode(ids, vocab)),
        token_bytes=None if vocab is None else np.array([len(c.encode()) for c in vocab], np.int64),
        tokenizer="ids" if vocab is None else "characters",
        chars=vocab,
    )


def _split(directory: Path, manifest: dict[str, Any], stream: Any) -> tuple[Any, Any]:
    """The training and held-out parts of a prepared directory's stream: its tail of ``EVAL_FRACTION``
    of the tokens, or (``--chat``) of its conversations, whole, with their masks (of its preference
    pairs, whole pairs; of its prompts, ``EVAL_FRACTION`` of them by count, :func:`meshkit.data.prompts.held_out`)."""
    held = len(stream) - split_at(len(stream))
    if "chat" not in manifest:
        return stream.view(0, len(stream) - held), stream.view(len(stream) - held, len(stream))
    from meshkit.data import shards
    from meshkit.data.packing import ChatSource
    from meshkit.data.source import ShardSource

    masks = shards.listed(directory, manifest["chat"].get("masks"), dtype="u1", below=2, what="mask")
    files, sizes = [m.path for m in masks], [m.tokens for m in masks]
    ends = shards.documents(directory, len(stream))
    starts = np.concatenate([[0], ends[:-1]])
    preference = manifest["chat"].get("preference")
    pairs = isinstance(preference, dict)
    if pairs and (not isinstance(n := preference.get("pairs"), int) or 2 * n != len(ends)):
        raise DataError(
            f"'{directory}' manifest says {preference.get('pairs')} preference pairs but it holds {len(ends)} "
            "documents: prepare it again (meshkit data prepare --chat)"
        )
    prompts = isinstance(manifest["chat"].get("prompts"), dict)
    if len(ends) < (4 if pairs else 2):
        what = f"{len(ends) // 2} preference pair(s)" if pairs else f"{len(ends)} conversation(s)"
        what = f"{len(ends)} prompt(s)" if prompts else what
        raise DataError(
            f"'{directory}' holds {what}: a run holds out its last ones for evaluation, so give at least 2 rows"
        )
    source = ChatSource(stream, ShardSource(files, sizes, "u1"), starts, ends, pairs=pairs, prompts=prompts)
    if prompts:
        from meshkit.data.prompts import held_out

        cut = len(ends) - held_out(len(ends), EVAL_FRACTION)
        return source.view(0, cut), source.view(cut, len(ends))
    return source.split(held)


def _from_shards(directory: Path) -> Corpus:
    from meshkit.data import shards

    manifest, stream, tokenizer = shards.open_shards(directory)
    train, held = _split(directory, manifest, stream)
    sets: tuple[Any, ...] = ()
    if getattr(train, "prompts", False):
        from meshkit.data.prompts import Prompts

        sets = Prompts.open(directory, manifest=manifest, stream=stream).split(EVAL_FRACTION)
    return Corpus(
        train=train,
        held_out=held,
        vocab_size=tokenizer.vocab_size,
        source=f"{directory} (BPE token shards)",
        packed=True,
        pad_id=tokenizer.eot_id,
        digest=shards.digest(manifest),
        decoder=tokenizer.decode,
        token_bytes=tokenizer.token_bytes,
        tokenizer="BPE",
        bpe=tokenizer,
        prompt_sets=sets,
    )


def _mixture(sources: list[tuple[str, float | None]]) -> Corpus:
    """The mixture of prepared directories ``sources`` (path, weight); one tokenizer or refused."""
    from meshkit.data import shards

    weights = mixture.shares(sources)  # before any source is opened (and verified)
    opened = []
    for path, _ in sources:
        if not shards.is_prepared(Path(path)):
            raise DataError(
                f"--data: mixture source '{path}' is not a directory made by meshkit data prepare: prepare it with "
                f"the mixture's tokenizer (meshkit data prepare TEXT --tokenizer DIR/tokenizer.json --out {path})"
            )
        opened.append(shards.open_shards(Path(path)))
    (first, _), (m0, _, tok) = sources[0], opened[0]
    for (path, _), (m, _, _) in zip(sources[1:], opened[1:], strict=True):
        if (m["tokenizer_sha256"], m["special"]) != (m0["tokenizer_sha256"], m0["special"]):
            raise DataError(
                f"--data: '{path}' was prepared with another tokenizer than '{first}' (tokenizer.json sha256 "
                f"{m['tokenizer_sha256'][:12]} vs {m0['tokenizer_sha256'][:12]}, or its special tokens): prepare it "
                f"again with --tokenizer {Path(first) / shards.TOKENIZER}"
            )
    names = [Path(path).resolve().name for path, _ in sources]
    if len(set(names)) < len(names):
        raise DataError(
            f"--data: two sources are named alike ({', '.join(names)}): give the directories distinct names"
        )
    parts = []
    for name, (path, _), share, (m, stream, _) in zip(names, sources, weights, opened, strict=True):
        train, held = _split(Path(path), m, stream)
        parts.append(
            mixture.Part(
                name=name, path=path, weight=share, train=train, held_out=held, digest=shards.digest(m)
            )
        )
    mixture.check_kinds(parts)
    for kind, said in (("pairs", "preference pairs"), ("prompts", "prompts")):
        if named := [p.name for p in parts if getattr(p.train, kind, False)]:
            raise DataError(
                f"--data: '{named[0]}' holds {said}, which a mixture does not draw from: train on one directory of "
                f"{said} (prepare the sources' rows together: meshkit data prepare --chat A B --out DIR)"
            )
    said = ", ".join(f"{p.name} {p.weight:.0%}" for p in parts)
    return Corpus(
        train=ConcatSource([p.train for p in parts]),
        held_out=ConcatSource([p.held_out for p in parts]),
        vocab_size=tok.vocab_size,
        source=f"a mixture of {said} (BPE token shards)",
        packed=True,
        pad_id=tok.eot_id,
        digest=None,
        decoder=tok.decode,
        token_bytes=tok.token_bytes,
        tokenizer="BPE",
        bpe=tok,
        parts=tuple(parts),
    )
