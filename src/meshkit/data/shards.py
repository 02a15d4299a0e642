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

:func:`open_shards` trusts nothing it reads: every file the manifest names must lie inside the
directory, and every shard must hash to the manifest's sha256 and hold only ids below the vocabulary
(JAX's gather would clamp a larger id and train on it without a word), a mask only 0 and 1. Hashing a
corpus costs a read of it (about 0.5 s per GB on one core), so what was verified is recorded in a
*stamp* (:func:`verify`): a small file per prepared directory in the user's cache
(``$XDG_CACHE_HOME/meshkit/verified``, or ``MESHKIT_DATA_CACHE``; ``off`` verifies at every open),
naming each shard's device, inode, size, mtime and ctime beside the sha256 and vocabulary it was
checked against. A shard whose stat no longer matches is hashed again: anything that writes a file
changes its ctime, which no user can set back. The stamp lives in the user's cache, not beside the
shards, because a corpus is often read-only or shared: a run never writes into its data, and no one
else's stamp is trusted. ``meshkit data prepare`` stamps what it writes (it hashed every byte and saw
every id), so a run on the host that prepared the data hashes nothing; the processes of a job on one
host take turns on the stamp's lock, so one of them hashes and the others read its stamp.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from meshkit._errors import MeshkitError
from meshkit.data.source import DataError, ShardSource, inside
from meshkit.data.tokenizer import EOT, Tokenizer, load_tokenizer
from meshkit.files import path_kind, write_atomic

FORMAT = "meshkit-tokens/1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
DOCUMENTS = "documents.npy"
DTYPES = ("<u2", "<u4")
"""The ids' types a manifest may name (:func:`dtype_for`)."""
CACHE_ENV = "MESHKIT_DATA_CACHE"
"""Where the stamps of verified shards go (a directory), or ``off``."""
CHUNK = 8 << 20
"""Bytes of a shard hashed and range-checked at a time."""
LOUD = 1 << 30
"""Bytes to verify above which a line on stderr says why the start takes a while."""


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
        self.max_id = -1
        """The largest id written (checked against the vocabulary before the shards are stamped)."""
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
        ids = np.asarray(ids)
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
        ids = ids.astype(self.dtype, copy=False)
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
    return {
        "eos": list(tokenizer.eos),
        "bos": None if tokenizer.bos is None else list(tokenizer.bos),
        "prefix": list(tokenizer.prefix),
        "suffix": list(tokenizer.suffix),
    }


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise DataError(f"'{path}' is nested too deeply to be a manifest: prepare the data again") from None
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
    sp = m["special"] if isinstance(m["special"], dict) else {}
    return (
        f"{m['vocab_size']} ids, end of text {sp.get('eos')}, BOS {sp.get('bos')} ({sp.get('prefix')} first)"
    )


def open_shards(directory: Path) -> tuple[dict[str, Any], ShardSource, Tokenizer]:
    """The manifest, the token stream and the tokenizer of a prepared directory, each checked against
    the manifest (the files it names inside the directory, shard sizes and contents, ids within the
    vocabulary, the tokenizer's sha256 and vocabulary); one line naming the fix if not."""
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
    theirs["special"] = theirs["special"] or {
        "eos": [EOT, manifest.get("eot_id")],
        "bos": None,
        "prefix": [],
        "suffix": [manifest.get("eot_id")],
    }  # before issue 36
    ours = {"vocab_size": tokenizer.vocab_size, "special": special_of(tokenizer)}
    if ours != theirs:
        raise DataError(
            f"'{tok_path}' has {_said(ours)} but the shards were made with {_said(theirs)}: {again}"
        )
    dtype = manifest.get("dtype")
    if dtype not in DTYPES:
        raise DataError(
            f"'{directory / MANIFEST}' names the ids' type {dtype!r}, not one of {DTYPES}: {again}"
        )
    shards = listed(directory, manifest.get("shards"), dtype=dtype, below=tokenizer.vocab_size, what="token")
    if not shards:
        raise DataError(f"'{directory}' holds no token shards: {again}")
    if sum(s.tokens for s in shards) != manifest.get("tokens"):
        raise DataError(
            f"'{directory / MANIFEST}' counts {manifest.get('tokens')} tokens but its shards hold "
            f"{sum(s.tokens for s in shards)}: {again}"
        )
    masks = []
    if "chat" in manifest:
        chat = manifest["chat"] if isinstance(manifest["chat"], dict) else {}
        masks = listed(directory, chat.get("masks"), dtype="u1", below=2, what="mask")
    verify(directory, shards + masks)
    return manifest, ShardSource([s.path for s in shards], [s.tokens for s in shards], dtype), tokenizer


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """A shard file as the manifest names it, and what its ids must stay below."""

    name: str
    path: Path
    tokens: int
    sha256: str
    dtype: str
    below: int
    """Every id is below this: the vocabulary's size (a mask's: 2)."""
    what: str
    """'token' or 'mask', for messages."""

    @property
    def nbytes(self) -> int:
        return self.tokens * np.dtype(self.dtype).itemsize


