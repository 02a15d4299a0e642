"""Where ``meshkit data prepare`` reads its text: UTF-8 text files (each file one document), JSON Lines,
Parquet, and a Hugging Face ``datasets`` directory as ``save_to_disk`` writes it (a document per row).

Every format gives the same thing, documents as pieces of text of at most about ``PIECE`` characters
(cut after a newline where there is one), so the passes of :mod:`meshkit.data.prepare` and the ids
they write never depend on where a text came from: a row of JSONL, Parquet or a datasets directory
gives exactly the ids its text gives from a file. Nothing is read whole: text files in ``CHUNK`` bytes,
JSONL a line at a time, Parquet by record batches of ``ROWS`` rows, and a datasets directory's Arrow
files (Arrow IPC streams) a record batch at a time, with pyarrow, imported only for those (and
without ``datasets``, which a prepared directory never needs). A row with an empty or null text is
skipped and counted (``Reader.skipped``); anything unreadable is one line naming the file and the line
or row.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshkit.data.source import DataError, inside
from meshkit.data.text import DEFAULT_SOURCE, default_documents
from meshkit.files import path_kind

CHUNK = 1 << 20
"""Bytes read from a text file at a time."""
PIECE = 1 << 20
"""Characters of a document encoded at a time (cut after a newline where there is one)."""
ROWS = 1024
"""Rows of a Parquet file read at a time (one record batch)."""
ROW_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}
"""File names that hold a document per row, and their format (any other file is UTF-8 text)."""
DATASET_DICT, DATASET_STATE, DATASET_INFO = "dataset_dict.json", "state.json", "dataset_info.json"
"""The files ``datasets``' ``save_to_disk`` writes beside the Arrow files (the first for a DatasetDict)."""
DEFAULT_SPLIT = "train"


@dataclass(frozen=True, kw_only=True, slots=True)
class Input:
    """One input of ``meshkit data prepare``."""

    name: str
    """How messages and the manifest name it: a path (a datasets directory's split's)."""
    kind: str
    """'text' (one document), 'jsonl', 'parquet' or 'arrow' (a datasets directory: a document per row),
    or 'embedded' (``text``)."""
    path: Path | None = None
    """The file (text, JSONL, Parquet)."""
    files: tuple[Path, ...] = ()
    """A datasets directory's Arrow files, in its order."""
    text: str | None = None
    """The embedded text."""
    size: int = 0
    """Bytes on disk (the progress of the first pass; an embedded text's UTF-8 bytes)."""


def _dataset_dir(path: Path) -> bool:
    """A directory ``datasets``' ``save_to_disk`` wrote: a DatasetDict, or a Dataset's state and info."""
    return (path / DATASET_DICT).is_file() or (
        (path / DATASET_STATE).is_file() and (path / DATASET_INFO).is_file()
    )


def _json_file(path: Path, kind: type, what: str) -> Any:
    """A datasets directory's JSON file, which must hold a ``kind`` (``what`` says what, for the line)."""
    fix = "save the dataset again with save_to_disk"
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise DataError(f"cannot read '{path}': it is nested too deeply to be JSON {what}; {fix}") from None
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read '{path}' ({e}): {fix}") from None
    if not isinstance(value, kind):
        raise DataError(f"'{path}' holds a JSON {_json_type(value)}, not {what}: {fix}")
    return value


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _dataset(path: Path, split: str | None) -> Input:
    """The Arrow files of the datasets directory ``path`` (of its ``split`` where it holds a DatasetDict);
    every name its JSON files give must stay inside it (:func:`meshkit.data.source.inside`)."""
    fix = "save the dataset again with save_to_disk"
    if (path / DATASET_DICT).is_file():
        listing = path / DATASET_DICT
        splits = _json_file(listing, dict, "an object with 'splits'").get("splits") or []
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DataError(f"'{listing}': 'splits' is not a list of names: {fix}")
        want = split or DEFAULT_SPLIT
        if want not in splits:
            raise DataError(
                f"'{path}' has no split '{want}' (its splits: {', '.join(map(str, splits)) or 'none'}): give --split"
            )
        path = inside(path, want, named_by=listing, fix=fix)
    named_by = path / DATASET_STATE
    state = _json_file(named_by, dict, "an object with '_data_files'")
    saved = state.get("_split")
    if saved is not None and not isinstance(saved, str):
        raise DataError(f"'{named_by}': '_split' is a JSON {_json_type(saved)}, not a split's name: {fix}")
    if split is not None and saved is not None and saved != split:
        raise DataError(
            f"'{path}' holds the split '{saved}', not '{split}': give --split {saved}, or leave it out"
        )
    listed = state.get("_data_files") or []
    if not isinstance(listed, list) or not all(isinstance(f, dict) for f in listed):
        raise DataError(f"'{named_by}': '_data_files' is not a list of {{\"filename\": ...}} objects: {fix}")
    files = tuple(inside(path, f.get("filename"), named_by=named_by, fix=fix) for f in listed)
    if not files:
        raise DataError(f"'{named_by}' names no Arrow files: {fix}")
    for f in files:
        if not f.is_file():
            raise DataError(f"'{f}' is {path_kind(f)}, but '{named_by}' names it: save the dataset again")
    return Input(name=str(path), kind="arrow", files=files, size=sum(f.stat().st_size for f in files))


