"""Training with real processes: 2 processes x 4 simulated devices, under meshkit launch and mpirun."""

import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import meshkit
from _limits import limit
from meshkit.launch import launch
from meshkit.models import mlp
from meshkit.train.checkpoint import Checkpointer, abstract_with

WORKER = str(Path(__file__).parent / "mp" / "train_worker.py")
WORKERS = Path(__file__).parent / "workers"
ENV = {"JAX_PLATFORMS": "cpu"}


def results(out_dir: Path) -> dict[int, dict]:
    found = (json.loads(p.read_text()) for p in out_dir.glob("result-*.json"))
    return {r["process"]: r for r in found}


@functools.cache  # one reference per plan for the tests that check against it (read, never stepped)
def single_process(plan: str):
    params = mlp.init(jax.random.key(0), [16, 64, 64, 8])
    t = meshkit.Trainer(mlp.loss, params, optax.adam(1e-2), plan=plan, mesh="data=8")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    y = np.sin(x @ np.ones((16, 8), np.float32) / 4)
    for _ in range(10):
        t.step((x, y))
    return t


def check(res: dict[int, dict], plan: str, ckpt: Path, source: str) -> None:
    assert sorted(res) == [0, 1]
    for r in res.values():
        assert (r["processes"], r["local_devices"], r["devices"], r["source"]) == (2, 4, 8, source)
    assert res[0]["params"] == res[1]["params"]  # both processes hold the same parameters
    ref = single_process(plan)
    for got, want in zip(res[0]["params"], jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    with Checkpointer(ckpt) as c:  # written by 2 processes, restored by this one
        params, _, meta = c.restore(None, abstract_with(ref.params, ref.shardings.params),
                                    abstract_with(ref.opt_state, ref.shardings.opt_state))  # fmt: skip
    assert meta == {"plan": plan}
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(params), res[0]["params"], strict=True)
    )


# Tiers: sweeps (dp: under mutual TLS below, the same checks on one job); launch() with these checks is core
# in test_two_processes_with_mutual_tls_match_one_process, meshkit train's fsdp on 2 processes in
# test_signals.py's stalled-rank job (test_mpirun's fsdp, with these checks, sweeps too).
@pytest.mark.parametrize("plan", [pytest.param("fsdp", marks=pytest.mark.sweep)])
def test_two_processes_under_meshkit_launch_match_one_process(tmp_path, plan):
    out = io.StringIO()
    cmd = [sys.executable, WORKER, plan, str(tmp_path / "ckpt"), str(tmp_path)]
    code = launch(cmd, 2, devices_per_process=4, env=ENV, output=out)
    assert code == 0, out.getvalue()[-3000:]
    check(results(tmp_path), plan, tmp_path / "ckpt", "meshkit-launch")


