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
them (``preference``: ``{"pairs": N}``; absent for other rows).

Prompt rows (``prompt`` and no answer, TRL's format for GRPO: :func:`meshkit.data.chat.read_prompt`)
become a document each, the prompt as the model is given it with a mask of 0s, and ``rows.jsonl`` beside
the shards holds each one's row as read (the prompt and every other column: what a reward function is
given, :mod:`meshkit.data.prompts`); the manifest's ``chat`` key counts them (``prompts``: ``{"count":
N}``, with the file and its sha256). Parquet and datasets inputs of prompt rows (no ``messages``,
``completion``, ``chosen`` or ``rejected`` column) are read whole, every column; others only from their
chat columns.

The inputs hold one kind of row: conversations (and prompt/completion rows), preference pairs or
prompts; a row of another kind than the first is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshkit.data import prompts as P
from meshkit.data import shards as S
from meshkit.data.chat import ANSWERS, FIX, Encoder, is_pair, is_prompt
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


def _columns(names: list[str]) -> list[str]:
    """The columns a table's rows are read from: all of them where its rows can be prompt rows (it has
    none of :data:`meshkit.data.chat.ANSWERS`: a reward function is given the other columns), else the
    chat columns it has."""
    if "prompt" in names and not any(c in names for c in ANSWERS):
        return list(names)
    return [c for c in FIELDS if c in names]


def _null_answers(where: str, names: list[str]) -> DataError:
    """A prompt row of a table read only from its chat columns (it has an answer column, null here): its
    other columns, which a reward function would be given, were not read."""
    null = [c for c in ANSWERS if c in names]
    return DataError(
        f"'{where}' is a prompt row (its {', '.join(null)} null) in a table with a '{null[0]}' column, whose other "
        f"columns are then not read for the rewards: drop the {', '.join(null)} column(s) from prompt rows, or {FIX}"
    )


def _table_rows(inp: Input) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def rows(name: str, schema: Any, batches: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        i, cols = 0, _columns(schema.names)
        for batch in batches:
            for row in _pylist(batch.select(cols), name, i):
                i += 1
                if len(cols) < len(schema.names) and is_prompt(row):
                    raise _null_answers(f"{name} row {i}", schema.names)
                yield f"{name} row {i}", row

    try:
        if inp.kind == "parquet":
            with pq.ParquetFile(inp.path) as f:
                cols = _columns(f.schema_arrow.names)
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
    """Encode every row into ``work`` (token and mask shards, ``documents.npy``, the template, and for
    prompt rows ``rows.jsonl``); returns the manifest's counts and its ``chat`` key."""
    template = _template(tokenizer)
    encoder = Encoder(tok, template)
    dtype = S.dtype_for(tok.vocab_size)
    ids_out = S.ShardWriter(work, dtype=dtype, end_ids=(), shard_tokens=shard_tokens)
    mask_out = S.ShardWriter(work, dtype="u1", end_ids=(), shard_tokens=shard_tokens, name="mask")
    rows_out = P.RowWriter(work)
    learnt, first = 0, None
    try:
        for chunk in _chunks((row, where) for inp in listed for where, row in records(inp)):
            first = _one_kind(chunk, first)
            encode = getattr(encoder, _ENCODE[_kind(first[0])])
            for ids, mask in encode(chunk):
                ids_out.add([ids], end=True)
                mask_out.add([mask], end=True)
                learnt += int(mask.sum())
            if is_prompt(first[0]):  # each row's columns, for the reward functions
                rows_out.add(chunk)
    except BaseException:
        ids_out.close(documents=False)  # the files closed; the directory is removed
        mask_out.close(documents=False)
        rows_out.close()
        raise
    ids_out.close()
    mask_out.close(documents=False)
    rows = rows_out.close()
    if not ids_out.doc_ends:
        raise DataError(
            "the inputs hold no rows: give rows of messages, of prompt and completion, of prompt, chosen and "
            "rejected, or of prompts"
        )
    if template is not None:
        (work / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    chat = _chat_key(template, tokenizer, encoder, mask_out.shards, learnt)
    if first is not None and is_pair(first[0]):
        chat["preference"] = {"pairs": len(ids_out.doc_ends) // 2}
    if rows is not None:  # nothing is learnt: no mask was found
        chat |= {"prompts": rows, "mask": None}
    return {
        "documents": len(ids_out.doc_ends),
        "tokens": ids_out.tokens,
        "shards": ids_out.shards,
        "chat": chat,
    }


def _chat_key(
    template: ChatTemplate | None, tokenizer: str, encoder: Encoder, masks: list, learnt: int
) -> dict[str, Any]:
    """The manifest's ``chat`` key but what a kind of rows adds (``preference``, ``prompts``)."""
    return {
        "masks": masks,
        "learnt_tokens": learnt,
        "template": None if template is None else template.name,
        "template_sha256": None if template is None else template.sha256,
        "mask": None if template is None else "generation tags" if template.tagged else "rendered turns",
        "end_of_turn_added": encoder.added,
        "tokenizer_class": read_config(
            Path(tokenizer).parent if Path(tokenizer).is_file() else Path(tokenizer)
        ).tokenizer_class,
    }


_ENCODE = {"pair": "encode_pairs", "prompt": "encode_prompts", "conversation": "encode_rows"}
"""Each kind of row's :class:`meshkit.data.chat.Encoder` method."""
_SAID = {
    "pair": "a preference pair ('chosen' and 'rejected')",
    "prompt": "a prompt to answer ('prompt' alone, for --task grpo)",
}


def _kind(row: dict[str, Any]) -> str:
    return "pair" if is_pair(row) else "prompt" if is_prompt(row) else "conversation"


def _one_kind(
    chunk: list[tuple[dict[str, Any], str]], first: tuple[dict[str, Any], str] | None
) -> tuple[dict[str, Any], str]:
    """The inputs' first row, each row of ``chunk`` checked to be of its kind: preference pairs, prompts, or
    conversations and prompt/completion rows. A preparation holds one kind: a run trains on pairs (``--task
    dpo``), on prompts (``--task grpo``) or on conversations (``--task sft``), and a mixed one could not be
    read as any."""
    first = first or chunk[0]
    kind = _kind(first[0])
    for row, where in chunk:
        if (this := _kind(row)) != kind:
            named = "prompt" if "prompt" in (this, kind) else "pair"  # the kind the line speaks of
            said, plural = _SAID[named], "prompts" if named == "prompt" else "preference pairs"
            this, those = ("is", "are not") if this == named else ("is not", "are")
            raise DataError(
                f"'{where}' {this} {said}, and the rows from '{first[1]}' on {those}: prepare {plural} and other "
                "rows apart (each with its own --out)"
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
    if chat.get("prompts"):  # the CLI's line counts them
        said = (
            f"none of them learnt (prompts to answer; template {chat['template'] or 'none'}), each prompt's row "
            f"in {chat['prompts']['rows']} for the reward functions"
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
