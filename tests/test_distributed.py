"""meshkit.distributed: where a process's place in its job comes from, start-up errors, and what
survivors do when a process of a running job is SIGKILLed (without the launcher)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from _limits import limit
from meshkit import distributed
from meshkit._errors import MeshkitError
from meshkit.distributed import DistributedError, ProcessInfo, detect, is_multiprocess_env

WORKERS = Path(__file__).parent / "workers"
_PREFIXES = ("MESHKIT_", "SLURM_", "OMPI_", "PMIX_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS")


@pytest.fixture
def clean_env(monkeypatch):
    """No job environment at all, and no job started in this process."""
    for name in list(os.environ):
        if name.startswith(_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setattr(distributed, "_started", None)
    return monkeypatch


def _slurm(monkeypatch, *, ntasks=2, procid=1, jobid=12345):
    for name, value in {
        "SLURM_JOB_ID": jobid, "SLURM_NTASKS": ntasks, "SLURM_PROCID": procid, "SLURM_LOCALID": procid,
        "SLURM_STEP_NODELIST": "localhost", "SLURM_NODELIST": "localhost", "SLURM_STEP_NUM_NODES": 1,
    }.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))


_HNP_URI = "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"
_OMPI_PORT = 1531576320 // 2**12 % 2**12 + 65535 - 2**12 + 1  # JAX's port from the job id: 62624


def _ompi(monkeypatch, *, size=2, rank=1):
    for name, value in {
        "OMPI_COMM_WORLD_SIZE": size, "OMPI_COMM_WORLD_RANK": rank, "OMPI_COMM_WORLD_LOCAL_RANK": rank,
        "OMPI_MCA_orte_hnp_uri": _HNP_URI,
    }.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))


class _FakeJax:
    """Stands in for jax.distributed.initialize and the backend, capturing the call."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.simulated = []
        monkeypatch.setattr(distributed, "backend_started", lambda: False)
        monkeypatch.setattr(distributed, "simulate_devices", self.simulated.append)
        monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
        monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: self.calls.append((a, k)))
        monkeypatch.setattr(distributed, "_describe", self._describe)

    @staticmethod
    def _describe(spec):
        return ProcessInfo(
            process_index=spec.process_index, process_count=spec.process_count, coordinator=spec.coordinator,
            source=spec.source, local_device_count=4, device_count=4 * spec.process_count,
        )  # fmt: skip


# --- detection -------------------------------------------------------------------------------------


def test_no_job_environment_is_a_single_process(clean_env):
    spec = detect()
    assert (spec.source, spec.process_index, spec.process_count, spec.coordinator) == ("single", 0, 1, None)
    assert not is_multiprocess_env()
    assert detect(num_processes=1).source == "single"


def test_meshkit_launch_environment(clean_env):
    for name, value in {
        distributed.MESHKIT_COORDINATOR_ADDRESS: "localhost:12355", distributed.MESHKIT_NUM_PROCESSES: "4",
        distributed.MESHKIT_PROCESS_ID: "3", distributed.MESHKIT_DEVICES_PER_PROCESS: "2",
    }.items():  # fmt: skip
        clean_env.setenv(name, value)
    spec = detect()
    assert (spec.source, spec.process_index, spec.process_count) == ("meshkit-launch", 3, 4)
    assert (spec.coordinator, spec.devices_per_process) == ("localhost:12355", 2)
    assert is_multiprocess_env()
    _slurm(clean_env)  # meshkit launch's variables come before a scheduler's
    assert detect().source == "meshkit-launch"
    explicit = detect("otherhost:1", 2, 0)  # and explicit values before both
    assert (explicit.source, explicit.coordinator, explicit.process_index) == ("explicit", "otherhost:1", 0)