# Tiers: sweeps; Open MPI's environment read as JAX reads it is core in test_distributed.py's
# test_openmpi_detected_as_jax_does and test_initialize_lets_jax_detect_the_scheduler[_ompi-ompi], a job of
# real processes formed through JAX's own detection in its test_a_slurm_job_forms_through_jax_s_own_detection,
# two processes training as one (and the checkpoint they wrote restored by one) under meshkit launch in
# test_two_processes_with_mutual_tls_match_one_process (dp), fsdp on 2 processes in test_signals.py's
# stalled-rank job.
@pytest.mark.sweep
def test_two_processes_under_mpirun_without_meshkit_environment(tmp_path):
    mpirun = shutil.which("mpirun")
    assert mpirun, (
        "mpirun is missing: install Debian's openmpi-bin (make test does: apt-get install -y openmpi-bin)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    env.update(ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [
        mpirun,
        "-np",
        "2",
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        WORKER,
        "fsdp",
        str(tmp_path / "ckpt"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit(6))  # measured: 6 CPU s
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    check(results(tmp_path), "fsdp", tmp_path / "ckpt", "openmpi")


# Tiers: sweeps, as are the same assertions on the resumed 2-process zero3 job of test_faults.py's
# test_two_processes_agree_on_the_step_when_only_one_cannot_read_the_latest (moved when make test measured 22
# min); meshkit train as a job of 2 processes (process 0 its writer) is core in test_signals.py's
# test_a_local_job_listens_on_loopback_only_and_a_stalled_rank_ends_it_in_one_line.
@pytest.mark.sweep
def test_meshkit_train_under_launch_writes_once(tmp_path):
    run = tmp_path / "run"
    exe = str(Path(sys.executable).parent / "meshkit")
    cmd = [
        exe,
        "launch",
        "-n",
        "2",
        "--devices-per-process",
        "4",
        "--",
        exe,
        "train",
        "--preset",
        "tiny",
        "--run-dir",
        str(run),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ENV}, timeout=limit(24))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[0] " in proc.stdout and "Run summary" in proc.stdout
    assert "Run summary" not in "".join(
        line for line in proc.stdout.splitlines(True) if line.startswith("[1] ")
    )
    report = json.loads((run / "report.json").read_text())
    assert (report["processes"], report["devices"], report["mesh"]) == (2, 8, {"data": 8})
    assert report["checks_ok"] and report["final_loss"] < report["initial_loss"]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == list(range(1, 13))  # one writer, not two


# Tiers: sweeps; a SIGKILLed peer named by the survivor is core in test_distributed.py's
# test_sigkill_mid_collective_survivor_names_the_lost_process (fail_fast, which meshkit train runs under in
# a job), meshkit train's job losing a peer in test_signals.py's stalled-rank test.
@pytest.mark.sweep
def test_a_killed_process_ends_the_survivor_with_its_name(tmp_path):
    from meshkit import distributed
    from meshkit.launch import free_port

    exe = str(Path(sys.executable).parent / "meshkit")
    run = tmp_path / "run"
    port = free_port()
    procs = []
    # The survivor notices when a collective fails or the peer's heartbeats stop: the job's heartbeat
    # timeout of 10 s (test_signals' stalled rank: on time beside the loaded suite), not the default
    # 30 s the survivor otherwise sat out after each kill.
    heartbeat = 10
    for rank in range(2):
        env = {**os.environ, **ENV, distributed.MESHKIT_COORDINATOR_ADDRESS: f"localhost:{port}",
               distributed.MESHKIT_NUM_PROCESSES: "2", distributed.MESHKIT_PROCESS_ID: str(rank),
               distributed.MESHKIT_DEVICES_PER_PROCESS: "4",
               distributed.MESHKIT_HEARTBEAT_TIMEOUT_S: str(heartbeat)}  # fmt: skip
        cmd = [exe, "train", "--preset", "tiny", "--steps", "400", "--eval-every", "0", "--run-dir", str(run)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    metrics = run / "metrics.jsonl"
    try:
        deadline = time.monotonic() + limit(11)  # the test's processes: 11 CPU s in all
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert time.monotonic() < deadline and procs[0].poll() is None, "training never started"
            time.sleep(0.2)
        procs[1].kill()  # SIGKILL mid-training
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=limit(11, waits_s=heartbeat))
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert elapsed < 120 and procs[0].returncode != 0
    # meshkit's one line when a collective fails first; JAX's heartbeat abort when it hangs instead
    assert re.search(r"lost process 1|stopped sending heartbeats\):\s*1\b", err), err[-2000:]


# Tiers: meshkit verify under launch is core in test_verify_deterministic_mp.py's
# test_every_mesh_row_has_the_bits_of_the_2_process_run[dp]; this one sweeps.
@pytest.mark.sweep
def test_meshkit_verify_under_launch(tmp_path):
    exe = str(Path(sys.executable).parent / "meshkit")
    cmd = [exe, "launch", "-n", "2", "--devices-per-process", "4", "--", exe, "verify", "--plan", "zero3",
           "--model", "mlp", "--steps", "5", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ENV}, timeout=limit(11))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in ("0", "1"):  # every process certifies the same result
        text = "".join(line[4:] for line in proc.stdout.splitlines(True) if line.startswith(f"[{rank}] "))
        cert = json.loads(text[text.index("{") :])
        assert cert["ok"] and cert["reproducible"] and cert["vs_single_device"] <= 1e-5
        assert cert["report"]["mesh"] == {"data": 8}


