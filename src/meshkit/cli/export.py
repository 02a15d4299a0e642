"""``meshkit export``: a run directory's trained model as a Hugging Face checkpoint."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer


def export(
    run_dir: Annotated[Path, typer.Argument(help="A meshkit train run directory (its newest checkpoint).")],
    out: Annotated[Path, typer.Argument(help="A new directory for config.json and the safetensors files.")],
    to: Annotated[str, typer.Option(help="The format: hf (Hugging Face config.json + safetensors).")] = "hf",
    shard_mb: Annotated[
        float, typer.Option(help="Largest safetensors file, in MiB (more: an index).")
    ] = 2048,
) -> None:
    """Write a run's model as a Hugging Face checkpoint of its own model type (a Llama as LlamaForCausalLM, a
    Gemma as GemmaForCausalLM, Gemma2ForCausalLM or Gemma3ForCausalLM, the GPT as GPT2LMHeadModel)."""
    from meshkit.cli.ledger import _simulate

    _simulate(None)
    from meshkit.cli._format import console
    from meshkit.interop import InteropError
    from meshkit.train.outputs import export_run

    if to != "hf":
        raise InteropError(f"unknown --to {to!r}: meshkit exports hf (Hugging Face)")
    if not 0 < shard_mb < math.inf:  # NaN fails both
        raise InteropError(f"--shard-mb must be a finite number of MiB above 0, got {shard_mb}")
    run = export_run(run_dir, out, max_shard_bytes=int(shard_mb * 2**20))
    console.print(
        f"exported step {run.step} of {run_dir} ({type(run.model).__name__}) to {out}",
        soft_wrap=True,
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    app.command()(export)
