"""``meshkit data prepare``: text in, a tokenizer and token shards out (:mod:`meshkit.data.shards`).

Three streaming passes over the inputs (text files, JSONL, Parquet, a datasets directory:
:mod:`meshkit.data.readers`), each holding one document piece at a time: a check (every file readable,
every row holding text; it counts the text's bytes), the tokenizer's training (skipped with
``--tokenizer``), and the encoding, in batches that ``tokenizers`` encodes on its own threads, written
straight to the shards. A document larger than ``readers.PIECE`` characters is encoded in pieces cut
after a newline (the ids still decode to exactly its text). Everything is written into a hidden directory beside ``--out``
and renamed into place at the end: bad input or a failure leaves nothing half-written.
"""

from __future__ import annotations

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
from meshkit.data.readers import Reader, list_inputs
from meshkit.data.source import DataError, path_kind
from meshkit.data.text import DEFAULT_SOURCE
from meshkit.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from meshkit.data.tokenizer_config import CONFIG, shards_config

BATCH = 4 << 20
"""Characters handed to one ``encode_batch`` call."""
SHARD_TOKENS = 1 << 28
"""Ids per shard file (512 MiB of uint16)."""


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


def _check(reader: Reader, progress: Progress) -> tuple[int, int]:
    """Read every document once (bad input raises here, before anything is written); returns the
    documents and the UTF-8 bytes of their text."""
    documents = nbytes = 0
    for piece, first, _ in reader.pieces():
        size = len(piece.encode())
        documents, nbytes = documents + first, nbytes + size
        progress.update("check", size)
    return documents, nbytes


def _texts(reader: Reader, progress: Progress) -> Iterator[str]:
    for piece, _, _ in reader.pieces():
        progress.update("tokenizer", len(piece.encode()))
        yield piece


def _encode(reader: Reader, tokenizer: Tokenizer, writer: S.ShardWriter, progress: Progress) -> None:
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
    for item in reader.pieces():
        pending.append(item)
        size += len(item[0])
        if size >= BATCH:
            flush()
            size = 0
    if pending:
        flush()


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


def _check_row_options(listed: list, text_field: str | None, split: str | None) -> None:
    """``--text-field`` reads rows and ``--split`` a datasets directory: given where there is none, each
    would do nothing, so it is refused."""
    kinds = {d.kind for d in listed}
    if text_field is not None and kinds <= {"text", "embedded"}:
        raise DataError(
            f"--text-field {text_field} names a column of JSONL, Parquet or datasets rows, but every input is "
            "text (a file is one document): drop --text-field, or give row files"
        )
    if split is not None and "arrow" not in kinds:
        raise DataError(
            f"--split {split} chooses a datasets directory's split, but no input is one: drop --split"
        )


def prepare(
    inputs: list[str],
    out: str | Path,
    *,
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    eos_token: str | None = None,
    bos_token: str | None = None,
    text_field: str | None = None,
    split: str | None = None,
    shard_tokens: int = SHARD_TOKENS,
    report: Callable[[Progress, str], None] | None = None,
    chat: bool = False,
) -> dict[str, Any]:
    """Prepare ``inputs`` into ``out``; returns the manifest. ``vocab_size``: of the BPE trained here (8192
    when None); with ``tokenizer`` (a ``tokenizer.json``, or a directory holding one) nothing is trained,
    a ``vocab_size`` must match it, and ``eos_token``/``bos_token`` name its end and beginning of text
    (None: those its tokenizer_config.json names, :func:`meshkit.data.tokenizer.load_tokenizer`).
    ``text_field``: the text of a row (JSONL, Parquet, a datasets directory; None: ``text``); ``split``: a
    datasets directory's (:func:`meshkit.data.readers.list_inputs`). Either, given where no input has
    rows or no datasets directory, is refused rather than ignored. ``chat``: rows are conversations, or
    prompts and completions (:mod:`meshkit.data.prepare_chat`), encoded with ``tokenizer``'s chat template."""
    out = Path(out)
    if path_kind(out) != "missing" and not (out.is_dir() and not any(out.iterdir())):
        what = (
            "already holds prepared data" if S.is_prepared(out) else f"is {path_kind(out)} that is not empty"
        )
        raise DataError(f"--out '{out}' {what}: give a new directory, or remove it first")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    given = _given(tokenizer, vocab_size, eos_token, bos_token)
    if chat:
        return _prepare_chat(inputs, out, given, tokenizer, text_field, split, shard_tokens)
    listed = list_inputs(inputs, split=split)
    _check_row_options(listed, text_field, split)
    text_field = text_field or "text"
    reader = Reader(listed, text_field=text_field)
    progress = Progress(total_bytes=sum(d.size for d in listed), report=report)
    documents, progress.total_bytes = _check(reader, progress)
    if not documents:
        raise DataError(
            f"the inputs hold no text ({reader.skipped} rows, every one empty): give rows with text"
        )
    skipped = reader.skipped
    progress.update("check")
    if given is None:
        progress.bytes = 0
        tok = train_bpe(_texts(reader, progress), 8192 if vocab_size is None else vocab_size)
    else:
        tok = given
    about = {"text_bytes": progress.total_bytes, "skipped_rows": skipped,
             "inputs": [d.name for d in listed] if inputs else [DEFAULT_SOURCE]}  # fmt: skip
    if any(d.kind not in ("text", "embedded") for d in listed):
        about["text_field"] = text_field
    manifest = _write(out, tok, reader, progress, shard_tokens, about)
    with contextlib.suppress(Exception):
        progress.update("done")
    return manifest