# --- mutual TLS -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The README's throwaway CA and certificate (tests/workers/make_pki.sh), and an outsider's."""
    directory = tmp_path_factory.mktemp("pki")
    subprocess.run(["sh", str(WORKERS / "make_pki.sh"), str(directory)], check=True, timeout=limit(1))
    return directory


def _tls(directory: Path, name: str = "node", ca: str = "ca"):
    from meshkit.distributed import MutualTLS

    return MutualTLS(
        cert=str(directory / f"{name}.crt"),
        key=str(directory / f"{name}.key"),
        ca=str(directory / f"{ca}.crt"),
    )


def test_two_processes_with_mutual_tls_match_one_process(tmp_path, pki):
    """DP on 2 processes under meshkit launch, the job's connections under mutual TLS: the checks of
    ``test_two_processes_under_meshkit_launch_match_one_process`` (which runs FSDP), on one job."""
    out = io.StringIO()
    cmd = [sys.executable, WORKER, "dp", str(tmp_path / "ckpt"), str(tmp_path)]
    code = launch(cmd, 2, devices_per_process=4, env=ENV, output=out, mtls=_tls(pki))
    assert code == 0, out.getvalue()[-3000:]
    check(results(tmp_path), "dp", tmp_path / "ckpt", "meshkit-launch")


def test_a_process_without_the_jobs_certificate_is_refused(pki):
    """Process 0 runs the coordination service with mutual TLS; a process 1 that knows the address, the
    port and the job's size but not a certificate of the job's CA is never admitted: one without a
    certificate, then one with another CA's (the same process 0 refuses both, in turn)."""
    from meshkit import distributed as d
    from meshkit.launch import free_port

    port = free_port()

    def start(rank: int, mine, timeout: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
        env.update(ENV, PYTHONUNBUFFERED="1", **(mine.env() if mine else {}))
        env.update({d.MESHKIT_COORDINATOR_ADDRESS: f"localhost:{port}", d.MESHKIT_NUM_PROCESSES: "2",
                    d.MESHKIT_PROCESS_ID: str(rank), d.MESHKIT_TIMEOUT_S: timeout,
                    d.MESHKIT_COORDINATOR_BIND_ADDRESS: "127.0.0.1"})  # fmt: skip
        cmd = [sys.executable, str(WORKERS / "psum_worker.py"), "2"]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [start(0, _tls(pki), "120")]
    try:
        deadline = time.monotonic() + limit(2)  # a process 1 starts once process 0's service listens
        while not _listening(port):
            assert time.monotonic() < deadline and procs[0].poll() is None, "process 0 never listened"
            time.sleep(0.2)
        for tls in (None, _tls(pki, "outsider", "other-ca")):
            procs.append(start(1, tls, "3"))
            out1 = procs[-1].communicate(timeout=limit(2, waits_s=3))  # 2 CPU s in all
            assert procs[-1].returncode == 2, out1
            assert "RESULT" not in out1[0]
            err = out1[1]
            assert err.startswith(
                f"error: the coordinator at localhost:{port} did not admit process 1 of 2 within 3 s"
            ), err
            assert err.count("\n") == 1
            hint = "give this process its certificate" if tls is None else "signed by the job's CA"
            assert hint in err
        assert procs[0].poll() is None  # still waiting for a process 1 it admits
        procs[0].terminate()  # it would wait its 120 s for a process 1 it will never admit
        out0 = procs[0].communicate(timeout=limit(2))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "RESULT" not in out0[0]  # no collective ran


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
