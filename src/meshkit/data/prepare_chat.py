"""``meshkit data prepare --chat``: conversations in, token shards and a loss mask beside them out.

Rows of JSONL, Parquet or a datasets directory (:mod:`meshkit.data.readers`), each a conversation
(``messages``) or a prompt and completion, become one document each: the ids of
:class:`meshkit.data.chat.Encoder` (the tokenizer's chat template applied as transformers applies it),
written as ``meshkit data prepare`` writes token shards, with no end-of-text id after them (the template
ends each turn), and a mask shard beside each token shard (a byte per id, 1 where it is learnt). The
manifest's ``chat`` key says so: the mask shards, the template, how its mask was found (its ``{%
generation %}`` tags, or its rendered turns), the end of turn given to rows whose template writes it
only between messages, and the counts. A bad row (no messages, an unknown role, a template that
refuses it) stops it with one line naming the file, row and fix, and leaves nothing written.

Preference rows (``chosen`` and ``rejected``, TRL's format for DPO: :func:`meshkit.data.chat.read_pair`)
become two documents each, the chosen one then the rejected one, and the manifest's ``chat`` key counts
them (``preference``: ``{"pairs": N}``; absent for other rows). The inputs hold one kind of row or the
other: a row of the other kind than the first is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshkit.data import shards as S
from meshkit.data.chat import FIX, Encoder, is_pair
from meshkit.data.chat_template import TEMPLATE_FILE, ChatTemplate, load_template
from meshkit.data.readers import ROWS, Input, json_row
from meshkit.data.source import DataError
from meshkit.data.tokenizer import Tokenizer
from meshkit.data.tokenizer_config import read_config

FIELDS = ("messages", "prompt", "completion", "chosen", "rejected")
"""The columns a chat row is read from."""
CHUNK = 256
"""Rows rendered, then encoded together on the tokenizer's threads."""
REBUILT_BY_5 = ("LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer")
"""SentencePiece-style classes whose pipeline transformers 5.x's AutoTokenizer rebuilds around the
vocabulary, ignoring the tokenizer.json's (docs/data.md, a model's own tokenizer)."""


def records(inp: Input) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of each row of a JSONL, Parquet or datasets input (``where``: file and line or row)."""
    if inp.kind == "jsonl":
        assert inp.path is not None
        try:
            with open(inp.path, "rb") as f:
                for number, raw in enumerate(f, 1):
                    if raw.strip():
                        where = f"{inp.name}:{number}"
                        yield where, json_row(where, raw)
        except OSError as e:
            raise DataError(f"cannot read '{inp.name}' ({e.strerror or e}): fix its permissions") from None
    elif inp.kind in ("parquet", "arrow"):
        yield from _table_rows(inp)
    else:
        raise DataError(
            f"'{inp.name}' is text, but --chat reads rows (messages, or prompt and completion): give JSONL, "
            "Parquet or a datasets directory"
        )


def _pylist(batch: Any, name: str, before: int) -> list[dict[str, Any]]:
    """A record batch's rows as Python dicts; a string that is not UTF-8 (Arrow writers need not check)
    is one line naming the file and row."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        for i in range(batch.num_rows):
            try:
                batch.slice(i, 1).to_pylist()
            except UnicodeDecodeError as e:
                raise DataError(
                    f"'{name} row {before + i + 1}' holds text that is not UTF-8 (byte 0x{e.object[e.start]:02x}): "
                    f"{FIX}"
                ) from None
        raise