def test_slurm_detected_as_jax_does(clean_env):
    """The index and count from SLURM's variables; the coordinator is left to JAX (which derives it
    from the step's first node and the job id: see test_a_slurm_job_forms_through_jax_s_own_detection)."""
    _slurm(clean_env)
    spec = detect()
    assert (spec.source, spec.process_index, spec.process_count, spec.coordinator) == ("slurm", 1, 2, None)
    assert is_multiprocess_env()
    _slurm(clean_env, ntasks=1, procid=0)
    assert detect().source == "single" and not is_multiprocess_env()
    _slurm(clean_env, ntasks=2, procid=0)
    clean_env.delenv("SLURM_STEP_NODELIST")  # a batch script's shell outside srun: no job step, as in JAX
    assert detect().source == "single"


def test_openmpi_detected_as_jax_does(clean_env):
    _ompi(clean_env)
    spec = detect()
    assert (spec.source, spec.process_index, spec.process_count, spec.coordinator) == ("openmpi", 1, 2, None)
    assert is_multiprocess_env()
    _slurm(clean_env, procid=0)  # mpirun inside a SLURM allocation: Open MPI's per-process values win
    assert (detect().source, detect().process_index) == ("openmpi", 1)
    clean_env.delenv("OMPI_MCA_orte_hnp_uri")  # Open MPI 5 (PRRTE): no ORTE URI, the per-process three
    assert (detect().source, detect().process_index) == ("openmpi", 1)


def test_a_kubernetes_indexed_job_gives_the_process_index(clean_env):
    for name, value in {"MESHKIT_NUM_PROCESSES": "4", "MESHKIT_COORDINATOR_ADDRESS": "train-0.train:1234",
                        "JOB_COMPLETION_INDEX": "2"}.items():  # fmt: skip
        clean_env.setenv(name, value)
    spec = detect()
    assert (spec.source, spec.process_index, spec.process_count) == ("meshkit-launch", 2, 4)
    clean_env.setenv("MESHKIT_PROCESS_ID", "3")  # given: it wins
    assert detect().process_index == 3


@pytest.mark.parametrize(("setup", "method"), [(_slurm, "slurm"), (_ompi, "ompi")])
def test_initialize_lets_jax_detect_the_scheduler(clean_env, setup, method):
    setup(clean_env)
    fake = _FakeJax(clean_env)
    info = distributed.initialize(devices_per_process=4, heartbeat_timeout_s=12)
    ((args, kwargs),) = fake.calls
    assert args == (None, None, None)  # JAX's own detection fills them...
    assert kwargs["cluster_detection_method"] == method  # ...from the source meshkit found
    assert kwargs["heartbeat_timeout_seconds"] == 2 * 12 + 10  # meshkit's line first (JAX beats every half)
    assert kwargs["coordinator_bind_address"] is None and "mtls_cert_file" not in kwargs  # JAX's defaults
    assert kwargs["shutdown_timeout_seconds"] == distributed.DEFAULT_SHUTDOWN_TIMEOUT_S
    assert kwargs["initialization_timeout"] > distributed.DEFAULT_TIMEOUT_S  # meshkit's message comes first
    assert fake.simulated == [4]
    assert (info.source, info.process_index, info.process_count) == (
        "slurm" if method == "slurm" else "openmpi", 1, 2,
    )  # fmt: skip
    assert distributed.initialize() is info  # idempotent
    with pytest.raises(DistributedError, match="already joined a job as process 1 of 2"):
        distributed.initialize("localhost:1", 3, 0)


def test_initialize_explicit_values_and_launch_environment(clean_env):
    fake = _FakeJax(clean_env)
    clean_env.setenv(distributed.MESHKIT_TIMEOUT_S, "7")
    info = distributed.initialize("localhost:4242", 2, 0)
    ((args, kwargs),) = fake.calls
    assert args == ("localhost:4242", 2, 0) and kwargs["cluster_detection_method"] == "deactivate"
    assert kwargs["initialization_timeout"] == 7 + distributed._JAX_TIMEOUT_MARGIN_S
    assert info.source == "explicit" and fake.simulated == []


def _pki(tmp_path):
    paths = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    for p in paths.values():
        p.write_text("-----BEGIN TEST-----\n")
    return {k: str(v) for k, v in paths.items()}


