"""Start the N processes of a job on this machine (``meshkit launch``), and stop them together.

Each process runs the same command with ``MESHKIT_*`` variables naming its place in the job (read
by :func:`meshkit.distributed.initialize`). Their output comes back line by line, prefixed with the
rank, and all of it (to the last line of a process stopped because another failed) is copied before
the launcher returns. When one fails, the others are stopped (SIGTERM, then SIGKILL after a grace
period) and its exit status is returned. SIGINT or SIGTERM to the launcher is passed on to every
process group and the processes get ``signal_grace_s`` to save and exit (``meshkit train`` saves a
checkpoint at a step they all agree on and exits with 128 + the signal) before SIGKILL; a process
that exits so is not a failure, and the others are waited for. Nothing outlives the launcher: on
Linux each process is SIGKILLed by the kernel when the launcher dies, even by SIGKILL.

Restarts (``--max-restarts N``): a failed process, or with ``--stall-timeout`` one that reached no
step boundary for that long (each process touches its own file in a private directory at every
boundary: :func:`report_progress`), stops the job, which starts again, up to N times, with
``MESHKIT_RESTART_ATTEMPT`` telling ``meshkit train --run-dir`` to resume from its latest checkpoint.

Who may join: the job is local, so its coordination service listens on loopback only (JAX's default
is every interface), and unless mutual TLS is given, the launcher makes it for this job alone: a
throwaway CA whose key is never written, and one certificate signed by it, in a private temporary
directory removed when the launcher ends. Another local process that knows the port and claims a
rank is refused (it has no certificate) and the job goes on.

The modules, one concept each, their public names re-exported here: ``_children`` (the processes of
one start: environment, spawning, output, stopping), ``_supervise`` (watching a start until it ends),
``_progress`` (step boundaries, for ``--stall-timeout``), ``_tls`` (the job's own certificates),
``_errors`` (:class:`LaunchError`). This module holds :func:`launch`: checking its options, and
starting the job again after a failure, up to ``max_restarts`` times.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from meshkit.distributed import (
    MESHKIT_COORDINATOR_BIND_ADDRESS,
    MESHKIT_RESTART_ATTEMPT,
    MutualTLS,
    bind_address,
)
from meshkit.launch._children import _Child, _drain, _spawn, _stop, child_env, describe_status
from meshkit.launch._errors import LaunchError
from meshkit.launch._progress import _PROGRESS_PREFIX, MESHKIT_PROGRESS_FILE, _progress_dir, report_progress
from meshkit.launch._supervise import (
    BAD_INPUT_EXIT_CODE,
    ORDERLY_STOP,
    STALLED_EXIT_CODE,
    _Ended,
    _ended_line,
    _Signals,
    _supervise,
)
from meshkit.launch._tls import _job_tls

__all__ = [
    "BAD_INPUT_EXIT_CODE",
    "DEFAULT_GRACE_S",
    "DEFAULT_SIGNAL_GRACE_S",
    "DRAIN_S",
    "LOOPBACK",
    "MESHKIT_PROGRESS_FILE",
    "ORDERLY_STOP",
    "STALLED_EXIT_CODE",
    "LaunchError",
    "child_env",
    "describe_status",
    "free_port",
    "launch",
    "report_progress",
]

#: Seconds the other processes get to exit after SIGTERM, once one failed, before SIGKILL.
DEFAULT_GRACE_S = 5.0
#: Seconds the processes get to save and exit after a SIGINT or SIGTERM passed on, before SIGKILL.
DEFAULT_SIGNAL_GRACE_S = 30.0
#: Seconds to wait, once every process has ended, for the rest of their output.
DRAIN_S = 30.0
#: Where a local job's coordination service listens (the port is the coordinator's).
LOOPBACK = "127.0.0.1"


def _port_free(port: int) -> bool:
    """Whether a server (such as JAX's coordination service, which binds ``[::]:port``) could listen
    on ``port``."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A TCP port that nothing listens on now."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        if _port_free(port):
            return port
    raise LaunchError("found no free TCP port for the coordinator: give one with --port")


def _check(
    command: Sequence[str], num_processes: int, devices_per_process: int | None, port: int | None
) -> None:
    if not command:
        raise LaunchError("give the command to run after --, e.g. meshkit launch -n 2 -- python train.py")
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise LaunchError(
            f"the number of processes must be at least 1, got {num_processes!r}: use -n 2 or more"
        )
    if devices_per_process is not None and (
        not isinstance(devices_per_process, int) or devices_per_process < 1
    ):
        raise LaunchError(f"--devices-per-process must be at least 1, got {devices_per_process!r}")
    if port is not None and not 0 < port < 65536:
        raise LaunchError(f"--port must be in 1..65535, got {port}")
    if port is not None and not _port_free(port):
        raise LaunchError(
            f"port {port} is in use, so the coordinator cannot listen there: pick another with --port, "
            f"or leave --port out to use a free one"
        )


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    coordinator_bind_address: str | None = None,
    mtls: MutualTLS | None = None,
    env: Mapping[str, str] | None = None,
    output: TextIO | None = None,
    error_output: TextIO | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    signal_grace_s: float = DEFAULT_SIGNAL_GRACE_S,
    drain_s: float = DRAIN_S,
    max_restarts: int = 0,
    stall_timeout_s: float | None = None,
) -> int:
    """Run ``command`` as processes 0..N-1 of one job on this machine; return the job's exit status.

    The coordinator is ``localhost`` on ``port`` (default: a free one); its coordination service
    listens on ``coordinator_bind_address`` (default ``MESHKIT_COORDINATOR_BIND_ADDRESS``, else
    loopback: 127.0.0.1). ``mtls`` (default: ``MESHKIT_MTLS_*`` of the launcher's environment, else
    a CA and certificate made for this job alone) makes every process authenticate with its
    certificate. ``devices_per_process`` simulates that many CPU devices in each; ``timeout_s`` is
    how long they wait for each other at start-up; ``heartbeat_timeout_s`` how long a silent (dead
    or stalled) process is waited for before the job stops. Children's stdout goes to ``output``
    (default ``sys.stdout``) and their stderr to ``error_output`` (default: ``output``), each line
    prefixed ``[rank] ``; the launcher's own messages go to ``error_output``. Returns 0 when all
    succeed, else the status of the first process to fail (128+N for signal N), after stopping the
    rest (SIGTERM, SIGKILL after ``grace_s``); on SIGINT/SIGTERM, passes the signal to every
    process group, SIGKILLs what remains after ``signal_grace_s`` and returns 128+signal. Every
    line written is copied before it returns (waiting up to ``drain_s`` for pipes that something
    outside the process groups holds open).

    Restarts: with ``max_restarts`` N > 0, a failed start (a process exiting non-zero other than
    with 2, bad input, or :data:`ORDERLY_STOP`; or, with ``stall_timeout_s``, a process that reached
    no step boundary for that long, see :func:`report_progress`) stops the rest and starts the whole
    job again, up to N times, with ``MESHKIT_RESTART_ATTEMPT`` set to the attempt (``meshkit train
    --run-dir`` then resumes from the run's latest checkpoint). An orderly stop or a signal to the
    launcher is never restarted.
    """
    _check(command, num_processes, devices_per_process, port)
    _check_restarts(max_restarts, stall_timeout_s)
    mtls = _given_tls(mtls)
    _check_seconds(heartbeat_timeout_s, signal_grace_s)
    out = output if output is not None else sys.stdout
    err = error_output if error_output is not None else out
    lock = threading.Lock()
    say = functools.partial(_say, err, lock)
    with _Signals() as signals, _job_tls(mtls) as tls, _progress_dir(stall_timeout_s) as progress:
        job = _Job(
            command=command,
            num_processes=num_processes,
            port=port,
            bind=coordinator_bind_address,
            env=env or {},
            devices_per_process=devices_per_process,
            timeout_s=timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            mtls=tls,
            out=out,
            err=err,
            lock=lock,
            say=say,
            grace_s=grace_s,
            signal_grace_s=signal_grace_s,
            drain_s=drain_s,
            max_restarts=max_restarts,
            signals=signals,
            progress=progress,
            stall_timeout_s=stall_timeout_s,
        )
        return _attempts(job)


