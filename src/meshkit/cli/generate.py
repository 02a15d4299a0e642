"""``meshkit generate``: text from a trained run, printed as it is drawn."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def generate(
    run_dir: Annotated[Path, typer.Option(help="A meshkit train run directory (its newest checkpoint).")],
    prompt: Annotated[list[str], typer.Option(help="Text to continue; repeat for a batch of prompts.")],
    max_new_tokens: Annotated[int, typer.Option(help="Tokens (characters) to add to each prompt.")] = 200,
    temperature: Annotated[float, typer.Option(help="0: greedy; else the logits divided by it.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens (0: all).")] = 0,
    top_p: Annotated[
        float, typer.Option(help="Sample among the most likely tokens whose mass reaches p.")
    ] = 1.0,
    min_p: Annotated[
        float, typer.Option(help="Sample among the tokens at least p times as likely as the most likely one.")
    ] = 0.0,
    stop: Annotated[
        list[str] | None,
        typer.Option(help="End a continuation before this text (not printed); repeat for several."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the sampling.")] = 0,
) -> None:
    """Continue each --prompt with the run's model and print one continuation per prompt: one prompt's as
    its tokens are drawn, several prompts' live on a terminal."""
    from meshkit.cli.ledger import _simulate

    _simulate(None)
    from meshkit.models.generate import Sampling
    from meshkit.train.outputs import generate_text, load_run

    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if max_new_tokens < 1:
        from meshkit._errors import MeshkitError

        raise MeshkitError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    run = load_run(run_dir)
    view = _Stream() if len(prompt) == 1 else _Live(len(prompt)) if sys.stdout.isatty() else None
    args = dict(sampling=sampling, seed=seed, stop_strings=tuple(stop or ()))
    if view is None:
        texts = generate_text(run, prompt, max_new_tokens, **args)
    else:
        with view:
            texts = generate_text(run, prompt, max_new_tokens, show=view.show, **args)
    if isinstance(view, _Stream):
        view.finish(texts[0])
        return
    for text in texts:
        typer.echo(text)


class _Waiting:
    """Says on stderr, on a terminal, that the sampler is compiling until its first text arrives (a new
    length bucket compiles once: ``models.generate.bucket``)."""

    def __enter__(self):
        from rich.console import Console

        console = Console(stderr=True)
        self._status = (
            console.status("compiling the sampler (once per length bucket)") if console.is_terminal else None
        )
        if self._status is not None:
            self._status.start()
        return self

    def started(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def __exit__(self, *exc) -> None:
        self.started()


class _Stream(_Waiting):
    """One prompt's continuation written to stdout as its text settles."""

    printed = ""

    def show(self, row: int, text: str) -> None:
        self.started()
        if text.startswith(self.printed) and len(text) > len(self.printed):
            sys.stdout.write(text[len(self.printed) :])
            sys.stdout.flush()
            self.printed = text

    def finish(self, text: str) -> None:
        """The rest of the final text; where the decoder rewrote what was already printed (its clean-up of
        spaces), the final text again on a line of its own."""
        if text.startswith(self.printed):
            typer.echo(text[len(self.printed) :])
        else:
            typer.echo("")
            typer.echo(text)


class _Live(_Waiting):
    """Several prompts' continuations growing together on a terminal, replaced by the final lines."""

    def __init__(self, rows: int) -> None:
        self.texts = [""] * rows

    def __enter__(self):
        from rich.live import Live

        super().__enter__()
        self._live = Live(self._render(), transient=True, auto_refresh=False)
        self._live.__enter__()
        return self

    def _render(self):
        from rich.console import Group
        from rich.text import Text

        return Group(*(Text(f"[{i + 1}] {t}") for i, t in enumerate(self.texts)))

    def show(self, row: int, text: str) -> None:
        self.started()
        self.texts[row] = text
        self._live.update(self._render(), refresh=True)

    def __exit__(self, *exc) -> None:
        self._live.__exit__(*exc)
        super().__exit__(*exc)


def register(app: typer.Typer) -> None:
    app.command()(generate)
