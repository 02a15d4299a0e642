"""``meshkit launch -n N -- COMMAND...``: run one multi-process job on this machine."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from meshkit._errors import MeshkitError


def launch(
    command: Annotated[
        list[str] | None, typer.Argument(help="The command each process runs (after --).")
    ] = None,
    num_processes: Annotated[
        int | None, typer.Option("-n", "--num-processes", help="Processes to start (ranks 0..N-1).")
    ] = None,
    devices_per_process: Annotated[
        int | None, typer.Option("--devices-per-process", help="Simulate D CPU devices in each process.")
    ] = None,
    port: Annotated[
        int | None, typer.Option("--port", help="Coordinator port (default: a free one).")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout", help="Seconds the processes wait for each other at start-up (default 300)."
        ),
    ] = None,
) -> None:
    """Start N processes of one job, prefix each output line with its rank, stop all when one fails."""
    if num_processes is None:
        raise MeshkitError(
            "give the number of processes with -n N, e.g. meshkit launch -n 2 -- python train.py"
        )
    if timeout is not None and not timeout > 0:
        raise MeshkitError(f"--timeout must be a positive number of seconds, got {timeout:g}")
    from meshkit.launch import launch as run

    status = run(
        command or [], num_processes, devices_per_process=devices_per_process, port=port, timeout_s=timeout,
        output=sys.stdout, error_output=sys.stderr,
    )  # fmt: skip
    raise typer.Exit(status)


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(launch)