def _file(path: Path) -> Input:
    kind = ROW_SUFFIXES.get(path.suffix.lower(), "text")
    return Input(name=str(path), kind=kind, path=path, size=path.stat().st_size)


def list_inputs(inputs: list[str], *, split: str | None = None) -> list[Input]:
    """The inputs named: files (by their suffix, ``ROW_SUFFIXES``), a datasets directory (its ``split``,
    ``train`` by default, where it holds several), and every non-hidden file under any other directory,
    sorted; the embedded default (Python's reference docs, one document per topic) when none is named."""
    if not inputs:
        return [
            Input(name=f"{DEFAULT_SOURCE} #{i}", kind="embedded", text=t, size=len(t.encode()))
            for i, t in enumerate(default_documents())
        ]
    out: list[Input] = []
    for item in inputs:
        path = Path(item)
        kind = path_kind(path)
        if kind == "a directory" and _dataset_dir(path):
            out.append(_dataset(path, split))
        elif kind == "a directory":
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not files:
                raise DataError(f"directory '{path}' holds no files: give text files, or a directory of them")
            out += [_file(p) for p in files]
        elif kind == "a regular file":
            out.append(_file(path))
        else:
            raise DataError(
                f"input '{path}' is {kind}: give UTF-8 text, JSONL or Parquet files, directories of them, "
                "or a datasets directory (save_to_disk)"
            )
    return out


def cut(text: str) -> Iterator[str]:
    """``text`` in pieces of at most ``PIECE`` characters, each cut after a newline where there is one."""
    while len(text) > PIECE:
        at = text.rfind("\n", 0, PIECE) + 1 or PIECE
        yield text[:at]
        text = text[at:]
    yield text


def with_last(items) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


