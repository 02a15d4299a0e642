"""Where this process sits in its job, found before anything starts: from the arguments, the
environment of ``meshkit launch`` (or one set by hand, as in a Kubernetes Indexed Job), Open MPI's
``mpirun`` or SLURM, else a single process. No side effects: :func:`detect` only reads."""

from __future__ import annotations

import os
from dataclasses import dataclass

from meshkit._errors import MeshkitError
from meshkit.distributed._env import (
    MESHKIT_COORDINATOR_ADDRESS,
    MESHKIT_DEVICES_PER_PROCESS,
    MESHKIT_NUM_PROCESSES,
    MESHKIT_PROCESS_ID,
    _env_int,
)
from meshkit.distributed._failure import DistributedError

SOURCES = ("explicit", "meshkit-launch", "openmpi", "slurm", "single")
_JAX_METHOD = {"openmpi": "ompi", "slurm": "slurm"}


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


#: The schedulers meshkit recognises, Open MPI first as in JAX (``mpirun`` inside a SLURM allocation
#: leaves the batch step's SLURM variables behind, while Open MPI's are per process): for each, the
#: variables that show it (any one of the first group, or all of the second), and those holding this
#: process's index and the process count. The coordinator's address is left to JAX's own detection
#: (``jax.distributed.initialize(cluster_detection_method=...)``), which reads the same variables.
_SCHEDULERS = {
    "openmpi": (
        ("OMPI_MCA_orte_hnp_uri",),
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
    ),
    "slurm": (
        (),
        ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ),
}
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
            source="single",
            process_index=0,
            process_count=1,
            coordinator=None,
            devices_per_process=devices_per_process,
        )
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