def listed(directory: Path, entries: Any, *, dtype: str, below: int, what: str) -> list[Shard]:
    """The shards a manifest lists (``entries``), each a file inside ``directory`` of the size the manifest
    gives; one line naming the fix if not."""
    again = f"prepare '{directory}' again with meshkit data prepare"
    manifest = directory / MANIFEST
    if not isinstance(entries, list):
        raise DataError(f"'{manifest}' lists no {what} shards: {again}")
    out: list[Shard] = []
    for entry in entries:
        ok = isinstance(entry, dict) and isinstance(entry.get("tokens"), int) and entry["tokens"] >= 0
        ok = ok and isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int)
        if not ok:
            raise DataError(
                f"'{manifest}' has a {what} shard entry {entry!r} without file, tokens, bytes and sha256: {again}"
            )
        path = inside(directory, entry.get("file"), named_by=manifest, fix=again)
        shard = Shard(
            name=entry["file"],
            path=path,
            tokens=entry["tokens"],
            sha256=entry["sha256"],
            dtype=dtype,
            below=below,
            what=what,
        )
        size = path.stat().st_size if path.is_file() else None
        if size != entry["bytes"] or shard.nbytes != entry["bytes"]:
            have = f"{size} bytes" if size is not None else path_kind(path)
            raise DataError(
                f"{what} shard '{path}' is {have}, the manifest says {entry['bytes']} bytes "
                f"({entry['tokens']} ids of {np.dtype(dtype).itemsize} bytes): {again}"
            )
        if any(s.name == shard.name for s in out):
            raise DataError(f"'{manifest}' lists the {what} shard '{shard.name}' twice: {again}")
        out.append(shard)
    return out


# -- verification, and its stamp ------------------------------------------------------------------
def cache_dir() -> Path | None:
    """Where stamps go: ``MESHKIT_DATA_CACHE`` (None where it is ``off``), else
    ``$XDG_CACHE_HOME/meshkit/verified`` (``~/.cache/meshkit/verified``)."""
    choice = os.environ.get(CACHE_ENV)
    if choice == "off":
        return None
    if choice:
        return Path(choice).expanduser()
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshkit" / "verified"
    except (RuntimeError, KeyError):  # no home directory: verified at every open
        return None


def stamp_path(directory: Path) -> Path | None:
    """The stamp of the prepared ``directory`` (by its real path); None where stamps are off."""
    cache = cache_dir()
    if cache is None:
        return None
    return cache / f"{hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:32]}.json"


