"""The processes of one start of a job: the environment each gets, spawning each in its own process
group (tied to the launcher's life on Linux), copying its output line by line with its rank, and
signalling, stopping and draining the groups."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TextIO

from meshkit.distributed import (
    MESHKIT_COORDINATOR_ADDRESS,
    MESHKIT_COORDINATOR_BIND_ADDRESS,
    MESHKIT_DEVICES_PER_PROCESS,
    MESHKIT_HEARTBEAT_TIMEOUT_S,
    MESHKIT_NUM_PROCESSES,
    MESHKIT_PROCESS_ID,
    MESHKIT_TIMEOUT_S,
    MutualTLS,
)
from meshkit.launch._errors import LaunchError

_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class _Child:
    rank: int
    proc: subprocess.Popen
    pumps: tuple[threading.Thread, ...]


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


def _die_with_launcher() -> Callable[[], None] | None:
    """Linux: what a child runs between fork and exec so that the kernel SIGKILLs it when the
    launcher dies (``PR_SET_PDEATHSIG``), even by SIGKILL; elsewhere None."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    launcher = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the line above
            os._exit(128 + signal.SIGKILL)

    return arm


_PR_SET_PDEATHSIG = 1


def _spawn(rank: int, command: Sequence[str], env: dict, out: TextIO, err: TextIO, lock) -> _Child:
    try:
        with warnings.catch_warnings():
            # JAX, if it runs in this process, warns at every fork(); the child only arms
            # PR_SET_PDEATHSIG and execs the command, touching nothing that JAX's threads hold
            warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
            proc = subprocess.Popen(
                list(command),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                process_group=0,
                preexec_fn=_die_with_launcher(),
            )
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