def _say(err: TextIO, lock: threading.Lock, message: str) -> None:
    """The launcher's own line on ``err``, whole beside the children's."""
    with lock:
        err.write(f"meshkit launch: {message}\n")
        err.flush()


def _attempts(job: _Job) -> int:
    """Start the job, and again after a failure that may be restarted (``launch``'s docstring), up to its
    ``max_restarts``; the status of the last start."""
    attempt = 0
    while True:
        ended = _start(job, attempt)
        restart = (
            ended.rank is not None
            and ended.status != BAD_INPUT_EXIT_CODE
            and attempt < job.max_restarts
            and job.signals.received is None
        )
        if not restart:
            return ended.status
        attempt += 1
        if job.progress is not None:
            for f in job.progress.iterdir():  # the next start's first step arms the stall watch again
                f.unlink(missing_ok=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    """What every start of one :func:`launch` shares: its checked arguments, the job's certificates,
    where output goes, the launcher's signals and the progress directory."""

    command: Sequence[str]
    num_processes: int
    port: int | None
    bind: str | None
    env: Mapping[str, str]
    devices_per_process: int | None
    timeout_s: float | None
    heartbeat_timeout_s: float | None
    mtls: MutualTLS
    out: TextIO
    err: TextIO
    lock: threading.Lock
    say: Callable[[str], None]
    grace_s: float
    signal_grace_s: float
    drain_s: float
    max_restarts: int
    signals: _Signals
    progress: Path | None
    stall_timeout_s: float | None


def _start(job: _Job, attempt: int) -> _Ended:
    """Start every process of ``job`` once (its ``attempt``-th start), wait until that start ends,
    and stop and reap whatever is left, its output copied to the last line."""
    at = job.port if job.port is not None else free_port()  # a new one per start: the last may linger
    bind = bind_address(
        job.bind or os.environ.get(MESHKIT_COORDINATOR_BIND_ADDRESS) or LOOPBACK,
        f"localhost:{at}",
    )
    extra = dict(job.env)
    if job.max_restarts:
        extra[MESHKIT_RESTART_ATTEMPT] = str(attempt)
    children: list[_Child] = []
    try:
        for rank in range(job.num_processes):
            if job.signals.received is not None:
                break
            if job.progress is not None:
                extra[MESHKIT_PROGRESS_FILE] = str(job.progress / f"{_PROGRESS_PREFIX}{rank}")
            child = child_env(
                rank,
                job.num_processes,
                f"localhost:{at}",
                devices_per_process=job.devices_per_process,
                timeout_s=job.timeout_s,
                heartbeat_timeout_s=job.heartbeat_timeout_s,
                coordinator_bind_address=bind,
                mtls=job.mtls,
                env=extra,
            )
            children.append(_spawn(rank, job.command, child, job.out, job.err, job.lock))
        ended = _supervise(
            children,
            job.say,
            job.grace_s,
            job.signal_grace_s,
            job.signals,
            (job.progress, job.stall_timeout_s),
        )
        if ended.rank is not None:
            alive = any(c.proc.poll() is None for c in children if c.rank != ended.rank)
            job.say(_ended_line(ended, alive, attempt, job.max_restarts))
            _stop(children, signal.SIGTERM, job.grace_s, job.signals.hurry)
    finally:
        _stop(children, signal.SIGKILL, 0, job.signals.hurry)
        _drain(children, job.say, job.drain_s)
    return ended


def _check_restarts(max_restarts: int, stall_timeout_s: float | None) -> None:
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise LaunchError(f"--max-restarts must be 0 or more, got {max_restarts!r}")
    if stall_timeout_s is not None and not (isinstance(stall_timeout_s, int | float) and stall_timeout_s > 0):
        raise LaunchError(f"--stall-timeout must be a positive number of seconds, got {stall_timeout_s!r}")


def _given_tls(mtls: MutualTLS | None) -> MutualTLS | None:
    """``mtls``, else the launcher's ``MESHKIT_MTLS_*`` (None: the job makes its own), its files
    checked."""
    mtls = MutualTLS.from_env() if mtls is None else mtls
    if mtls is not None:
        mtls.check()
    return mtls


def _check_seconds(heartbeat_timeout_s: float | None, signal_grace_s: float) -> None:
    for name, value in (
        ("--heartbeat-timeout", heartbeat_timeout_s),
        ("--grace", signal_grace_s),
    ):
        if value is not None and not value > 0:
            raise LaunchError(f"{name} must be a positive number of seconds, got {value:g}")
