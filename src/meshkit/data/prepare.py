"""``meshkit data prepare``: text in, a tokenizer and token shards out (:mod:`meshkit.data.shards`).

Three streaming passes over the inputs, each holding one document piece at a time: a check (every
file non-empty UTF-8 text, no NUL bytes), the tokenizer's training (skipped with ``--tokenizer``), and
the encoding, in batches that ``tokenizers`` encodes on its own threads, written straight to the
shards. A document larger than ``PIECE`` characters is encoded in pieces cut after a newline (the ids
still decode to exactly its text). Everything is written into a hidden directory beside ``--out``
and renamed into place at the end: bad input or a failure leaves nothing half-written.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.data import shards as S
from meshkit.data.source import DataError, path_kind
from meshkit.data.text import DEFAULT_SOURCE, default_documents
from meshkit.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from meshkit.data.tokenizer_config import CONFIG, shards_config

CHUNK = 1 << 20
"""Bytes read from a file at a time."""
PIECE = 1 << 20
"""Characters of a document encoded at a time (cut after a newline where there is one)."""
BATCH = 4 << 20
"""Characters handed to one ``encode_batch`` call."""
SHARD_TOKENS = 1 << 28
"""Ids per shard file (512 MiB of uint16)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Document:
    """A document to prepare: a UTF-8 file, or an embedded text."""

    name: str
    path: Path | None = None
    text: str | None = None
    size: int = 0
    """Bytes of UTF-8."""


def list_inputs(inputs: list[str]) -> list[Document]:
    """The documents of ``inputs`` (files, and every non-hidden file under a directory, sorted); the
    embedded default (Python's reference docs, one document per topic) when there are none."""
    if not inputs:
        return [
            Document(name=f"{DEFAULT_SOURCE} #{i}", text=t, size=len(t.encode()))
            for i, t in enumerate(default_documents())
        ]
    docs: list[Document] = []
    for item in inputs:
        path = Path(item)
        kind = path_kind(path)
        if kind == "a directory":
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not files:
                raise DataError(f"directory '{path}' holds no files: give text files, or a directory of them")
            docs += [Document(name=str(p), path=p, size=p.stat().st_size) for p in files]
        elif kind == "a regular file":
            docs.append(Document(name=str(path), path=path, size=path.stat().st_size))
        else:
            raise DataError(f"input '{path}' is {kind}: give UTF-8 text files or directories of them")
    return docs


def _chunks(doc: Document) -> Iterator[str]:
    """The document's text in pieces of at most about ``PIECE`` characters; raises on bad input."""
    if doc.text is not None:
        yield from _cut(doc.text)
        return
    assert doc.path is not None
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, carry = 0, ""
    try:
        with open(doc.path, "rb") as f:
            while raw := f.read(CHUNK):
                if b"\0" in raw:
                    at = offset + raw.index(b"\0")
                    raise DataError(
                        f"'{doc.name}' is binary (a NUL byte at offset {at}), not text: leave it out of the inputs"
                    )
                try:
                    text = decoder.decode(raw)
                except UnicodeDecodeError as e:
                    raise _not_utf8(doc, offset + e.start, raw[e.start]) from None
                offset += len(raw)
                *whole, carry = list(_cut(carry + text)) or [""]
                yield from whole
    except OSError as e:
        raise DataError(f"cannot read '{doc.name}' ({e.strerror or e}): fix its permissions") from None
    pending = decoder.getstate()[0]
    if pending:  # the file ends inside a character
        raise _not_utf8(doc, offset - len(pending), pending[0])
    if offset == 0:
        raise DataError(f"'{doc.name}' is empty: leave it out of the inputs, or give it text")
    if carry:
        yield carry


def _not_utf8(doc: Document, at: int, byte: int) -> DataError:
    return DataError(
        f"'{doc.name}' is not UTF-8 text (byte 0x{byte:02x} at offset {at}): convert it "
        f"(e.g. iconv -f latin1 -t utf-8), or leave it out of the inputs"
    )


def _cut(text: str) -> Iterator[str]:
    while len(text) > PIECE:
        at = text.rfind("\n", 0, PIECE) + 1 or PIECE
        yield text[:at]
        text = text[at:]
    yield text


@dataclass(kw_only=True)
class Progress:
    """Counts for the progress bar: bytes and ids done, and the time since the start."""

    total_bytes: int
    bytes: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    report: Callable[[Progress, str], None] | None = None

    def update(self, phase: str, nbytes: int = 0, ntokens: int = 0) -> None:
        self.bytes += nbytes
        self.tokens += ntokens
        if self.report is not None:
            self.report(self, phase)

    @property
    def seconds(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)


def _check(docs: list[Document], progress: Progress) -> None:
    for doc in docs:
        for piece in _chunks(doc):
            progress.update("check", len(piece.encode()))


