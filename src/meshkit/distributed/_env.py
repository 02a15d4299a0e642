"""The environment a job's processes read: the variables ``meshkit launch`` (or a scheduler) sets for
each process, the defaults when they are unset, and how their values are parsed (one-line errors)."""

from __future__ import annotations

import os

from meshkit.distributed._failure import DistributedError

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


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not a whole number: fix or unset it") from None


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


def restart_attempt() -> int:
    """0 for a job's first start; k when ``meshkit launch --max-restarts`` restarted it for the k-th
    time (``MESHKIT_RESTART_ATTEMPT``) or SLURM requeued it k times (``SLURM_RESTART_COUNT``)."""
    return max(_env_int(MESHKIT_RESTART_ATTEMPT) or 0, _env_int(SLURM_RESTART_COUNT) or 0)
