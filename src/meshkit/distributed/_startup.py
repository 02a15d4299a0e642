"""Starting JAX's side of a job: :func:`jax.distributed.initialize` with failure detection tuned for
fast, clear failures (timeouts a little past meshkit's own, so that meshkit's one line comes first),
the one line a process exits with when the job does not form in time, and the description of the
started job (:class:`ProcessInfo`)."""

from __future__ import annotations

import math
import signal
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import jax

from meshkit.distributed._detect import _JAX_METHOD, ProcessSpec
from meshkit.distributed._env import MESHKIT_MTLS_CERT
from meshkit.distributed._failure import STARTUP_FAILED_EXIT_CODE, DistributedError, _exit_now, _first_line

#: Extra seconds JAX waits beyond ``timeout_s``, so that meshkit's clear message comes first.
_JAX_TIMEOUT_MARGIN_S = 5
#: Extra seconds of JAX's heartbeat timeout beyond twice meshkit's (see :func:`jax_heartbeat_timeout`).
_JAX_HEARTBEAT_MARGIN_S = 10


def jax_heartbeat_timeout(heartbeat_timeout_s: float) -> int:
    """JAX's heartbeat timeout for a job whose peer watch waits ``heartbeat_timeout_s``: late enough
    that meshkit's one line always comes first. A JAX process beats every half of JAX's timeout, so
    a stalled peer's last beat may already be half a timeout old when it stalls, and JAX's service
    aborts the job half a timeout later; a client whose beat to a stalled coordinator goes
    unanswered likewise gives up after half a timeout. Hence twice meshkit's, plus a margin for the
    watch's own polling (measured with meshkit's default of 30 s and JAX's then 35 s: JAX's abort
    came first in 2 of 4 stalls of ``meshkit train``, 20 s after the stall)."""
    return 2 * math.ceil(heartbeat_timeout_s) + _JAX_HEARTBEAT_MARGIN_S


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessInfo:
    """This process's place in a started job."""

    process_index: int
    process_count: int
    coordinator: str | None
    source: str
    local_device_count: int
    device_count: int

    def to_json(self) -> dict:
        return asdict(self)


def _check_timeouts(timeout: float, heartbeat: float, shutdown: int) -> None:
    for name, value in (
        ("timeout_s", timeout),
        ("heartbeat_timeout_s", heartbeat),
        ("shutdown_timeout_s", shutdown),
    ):
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise DistributedError(f"{name} must be a positive number of seconds, got {value!r}")


def _start(
    spec: ProcessSpec,
    explicit: tuple[str | None, int | None, int | None],
    local_device_ids: Sequence[int] | None,
    timeout: float,
    heartbeat: float,
    shutdown: int,
    security: dict,
) -> None:
    """Call :func:`jax.distributed.initialize`; under mpirun or SLURM only with what the caller gave
    explicitly, letting JAX's own detection (forced to the source meshkit found) fill the rest."""
    kwargs = dict(
        local_device_ids=list(local_device_ids) if local_device_ids is not None else None,
        initialization_timeout=math.ceil(timeout) + _JAX_TIMEOUT_MARGIN_S,
        heartbeat_timeout_seconds=jax_heartbeat_timeout(heartbeat),
        shutdown_timeout_seconds=math.ceil(shutdown),
        **security,
    )
    watchdog = threading.Timer(
        timeout, _startup_timed_out, args=(spec, timeout, "mtls_cert_file" in security)
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        with _sigterm_kept():
            _jax_initialize(spec, explicit, kwargs)
    except RuntimeError as e:
        raise DistributedError(
            f"cannot start process {spec.process_index} of the job: {_first_line(e)}"
        ) from e
    finally:
        watchdog.cancel()


def _jax_initialize(spec: ProcessSpec, explicit: tuple, kwargs: dict) -> None:
    if spec.source in _JAX_METHOD:  # JAX's own detection fills what the arguments left out
        jax.distributed.initialize(*explicit, cluster_detection_method=_JAX_METHOD[spec.source], **kwargs)
    else:
        jax.distributed.initialize(
            spec.coordinator,
            spec.process_count,
            spec.process_index,
            cluster_detection_method="deactivate",
            **kwargs,
        )


@contextmanager
def _sigterm_kept() -> Iterator[None]:
    """Keep SIGTERM's handler across JAX's start-up. JAX's preemption service installs one in C++
    that only records the signal for ``multihost_utils.reached_preemption_sync_point``, so a
    process that does not poll it ignores SIGTERM: restored, SIGTERM ends the process as before,
    and ``meshkit train`` handles it itself (:mod:`meshkit.train.stop`: a checkpoint at a step
    every process agrees on)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if before is not None:  # None: set outside Python, which cannot put it back
            signal.signal(signal.SIGTERM, before)


def _reachable(address: str | None, timeout: float = 1.0) -> bool:
    if not address:
        return False
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _startup_timed_out(spec: ProcessSpec, timeout: float, tls: bool) -> None:
    """Runs on a timer thread while JAX waits in C++: say why in one line and exit (JAX would
    abort the process a few seconds later with a stack trace)."""
    me = f"process {spec.process_index} of {spec.process_count}"
    if spec.coordinator is None:  # JAX derived it from the scheduler's environment
        msg = (
            f"the job did not form within {timeout:g} s ({me}; coordinator found by JAX in the {spec.source} "
            f"environment): check that all {spec.process_count} processes started, that process 0's host is "
            f"reachable on the port (set JAX_COORDINATOR_PORT to choose it, or JAX_COORDINATOR_ADDRESS), or raise the timeout"
        )
    elif spec.process_index != 0 and not _reachable(spec.coordinator):
        msg = (
            f"could not reach the coordinator at {spec.coordinator} within {timeout:g} s ({me}): check that "
            f"process 0 started and listens there, or raise the timeout (timeout_s / meshkit launch --timeout)"
        )
    elif spec.process_index != 0:
        msg = (
            f"the coordinator at {spec.coordinator} did not admit {me} within {timeout:g} s: "
            + (
                "check that this process's certificate is signed by the job's CA and names the coordinator's host"
                if tls
                else f"if the job uses mutual TLS, give this process its certificate ({MESHKIT_MTLS_CERT}/KEY/CA or "
                f"meshkit --mtls-cert/--mtls-key/--mtls-ca)"
            )
            + "; else check that every process has the same coordinator address and process count, or raise the timeout"
        )
    else:
        msg = (
            f"the job did not form within {timeout:g} s at coordinator {spec.coordinator} ({me}): not all "
            f"{spec.process_count} processes connected; check that every process started with the same "
            f"coordinator address and process count (and, with mutual TLS, a certificate of the job's CA), "
            f"or raise the timeout"
        )
    _exit_now(DistributedError(msg), STARTUP_FAILED_EXIT_CODE)


def _describe(spec: ProcessSpec) -> ProcessInfo:
    coordinator = None
    if spec.multiprocess:
        from jax._src import distributed

        coordinator = distributed.global_state.coordinator_address or spec.coordinator
    count = jax.process_count()
    if count != spec.process_count:
        raise DistributedError(
            f"JAX sees {count} process(es) but the {spec.source} environment says {spec.process_count}: "
            f"check the launcher's settings"
        )
    return ProcessInfo(
        process_index=jax.process_index(),
        process_count=count,
        coordinator=coordinator,
        source=spec.source,
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
    )
