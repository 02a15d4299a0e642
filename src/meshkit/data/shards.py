"""Token shards on disk: the format ``meshkit data prepare`` writes and ``meshkit train`` reads.

A prepared directory holds::

    manifest.json     format, tokenizer, counts, dtype, and each shard's tokens, bytes and sha256
    tokenizer.json    the tokenizer every later command encodes and decodes with (its post-processor
                      frames a document as transformers does: a BOS id first where it has one)
    tokenizer_config.json  its end-of-text and BOS tokens, for meshkit and transformers' AutoTokenizer
    shard-00000.bin   raw little-endian ids (uint16 below 65,536 ids, else uint32): the documents,
    shard-00001.bin   each followed by the end-of-text id, one stream cut into shards
    documents.npy     int64 end offset of each document (after its end-of-text) in that stream
    mask-00000.bin    (``--chat`` only) a byte per id, 1 where it is learnt, cut like the shards; the
                      conversations are not followed by the end-of-text id (their template ends them)

The files are plain arrays (``numpy.memmap(path, dtype)`` opens a shard); meshkit reads them with
``pread`` (:class:`meshkit.data.source.ShardSource`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from meshkit.data.source import DataError, ShardSource
from meshkit.data.tokenizer import EOT, Tokenizer, load_tokenizer

FORMAT = "meshkit-tokens/1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
DOCUMENTS = "documents.npy"


def is_prepared(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def dtype_for(vocab_size: int) -> str:
    return "<u2" if vocab_size <= 2**16 else "<u4"


class ShardWriter:
    """Appends documents to shards of at most ``shard_tokens`` ids each; records sizes and sha256."""

    def __init__(
        self, directory: Path, *, dtype: str, end_ids: Sequence[int], shard_tokens: int, name: str = "shard"
    ) -> None:
        self.directory, self.dtype, self.shard_tokens, self.name = (
            directory,
            np.dtype(dtype),
            shard_tokens,
            name,
        )
        self.end_ids = np.asarray(end_ids, np.int64)
        """What closes each document: the tokenizer's post-processor's ids, then the end-of-text id."""
        self.shards: list[dict[str, Any]] = []
        self.doc_ends: list[int] = []
        self.tokens = 0
        self._file: BinaryIO | None = None
        self._hash: Any = None

    def _rotate(self) -> None:
        self._close_shard()
        name = f"{self.name}-{len(self.shards):05d}.bin"
        self._file, self._hash = open(self.directory / name, "xb"), hashlib.sha256()  # noqa: SIM115
        self.shards.append({"file": name, "tokens": 0})

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            self.shards[-1] |= {
                "bytes": self.shards[-1]["tokens"] * self.dtype.itemsize,
                "sha256": self._hash.hexdigest(),
            }
            self._file = None

    def _put(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        while len(ids):
            if self._file is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                self._rotate()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            raw = part.tobytes()
            self._file.write(raw)
            self._hash.update(raw)
            self.shards[-1]["tokens"] += len(part)
            self.tokens += len(part)

    def add(self, pieces: list[np.ndarray], *, end: bool) -> None:
        """Append a document's ids (in pieces); ``end`` closes it (``end_ids``)."""
        for ids in pieces:
            self._put(ids)
        if end:
            self._put(self.end_ids)
            self.doc_ends.append(self.tokens)

    def close(self, documents: bool = True) -> None:
        """Close the last shard; ``documents``: write the documents' ends (``documents.npy``)."""
        self._close_shard()
        if documents:
            np.save(self.directory / DOCUMENTS, np.asarray(self.doc_ends, np.int64))


def special_of(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tokenizer's special tokens as the manifest records them: end and beginning of text (string
    and id; training, generation and export read them), and the ids around each document."""
    return {"eos": list(tokenizer.eos), "bos": None if tokenizer.bos is None else list(tokenizer.bos),
            "prefix": list(tokenizer.prefix), "suffix": list(tokenizer.suffix)}  # fmt: skip


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(
            f"cannot read '{path}' ({e}): prepare the data again with meshkit data prepare"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(
            f"'{path}' is not a {FORMAT} manifest: prepare the data again with meshkit data prepare"
        )
    return manifest


def digest(manifest: dict[str, Any]) -> str:
    """What names this preparation: the sha256 of its manifest (shard checksums and tokenizer included)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


def _said(m: dict[str, Any]) -> str:
    sp = m["special"]
    return f"{m['vocab_size']} ids, end of text {sp['eos']}, BOS {sp['bos']} ({sp['prefix']} first)"


def open_shards(directory: Path) -> tuple[dict[str, Any], ShardSource, Tokenizer]:
    """The manifest, the token stream and the tokenizer of a prepared directory, each checked against
    the manifest (shard sizes, the tokenizer's sha256 and vocabulary); one line naming the fix if not."""
    manifest = read_manifest(directory)
    again = f"prepare '{directory}' again with meshkit data prepare"
    tok_path = directory / TOKENIZER
    if not tok_path.is_file():
        raise DataError(f"'{directory}' has no {TOKENIZER}: {again}")
    if hashlib.sha256(tok_path.read_bytes()).hexdigest() != manifest.get("tokenizer_sha256"):
        raise DataError(
            f"'{tok_path}' is not the tokenizer the shards were made with (its sha256 differs): {again}"
        )
    tokenizer = load_tokenizer(tok_path)
    theirs = {k: manifest.get(k) for k in ("vocab_size", "special")}
    theirs["special"] = theirs["special"] or {"eos": [EOT, manifest.get("eot_id")], "bos": None, "prefix": [],
                                              "suffix": [manifest.get("eot_id")]}  # fmt: skip  # before issue 36
    ours = {"vocab_size": tokenizer.vocab_size, "special": special_of(tokenizer)}
    if ours != theirs:
        raise DataError(
            f"'{tok_path}' has {_said(ours)} but the shards were made with {_said(theirs)}: {again}"
        )
    files, sizes = [], []
    for shard in manifest.get("shards", []):
        path = directory / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            have = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
            raise DataError(
                f"token shard '{path}' is {have}, the manifest says {shard['bytes']} bytes: {again}"
            )
        files.append(path)
        sizes.append(int(shard["tokens"]))
    if not files:
        raise DataError(f"'{directory}' holds no token shards: {again}")
    return manifest, ShardSource(files, sizes, manifest["dtype"]), tokenizer


def documents(directory: Path) -> np.ndarray:
    """End offsets of the documents (after each one's end-of-text) in the stream; a missing or unreadable
    file is one line naming the fix."""
    try:
        return np.load(directory / DOCUMENTS, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(
            f"'{directory / DOCUMENTS}' cannot be read ({type(e).__name__}): prepare '{directory}' again with "
            f"meshkit data prepare"
        ) from None
