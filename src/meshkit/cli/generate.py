"""``meshkit generate``: text from a trained run (the Llama with a key/value cache)."""

from __future__ import annotations

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
    seed: Annotated[int, typer.Option(help="Seed of the sampling.")] = 0,
) -> None:
    """Continue each --prompt with the run's model and print one continuation per prompt."""
    from meshkit.cli.ledger import _simulate

    _simulate(None)
    from meshkit.models.generate import Sampling
    from meshkit.train.outputs import generate_text, load_run

    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if max_new_tokens < 1:
        from meshkit._errors import MeshkitError

        raise MeshkitError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    run = load_run(run_dir)
    for text in generate_text(run, prompt, max_new_tokens, sampling=sampling, seed=seed):
        typer.echo(text)


def register(app: typer.Typer) -> None:
    app.command()(generate)
