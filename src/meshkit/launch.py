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
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO

from meshkit._errors import MeshkitError
from meshkit.distributed import (
    MESHKIT_COORDINATOR_ADDRESS,
    MESHKIT_COORDINATOR_BIND_ADDRESS,
    MESHKIT_DEVICES_PER_PROCESS,
    MESHKIT_HEARTBEAT_TIMEOUT_S,
    MESHKIT_NUM_PROCESSES,
    MESHKIT_PROCESS_ID,
    MESHKIT_RESTART_ATTEMPT,
    MESHKIT_TIMEOUT_S,
    PEER_LOST_EXIT_CODE,
    MutualTLS,
    bind_address,
)

#: Seconds the other processes get to exit after SIGTERM, once one failed, before SIGKILL.
DEFAULT_GRACE_S = 5.0
#: Seconds the processes get to save and exit after a SIGINT or SIGTERM passed on, before SIGKILL.
DEFAULT_SIGNAL_GRACE_S = 30.0
#: Exit statuses of a process that stopped in order on a signal (``meshkit train``: 128 + SIGINT or
#: SIGTERM, after its checkpoint): not a failure, the others are stopping at the same step.
ORDERLY_STOP = frozenset(128 + s for s in (signal.SIGINT, signal.SIGTERM))
#: Exit status of a process that rejected its input; the launcher never restarts it (it would again).
BAD_INPUT_EXIT_CODE = 2
#: Exit status of a job stopped because a process made no progress for ``--stall-timeout`` seconds
#: (EX_TEMPFAIL, as for a lost peer: a restart may succeed).
STALLED_EXIT_CODE = PEER_LOST_EXIT_CODE
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
                list(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, process_group=0, preexec_fn=_die_with_launcher(),
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


@dataclass(frozen=True, slots=True)
class _Ended:
    """How one start of the job ended: its exit status and, for a failure that a restart may
    cure, which process and why (None: success, an orderly stop or a signal to the launcher)."""

    status: int
    rank: int | None = None
    why: str = ""


def _stalled(children: Sequence[_Child], progress: Path | None, stall_timeout_s: float | None) -> int | None:
    """The first running process whose last step boundary (its progress file's time, see
    :func:`report_progress`) is more than ``stall_timeout_s`` old; a process that has not reached
    its first step yet (start-up, compilation) is never stalled."""
    if progress is None or stall_timeout_s is None:
        return None
    now = time.time()
    for c in children:
        if c.proc.poll() is not None:  # ended: done (or judged as it exited), not stalled
            continue
        with contextlib.suppress(OSError):
            if now - (progress / f"{_PROGRESS_PREFIX}{c.rank}").stat().st_mtime > stall_timeout_s:
                return c.rank
    return None


def _supervise(
    children: Sequence[_Child],
    say: Callable[[str], None],
    grace_s: float,
    signal_grace_s: float,
    signals: _Signals,
    stall: tuple[Path | None, float | None] = (None, None),
) -> _Ended:
    """Wait for every child. On the first failure (or a process making no progress for the stall
    timeout) return it, the others still running; on a signal to the launcher pass it on to all,
    give them ``signal_grace_s`` to save and exit, and return 128+signal. A child that stopped in
    order (:data:`ORDERLY_STOP`) is not a failure: the others, stopping at the same step, get
    ``signal_grace_s`` to follow, and its status is returned."""
    orderly: tuple[float, int] | None = None  # (when, status) of the first orderly stop
    checked = time.monotonic()
    while True:
        if signals.received is not None:
            name = signal.Signals(signals.received).name
            say(
                f"got {name}; passing it on to all {len(children)} process(es), {signal_grace_s:g} s to save and exit"
            )
            _stop(children, signals.received, signal_grace_s, signals.hurry)
            return _Ended(128 + signals.received)
        running = False
        for c in children:
            rc = c.proc.poll()
            if rc is None:
                running = True
            elif rc in ORDERLY_STOP:
                orderly = orderly or (time.monotonic(), rc)
            elif rc != 0:
                return _Ended(_shell_status(rc), c.rank, f"exited with {describe_status(rc)}")
        if not running:
            return _Ended(orderly[1] if orderly else 0)
        if orderly and time.monotonic() - orderly[0] > signal_grace_s:
            late = [c.rank for c in children if c.proc.poll() is None]
            say(
                f"process(es) {', '.join(map(str, late))} still running {signal_grace_s:g} s after another stopped "
                "on a signal; stopping them"
            )
            _stop(children, signal.SIGTERM, grace_s, signals.hurry)
            return _Ended(orderly[1])
        if not orderly and time.monotonic() - checked >= _STALL_CHECK_S:
            checked = time.monotonic()
            if (rank := _stalled(children, *stall)) is not None:
                why = f"made no progress (no step) for {stall[1]:g} s (--stall-timeout)"
                return _Ended(STALLED_EXIT_CODE, rank, why)
        time.sleep(_POLL_S)


def _ended_line(ended: _Ended, alive: bool, attempt: int, max_restarts: int) -> str:
    """The launcher's one line about a failed start: which process, why, and what happens next."""
    line = f"process {ended.rank} {ended.why}"
    if ended.status == BAD_INPUT_EXIT_CODE and max_restarts:
        return line + "; not restarting: exit code 2 means bad input, which a restart repeats"
    if attempt < max_restarts:
        return (
            line
            + f"; restarting the job from its latest checkpoint (restart {attempt + 1} of {max_restarts})"
        )
    if max_restarts:
        return line + ("; stopping the others" if alive else "") + f" (no restarts left: {max_restarts} used)"
    return line + ("; stopping the others" if alive else "")


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
    mtls = MutualTLS.from_env() if mtls is None else mtls
    if mtls is not None:
        mtls.check()
    for name, value in (
        ("--heartbeat-timeout", heartbeat_timeout_s),
        ("--grace", signal_grace_s),
    ):
        if value is not None and not value > 0:
            raise LaunchError(f"{name} must be a positive number of seconds, got {value:g}")
    out = output if output is not None else sys.stdout
    err = error_output if error_output is not None else out
    lock = threading.Lock()

    def say(message: str) -> None:
        with lock:
            err.write(f"meshkit launch: {message}\n")
            err.flush()

    with _Signals() as signals, _job_tls(mtls) as tls, _progress_dir(stall_timeout_s) as progress:
        attempt = 0
        while True:
            at = port if port is not None else free_port()  # a new one per start: the last may linger
            bind = bind_address(
                coordinator_bind_address or os.environ.get(MESHKIT_COORDINATOR_BIND_ADDRESS) or LOOPBACK,
                f"localhost:{at}",
            )
            extra = dict(env or {})
            if max_restarts:
                extra[MESHKIT_RESTART_ATTEMPT] = str(attempt)
            children: list[_Child] = []
            try:
                for rank in range(num_processes):
                    if signals.received is not None:
                        break
                    if progress is not None:
                        extra[MESHKIT_PROGRESS_FILE] = str(progress / f"{_PROGRESS_PREFIX}{rank}")
                    child = child_env(rank, num_processes, f"localhost:{at}", devices_per_process=devices_per_process,
                                      timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
                                      coordinator_bind_address=bind, mtls=tls, env=extra)  # fmt: skip
                    children.append(_spawn(rank, command, child, out, err, lock))
                ended = _supervise(
                    children, say, grace_s, signal_grace_s, signals, (progress, stall_timeout_s)
                )
                if ended.rank is not None:
                    alive = any(c.proc.poll() is None for c in children if c.rank != ended.rank)
                    say(_ended_line(ended, alive, attempt, max_restarts))
                    _stop(children, signal.SIGTERM, grace_s, signals.hurry)
            finally:
                _stop(children, signal.SIGKILL, 0, signals.hurry)
                _drain(children, say, drain_s)
            restart = (
                ended.rank is not None
                and ended.status != BAD_INPUT_EXIT_CODE
                and attempt < max_restarts
                and signals.received is None
            )
            if not restart:
                return ended.status
            attempt += 1
            if progress is not None:
                for f in progress.iterdir():  # the next start's first step arms the stall watch again
                    f.unlink(missing_ok=True)


def _check_restarts(max_restarts: int, stall_timeout_s: float | None) -> None:
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise LaunchError(f"--max-restarts must be 0 or more, got {max_restarts!r}")
    if stall_timeout_s is not None and not (isinstance(stall_timeout_s, int | float) and stall_timeout_s > 0):
        raise LaunchError(f"--stall-timeout must be a positive number of seconds, got {stall_timeout_s!r}")


# --- progress: a step boundary reached -----------------------------------------------------------------

#: Set by ``meshkit launch --stall-timeout`` for each process: the file whose time says when it last
#: reached a step boundary (see :func:`report_progress`).
MESHKIT_PROGRESS_FILE = "MESHKIT_PROGRESS_FILE"
_PROGRESS_PREFIX = "progress-"
#: How often the launcher looks at the progress files.
_STALL_CHECK_S = 1.0


def report_progress(*, done: bool = False) -> None:
    """Tell ``meshkit launch --stall-timeout`` that this process reached a step boundary: one
    ``utime`` of the file ``MESHKIT_PROGRESS_FILE`` names (nothing when unset); ``done``: it left
    its steps (what follows, e.g. a final evaluation, is not judged), the file is removed.
    ``meshkit train`` calls it at every step boundary after the first step; a program of your own
    may call it in its loop."""
    path = os.environ.get(MESHKIT_PROGRESS_FILE)
    if not path:
        return
    try:
        if done:
            os.unlink(path)
        else:
            os.utime(path)
    except FileNotFoundError:
        if not done:
            with contextlib.suppress(OSError):
                open(path, "a").close()
    except OSError:
        pass  # the launcher is gone, or its directory: nothing to tell


@contextlib.contextmanager
def _progress_dir(stall_timeout_s: float | None) -> Iterator[Path | None]:
    """A private directory for the processes' progress files while the job runs (None without a
    stall timeout); swept like the certificates' if the launcher is SIGKILLed."""
    if stall_timeout_s is None:
        yield None
        return
    try:
        directory = tempfile.mkdtemp(prefix=f"{_TLS_PREFIX}{os.getpid()}-progress-")
    except OSError as e:
        raise LaunchError(
            f"cannot make the job's progress directory in {tempfile.gettempdir()} ({e.strerror or e}): set TMPDIR "
            "to a writable directory, or leave out --stall-timeout"
        ) from None
    try:
        yield Path(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --- the job's own certificates ---------------------------------------------------------------------

#: Prefix of the private directory holding a job's certificates (followed by the launcher's pid).
_TLS_PREFIX = "meshkit-launch-"


@contextlib.contextmanager
def _job_tls(given: MutualTLS | None) -> Iterator[MutualTLS]:
    """``given``, or a CA and certificate made for this job, in a directory only this user can read,
    removed on leaving (one left by a launcher that was SIGKILLed is removed by the next)."""
    if given is not None:
        yield given
        return
    _sweep_stale_tls()
    try:
        directory = tempfile.mkdtemp(prefix=f"{_TLS_PREFIX}{os.getpid()}-")  # mode 0700
    except OSError as e:
        raise LaunchError(
            f"cannot make the job's certificates in {tempfile.gettempdir()} ({e.strerror or e}): set TMPDIR to a "
            "writable directory, or give your own with --mtls-cert/--mtls-key/--mtls-ca"
        ) from None
    try:
        yield _make_tls(Path(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _make_tls(directory: Path) -> MutualTLS:
    """A CA whose key is never written and one certificate it signed, for every process of the job:
    server (process 0's coordination service, checked against the coordinator address's host,
    ``localhost``) and client (every process)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshkit launch {os.getpid()} job CA")])

    def signed(subject: x509.Name, public_key, extensions) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=3650))  # the job's length: the CA dies with it
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(ca_key, hashes.SHA256())

    usage = dict.fromkeys(("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
                           "encipher_only", "decipher_only"), False)  # fmt: skip
    ca = signed(ca_name, ca_key.public_key(), [
        (x509.BasicConstraints(ca=True, path_length=0), True),
        (x509.KeyUsage(digital_signature=False, key_cert_sign=True, crl_sign=True, **usage), True),
    ])  # fmt: skip
    host = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
             x509.IPAddress(ipaddress.ip_address("::1"))]  # fmt: skip
    cert = signed(host, key.public_key(), [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, **usage), True),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False),
        (x509.SubjectAlternativeName(names), False),
    ])  # fmt: skip
    pem = serialization.Encoding.PEM
    files = {
        "ca.pem": ca.public_bytes(pem),
        "job.pem": cert.public_bytes(pem),
        "job.key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    }
    for name, data in files.items():
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return MutualTLS(
        cert=str(directory / "job.pem"), key=str(directory / "job.key"), ca=str(directory / "ca.pem")
    )


def _sweep_stale_tls() -> None:
    """Remove this user's job certificate directories whose launcher is gone (SIGKILLed)."""
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for d in root.glob(f"{_TLS_PREFIX}*-*"):
            pid = d.name[len(_TLS_PREFIX) :].partition("-")[0]
            with contextlib.suppress(OSError, ValueError):
                if d.stat().st_uid == os.getuid() and not _pid_alive(int(pid)):
                    shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