def _key(st: os.stat_result) -> list[int]:
    """What must not change for a stamp to hold: the file's identity, size and times (``ctime`` moves
    with every write and every ``utime``, and cannot be set back)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _entry(shard: Shard, st: os.stat_result) -> dict[str, Any]:
    return {"stat": _key(st), "sha256": shard.sha256, "dtype": shard.dtype, "below": shard.below}


def _read_stamp(path: Path | None) -> dict[str, Any]:
    """The stamp's entries by file name ({} where there is none or it is not one: nothing is trusted)."""
    if path is None:
        return {}
    try:
        entries = json.loads(path.read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, RecursionError, AttributeError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _holds(stamp: dict[str, Any], shard: Shard) -> bool:
    try:
        return stamp.get(shard.name) == _entry(shard, os.stat(shard.path))
    except OSError:
        return False


def _write_stamp(path: Path | None, directory: Path, entries: dict[str, Any], nbytes: int) -> None:
    """Record ``entries``; a cache that cannot be written costs a verification at every open (said on
    stderr where that is more than ``LOUD`` bytes), never the run."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"directory": str(directory.resolve()), "files": entries}, indent=1))
    except (OSError, MeshkitError) as e:
        if nbytes >= LOUD:
            sys.stderr.write(
                f"warning: cannot record the verified token shards of '{directory}' in '{path.parent}' ({e}): "
                f"every run will hash them again; set {CACHE_ENV} to a directory you can write\n"
            )


@contextlib.contextmanager
def _turn(path: Path | None, wait_s: float) -> Iterator[None]:
    """An exclusive lock beside the stamp, so that the processes of a job on one host verify once; given
    up after ``wait_s`` (a holder stopped with ^Z must not hang a start): the shards are then verified
    without it, which is only slower."""
    fd = None
    if path is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(
                path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644
            )
    try:
        deadline = time.monotonic() + wait_s
        while fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def scan(path: Path, dtype: str, below: int) -> tuple[os.stat_result, str, tuple[int, int] | None]:
    """The file's stat (taken before it is read, so a write during the read voids the stamp), its sha256,
    and its first id at or above ``below`` with its position (None: none), in one pass of ``CHUNK`` bytes."""
    digest, first, pos = hashlib.sha256(), None, 0
    size = np.dtype(dtype).itemsize
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        while n := f.readinto(buf):
            view = memoryview(buf)[:n]
            digest.update(view)
            if first is None:
                ids = np.frombuffer(view[: n - n % size], dtype)
                if len(ids) and int(ids.max()) >= below:
                    at = int(np.argmax(ids >= below))
                    first = (int(ids[at]), pos + at)
                pos += len(ids)
            del view
    return st, digest.hexdigest(), first


def verify(directory: Path, shards: list[Shard]) -> None:
    """Each shard's content against the manifest's sha256, and its ids below its bound, unless the stamp
    says so already (module docstring); one line naming the shard and the fix if not."""
    path = stamp_path(directory)
    stamp = _read_stamp(path)
    if all(_holds(stamp, s) for s in shards):
        return
    nbytes = sum(s.nbytes for s in shards)
    with _turn(path, wait_s=max(60.0, nbytes / 50e6)):
        stamp = _read_stamp(path)  # another process may have verified them while this one waited
        todo = [s for s in shards if not _holds(stamp, s)]
        if not todo:
            return
        size = sum(s.nbytes for s in todo)
        if size >= LOUD:
            sys.stderr.write(
                f"verifying {size / 1e9:,.1f} GB of token shards of '{directory}' against their manifest "
                f"(once: recorded in '{path or 'nowhere: ' + CACHE_ENV + '=off'}')\n"
            )
        workers = max(1, min(len(todo), os.cpu_count() or 1, 8))
        try:
            with ThreadPoolExecutor(workers) as pool:
                results = list(pool.map(lambda s: scan(s.path, s.dtype, s.below), todo))
        except OSError as e:
            raise DataError(
                f"cannot read '{e.filename or directory}' ({e.strerror or e}): fix its "
                f"permissions, or prepare '{directory}' again with meshkit data prepare"
            ) from None
        for shard, (st, sha, first) in zip(todo, results, strict=True):
            _check(directory, shard, sha, first)
            stamp[shard.name] = _entry(shard, st)
        _write_stamp(path, directory, {s.name: stamp[s.name] for s in shards if s.name in stamp}, size)


def _check(directory: Path, shard: Shard, sha: str, first: tuple[int, int] | None) -> None:
    again = f"prepare '{directory}' again with meshkit data prepare"
    if sha != shard.sha256:
        raise DataError(
            f"{shard.what} shard '{shard.path}' is not the one its manifest names (sha256 {sha[:16]}..., the "
            f"manifest's {shard.sha256[:16]}...): it changed after it was prepared; {again}"
        )
    if first is not None:
        bound = (
            "a mask holds 0 or 1"
            if shard.what == "mask"
            else f"the vocabulary has {shard.below} ids: the shards do not belong to this tokenizer"
        )
        raise DataError(
            f"{shard.what} shard '{shard.path}' holds {first[0]} at position {first[1]}, but {bound}; {again}"
        )


def stamp_prepared(directory: Path, shards: list[Shard]) -> None:
    """Stamp shards just written by ``meshkit data prepare`` (which hashed every byte and checked every
    id as it wrote them), so that a run on this host need not read them again."""
    path = stamp_path(directory)
    try:
        entries = {s.name: _entry(s, os.stat(s.path)) for s in shards}
    except OSError:
        return
    _write_stamp(path, directory, entries, 0)


def documents(directory: Path, tokens: int | None = None) -> np.ndarray:
    """End offsets of the documents (after each one's end-of-text) in the stream; a missing or unreadable
    file, or one that is not increasing offsets ending at ``tokens`` (the stream's length, where given),
    is one line naming the fix."""
    path, again = directory / DOCUMENTS, f"prepare '{directory}' again with meshkit data prepare"
    try:
        ends = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"'{path}' cannot be read ({type(e).__name__}): {again}") from None
    ok = ends.ndim == 1 and ends.dtype.kind in "iu" and len(ends) > 0
    ok = ok and bool(ends[0] > 0) and bool(np.all(np.diff(ends) > 0))
    if not ok or (tokens is not None and int(ends[-1]) != tokens):
        raise DataError(
            f"'{path}' does not hold the documents' increasing end offsets"
            f"{'' if tokens is None else f', the last {tokens}'}: {again}"
        )
    return ends
