"""Start-up of multi-process jobs: one call, before any JAX computation, joins this process to its job.

:func:`initialize` finds where the job's shape comes from (explicit arguments, the environment set
by ``meshkit launch``, Open MPI's ``mpirun``, or SLURM), calls :func:`jax.distributed.initialize`
with failure detection tuned for fast, clear failures, and returns a :class:`ProcessInfo`.
:func:`detect` does the finding alone, without side effects.

When a process of a running job dies or stalls (SIGSTOP, swapping, stuck in I/O), meshkit's peer
watch (:mod:`meshkit.distributed._heartbeat`) notices its missing heartbeats after ``heartbeat_timeout_s`` and
ends every survivor with one line naming it (JAX's coordination service, set to twice that and 10 s
more, would abort them from C++); a collective that fails first (e.g. gloo's "Connection reset by peer")
raises in Python, where :func:`fail_fast` turns it into one line naming the lost process.

Who may join: the coordination service binds where ``coordinator_bind_address`` says (``meshkit
launch`` binds it to loopback; JAX's default is every interface), and with :class:`MutualTLS` the
service and every process prove themselves with certificates of one CA.

This module holds the job this process joined (joining, leaving, and telling a lost peer from other
failures after start-up); the rest lives in one module per concept, re-exported here: ``_env`` (the
variables and defaults), ``_detect`` (where the process sits, before anything starts), ``_security``
(bind address, mutual TLS), ``_startup`` (JAX's start-up and its timeouts), ``_failure`` (errors,
exit statuses, the last line), ``_heartbeat`` (the peer watch).
"""

from __future__ import annotations

import atexit
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import jax

from meshkit.devices import backend_started, simulate_devices
from meshkit.distributed._detect import (
    JOB_COMPLETION_INDEX,
    SOURCES,
    ProcessSpec,
    detect,
    is_multiprocess_env,
)
from meshkit.distributed._env import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    MESHKIT_COORDINATOR_ADDRESS,
    MESHKIT_COORDINATOR_BIND_ADDRESS,
    MESHKIT_DEVICES_PER_PROCESS,
    MESHKIT_HEARTBEAT_TIMEOUT_S,
    MESHKIT_MTLS_CA,
    MESHKIT_MTLS_CERT,
    MESHKIT_MTLS_KEY,
    MESHKIT_NUM_PROCESSES,
    MESHKIT_PROCESS_ID,
    MESHKIT_RESTART_ATTEMPT,
    MESHKIT_TIMEOUT_S,
    SLURM_RESTART_COUNT,
    _default_timeout,
    _env_float,
    restart_attempt,
)
from meshkit.distributed._failure import (
    PEER_LOST_EXIT_CODE,
    STARTUP_FAILED_EXIT_CODE,
    DistributedError,
    PeerLostError,
    _exit_now,
    _first_line,
    _reason,
)
from meshkit.distributed._heartbeat import PeerWatch
from meshkit.distributed._security import MutualTLS, bind_address
from meshkit.distributed._startup import _JAX_TIMEOUT_MARGIN_S as _JAX_TIMEOUT_MARGIN_S
from meshkit.distributed._startup import (
    ProcessInfo,
    _check_timeouts,
    _describe,
    _start,
    jax_heartbeat_timeout,
)

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "JOB_COMPLETION_INDEX",
    "MESHKIT_COORDINATOR_ADDRESS",
    "MESHKIT_COORDINATOR_BIND_ADDRESS",
    "MESHKIT_DEVICES_PER_PROCESS",
    "MESHKIT_HEARTBEAT_TIMEOUT_S",
    "MESHKIT_MTLS_CA",
    "MESHKIT_MTLS_CERT",
    "MESHKIT_MTLS_KEY",
    "MESHKIT_NUM_PROCESSES",
    "MESHKIT_PROCESS_ID",
    "MESHKIT_RESTART_ATTEMPT",
    "MESHKIT_TIMEOUT_S",
    "PEER_LOST_EXIT_CODE",
    "SLURM_RESTART_COUNT",
    "SOURCES",
    "STARTUP_FAILED_EXIT_CODE",
    "DistributedError",
    "MutualTLS",
    "PeerLostError",
    "ProcessInfo",
    "ProcessSpec",
    "bind_address",
    "detect",
    "fail_fast",
    "initialize",
    "is_multiprocess_env",
    "jax_heartbeat_timeout",
    "peer_failure",
    "process_info",
    "restart_attempt",
    "roll_call",
    "shutdown",
]

