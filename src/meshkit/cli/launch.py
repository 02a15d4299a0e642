"""``meshkit launch -n N -- COMMAND...``: run one multi-process job on this machine; and the global
options of every command that may join a multi-process job (who may join it, when a silent peer
counts as lost), as flags before the command or as environment variables."""

from __future__ import annotations

import os
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
    grace: Annotated[
        float | None,
        typer.Option(
            "--grace",
            metavar="SECONDS",
            help="After a SIGINT or SIGTERM passed on to the processes: seconds they get to save a "
            "checkpoint and exit before SIGKILL (default 30).",
        ),
    ] = None,
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            metavar="N",
            help="When a process fails (or stalls, with --stall-timeout), stop the rest and start the job "
            "again, up to N times; meshkit train --run-dir resumes from its latest checkpoint. Never "
            "after exit code 2 (bad input), an orderly stop or a signal to the launcher.",
        ),
    ] = 0,
    stall_timeout: Annotated[
        float | None,
        typer.Option(
            "--stall-timeout",
            metavar="SECONDS",
            help="A process that reached no step boundary for this long, once it reached its first, "
            "counts as failed (exit 75). Longer than the slowest step, evaluation and save.",
            show_default="off",
        ),
    ] = None,
) -> None:
    """Start N processes of one job, prefix each output line with its rank, stop all when one fails
    (or restart them all, with --max-restarts)."""
    if num_processes is None:
        raise MeshkitError(
            "give the number of processes with -n N, e.g. meshkit launch -n 2 -- python train.py"
        )
    if timeout is not None and not timeout > 0:
        raise MeshkitError(f"--timeout must be a positive number of seconds, got {timeout:g}")
    from meshkit.launch import launch as run

    status = run(
        command or [],
        num_processes,
        devices_per_process=devices_per_process,
        port=port,
        timeout_s=timeout,
        output=sys.stdout,
        error_output=sys.stderr,
        **({} if grace is None else {"signal_grace_s": grace}),
        max_restarts=max_restarts,
        stall_timeout_s=stall_timeout,
    )
    raise typer.Exit(status)


def job_options(
    coordinator_bind_address: Annotated[
        str | None,
        typer.Option(
            "--coordinator-bind-address",
            envvar="MESHKIT_COORDINATOR_BIND_ADDRESS",
            metavar="HOST[:PORT]",
            help="Where process 0's coordination service listens (meshkit launch: 127.0.0.1; "
            "otherwise JAX's default, every interface).",
        ),
    ] = None,
    mtls_cert: Annotated[
        str | None,
        typer.Option(
            "--mtls-cert", envvar="MESHKIT_MTLS_CERT", help="Mutual TLS: this process's PEM certificate."
        ),
    ] = None,
    mtls_key: Annotated[
        str | None, typer.Option("--mtls-key", envvar="MESHKIT_MTLS_KEY", help="Mutual TLS: its private key.")
    ] = None,
    mtls_ca: Annotated[
        str | None,
        typer.Option(
            "--mtls-ca",
            envvar="MESHKIT_MTLS_CA",
            help="Mutual TLS: the CA that signed every process's certificate.",
        ),
    ] = None,
    heartbeat_timeout: Annotated[
        float | None,
        typer.Option(
            "--heartbeat-timeout",
            envvar="MESHKIT_HEARTBEAT_TIMEOUT_S",
            metavar="SECONDS",
            help="A process silent this long (dead or stalled) stops the job (default 30).",
        ),
    ] = None,
) -> None:
    """Set for this command (and the processes ``meshkit launch`` starts) through the environment
    that :func:`meshkit.distributed.initialize` reads."""
    for (
        name,
        value,
    ) in (  # the names of meshkit.distributed, not imported: it imports jax, and every command runs this
        ("MESHKIT_COORDINATOR_BIND_ADDRESS", coordinator_bind_address),
        ("MESHKIT_MTLS_CERT", mtls_cert),
        ("MESHKIT_MTLS_KEY", mtls_key),
        ("MESHKIT_MTLS_CA", mtls_ca),
        ("MESHKIT_HEARTBEAT_TIMEOUT_S", heartbeat_timeout),
    ):
        if value is not None:
            os.environ[name] = str(value)
    if heartbeat_timeout is not None and not heartbeat_timeout > 0:
        raise MeshkitError(
            f"--heartbeat-timeout must be a positive number of seconds, got {heartbeat_timeout:g}"
        )


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(launch)