def _texts(docs: list[Document], progress: Progress) -> Iterator[str]:
    for doc in docs:
        for piece in _chunks(doc):
            progress.update("tokenizer", len(piece.encode()))
            yield piece


def _encode(docs: list[Document], tokenizer: Tokenizer, writer: S.ShardWriter, progress: Progress) -> None:
    """Encode the documents in batches of about ``BATCH`` characters; write them in order."""
    pending: list[tuple[str, bool, bool]] = []  # (piece, first, last piece of its document)
    prefix = np.asarray(tokenizer.prefix, np.int32)

    def flush() -> None:
        ids = tokenizer.encode_batch([p for p, _, _ in pending], [not first for _, first, _ in pending])
        for (piece, first, last), piece_ids in zip(pending, ids, strict=True):
            pieces = [prefix, piece_ids] if first else [piece_ids]
            writer.add(pieces, end=last)
            ntokens = len(piece_ids) + first * len(prefix) + last * len(writer.end_ids)
            progress.update("encode", len(piece.encode()), ntokens)
        pending.clear()

    size = 0
    for doc in docs:
        for i, (piece, last) in enumerate(_with_last(_chunks(doc))):
            pending.append((piece, i == 0, last))
            size += len(piece)
            if size >= BATCH:
                flush()
                size = 0
    if pending:
        flush()


def _with_last(items) -> Iterator[tuple[Any, bool]]:
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _given(
    tokenizer: str | None, vocab_size: int | None, eos: str | None, bos: str | None
) -> Tokenizer | None:
    """The ``--tokenizer`` given (None: train one), checked against the other options."""
    if tokenizer is None:
        if eos or bos:
            flag = "--eos-token" if eos else "--bos-token"
            raise DataError(f"{flag} names a token of --tokenizer: give --tokenizer too, or leave {flag} out")
        return None
    given = load_tokenizer(tokenizer, eos=eos, bos=bos)
    if vocab_size is not None and vocab_size != given.vocab_size:
        raise DataError(
            f"--vocab-size {vocab_size} does not match the {given.vocab_size} ids of --tokenizer '{tokenizer}': "
            "drop --vocab-size, or leave out --tokenizer to train a BPE of that size"
        )
    return given


def prepare(
    inputs: list[str],
    out: str | Path,
    *,
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    eos_token: str | None = None,
    bos_token: str | None = None,
    shard_tokens: int = SHARD_TOKENS,
    report: Callable[[Progress, str], None] | None = None,
) -> dict[str, Any]:
    """Prepare ``inputs`` into ``out``; returns the manifest. ``vocab_size``: of the BPE trained here (8192
    when None); with ``tokenizer`` (a ``tokenizer.json``, or a directory holding one) nothing is trained,
    a ``vocab_size`` must match it, and ``eos_token``/``bos_token`` name its end and beginning of text
    (None: those its tokenizer_config.json names, :func:`meshkit.data.tokenizer.load_tokenizer`)."""
    out = Path(out)
    if path_kind(out) != "missing" and not (out.is_dir() and not any(out.iterdir())):
        what = (
            "already holds prepared data" if S.is_prepared(out) else f"is {path_kind(out)} that is not empty"
        )
        raise DataError(f"--out '{out}' {what}: give a new directory, or remove it first")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    given = _given(tokenizer, vocab_size, eos_token, bos_token)
    docs = list_inputs(inputs)
    progress = Progress(total_bytes=sum(d.size for d in docs), report=report)
    _check(docs, progress)
    progress.update("check")
    if given is None:
        progress.bytes = 0
        tok = train_bpe(_texts(docs, progress), 8192 if vocab_size is None else vocab_size)
    else:
        tok = given
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        progress.bytes = 0
        (work / S.TOKENIZER).write_text(tok.to_str(), encoding="utf-8")
        bos = None if tok.bos is None else tok.bos[0]
        config = shards_config(tok.eos[0], bos, bool(tok.prefix))
        (work / CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
        writer = S.ShardWriter(
            work, dtype=S.dtype_for(tok.vocab_size), end_ids=tok.suffix, shard_tokens=shard_tokens
        )
        _encode(docs, tok, writer, progress)
        writer.close()
        manifest = {
            "format": S.FORMAT,
            "tokenizer": S.TOKENIZER,
            "tokenizer_sha256": _sha256(work / S.TOKENIZER),
            "tokenizer_source": tok.source,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "special": S.special_of(tok),
            "dtype": S.dtype_for(tok.vocab_size),
            "documents": len(writer.doc_ends),
            "tokens": writer.tokens,
            "text_bytes": progress.total_bytes,
            "inputs": [d.name for d in docs] if inputs else [DEFAULT_SOURCE],
            "shards": writer.shards,
        }
        (work / S.MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        if out.is_dir():
            out.rmdir()  # empty: checked above
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    with contextlib.suppress(Exception):
        progress.update("done")
    return manifest