class Reader:
    """The documents of ``inputs`` as pieces; ``text_field`` names a row's text (JSONL's key, the
    column of Parquet and Arrow). ``skipped``: the rows with no text (empty or null) of the last pass."""

    def __init__(self, inputs: list[Input], *, text_field: str = "text") -> None:
        self.inputs, self.text_field, self.skipped = inputs, text_field, 0

    def pieces(self) -> Iterator[tuple[str, bool, bool]]:
        """``(piece, first, last)`` of each document in order: its first and last piece flagged."""
        self.skipped = 0
        for inp in self.inputs:
            for doc in self._documents(inp):
                for i, (piece, last) in enumerate(with_last(doc)):
                    yield piece, i == 0, last

    def _documents(self, inp: Input) -> Iterator[Iterator[str]]:
        if inp.kind == "embedded":
            yield cut(inp.text or "")
        elif inp.kind == "text":
            yield _text_file(inp)
        else:
            rows = {"jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}[inp.kind](inp, self.text_field)
            for text in rows:
                if text:
                    yield cut(text)
                else:
                    self.skipped += 1


def _text_file(inp: Input) -> Iterator[str]:
    """A text file's pieces; raises on bad input (not UTF-8, a NUL byte, empty)."""
    assert inp.path is not None
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, carry = 0, ""
    try:
        with open(inp.path, "rb") as f:
            while raw := f.read(CHUNK):
                if b"\0" in raw:
                    at = offset + raw.index(b"\0")
                    raise DataError(
                        f"'{inp.name}' is binary (a NUL byte at offset {at}), not text: leave it out of the inputs"
                    )
                try:
                    text = decoder.decode(raw)
                except UnicodeDecodeError as e:
                    raise _not_utf8(inp.name, offset + e.start, raw[e.start]) from None
                offset += len(raw)
                *whole, carry = list(cut(carry + text)) or [""]
                yield from whole
    except OSError as e:
        raise DataError(f"cannot read '{inp.name}' ({e.strerror or e}): fix its permissions") from None
    pending = decoder.getstate()[0]
    if pending:  # the file ends inside a character
        raise _not_utf8(inp.name, offset - len(pending), pending[0])
    if offset == 0:
        raise DataError(f"'{inp.name}' is empty: leave it out of the inputs, or give it text")
    if carry:
        yield carry


def _not_utf8(name: str, at: int, byte: int) -> DataError:
    return DataError(
        f"'{name}' is not UTF-8 text (byte 0x{byte:02x} at offset {at}): convert it "
        f"(e.g. iconv -f latin1 -t utf-8), or leave it out of the inputs"
    )


# -- a document per row ----------------------------------------------------------------------
def _jsonl(inp: Input, field: str) -> Iterator[str | None]:
    """Each line's ``field`` (blank lines skipped); a line that is not a JSON object holding text there
    is refused, naming the file and line."""
    assert inp.path is not None
    rows = 0
    try:
        with open(inp.path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    rows += 1
                    yield _json_text(f"{inp.name}:{number}", raw, field)
    except OSError as e:
        raise DataError(f"cannot read '{inp.name}' ({e.strerror or e}): fix its permissions") from None
    if not rows:
        raise DataError(f"'{inp.name}' holds no JSON lines: leave it out of the inputs, or give it rows")


def _json_text(where: str, raw: bytes, field: str) -> str | None:
    fix = "fix or remove the line"
    row = json_row(where, raw)
    if field not in row:
        keys = ", ".join(sorted(map(str, row))[:8]) or "none"
        raise DataError(f"'{where}' has no field '{field}' (its fields: {keys}): give --text-field, or {fix}")
    text = row[field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"'{where}': field '{field}' is a JSON {type(text).__name__}, not text: {fix}")
    return text


def json_row(where: str, raw: bytes) -> dict[str, Any]:
    """A JSON Lines line as an object; one line naming ``where`` if it is not one."""
    fix = "fix or remove the line"
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(
            f"'{where}' is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}): {fix}"
        ) from None
    except RecursionError:
        raise DataError(
            f"'{where}' is nested too deeply to read (arrays or objects within each other): {fix}"
        ) from None
    except ValueError as e:
        said = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise DataError(f"'{where}' is not JSON ({said}): {fix}") from None
    if not isinstance(row, dict):
        raise DataError(f"'{where}' is a JSON {type(row).__name__}, not an object: {fix}")
    if (b"\\ud" in raw or b"\\uD" in raw) and (bad := lone_surrogate(row)) is not None:
        raise DataError(f"'{where}': {surrogate_said(*bad)}: {fix}")
    return row


def lone_surrogate(value: Any, key: str = "") -> tuple[str, int, str] | None:
    """Where a JSON value's strings (keys too) first hold a lone UTF-16 surrogate: ``(key path, character
    index, the surrogate)``, None where none does. JSON's ``\\ud800`` escapes decode to such code points,
    which no text encodes and no tokenizer reads (JSONL lines are walked only where they hold a ``\\ud``
    escape)."""
    stack = [(key, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as e:
                    return path, e.start, item[e.start]
        elif isinstance(item, dict):
            stack += [(f"{path} key", k) for k in item] + [
                (f"{path}.{k}".lstrip("."), v) for k, v in item.items()
            ]
        elif isinstance(item, list):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(item)]
    return None


def surrogate_said(path: str, index: int, char: str) -> str:
    """What a lone surrogate (``lone_surrogate``'s finding) is, for an error line."""
    return (
        f"{path or 'it'} holds a lone UTF-16 surrogate (\\u{ord(char):04x} at character {index}), which is no "
        "character: write the character itself (or its surrogate pair)"
    )


def _column(name: str, schema: Any, field: str) -> None:
    """``field`` must be a text column of ``schema``."""
    import pyarrow as pa

    strings = [f.name for f in schema if _is_text(pa, f.type)]
    if field not in schema.names:
        raise DataError(
            f"'{name}' has no column '{field}' (its text columns: {', '.join(strings) or 'none'}): give --text-field"
        )
    kind = schema.field(field).type
    if not _is_text(pa, kind):
        raise DataError(
            f"'{name}': column '{field}' holds {kind}, not text: give --text-field naming one of its text "
            f"columns ({', '.join(strings) or 'none'})"
        )


def _is_text(pa: Any, kind: Any) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _parquet(inp: Input, field: str) -> Iterator[str | None]:
    """The rows' ``field``, a record batch of ``ROWS`` rows at a time (never the whole file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(inp.path) as f:
            _column(inp.name, f.schema_arrow, field)
            rows = 0
            for batch in f.iter_batches(batch_size=ROWS, columns=[field]):
                yield from _strings(batch.column(0), inp.name, field, rows)
                rows += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"cannot read '{inp.name}' as Parquet ({_first_line(e)}): give a Parquet file"
        ) from None


def _arrow(inp: Input, field: str) -> Iterator[str | None]:
    """The rows' ``field`` in a datasets directory's Arrow files (IPC streams), a record batch at a time."""
    import pyarrow as pa

    for path in inp.files:
        try:
            with pa.OSFile(str(path)) as f:
                stream = pa.ipc.open_stream(f)
                _column(str(path), stream.schema, field)
                rows = 0
                for batch in stream:
                    yield from _strings(batch.column(field), str(path), field, rows)
                    rows += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            raise DataError(
                f"cannot read '{path}' as an Arrow stream ({_first_line(e)}): save the dataset again with save_to_disk"
            ) from None


def _strings(column: Any, name: str, field: str, before: int) -> list[str | None]:
    """A record batch's text column as Python strings; a value that is not UTF-8 (Arrow writers need not
    check) is one line naming the file and row."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError as e:
                raise DataError(
                    f"'{name}' row {before + i + 1}: column '{field}' is not UTF-8 (byte 0x{e.object[e.start]:02x} "
                    f"at offset {e.start}): fix or remove the row"
                ) from None
        raise


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