def test_bind_address_tls_and_heartbeat_from_the_environment(clean_env, tmp_path):
    fake = _FakeJax(clean_env)
    pki = _pki(tmp_path)
    for name, value in {
        distributed.MESHKIT_COORDINATOR_BIND_ADDRESS: "127.0.0.1", distributed.MESHKIT_HEARTBEAT_TIMEOUT_S: "7",
        distributed.MESHKIT_MTLS_CERT: pki["cert"], distributed.MESHKIT_MTLS_KEY: pki["key"],
        distributed.MESHKIT_MTLS_CA: pki["ca"],
    }.items():  # fmt: skip
        clean_env.setenv(name, value)
    distributed.initialize("localhost:4242", 2, 1)
    ((_, kwargs),) = fake.calls
    assert kwargs["coordinator_bind_address"] == "127.0.0.1:4242"  # a bare host takes the coordinator's port
    assert kwargs["heartbeat_timeout_seconds"] == 2 * 7 + 10
    assert (kwargs["mtls_cert_file"], kwargs["mtls_key_file"], kwargs["mtls_ca_file"]) == (
        pki["cert"], pki["key"], pki["ca"],
    )  # fmt: skip


def test_arguments_come_before_the_environment(clean_env, tmp_path):
    fake = _FakeJax(clean_env)
    pki = _pki(tmp_path)
    clean_env.setenv(distributed.MESHKIT_COORDINATOR_BIND_ADDRESS, "0.0.0.0")
    tls = distributed.MutualTLS(cert=pki["cert"], key=pki["key"], ca=pki["ca"])
    distributed.initialize("localhost:4242", 2, 0, coordinator_bind_address="[::1]:5000", mtls=tls)
    ((_, kwargs),) = fake.calls
    assert kwargs["coordinator_bind_address"] == "[::1]:5000" and kwargs["mtls_ca_file"] == pki["ca"]


@pytest.mark.parametrize(
    ("bind", "coordinator", "want"),
    [("127.0.0.1", "localhost:9", "127.0.0.1:9"), ("::1", "h:9", "[::1]:9"), ("[::1]", "h:9", "[::1]:9"),
     ("10.0.0.5:77", None, "10.0.0.5:77"), ("[::]:77", "h:9", "[::]:77"), (None, "h:9", None)],
)  # fmt: skip
def test_bind_address_forms(bind, coordinator, want):
    assert distributed.bind_address(bind, coordinator) == want


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MESHKIT_MTLS_CERT": "c.pem"}, "set MESHKIT_MTLS_KEY, MESHKIT_MTLS_CA too"),
        ({"MESHKIT_MTLS_CERT": "/no/c.pem", "MESHKIT_MTLS_KEY": "/no/k", "MESHKIT_MTLS_CA": "/no/ca"},
         "cannot read the mutual-TLS certificate '/no/c.pem' (No such file or directory)"),
        ({"MESHKIT_COORDINATOR_BIND_ADDRESS": "host:99999"}, "port 99999 is not in 1..65535"),
        ({"MESHKIT_HEARTBEAT_TIMEOUT_S": "soon"}, "MESHKIT_HEARTBEAT_TIMEOUT_S='soon' is not a number"),
        ({"MESHKIT_HEARTBEAT_TIMEOUT_S": "-1"}, "heartbeat_timeout_s must be a positive number"),
    ],
)  # fmt: skip
def test_bad_security_settings_are_one_line_errors(clean_env, env, message):
    fake = _FakeJax(clean_env)
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(DistributedError, match=re.escape(message)) as info:
        distributed.initialize("localhost:4242", 2, 0)
    assert "\n" not in str(info.value) and fake.calls == []