_PEER_FAILURE = re.compile(
    r"gloo|connection (reset|refused|closed)|broken pipe|socket closed|unavailable|heartbeat|"
    r"coordination service|end of file",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class _Started:
    spec: ProcessSpec
    info: ProcessInfo
    watch: PeerWatch | None = None


_started: _Started | None = None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    devices_per_process: int | None = None,
    timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S,
    coordinator_bind_address: str | None = None,
    mtls: MutualTLS | None = None,
) -> ProcessInfo:
    """Join this process to its multi-process job; call it first, before any JAX computation.

    Values come from the arguments, else ``meshkit launch``'s environment, else mpirun or SLURM
    (see :func:`detect`); with none of them this only applies ``devices_per_process`` and describes
    the single process. ``devices_per_process`` (or ``MESHKIT_DEVICES_PER_PROCESS``) simulates that
    many CPU devices in each process.

    ``timeout_s`` (default ``MESHKIT_TIMEOUT_S`` or 300): how long to wait for all processes to
    connect; past it the process prints one ``error:`` line naming the coordinator and exits with
    status 2 (JAX would abort it there anyway). ``heartbeat_timeout_s`` (default
    ``MESHKIT_HEARTBEAT_TIMEOUT_S`` or 30): a process silent this long (dead or stalled) is named in
    one line and every survivor exits with status 75. ``shutdown_timeout_s``: how long a finished
    process waits at exit for the others.

    Who may join: ``coordinator_bind_address`` (default ``MESHKIT_COORDINATOR_BIND_ADDRESS``, else
    JAX's: every interface) is where process 0's coordination service listens, 'host:port' or a
    bare host taking the coordinator's port; ``mtls`` (default ``MESHKIT_MTLS_CERT/KEY/CA``) makes
    the service and every process authenticate each other with certificates of one CA.

    Calling it again with the same values returns the same :class:`ProcessInfo`. Starts JAX's
    backend (to report devices).
    """
    global _started
    spec = detect(coordinator_address, num_processes, process_id, devices_per_process=devices_per_process)
    if _started is not None:
        return _same_job(spec)
    if spec.multiprocess:
        _check_can_start(spec)
        timeout = _default_timeout() if timeout_s is None else timeout_s
        if heartbeat_timeout_s is None:
            heartbeat_timeout_s = _env_float(MESHKIT_HEARTBEAT_TIMEOUT_S, DEFAULT_HEARTBEAT_TIMEOUT_S)
        _check_timeouts(timeout, heartbeat_timeout_s, shutdown_timeout_s)
        bind = bind_address(
            coordinator_bind_address or os.environ.get(MESHKIT_COORDINATOR_BIND_ADDRESS), spec.coordinator
        )
        mtls = MutualTLS.from_env() if mtls is None else mtls
        if mtls is not None:
            mtls.check()
    if spec.devices_per_process is not None:
        simulate_devices(spec.devices_per_process)
    watch = None
    if spec.multiprocess:
        explicit = (coordinator_address, num_processes, process_id)
        security = {"coordinator_bind_address": bind, **(mtls.jax_kwargs() if mtls else {})}
        _start(spec, explicit, local_device_ids, timeout, heartbeat_timeout_s, shutdown_timeout_s, security)
    info = _describe(spec)
    if (
        spec.multiprocess and (client := _client()) is not None
    ):  # the peer watch (see meshkit.distributed._heartbeat)
        watch = PeerWatch(
            client,
            process_index=info.process_index,
            process_count=info.process_count,
            timeout_s=heartbeat_timeout_s,
            coordinator=info.coordinator,
            fail=_peer_stalled,
        ).start()
        atexit.register(watch.stop)
    _started = _Started(spec, info, watch)
    return info


def _peer_stalled(message: str, lost: tuple[int, ...]) -> NoReturn:
    _exit_now(PeerLostError(message, lost), PEER_LOST_EXIT_CODE)


