"""``meshkit data prepare``: text in, a BPE tokenizer and token shards out, for ``meshkit train --data DIR``."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Annotated

import typer

data_app = typer.Typer(
    name="data", help="Prepare token data: a BPE tokenizer and token shards.", no_args_is_help=True
)


CHAT_HELP = (
    "Rows are conversations ('messages': a list of {role, content}) or 'prompt' and 'completion' (strings, or "
    "lists of messages): each row one document, rendered with --tokenizer's chat template as transformers' "
    "apply_chat_template does, with a loss mask on the assistant's tokens (for meshkit train --task sft); or "
    "preference rows ('prompt', 'chosen', 'rejected': two documents each, for --task dpo); or prompts ('prompt' "
    "alone, TRL's GRPO rows: the prompt as the model is given it, each row's other columns in rows.jsonl for "
    "the rewards of --task grpo)."
)


@data_app.command("prepare")
def prepare(
    out: Annotated[str, typer.Option(help="New directory to write (must not hold anything yet).")],
    inputs: Annotated[
        list[str] | None,
        typer.Argument(
            help="UTF-8 text files (each file one document), JSONL (.jsonl) and Parquet (.parquet) files "
            "(each row one document), directories of them, or a Hugging Face datasets directory (save_to_disk); "
            "none: Python's reference docs (pydoc_data.topics, one document per topic).",
            show_default=False,
        ),
    ] = None,
    vocab_size: Annotated[
        int | None, typer.Option(help="Ids of the BPE trained here.", show_default="8192")
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="An existing tokenizer.json (Hugging Face tokenizers), or a model's directory holding one; "
            "its tokenizer_config.json / special_tokens_map.json beside it name its end and beginning of "
            "text, and a BOS starts each document where transformers would prepend one; none: train a "
            "byte-level BPE.",
            show_default="train one",
        ),
    ] = None,
    eos_token: Annotated[
        str | None,
        typer.Option(
            help="--tokenizer's end-of-text token, which closes every document.",
            show_default="its tokenizer_config.json's eos_token, else <|endoftext|>",
        ),
    ] = None,
    bos_token: Annotated[
        str | None,
        typer.Option(
            help="--tokenizer's beginning-of-text token (prepended where the tokenizer prepends one).",
            show_default="its tokenizer_config.json's bos_token",
        ),
    ] = None,
    text_field: Annotated[
        str | None,
        typer.Option(
            help="The text of a row: a JSONL line's key, a Parquet or datasets column.", show_default="text"
        ),
    ] = None,
    split: Annotated[
        str | None,
        typer.Option(help="The split of a datasets directory that holds several.", show_default="train"),
    ] = None,
    shard_tokens: Annotated[int, typer.Option(help="Ids per shard file.")] = 1 << 28,
    chat: Annotated[bool, typer.Option("--chat", help=CHAT_HELP)] = False,
) -> None:
    """Train a byte-level BPE (or take --tokenizer) and write token shards with a manifest."""
    import time

    start = time.perf_counter()
    options = {
        "vocab_size": vocab_size,
        "tokenizer": tokenizer,
        "eos_token": eos_token,
        "bos_token": bos_token,
        "text_field": text_field,
        "split": split,
        "shard_tokens": shard_tokens,
        "chat": chat,
    }
    manifest = _prepared(inputs or [], out, options)
    _done(out, manifest, time.perf_counter() - start)


def _prepared(inputs: list[str], out: str, options: dict) -> dict:
    """``meshkit.data.prepare.prepare`` with a progress bar on a terminal, cleaned up on SIGTERM."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from meshkit.cli._format import console
    from meshkit.data.prepare import prepare as run

    columns = [
        TextColumn("[bold]{task.description:<9}[/]"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, disable=not console.is_terminal, transient=True) as bar:
        task = bar.add_task("check", total=1, info="")

        def report(p, phase: str) -> None:
            mb = p.bytes / 1e6
            info = f"{mb:,.1f} MB  {mb / p.seconds:,.2f} MB/s"
            if phase == "encode":
                info += f"  {p.tokens:,} tokens  {p.tokens / p.seconds:,.0f} tokens/s"
            bar.update(task, description=phase, total=max(p.total_bytes, 1), completed=p.bytes, info=info)

        with _cleanup_on_sigterm(out):
            return run(inputs, out, report=report, **options)


class _Terminated(BaseException):
    """SIGTERM arrived: unwinds ``prepare`` as Ctrl-C does, so that its hidden directory is removed and
    its lock released (SIGTERM's default action would end the process with both left behind)."""


@contextlib.contextmanager
def _cleanup_on_sigterm(out: str) -> Iterator[None]:
    """While preparing (main thread only), SIGTERM stops with nothing written and exit status 143; a
    second SIGTERM during that cleanup ends the process at once (the next prepare into ``out`` removes
    what it left)."""

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise _Terminated

    try:
        before = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: SIGTERM keeps its handler
        yield
        return
    try:
        yield
    except _Terminated:
        from pathlib import Path

        from meshkit.data.shards import is_prepared

        done = "was whole before it stopped" if is_prepared(Path(out)) else "was not written"
        sys.stderr.write(f"error: stopped by SIGTERM: --out {out} {done}\n")
        raise typer.Exit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, before)


def _done(out: str, manifest: dict, seconds: float) -> None:
    """The line that says what was prepared, how fast, and how to train on it."""
    from meshkit.cli._format import console

    if "chat" in manifest:
        from meshkit.data.prepare_chat import summary

        pairs = bool(manifest["chat"].get("preference"))  # a chosen and a rejected document per pair
        what, task = ("documents", "dpo") if pairs else ("conversations", "sft")
        if manifest["chat"].get("prompts"):
            what, task = "prompts", "grpo --reward SPEC"
        console.print(
            f"prepared {out}: {manifest['documents']:,} {what} -> {manifest['tokens']:,} tokens, "
            f"{summary(manifest)}, in {len(manifest['shards'])} shard(s), {seconds:.1f} s; train on it with: "
            f"meshkit train --task {task} --data {out}",
            soft_wrap=True,
            highlight=False,
        )
        return
    mb = manifest["text_bytes"] / 1e6
    skipped = f" ({manifest['skipped_rows']:,} rows without text skipped)" if manifest["skipped_rows"] else ""
    console.print(
        f"prepared {out}: {manifest['documents']:,} documents{skipped}, {mb:,.2f} MB of text -> {manifest['tokens']:,} tokens "
        f"(vocab {manifest['vocab_size']:,}, {mb * 1e6 / max(manifest['tokens'], 1):.2f} bytes/token) in "
        f"{len(manifest['shards'])} shard(s), {seconds:.1f} s ({mb / seconds:,.2f} MB/s, "
        f"{manifest['tokens'] / seconds:,.0f} tokens/s); train on it with: meshkit train --data {out}",
        soft_wrap=True,
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    app.add_typer(data_app)