def test_single_process_initialize_needs_no_coordinator(clean_env):
    info = distributed.initialize(devices_per_process=jax.device_count())  # same count: allowed
    assert (info.source, info.process_count, info.coordinator) == ("single", 1, None)
    assert info.device_count == jax.device_count() == info.local_device_count
    assert distributed.initialize() is info and distributed.process_info() is info
    distributed.shutdown()
    assert distributed.process_info() is None


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"coordinator_address": "localhost:1", "num_processes": 2, "process_id": 2}, {}, "process_id 2 is out of range for 2"),
        ({"num_processes": 2}, {}, "give coordinator_address, num_processes and process_id together"),
        ({"coordinator_address": "nohost", "num_processes": 2, "process_id": 0}, {}, "is not 'host:port'"),
        ({}, {"MESHKIT_NUM_PROCESSES": "two"}, "MESHKIT_NUM_PROCESSES='two' is not a whole number"),
        ({}, {"MESHKIT_NUM_PROCESSES": "2", "MESHKIT_PROCESS_ID": "0"}, "set MESHKIT_COORDINATOR_ADDRESS"),
        ({}, {"MESHKIT_NUM_PROCESSES": "2", "MESHKIT_COORDINATOR_ADDRESS": "localhost:1"}, "MESHKIT_PROCESS_ID is not set"),
        ({"coordinator_address": "localhost:1", "num_processes": 2, "process_id": 0, "devices_per_process": 0}, {}, "devices_per_process must be a positive"),
    ],
)  # fmt: skip
def test_inconsistent_values_are_one_line_errors(clean_env, kwargs, env, message):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(DistributedError, match=re.escape(message)) as info:
        distributed.initialize(**kwargs)
    assert "\n" not in str(info.value) and isinstance(info.value, MeshkitError)
    assert is_multiprocess_env() == bool(env)


def test_backend_already_started_is_a_clear_error(clean_env):
    jax.devices()  # the backend has started in this process
    with pytest.raises(
        DistributedError, match=r"call meshkit.distributed.initialize\(\) before any JAX computation"
    ):
        distributed.initialize("localhost:4242", 2, 0)


def test_bad_timeouts(clean_env):
    _FakeJax(clean_env)
    with pytest.raises(DistributedError, match="heartbeat_timeout_s must be a positive number"):
        distributed.initialize("localhost:4242", 2, 0, heartbeat_timeout_s=0)