def _check_can_start(spec: ProcessSpec) -> None:
    if jax.distributed.is_initialized():
        raise DistributedError(
            "jax.distributed.initialize() was already called directly: call only "
            "meshkit.distributed.initialize(), once, at start-up"
        )
    if backend_started():
        raise DistributedError(
            f"JAX's backend already started, so this process cannot join a {spec.process_count}-process "
            f"job: call meshkit.distributed.initialize() before any JAX computation (right after imports)"
        )


def _same_job(spec: ProcessSpec) -> ProcessInfo:
    assert _started is not None
    have = _started.spec
    same = (have.process_index, have.process_count) == (spec.process_index, spec.process_count) and (
        spec.coordinator is None or have.coordinator is None or spec.coordinator == have.coordinator
    )
    if not same:
        raise DistributedError(
            f"this process already joined a job as process {have.process_index} of {have.process_count} "
            f"(coordinator {have.coordinator}); it cannot join another: start a new process instead"
        )
    return _started.info


def process_info() -> ProcessInfo | None:
    """The :class:`ProcessInfo` of the last :func:`initialize`, or None."""
    return None if _started is None else _started.info


def shutdown() -> None:
    """Leave the job: waits (up to ``shutdown_timeout_s``) for the other processes to leave too.
    A no-op when not initialized."""
    global _started
    if _started is not None and _started.watch is not None:
        _started.watch.stop()
        atexit.unregister(_started.watch.stop)
    if _started is not None and _started.spec.multiprocess:
        jax.distributed.shutdown()
    _started = None


# --- failures after start-up ---------------------------------------------------------------------


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def roll_call(timeout_s: float = 5.0) -> tuple[int, ...]:
    """After a failure, find which processes are gone: each process that calls this reports in
    through the coordination service; returns those that did not within ``timeout_s``.

    Raises :class:`PeerLostError` naming process 0 when the coordinator itself is unreachable.
    """
    import time

    state = _started
    if state is None or not state.spec.multiprocess:
        return ()
    me, n = state.info.process_index, state.info.process_count
    client = _client()
    try:
        client.key_value_set(f"meshkit/roll_call/{me}", "here")
    except Exception as e:  # the coordination service (in process 0) is gone
        raise PeerLostError(
            f"lost process 0 of {n}, the coordinator at {state.info.coordinator} ({_first_line(e)}); "
            f"process {me} stops: check process 0's log for why it ended",
            lost=(0,),
        ) from e
    deadline = time.monotonic() + timeout_s
    lost = []
    for rank in range(n):
        if rank == me:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            client.blocking_key_value_get(f"meshkit/roll_call/{rank}", left_ms)
        except Exception:
            lost.append(rank)
    return tuple(lost)


def peer_failure(error: BaseException, *, roll_call_s: float = 5.0) -> PeerLostError | None:
    """If ``error`` (e.g. a failed collective) means another process of the job was lost, a
    :class:`PeerLostError` naming it (found by :func:`roll_call`); otherwise None."""
    if _started is None or not _started.spec.multiprocess or not _PEER_FAILURE.search(str(error)):
        return None
    me, n = _started.info.process_index, _started.info.process_count
    try:
        lost = roll_call(roll_call_s)
    except PeerLostError as e:
        return e
    if not lost:
        return None
    names = ", ".join(map(str, lost))
    return PeerLostError(
        f"lost process {names} of {n} ({_reason(error)}): it crashed, was killed or hangs; "
        f"process {me} stops: check process {lost[0]}'s log for why",
        lost=lost,
    )


@contextmanager
def fail_fast(*, roll_call_s: float = 5.0, exit_code: int = PEER_LOST_EXIT_CODE) -> Iterator[None]:
    """Around a multi-process job's work: when it fails because another process was lost, print one
    ``error:`` line naming that process and exit at once with ``exit_code`` (skipping JAX's exit
    handlers, which would wait for the lost process). Other errors propagate unchanged.

    Every surviving process should run its work inside it: the survivors answer each other's
    roll call, so only the dead are named.
    """
    try:
        yield
    except Exception as e:
        lost = peer_failure(e, roll_call_s=roll_call_s)
        if lost is None:
            raise
        _exit_now(lost, exit_code)