def _table_rows(inp: Input) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def rows(name: str, schema: Any, batches: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        i = 0
        for batch in batches:
            for row in _pylist(batch.select([c for c in FIELDS if c in schema.names]), name, i):
                i += 1
                yield f"{name} row {i}", row

    try:
        if inp.kind == "parquet":
            with pq.ParquetFile(inp.path) as f:
                cols = [c for c in FIELDS if c in f.schema_arrow.names]
                yield from rows(
                    inp.name, f.schema_arrow, f.iter_batches(batch_size=ROWS, columns=cols or None)
                )
            return
        for path in inp.files:
            with pa.OSFile(str(path)) as f:
                stream = pa.ipc.open_stream(f)
                yield from rows(str(path), stream.schema, stream)
    except (pa.ArrowException, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(
            f"cannot read '{inp.name}' ({first}): give a Parquet file or a datasets directory"
        ) from None


def _chunks(items: Iterator[Any], size: int = CHUNK) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _template(tokenizer: str) -> ChatTemplate | None:
    """The tokenizer directory's chat template; None where it has none (plain prompt/completion rows
    need none: a row of messages then names the fix)."""
    try:
        return load_template(tokenizer)
    except DataError as e:
        if "has no chat template" in str(e):
            return None
        raise


def write_chat(
    work: Path, listed: list[Input], tok: Tokenizer, tokenizer: str, shard_tokens: int
) -> dict[str, Any]:
    """Encode every row into ``work`` (token and mask shards, ``documents.npy``, the template); returns
    the manifest's counts and its ``chat`` key."""
    template = _template(tokenizer)
    encoder = Encoder(tok, template)
    dtype = S.dtype_for(tok.vocab_size)
    ids_out = S.ShardWriter(work, dtype=dtype, end_ids=(), shard_tokens=shard_tokens)
    mask_out = S.ShardWriter(work, dtype="u1", end_ids=(), shard_tokens=shard_tokens, name="mask")
    learnt, first = 0, None
    try:
        for chunk in _chunks((row, where) for inp in listed for where, row in records(inp)):
            first = _one_kind(chunk, first)
            encode = encoder.encode_pairs if is_pair(first[0]) else encoder.encode_rows
            for ids, mask in encode(chunk):
                ids_out.add([ids], end=True)
                mask_out.add([mask], end=True)
                learnt += int(mask.sum())
    except BaseException:
        ids_out.close(documents=False)  # the files closed; the directory is removed
        mask_out.close(documents=False)
        raise
    ids_out.close()
    mask_out.close(documents=False)
    if not ids_out.doc_ends:
        raise DataError(
            "the inputs hold no rows: give rows of messages, of prompt and completion, or of prompt, chosen and "
            "rejected"
        )
    if template is not None:
        (work / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    chat = {
        "masks": mask_out.shards,
        "learnt_tokens": learnt,
        "template": None if template is None else template.name,
        "template_sha256": None if template is None else template.sha256,
        "mask": None if template is None else "generation tags" if template.tagged else "rendered turns",
        "end_of_turn_added": encoder.added,
        "tokenizer_class": read_config(
            Path(tokenizer).parent if Path(tokenizer).is_file() else Path(tokenizer)
        ).tokenizer_class,
    }
    if first is not None and is_pair(first[0]):
        chat["preference"] = {"pairs": len(ids_out.doc_ends) // 2}
    return {
        "documents": len(ids_out.doc_ends),
        "tokens": ids_out.tokens,
        "shards": ids_out.shards,
        "chat": chat,
    }


def _one_kind(
    chunk: list[tuple[dict[str, Any], str]], first: tuple[dict[str, Any], str] | None
) -> tuple[dict[str, Any], str]:
    """The inputs' first row, each row of ``chunk`` checked to be of its kind: preference pairs, or
    conversations and prompt/completion rows. A preparation holds one kind: a run trains on pairs
    (``--task dpo``) or on conversations (``--task sft``), and a mixed one could not be read as either."""
    first = first or chunk[0]
    pairs = is_pair(first[0])
    for row, where in chunk:
        if is_pair(row) != pairs:
            this, those = ("is", "are not") if is_pair(row) else ("is not", "are")
            raise DataError(
                f"'{where}' {this} a preference pair ('chosen' and 'rejected'), and the rows from '{first[1]}' on "
                f"{those}: prepare preference pairs and other rows apart (each with its own --out)"
            )
    return first


def summary(manifest: dict[str, Any]) -> str:
    """What the CLI says of a chat preparation."""
    chat = manifest["chat"]
    share = chat["learnt_tokens"] / max(manifest["tokens"], 1)
    how = f", mask from its {chat['mask']}" if chat.get("mask") else ""
    said = (
        f"{chat['learnt_tokens']:,} of them learnt ({share:.1%}; template {chat['template'] or 'none'}{how})"
    )
    if chat.get("preference"):
        said += f"; {chat['preference']['pairs']:,} preference pairs (chosen, rejected: a document each)"
    for token, rows in (chat.get("end_of_turn_added") or {}).items():
        said += (
            f"; {rows:,} conversation(s) end with {token!r} added after the last answer (the template writes it "
            "only when another message follows: it ends a turn, and is learnt)"
        )
    if chat.get("tokenizer_class") in REBUILT_BY_5:
        said += (
            f"; note: transformers 5.x's AutoTokenizer rebuilds this {chat['tokenizer_class']} and may encode the "
            "text after a special token otherwise: these ids are its tokenizer.json's (4.x's, "
            "PreTrainedTokenizerFast's in 5.x), see docs/data.md"
        )
    return said