# --- real processes --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES)}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.slow
def test_unreachable_coordinator_and_missing_processes_time_out_clearly():
    code = "import sys; from meshkit import distributed as d; d.initialize(sys.argv[1], 2, int(sys.argv[2]), timeout_s=2)"
    address = f"localhost:{_free_port()}"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, a, r], env=_env(), stderr=subprocess.PIPE, text=True)
        for a, r in ((address, "1"), (f"localhost:{_free_port()}", "0"))
    ]
    errs = [p.communicate(timeout=limit(2))[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert errs[0] == (
        f"error: could not reach the coordinator at {address} within 2 s (process 1 of 2): check that "
        f"process 0 started and listens there, or raise the timeout (timeout_s / meshkit launch --timeout)\n"
    )
    assert errs[1].startswith("error: the job did not form within 2 s") and errs[1].count("\n") == 1


def _worker(address: str, rank: int, heartbeat: int, extra: tuple[str, ...]) -> subprocess.Popen:
    argv = ["--explicit", address, "2", str(rank), "--heartbeat", str(heartbeat), *extra]
    return subprocess.Popen(
        [sys.executable, str(WORKERS / "fault_worker.py"), *argv],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _start_pair(*extra: str, heartbeat: int = 8) -> list[subprocess.Popen]:
    """Two fault workers with explicit arguments (no launcher), both past their first psum."""
    address = f"localhost:{_free_port()}"
    procs = [_worker(address, rank, heartbeat, extra) for rank in range(2)]
    for p in procs:
        for line in p.stdout:
            if line.startswith("ready"):
                break
        else:
            pytest.fail(f"worker exited before it was ready: {p.wait()}")
    return procs


def _kill_and_wait(procs: list[subprocess.Popen], victim: int) -> tuple[int, str, float]:
    time.sleep(0.3)  # mid-loop
    start = time.monotonic()
    procs[victim].send_signal(signal.SIGKILL)
    survivor = procs[1 - victim]
    try:
        out, _ = survivor.communicate(timeout=limit(2, waits_s=120))  # the tests allow 60-120 s to notice
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
    return survivor.returncode, out, time.monotonic() - start


_NAMES_PROCESS_1 = re.compile(
    r"lost process 1 of 2|Task 1 heartbeat timeout|stopped sending heartbeats\):\s*1\b"
)


@pytest.mark.slow
def test_sigkill_mid_collective_survivor_names_the_lost_process():
    """The survivor's psum fails (or hangs until the heartbeat timeout): it exits non-zero, naming 1."""
    code, out, elapsed = _kill_and_wait(_start_pair(), victim=1)
    assert code != 0 and elapsed < 120, (code, elapsed)
    assert _NAMES_PROCESS_1.search(out), out[-3000:]
    if code == distributed.PEER_LOST_EXIT_CODE:  # meshkit's one line: the collective failed, or no heartbeat
        assert re.search(
            r"^error: lost process 1 of 2( \(.*\): it crashed, was killed or hangs|: no heartbeat for 8 s)",
            out,
            re.M,
        ), out[-3000:]


# Tiers: sweeps; a survivor naming a silent peer once its heartbeats stop is core in
# test_a_stalled_process_ends_the_job_and_leaves_when_resumed[0] (the coordinator silent: process 1 names
# it) and test_signals.py's test_a_local_job_listens_on_loopback_only_and_a_stalled_rank_ends_it_in_one_line
# (rank 1 silent: rank 0 names it within the heartbeat timeout), a SIGKILLed peer named by the survivor in
# test_sigkill_mid_collective_survivor_names_the_lost_process.
@pytest.mark.slow
@pytest.mark.sweep
def test_sigkill_while_survivor_is_idle_heartbeat_timeout_stops_it():
    """No collective to fail: JAX's coordination service misses process 1's heartbeats and stops 0."""
    code, out, elapsed = _kill_and_wait(_start_pair("--idle-rank", "0", heartbeat=5), victim=1)
    assert code != 0 and elapsed < 60, (code, elapsed)
    assert _NAMES_PROCESS_1.search(out), out[-3000:]


@pytest.mark.slow
def test_sigkill_of_the_coordinator_stops_the_survivor_at_once():
    code, out, elapsed = _kill_and_wait(_start_pair(), victim=0)
    assert code != 0 and elapsed < 60, (code, elapsed)
    assert re.search(r"lost process 0 of 2, the coordinator|coordination service", out), out[-3000:]


# --- Open MPI ---------------------------------------------------------------------------------------


# Tiers: sweeps; Open MPI's environment detected as openmpi is core in test_openmpi_detected_as_jax_does
# (test_multiprocess.py's job under mpirun sweeps too), this worker's sums across 2 processes of 4 devices
# in test_launch.py's test_two_processes_of_four_devices_sum_across_processes.
@pytest.mark.slow
@pytest.mark.sweep
def test_mpirun_job_is_detected_as_openmpi(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found: install Open MPI (Debian/Ubuntu: apt-get install -y openmpi-bin)")
    env = _env(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1"
    )
    out = subprocess.run(
        [mpirun, "-np", "2", sys.executable, str(WORKERS / "psum_worker.py"), "4", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=limit(2),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in range(2)]
    assert sorted(r["info"]["process_index"] for r in results) == [0, 1]
    for r in results:
        assert r["info"]["source"] == "openmpi" and r["info"]["process_count"] == 2
        assert (r["info"]["local_device_count"], r["info"]["device_count"]) == (4, 8)
        assert r["shard_map_psum"] == r["jit_sum"] == 36.0
        assert r["pmap_leading_axis"] == 4 and r["pmap_psum"] == [36.0] * 4


@pytest.mark.slow
def test_a_slurm_job_forms_through_jax_s_own_detection(tmp_path):
    """Two processes with the variables srun sets: meshkit reads index and count, JAX's public
    ``jax.distributed.initialize(cluster_detection_method="slurm")`` finds the coordinator (the
    step's first node; the port from JAX_COORDINATOR_PORT, else from the job id)."""
    port = _free_port()
    base = dict(SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_STEP_NODELIST="localhost", SLURM_NODELIST="localhost",
                SLURM_STEP_NUM_NODES="1", JAX_COORDINATOR_PORT=str(port))  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKERS / "psum_worker.py"), "2", str(tmp_path)],
            env=_env(**base, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=limit(2))[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    for rank in range(2):
        r = json.loads((tmp_path / f"result_{rank}.json").read_text())
        assert (r["info"]["source"], r["info"]["process_index"], r["info"]["process_count"]) == (
            "slurm",
            rank,
            2,
        )
        assert r["info"]["coordinator"] == f"localhost:{port}" and r["shard_map_psum"] == 10.0  # 1+2+3+4


# --- stalled processes (SIGSTOP) --------------------------------------------------------------------


# Tiers: the coordinator stalled ([0]) is core; [1] sweeps: process 0 naming a stalled process 1 in one
# line within the heartbeat timeout is core in test_signals.py's
# test_a_local_job_listens_on_loopback_only_and_a_stalled_rank_ends_it_in_one_line (a meshkit train job, exit
# 75), the stalled process leaving with one line once resumed in [0].
@pytest.mark.slow
@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.sweep), 0])
def test_a_stalled_process_ends_the_job_and_leaves_when_resumed(victim):
    """SIGSTOP of one process: the other ends within the heartbeat timeout (+10 s) with one line
    naming it; after SIGCONT the stalled one finds the job gone and leaves with one line."""
    heartbeat = 6
    procs = _start_pair(heartbeat=heartbeat)
    survivor, stalled = procs[1 - victim], procs[victim]
    try:
        time.sleep(0.3)
        stalled.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        out, _ = survivor.communicate(timeout=heartbeat + 60)
        elapsed = time.monotonic() - start
        stalled.send_signal(signal.SIGCONT)
        start = time.monotonic()
        rest, _ = stalled.communicate(timeout=60)
        resumed_after = time.monotonic() - start
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
            p.stdout.close()
    assert survivor.returncode == distributed.PEER_LOST_EXIT_CODE and elapsed < heartbeat + 10, (elapsed, out)
    lost = (
        f"lost process 1 of 2: no heartbeat for {heartbeat} s (stalled - stopped, swapping or stuck in I/O - or "
        "dead); process 0 stops"
        if victim == 1
        else "lost process 0 of 2, the coordinator at localhost:"
    )
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {lost}"), out[-3000:]
    assert "Traceback" not in out and "Terminating process" not in out
    # the resumed process: gone within seconds, non-zero, one line saying it was stopped too long
    assert stalled.returncode != 0 and resumed_after < 10, (resumed_after, rest)
    assert "Traceback" not in rest, rest[-3000:]
    said = [line for line in rest.splitlines() if line.startswith("error:")]
    meshkit_line = re.compile(
        rf"error: (process {victim} of 2 was stopped for \d+ s, past the job's heartbeat timeout of {heartbeat} s"
        rf"|lost process {1 - victim} of 2)"
    )
    assert len(said) <= 1 and all(meshkit_line.match(line) for line in said), rest[-3000:]
    # Two threads wake at the same SIGCONT: meshkit's judge (it was stopped, or its heartbeat thread's
    # fresh view finds the peer gone) and JAX's C++ error-poll thread, which finds the coordinator's
    # connection closed and aborts the process with "Terminating process ...". Which runs first is the
    # scheduler's choice (CI saw JAX's line printed, then meshkit's exit won). Without JAX's line the
    # process must have left through meshkit: its one line and exit 75.
    if "Terminating process" not in rest:
        assert stalled.returncode == distributed.PEER_LOST_EXIT_CODE and len(said) == 1, rest[-3000:]
