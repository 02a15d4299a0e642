"""Start-up of multi-process jobs: one call, before any JAX computation, joins this process to its job.

:func:`initialize` finds where the job's shape comes from (explicit arguments, the environment set
by ``meshkit launch``, Open MPI's ``mpirun``, or SLURM), calls :func:`jax.distributed.initialize`
with failure detection tuned for fast, clear failures, and returns a :class:`ProcessInfo`.
:func:`detect` does the finding alone, without side effects.

When a process of a running job dies or stalls (SIGSTOP, swapping, stuck in I/O), meshkit's peer
watch (:mod:`meshkit._heartbeat`) notices its missing heartbeats after ``heartbeat_timeout_s`` and
ends every survivor with one line naming it (JAX's coordination service, set to twice that and 10 s
more, would abort them from C++); a collective that fails first (e.g. gloo's "Connection reset by peer")
raises in Python, where :func:`fail_fast` turns it into one line naming the lost process.

Who may join: the coordination service binds where ``coordinator_bind_address`` says (``meshkit
launch`` binds it to loopback; JAX's default is every interface), and with :class:`MutualTLS` the
service and every process prove themselves with certificates of one CA.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from typing import NoReturn

import jax

from meshkit._errors import MeshkitError
from meshkit.devices import backend_started, simulate_devices
from meshkit.distributed._heartbeat import PeerWatch

#: Environment set by ``meshkit launch`` for each process it starts.
MESHKIT_COORDINATOR_ADDRESS = "MESHKIT_COORDINATOR_ADDRESS"
MESHKIT_NUM_PROCESSES = "MESHKIT_NUM_PROCESSES"
MESHKIT_PROCESS_ID = "MESHKIT_PROCESS_ID"
MESHKIT_DEVICES_PER_PROCESS = "MESHKIT_DEVICES_PER_PROCESS"
#: Seconds to wait for the whole job to connect (``meshkit launch --timeout``).
MESHKIT_TIMEOUT_S = "MESHKIT_TIMEOUT_S"
#: Where process 0's coordination service listens ('host:port', or 'host' for the coordinator's port).
MESHKIT_COORDINATOR_BIND_ADDRESS = "MESHKIT_COORDINATOR_BIND_ADDRESS"
#: Seconds without a heartbeat after which a process is declared lost and the job stops.
MESHKIT_HEARTBEAT_TIMEOUT_S = "MESHKIT_HEARTBEAT_TIMEOUT_S"
#: Set by ``meshkit launch --max-restarts`` in every process: 0 for the first start of the job, k for
#: its k-th restart (``meshkit train --run-dir`` resumes from the run's checkpoint when k > 0).
MESHKIT_RESTART_ATTEMPT = "MESHKIT_RESTART_ATTEMPT"
#: Set by SLURM in a job that was requeued (``sbatch --requeue``, ``scontrol requeue``): how many times.
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"
#: Mutual TLS: this process's PEM certificate chain, its private key, and the CA bundle of the job.
MESHKIT_MTLS_CERT = "MESHKIT_MTLS_CERT"
MESHKIT_MTLS_KEY = "MESHKIT_MTLS_KEY"
MESHKIT_MTLS_CA = "MESHKIT_MTLS_CA"

DEFAULT_TIMEOUT_S = 300.0
#: A process silent this long is declared dead and the job stops (JAX's default is 100 s).
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
#: How long a finished process waits at exit for the others to finish (JAX's default is 300 s).
DEFAULT_SHUTDOWN_TIMEOUT_S = 120
#: Exit status of a process stopped because a peer was lost (EX_TEMPFAIL: a restart may succeed).
PEER_LOST_EXIT_CODE = 75
#: Exit status when the job did not form within the start-up timeout.
STARTUP_FAILED_EXIT_CODE = 2

SOURCES = ("explicit", "meshkit-launch", "openmpi", "slurm", "single")
_JAX_METHOD = {"openmpi": "ompi", "slurm": "slurm"}
_PEER_FAILURE = re.compile(
    r"gloo|connection (reset|refused|closed)|broken pipe|socket closed|unavailable|heartbeat|"
    r"coordination service|end of file",
    re.IGNORECASE,
)
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


class DistributedError(MeshkitError):
    """A multi-process job cannot start or continue as asked."""


class PeerLostError(DistributedError):
    """Another process of the job died or stopped answering."""

    def __init__(self, message: str, lost: tuple[int, ...]) -> None:
        super().__init__(message)
        self.lost = lost


@dataclass(frozen=True, kw_only=True, slots=True)
class MutualTLS:
    """Mutual TLS for the coordination service: each process presents ``cert`` (with ``key``) and
    accepts only peers whose certificates ``ca`` signed. Clients check the coordinator's certificate
    against the host of the coordinator address (e.g. a DNS:localhost entry under ``meshkit launch``)."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> MutualTLS | None:
        """From ``MESHKIT_MTLS_CERT/KEY/CA`` (all three, or none: None)."""
        env = os.environ if env is None else env
        names = (MESHKIT_MTLS_CERT, MESHKIT_MTLS_KEY, MESHKIT_MTLS_CA)
        values = [env.get(n) or None for n in names]
        if not any(values):
            return None
        if not all(values):
            missing = ", ".join(n for n, v in zip(names, values, strict=True) if not v)
            raise DistributedError(f"mutual TLS needs a certificate, its key and the CA: set {missing} too")
        return cls(cert=values[0], key=values[1], ca=values[2])

    def check(self) -> None:
        """Raise :class:`DistributedError` unless every file can be read."""
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA bundle", self.ca)):
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise DistributedError(
                    f"cannot read the mutual-TLS {what} '{path}' ({e.strerror or e}): fix the path "
                    f"(--mtls-cert/--mtls-key/--mtls-ca or {MESHKIT_MTLS_CERT}/KEY/CA)"
                ) from None

    def env(self) -> dict[str, str]:
        return {MESHKIT_MTLS_CERT: self.cert, MESHKIT_MTLS_KEY: self.key, MESHKIT_MTLS_CA: self.ca}

    def jax_kwargs(self) -> dict[str, str]:
        return {"mtls_cert_file": self.cert, "mtls_key_file": self.key, "mtls_ca_file": self.ca}


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessSpec:
    """Where this process sits in its job, as found before starting anything."""

    source: str
    """'explicit', 'meshkit-launch', 'openmpi', 'slurm' or 'single'."""
    process_index: int
    process_count: int
    coordinator: str | None
    """'host:port' of process 0's coordination service (None when single, or left to JAX)."""
    devices_per_process: int | None = None
    """CPU devices to simulate in each process, if asked."""

    @property
    def multiprocess(self) -> bool:
        return self.process_count > 1


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