def _write(
    out: Path, tok: Tokenizer, reader: Reader, progress: Progress, shard_tokens: int, about: dict[str, Any]
) -> dict[str, Any]:
    """Encode into a hidden directory beside ``out``, renamed into place once whole; returns the manifest
    (``about``: what the inputs were)."""
    with workdir(out) as work:
        progress.bytes = 0
        named = tokenizer_files(work, tok)
        writer = S.ShardWriter(
            work, dtype=S.dtype_for(tok.vocab_size), end_ids=tok.suffix, shard_tokens=shard_tokens
        )
        _encode(reader, tok, writer, progress)
        writer.close()
        manifest = {
            **named,
            "documents": len(writer.doc_ends),
            "tokens": writer.tokens,
            **about,
            "shards": writer.shards,
        }
        (work / S.MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


@contextlib.contextmanager
def workdir(out: Path) -> Iterator[Path]:
    """A hidden directory beside ``out``, renamed to ``out`` when the block ends well, removed if not."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        yield work
        if out.is_dir():
            out.rmdir()  # empty: checked by prepare
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def tokenizer_files(work: Path, tok: Tokenizer) -> dict[str, Any]:
    """Write the tokenizer and its config beside the shards; the manifest's keys that name it."""
    (work / S.TOKENIZER).write_text(tok.to_str(), encoding="utf-8")
    bos = None if tok.bos is None else tok.bos[0]
    config = shards_config(tok.eos[0], bos, bool(tok.prefix))
    (work / CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
    return {"format": S.FORMAT, "tokenizer": S.TOKENIZER, "tokenizer_sha256": _sha256(work / S.TOKENIZER),
            "tokenizer_source": tok.source, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
            "special": S.special_of(tok), "dtype": S.dtype_for(tok.vocab_size)}  # fmt: skip


def _prepare_chat(
    inputs: list[str], out: Path, given: Tokenizer | None, tokenizer: str | None, text_field: str | None,
    split: str | None, shard_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    """``prepare(..., chat=True)``: a document and its mask per row (:mod:`meshkit.data.prepare_chat`)."""
    from meshkit.data.prepare_chat import write_chat

    if given is None or tokenizer is None:
        raise DataError(
            "--chat applies a model's chat template: give --tokenizer the model's (or tokenizer's) directory"
        )
    if text_field is not None:
        raise DataError(
            "--chat reads 'messages', or 'prompt' and 'completion', not --text-field: drop --text-field"
        )
    if not inputs:
        raise DataError("--chat needs inputs: give JSONL, Parquet or datasets directories of conversations")
    listed = list_inputs(inputs, split=split)
    with workdir(out) as work:
        named = tokenizer_files(work, given)
        body = write_chat(work, listed, given, tokenizer, shard_tokens)
        manifest = {**named, "documents": body["documents"], "tokens": body["tokens"],
                    "text_bytes": sum(d.size for d in listed), "skipped_rows": 0,
                    "inputs": [d.name for d in listed], "shards": body["shards"], "chat": body["chat"]}  # fmt: skip
        (work / S.MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest
