"""``meshkit train``: the main job. Options map one to one onto ``meshkit.train.config.TrainConfig``."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from pathlib import Path
from typing import Annotated

import typer

from meshkit.cli.ledger import DevicesOpt


def train(
    preset: Annotated[
        str, typer.Option(help="Starting point: default or tiny; options below override it.")
    ] = "default",
    plan: Annotated[
        str | None, typer.Option(help="dp, zero1, zero2, zero3/fsdp, tp, dp+tp, fsdp+tp.")
    ] = None,
    mesh: Annotated[
        str | None, typer.Option(help="e.g. data=8 or data=4,model=2 (default: per plan).")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps in total.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Global batch in sequences.")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Characters per sequence.")] = None,
    layers: Annotated[int | None, typer.Option(help="Transformer blocks.")] = None,
    width: Annotated[int | None, typer.Option(help="Model width.")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads.")] = None,
    optimizer: Annotated[str | None, typer.Option(help="adamw or sgd (momentum).")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (warmup + cosine).")] = None,
    warmup: Annotated[int | None, typer.Option(help="Warmup steps.")] = None,
    accumulate: Annotated[int | None, typer.Option(help="Micro-batches per step.")] = None,
    clip: Annotated[float | None, typer.Option(help="Global-norm clipping (0 turns it off).")] = None,
    precision: Annotated[
        str | None, typer.Option(help="fp32, or bf16 (bf16 compute, fp32 master weights).")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of initialisation and data order.")] = None,
    remat: Annotated[
        str | None, typer.Option(help="Activation checkpointing per block: none, layer, dots or regather.")
    ] = None,
    scan_layers: Annotated[
        bool | None, typer.Option("--scan-layers/--no-scan-layers", help="Stack the blocks under lax.scan.")
    ] = None,
    data: Annotated[
        str | None, typer.Option(help="UTF-8 text file or .npy of token ids (default: Python's docs).")
    ] = None,
    run_dir: Annotated[
        str | None,
        typer.Option(help="Output directory (default: a new runs/<time>; with --resume, runs/latest)."),
    ] = None,
    eval_every: Annotated[
        int | None, typer.Option(help="Evaluate every k steps (0: at the end only).")
    ] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="Checkpoint every k steps.")] = None,
    sample_chars: Annotated[int | None, typer.Option(help="Characters to sample at the end.")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the run directory's latest checkpoint.")
    ] = False,
    stop_after: Annotated[
        int | None, typer.Option(help="Stop (with a checkpoint) after this step; --resume continues.")
    ] = None,
    devices: DevicesOpt = 8,
) -> None:
    """Train a character-level GPT under a plan; write metrics, checkpoints, report and plots."""
    from meshkit.cli.ledger import _simulate

    _simulate(devices)
    import jax
    from rich.console import Console

    from meshkit.cli._format import console

    if jax.process_index() != 0:  # one voice per job: the others train quietly (errors still print)
        console = Console(file=io.StringIO())
    from meshkit.train import config as C
    from meshkit.train.loop import run

    if preset not in C.PRESETS:
        raise C.ConfigError(f"unknown --preset {preset!r}: use {' or '.join(C.PRESETS)}")
    given = dict(plan=plan, mesh=mesh, steps=steps, batch_size=batch_size, seq_len=seq_len, layers=layers, width=width,
                 heads=heads, optimizer=optimizer, lr=lr, warmup=warmup, accumulate=accumulate, precision=precision,
                 seed=seed, data=data, run_dir=run_dir, eval_every=eval_every, checkpoint_every=checkpoint_every,
                 sample_chars=sample_chars, remat=remat, scan_layers=scan_layers)  # fmt: skip
    changes = {k: v for k, v in given.items() if v is not None}
    if clip is not None:
        changes["clip"] = clip or None
    latest = Path("runs") / "latest"
    if run_dir is None:
        changes["run_dir"] = str(
            latest.resolve() if resume else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        )
    cfg = dataclasses.replace(C.PRESETS[preset](), **changes)
    from meshkit import distributed

    guard = distributed.fail_fast() if jax.process_count() > 1 else contextlib.nullcontext()
    with guard:  # a lost peer ends every survivor at once, with one line naming it
        code = run(
            cfg,
            console,
            resume=resume,
            stop_after=stop_after,
            latest_link=latest if run_dir is None else None,
        )
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command()(train)