@dataclass(frozen=True, slots=True)
class _Started:
    spec: ProcessSpec
    info: ProcessInfo
    watch: PeerWatch | None = None


_started: _Started | None = None


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not a whole number: fix or unset it") from None


#: The schedulers meshkit recognises, Open MPI first as in JAX (``mpirun`` inside a SLURM allocation
#: leaves the batch step's SLURM variables behind, while Open MPI's are per process): for each, the
#: variables that show it (any one of the first group, or all of the second), and those holding this
#: process's index and the process count. The coordinator's address is left to JAX's own detection
#: (``jax.distributed.initialize(cluster_detection_method=...)``), which reads the same variables.
_SCHEDULERS = {
    "openmpi": (("OMPI_MCA_orte_hnp_uri",), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_LOCAL_RANK"), "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    "slurm": ((), ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
              "SLURM_PROCID", "SLURM_NTASKS"),
}  # fmt: skip
#: Set by Kubernetes in each pod of an Indexed Job (and of a JobSet): its index, used as the process
#: index when ``MESHKIT_NUM_PROCESSES`` is set and ``MESHKIT_PROCESS_ID`` is not.
JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"


def _cluster_source() -> str | None:
    """The scheduler whose environment is present (see :data:`_SCHEDULERS`), or None."""
    for source, (any_of, all_of, _, _) in _SCHEDULERS.items():
        if any(v in os.environ for v in any_of) or all(v in os.environ for v in all_of):
            return source
    return None


def _from_cluster(source: str) -> tuple[int, int]:
    """(process_index, process_count) from a scheduler's environment."""
    _, _, index, count = _SCHEDULERS[source]
    return _env_int(index) or 0, _env_int(count) or 1


def _pick_source(explicit: tuple) -> str:
    if None not in explicit:
        return "explicit"
    if os.environ.get(MESHKIT_NUM_PROCESSES) or os.environ.get(MESHKIT_COORDINATOR_ADDRESS):
        return "meshkit-launch"
    cluster = _cluster_source()
    if cluster is not None:
        return cluster
    if explicit[1] == 1 and explicit[2] in (None, 0):
        return "explicit"
    if any(v is not None for v in explicit):
        raise DistributedError(
            "give coordinator_address, num_processes and process_id together (or run under "
            "`meshkit launch`, mpirun or srun, which set them)"
        )
    return "single"


def detect(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    devices_per_process: int | None = None,
) -> ProcessSpec:
    """Find this process's place in its job without starting anything.

    Each value comes from, in order: the arguments; the ``MESHKIT_*`` environment of ``meshkit
    launch`` (or set by hand, e.g. in a Kubernetes Indexed Job, whose ``JOB_COMPLETION_INDEX`` is the
    index when ``MESHKIT_PROCESS_ID`` is unset); Open MPI's ``mpirun``; SLURM (read from their
    variables as JAX reads them; the coordinator's address of these two is left to JAX, which finds
    it at start-up). With none of them the job is a single process.
    Raises :class:`DistributedError` on inconsistent values.
    """
    explicit = (coordinator_address, num_processes, process_id)
    source = _pick_source(explicit)
    if devices_per_process is None:
        devices_per_process = _env_int(MESHKIT_DEVICES_PER_PROCESS)
    coordinator, count, index = explicit
    if source == "meshkit-launch":
        coordinator = coordinator or os.environ.get(MESHKIT_COORDINATOR_ADDRESS)
        count = _env_int(MESHKIT_NUM_PROCESSES) if count is None else count
        if index is None:
            index = _env_int(MESHKIT_PROCESS_ID)
            index = _env_int(JOB_COMPLETION_INDEX) if index is None else index
        if index is None and count not in (None, 1):
            raise DistributedError(
                f"{MESHKIT_PROCESS_ID} is not set: start the processes with `meshkit launch`, or set it to "
                f"each process's index (Kubernetes Indexed Jobs set {JOB_COMPLETION_INDEX}, which is used)"
            )
    elif source in _JAX_METHOD:
        env_index, env_count = _from_cluster(source)
        count = env_count if count is None else count
        index = env_index if index is None else index

    elif source == "single":
        count, index = 1, 0
    spec = ProcessSpec(
        source=source,
        process_index=index if index is not None else 0,
        process_count=count if count is not None else 1,
        coordinator=coordinator,
        devices_per_process=devices_per_process,
    )
    _validate(spec, given=source in ("explicit", "meshkit-launch"))
    if not spec.multiprocess:
        return ProcessSpec(
            source="single", process_index=0, process_count=1, coordinator=None,
            devices_per_process=devices_per_process,
        )  # fmt: skip
    return spec


def _validate(spec: ProcessSpec, *, given: bool) -> None:
    n, i = spec.process_count, spec.process_index
    for name, value in (("num_processes", n), ("process_id", i)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise DistributedError(f"{name} must be a whole number, got {value!r}")
    if n < 1:
        raise DistributedError(f"num_processes must be at least 1, got {n}")
    if not 0 <= i < n:
        raise DistributedError(
            f"process_id {i} is out of range for {n} process(es) (from {spec.source}): "
            f"give each process a distinct id in 0..{n - 1}"
        )
    d = spec.devices_per_process
    if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
        raise DistributedError(f"devices_per_process must be a positive whole number, got {d!r}")
    if n > 1 and given:
        _check_address(spec.coordinator, spec.source)


def _check_address(address: str | None, source: str) -> None:
    where = f"set {MESHKIT_COORDINATOR_ADDRESS}" if source == "meshkit-launch" else "pass coordinator_address"
    if not address:
        raise DistributedError(f"a multi-process job needs the coordinator's 'host:port': {where}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(
            f"coordinator address {address!r} is not 'host:port' (e.g. 'localhost:12355'): {where}"
        )


def is_multiprocess_env() -> bool:
    """Whether the environment (``meshkit launch``, mpirun, srun) describes a job of more than one
    process, i.e. whether :func:`initialize` has work to do. Never raises."""
    try:
        return detect().multiprocess
    except MeshkitError:
        return True  # a job was meant; initialize() will say what is wrong


def restart_attempt() -> int:
    """0 for a job's first start; k when ``meshkit launch --max-restarts`` restarted it for the k-th
    time (``MESHKIT_RESTART_ATTEMPT``) or SLURM requeued it k times (``SLURM_RESTART_COUNT``)."""
    return max(_env_int(MESHKIT_RESTART_ATTEMPT) or 0, _env_int(SLURM_RESTART_COUNT) or 0)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not a number of seconds") from None


def _default_timeout() -> float:
    return _env_float(MESHKIT_TIMEOUT_S, DEFAULT_TIMEOUT_S)


def bind_address(bind: str | None, coordinator: str | None) -> str | None:
    """``bind`` as JAX takes it ('host:port'); a bare host (``127.0.0.1``, ``::1``, ``[::1]``) gets
    the coordinator's port. None stays None (JAX binds every interface)."""
    if bind is None or bind.strip() == "":
        return None
    bind = bind.strip()
    host, sep, port = bind.rpartition(":")
    bracketed = bind.startswith("[") and bind.endswith("]")
    if sep and port.isdigit() and (host.startswith("[") or ":" not in host) and host:
        if not 0 < int(port) < 65536:
            raise DistributedError(f"coordinator bind address {bind!r}: port {port} is not in 1..65535")
        return bind
    if not sep or bracketed or bind.count(":") > 1:  # a bare host name, IPv4 or IPv6 address
        if coordinator is None:
            raise DistributedError(
                f"coordinator bind address {bind!r} has no port and the coordinator's is unknown: give 'host:port'"
            )
        host = bind if bracketed or ":" not in bind else f"[{bind}]"
        return f"{host}:{coordinator.rpartition(':')[2]}"
    raise DistributedError(
        f"coordinator bind address {bind!r} is not 'host:port' or 'host' (e.g. 127.0.0.1:12355, [::1], 10.0.0.5): "
        f"fix --coordinator-bind-address or {MESHKIT_COORDINATOR_BIND_ADDRESS}"
    )


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
            client, process_index=info.process_index, process_count=info.process_count,
            timeout_s=heartbeat_timeout_s, coordinator=info.coordinator, fail=_peer_stalled,
        ).start()  # fmt: skip
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


def _check_timeouts(timeout: float, heartbeat: float, shutdown: int) -> None:
    for name, value in (
        ("timeout_s", timeout),
        ("heartbeat_timeout_s", heartbeat),
        ("shutdown_timeout_s", shutdown),
    ):
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise DistributedError(f"{name} must be a positive number of seconds, got {value!r}")


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
            spec.coordinator, spec.process_count, spec.process_index,
            cluster_detection_method="deactivate", **kwargs,
        )  # fmt: skip


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


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _reason(e: BaseException) -> str:
    """The gist of a runtime error: its first line without XLA's source locations."""
    return _first_line(e).rpartition("] ")[2]


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


def _exit_now(error: MeshkitError, code: int) -> NoReturn:
    """Print ``error: ...`` and leave without Python's exit handlers: JAX's would wait in the
    shutdown barrier for the lost process until the heartbeat timeout, then abort."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os.write(2, f"error: {error}\n".encode())
    os._exit(code)


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
