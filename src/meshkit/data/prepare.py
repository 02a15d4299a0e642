"""``meshkit data prepare``: text in, a tokenizer and token shards out (:mod:`meshkit.data.shards`).

Three streaming passes over the inputs (text files, JSONL, Parquet, a datasets directory:
:mod:`meshkit.data.readers`), each holding one document piece at a time: a check (every file readable,
every row holding text; it counts the text's bytes), the tokenizer's training (skipped with
``--tokenizer``), and the encoding, in batches that ``tokenizers`` encodes on its own threads, written
straight to the shards. A document larger than ``readers.PIECE`` characters is encoded in pieces cut
after a newline (the ids still decode to exactly its text). Everything is written into a hidden directory beside ``--out``
and renamed into place at the end: bad input or a failure leaves nothing half-written.

One prepare at a time writes an ``--out``: it holds an exclusive ``flock`` on ``.OUT.lock`` beside it
from before ``--out`` is checked until its directory is in place (another is refused in one line
naming the holder), then removes it. So a hidden ``.OUT.partial-PID`` found while holding the lock is
left by a prepare that died (SIGKILL, a crash, a power cut) and is removed; the kernel releases the
lock of a dead process, so nothing stale ever blocks a prepare. (flock is advisory and, on a file
system shared by several hosts, as good as that file system's locks.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.data import shards as S
from meshkit.data.readers import Reader, list_inputs
from meshkit.data.source import DataError
from meshkit.data.text import DEFAULT_SOURCE
from meshkit.data.tokenizer import Tokenizer, check_vocab_size, load_tokenizer, train_bpe
from meshkit.data.tokenizer_config import CARRIED, CONFIG, shards_config
from meshkit.files import free_space, path_kind, try_lock

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
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if tokenizer is None and vocab_size is not None:
        check_vocab_size(vocab_size)  # before any input is read
    _check_out(out)
    with output_lock(out):
        return _prepare(
            inputs,
            out,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            eos_token=eos_token,
            bos_token=bos_token,
            text_field=text_field,
            split=split,
            shard_tokens=shard_tokens,
            report=report,
            chat=chat,
        )


def _check_out(out: Path) -> None:
    if path_kind(out) != "missing" and not (out.is_dir() and not any(out.iterdir())):
        what = (
            "already holds prepared data" if S.is_prepared(out) else f"is {path_kind(out)} that is not empty"
        )
        raise DataError(f"--out '{out}' {what}: give a new directory, or remove it first")


def _prepare(
    inputs: list[str],
    out: Path,
    *,
    vocab_size: int | None,
    tokenizer: str | None,
    eos_token: str | None,
    bos_token: str | None,
    text_field: str | None,
    split: str | None,
    shard_tokens: int,
    report: Callable[[Progress, str], None] | None,
    chat: bool,
) -> dict[str, Any]:
    """:func:`prepare` with ``--out``'s lock held."""
    _check_out(out)  # again: another prepare may have finished it while this one waited for its lock
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
    about = {
        "text_bytes": progress.total_bytes,
        "skipped_rows": skipped,
        "inputs": [d.name for d in listed] if inputs else [DEFAULT_SOURCE],
    }
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
        if writer.max_id >= tok.vocab_size:
            raise DataError(
                f"tokenizer {tok.source} gave the id {writer.max_id}, but it counts {tok.vocab_size} ids (its "
                "vocabulary has gaps): a model of that vocabulary cannot embed it; give a tokenizer whose ids "
                "run from 0 without gaps"
            )
        manifest = {
            **named,
            "documents": len(writer.doc_ends),
            "tokens": writer.tokens,
            **about,
            "shards": writer.shards,
        }
        (work / S.MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    S.stamp_prepared(
        out,
        S.listed(
            out, manifest["shards"], dtype=S.dtype_for(tok.vocab_size), below=tok.vocab_size, what="token"
        ),
    )
    return manifest


def _cannot_write(out: Path, e: OSError) -> DataError:
    return DataError(
        f"cannot write --out '{out}' ({e.strerror or e}); {free_space(out.parent)} in '{out.parent}': free "
        "space or fix its permissions, or give another --out"
    )


def _partial(out: Path) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(out.name)}\.partial-\d+")


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold ``.OUT.lock`` beside ``out`` (module docstring) while the block runs, and remove the hidden
    directories that dead prepares into ``out`` left; another live prepare into ``out`` is one line."""
    lock = out.parent / f".{out.name}.lock"
    fd = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        while fd is None:
            fd, holder = try_lock(
                lock,
                what="the lock meshkit data prepare keeps beside --out",
                fix="give another --out",
                error=DataError,
            )
            if fd is None:
                raise DataError(
                    f"--out '{out}' is being prepared by another meshkit data prepare ({holder}): wait for it "
                    "to finish, or give another --out"
                )
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.lstat(lock)):
                    break
            os.close(fd)  # its holder removed it as it finished: lock the file now at that name
            fd = None
        stale = _partial(out)  # no live prepare owns one: each holds this lock while its own exists
        for left in out.parent.iterdir():
            if stale.fullmatch(left.name):
                _remove(left)
    except OSError as e:
        if fd is not None:
            os.close(fd)
        raise _cannot_write(out, e) from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # while held: a prepare that opened it finds it gone and locks a new one
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


@contextlib.contextmanager
def workdir(out: Path) -> Iterator[Path]:
    """A hidden directory beside ``out``, renamed to ``out`` when the block ends well, removed if not
    (a failure to write is one line naming ``out`` and its disk's free space). ``out``'s lock must be
    held (:func:`output_lock`)."""
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(work):
            _remove(work)
        work.mkdir()
    except OSError as e:
        raise _cannot_write(out, e) from None
    try:
        yield work
        if out.is_dir():
            out.rmdir()  # empty: checked by prepare
        work.rename(out)
    except BaseException as e:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(e, OSError):
            raise _cannot_write(out, e) from None
        raise


def carried_tokens(tok: Tokenizer, directory: Path | None = None) -> dict[str, str]:
    """The ``CARRIED`` tokens (padding, unknown) that the files of ``directory`` (default: those beside the
    tokenizer's own file) name, where they are tokens of it."""
    from meshkit.data.chat_template import special_tokens

    source = Path(tok.source)
    directory = directory or (source.parent if source.is_file() else None)
    if directory is None or not directory.is_dir():
        return {}
    tokens = tok.vocabulary()
    return {
        k: v
        for k, v in special_tokens(directory).items()
        if k in CARRIED and isinstance(v, str) and v in tokens
    }


def tokenizer_files(work: Path, tok: Tokenizer) -> dict[str, Any]:
    """Write the tokenizer and its config beside the shards; the manifest's keys that name it."""
    (work / S.TOKENIZER).write_text(tok.to_str(), encoding="utf-8")
    bos = None if tok.bos is None else tok.bos[0]
    config = shards_config(tok.eos[0], bos, bool(tok.prefix), carried_tokens(tok))
    (work / CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
    return {
        "format": S.FORMAT,
        "tokenizer": S.TOKENIZER,
        "tokenizer_sha256": _sha256(work / S.TOKENIZER),
        "tokenizer_source": tok.source,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "special": S.special_of(tok),
        "dtype": S.dtype_for(tok.vocab_size),
    }


def _prepare_chat(
    inputs: list[str],
    out: Path,
    given: Tokenizer | None,
    tokenizer: str | None,
    text_field: str | None,
    split: str | None,
    shard_tokens: int,
) -> dict[str, Any]:
    """``prepare(..., chat=True)``: a document and its mask per row (:mod:`meshkit.data.prepare_chat`)."""
    from meshkit.data.prepare_chat import write_chat

    if given is None or tokenizer is None:
        raise DataError(
            "--chat applies a model's chat template: give --tokenizer the model's (or tokenizer's) directory"
        )
    if text_field is not None:
        raise DataError(
            "--chat reads its rows' own columns ('messages', 'prompt', 'completion', 'chosen', 'rejected'), not "
            "--text-field: drop --text-field"
        )
    if not inputs:
        raise DataError("--chat needs inputs: give JSONL, Parquet or datasets directories of conversations")
    listed = list_inputs(inputs, split=split)
    with workdir(out) as work:
        named = tokenizer_files(work, given)
        body = write_chat(work, listed, given, tokenizer, shard_tokens)
        manifest = {
            **named,
            "documents": body["documents"],
            "tokens": body["tokens"],
            "text_bytes": sum(d.size for d in listed),
            "skipped_rows": 0,
            "inputs": [d.name for d in listed],
            "shards": body["shards"],
            "chat": body["chat"],
        }
        (work / S.MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest
