"""Start the N processes of a job on this machine (``meshkit launch``), and stop them together.

Each process runs the same command with ``MESHKIT_*`` variables naming its place in the job (read
by :func:`meshkit.distributed.initialize`). Their output comes back line by line, prefixed with the
rank, and all of it (to the last line of a process stopped because another failed) is copied before
the launcher returns. When one fails, the others are stopped (SIGTERM, then SIGKILL after a grace
period) and its exit status is returned; SIGINT or SIGTERM to the launcher is passed on to every
process group, so that nothing outlives the launcher.

The job is local, so its coordination service listens on loopback only (JAX's default is every
interface): no other host can join or talk to it. Mutual TLS, if given, is passed on to every process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TextIO

from meshkit._errors import MeshkitError
from meshkit.distributed import (
    MESHKIT_COORDINATOR_ADDRESS,
    MESHKIT_COORDINATOR_BIND_ADDRESS,
    MESHKIT_DEVICES_PER_PROCESS,
    MESHKIT_HEARTBEAT_TIMEOUT_S,
    MESHKIT_NUM_PROCESSES,
    MESHKIT_PROCESS_ID,
    MESHKIT_TIMEOUT_S,
    MutualTLS,
    bind_address,
)

#: Seconds the other processes get to exit after SIGTERM (or a forwarded SIGINT) before SIGKILL.
DEFAULT_GRACE_S = 5.0
#: Seconds to wait, once every process has ended, for the rest of their output.
DRAIN_S = 30.0
_POLL_S = 0.05
#: Where a local job's coordination service listens (the port is the coordinator's).
LOOPBACK = "127.0.0.1"


class LaunchError(MeshkitError):
    """The processes cannot be started as asked."""


@dataclass(frozen=True, slots=True)
class _Child:
    rank: int
    proc: subprocess.Popen
    pumps: tuple[threading.Thread, ...]


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


def child_env(
    rank: int,
    num_processes: int,
    coordinator: str,
    *,
    devices_per_process: int | None = None,
    timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    coordinator_bind_address: str | None = None,
    mtls: MutualTLS | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``rank``: the launcher's own, then ``env``, then the job's.
    Values left None are not set (a heartbeat timeout, bind address or mutual TLS already in the
    launcher's environment passes through)."""
    out = {**os.environ, **(env or {})}
    out.setdefault("PYTHONUNBUFFERED", "1")  # lines arrive as printed, not at exit
    out[MESHKIT_COORDINATOR_ADDRESS] = coordinator
    out[MESHKIT_NUM_PROCESSES] = str(num_processes)
    out[MESHKIT_PROCESS_ID] = str(rank)
    for name, value in ((MESHKIT_DEVICES_PER_PROCESS, devices_per_process), (MESHKIT_TIMEOUT_S, timeout_s)):
        if value is None:
            out.pop(name, None)
        else:
            out[name] = str(value)
    for name, value in (
        (MESHKIT_HEARTBEAT_TIMEOUT_S, heartbeat_timeout_s),
        (MESHKIT_COORDINATOR_BIND_ADDRESS, coordinator_bind_address),
    ):
        if value is not None:
            out[name] = str(value)
    out.update(mtls.env() if mtls is not None else {})
    return out


def _pump(stream: IO[bytes], prefix: str, sink: TextIO, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``sink`` line by line, each line prefixed."""
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            with lock:
                sink.write(f"{prefix}{line}\n")
                sink.flush()


def _spawn(rank: int, command: Sequence[str], env: dict, out: TextIO, err: TextIO, lock) -> _Child:
    try:
        proc = subprocess.Popen(
            list(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, process_group=0,
        )  # fmt: skip
    except OSError as e:
        raise LaunchError(f"cannot start {command[0]!r}: {e.strerror or e}") from None
    pumps = tuple(
        threading.Thread(target=_pump, args=(stream, f"[{rank}] ", sink, lock), daemon=True)
        for stream, sink in ((proc.stdout, out), (proc.stderr, err))
    )
    for t in pumps:
        t.start()
    return _Child(rank, proc, pumps)


def _drain(children: Sequence[_Child], say: Callable[[str], None], drain_s: float) -> None:
    """Wait until every line the processes wrote has been copied (their pipes reach end of file);
    a pipe still open after ``drain_s`` (held by something a process started outside its group) is
    named and left."""
    deadline = time.monotonic() + drain_s
    for c in children:
        for t in c.pumps:
            t.join(max(0.0, deadline - time.monotonic()))
    cut = [c.rank for c in children if any(t.is_alive() for t in c.pumps)]
    if cut:
        say(
            f"output of process(es) {', '.join(map(str, cut))} may be cut short: something they started "
            f"still holds it open {drain_s:g} s after they ended"
        )


def _signal_group(child: _Child, signum: int) -> None:
    """Signal the child's whole process group (it and anything it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, signum)


def _stop(children: Sequence[_Child], signum: int, grace_s: float, hurry: threading.Event) -> None:
    """Send ``signum`` to every process group, SIGKILL what is left after ``grace_s``, and reap."""
    for c in children:
        if c.proc.poll() is None:
            _signal_group(c, signum)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not hurry.is_set():
        if all(c.proc.poll() is not None for c in children):
            break
        time.sleep(_POLL_S)
    for c in children:
        _signal_group(c, signal.SIGKILL)  # also grandchildren whose parent already exited
        c.proc.wait()


def describe_status(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL', from a :class:`subprocess.Popen` return code."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _shell_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class _Signals:
    """While launching (main thread only): the first SIGINT/SIGTERM is recorded in ``received`` for
    the supervising loop to act on; a second one sets ``hurry`` (skip the grace period)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.hurry = threading.Event()
        self._saved: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        else:
            self.hurry.set()

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._saved.items():
            signal.signal(s, handler)


def _supervise(
    children: Sequence[_Child], say: Callable[[str], None], grace_s: float, signals: _Signals
) -> int:
    """Wait for every child; on the first failure stop the others and return its status; on a
    signal to the launcher pass it on to all and return 128+signal."""
    while True:
        if signals.received is not None:
            name = signal.Signals(signals.received).name
            say(f"got {name}; stopping all {len(children)} process(es)")
            _stop(children, signals.received, grace_s, signals.hurry)
            return 128 + signals.received
        running = False
        for c in children:
            rc = c.proc.poll()
            if rc is None:
                running = True
            elif rc != 0:
                alive = any(o.proc.poll() is None for o in children if o is not c)
                say(
                    f"process {c.rank} exited with {describe_status(rc)}"
                    + ("; stopping the others" if alive else "")
                )
                _stop(children, signal.SIGTERM, grace_s, signals.hurry)
                return _shell_status(rc)
        if not running:
            return 0
        time.sleep(_POLL_S)


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
    drain_s: float = DRAIN_S,
) -> int:
    """Run ``command`` as processes 0..N-1 of one job on this machine; return the job's exit status.

    The coordinator is ``localhost`` on ``port`` (default: a free one); its coordination service
    listens on ``coordinator_bind_address`` (default ``MESHKIT_COORDINATOR_BIND_ADDRESS``, else
    loopback: 127.0.0.1). ``mtls`` (default: ``MESHKIT_MTLS_*`` of the launcher's environment)
    makes every process authenticate with its certificate. ``devices_per_process`` simulates that
    many CPU devices in each; ``timeout_s`` is how long they wait for each other at start-up;
    ``heartbeat_timeout_s`` how long a silent (dead or stalled) process is waited for before the
    job stops. Children's stdout goes to ``output`` (default ``sys.stdout``) and their stderr to
    ``error_output`` (default: ``output``), each line prefixed ``[rank] ``; the launcher's own
    messages go to ``error_output``. Returns 0 when all succeed, else the status of the first
    process to fail (128+N for signal N), after stopping the rest; on SIGINT/SIGTERM, passes the
    signal to every process group, SIGKILLs what remains after ``grace_s`` and returns 128+signal.
    Every line written is copied before it returns (waiting up to ``drain_s`` for pipes that
    something outside the process groups holds open).
    """
    _check(command, num_processes, devices_per_process, port)
    mtls = MutualTLS.from_env() if mtls is None else mtls
    if mtls is not None:
        mtls.check()
    if heartbeat_timeout_s is not None and not heartbeat_timeout_s > 0:
        raise LaunchError(
            f"--heartbeat-timeout must be a positive number of seconds, got {heartbeat_timeout_s:g}"
        )
    port = free_port() if port is None else port
    bind = bind_address(
        coordinator_bind_address or os.environ.get(MESHKIT_COORDINATOR_BIND_ADDRESS) or LOOPBACK,
        f"localhost:{port}",
    )
    out = output if output is not None else sys.stdout
    err = error_output if error_output is not None else out
    lock = threading.Lock()

    def say(message: str) -> None:
        with lock:
            err.write(f"meshkit launch: {message}\n")
            err.flush()

    children: list[_Child] = []
    coordinator = f"localhost:{port}"
    with _Signals() as signals:
        try:
            for rank in range(num_processes):
                if signals.received is not None:
                    break
                child = child_env(rank, num_processes, coordinator, devices_per_process=devices_per_process,
                                  timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
                                  coordinator_bind_address=bind, mtls=mtls, env=env)  # fmt: skip
                children.append(_spawn(rank, command, child, out, err, lock))
            status = _supervise(children, say, grace_s, signals)
        finally:
            _stop(children, signal.SIGKILL, 0, signals.hurry)
            _drain(children, say, drain_s)
    return status
