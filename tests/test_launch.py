"""meshkit.launch and ``meshkit launch``: real local processes, rank-prefixed output, first failure
wins, nothing outlives the launcher."""

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _limits import limit
from meshkit.cli import main
from meshkit.launch import LaunchError, child_env, describe_status, launch

WORKERS = Path(__file__).parent / "workers"
PY = sys.executable


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for name in list(os.environ):
        if name.startswith(("MESHKIT_", "SLURM_", "OMPI_")):
            monkeypatch.delenv(name)


def _results(text: str) -> dict[int, dict]:
    """RESULT lines of the psum worker, by the rank in their prefix."""
    out = {}
    for line in text.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("RESULT "):
            out[int(prefix.lstrip("["))] = json.loads(rest[len("RESULT ") :])
    return out


@pytest.mark.slow
def test_two_processes_of_four_devices_sum_across_processes():
    out = io.StringIO()
    code = launch([PY, str(WORKERS / "psum_worker.py")], 2, devices_per_process=4, output=out)
    assert code == 0, out.getvalue()[-3000:]
    results = _results(out.getvalue())
    assert sorted(results) == [0, 1]
    for rank, r in results.items():
        info = r["info"]
        assert (info["process_index"], info["process_count"], info["source"]) == (rank, 2, "meshkit-launch")
        assert (info["local_device_count"], info["device_count"]) == (4, 8)
        assert info["coordinator"].startswith("localhost:")
        assert r["global_shape"] == [8]
        assert r["shard_map_psum"] == r["jit_sum"] == 36.0  # 1 + ... + 8 across both processes
        assert r["pmap_leading_axis"] == 4 and r["pmap_psum"] == [36.0] * 4  # legacy pmap: local axis


def test_child_environment():
    env = child_env(1, 3, "localhost:5", devices_per_process=2, timeout_s=9.5, env={"A": "b"})
    assert (env["MESHKIT_PROCESS_ID"], env["MESHKIT_NUM_PROCESSES"], env["MESHKIT_COORDINATOR_ADDRESS"]) == (
        "1", "3", "localhost:5",
    )  # fmt: skip
    assert (env["MESHKIT_DEVICES_PER_PROCESS"], env["MESHKIT_TIMEOUT_S"], env["A"]) == ("2", "9.5", "b")
    assert "MESHKIT_DEVICES_PER_PROCESS" not in child_env(0, 2, "localhost:5")
    assert describe_status(-9) == "signal SIGKILL" and describe_status(3) == "exit code 3"


def test_lines_are_prefixed_and_the_first_failure_wins(tmp_path):
    """Process 1 fails once every process has printed (so that none is stopped before it could,
    however loaded the machine); the others' last lines, written while they are being stopped,
    are kept."""
    script = textwrap.dedent("""
        import os, signal, sys, time
        from pathlib import Path
        rank, sync = int(os.environ["MESHKIT_PROCESS_ID"]), Path(os.environ["SYNC"])
        def stopping(signum, frame):
            print(f"stopping {rank}", file=sys.stderr, flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, stopping)
        print(f"hello from {rank}\\nsecond line", flush=True)
        print(f"to stderr {rank}", file=sys.stderr, flush=True)
        (sync / str(rank)).touch()
        if rank == 1:
            deadline = time.monotonic() + 60
            while len(list(sync.iterdir())) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.exit(7)
        time.sleep(60)
    """)
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = launch(
        [PY, "-c", script], 3, output=out, error_output=err, grace_s=10, env={"SYNC": str(tmp_path)}
    )
    assert code == 7 and time.monotonic() - start < 60
    lines, errors = out.getvalue().splitlines(), err.getvalue().splitlines()
    for rank in range(3):
        assert f"[{rank}] hello from {rank}" in lines and f"[{rank}] second line" in lines
        assert f"[{rank}] to stderr {rank}" in errors
    assert "[0] stopping 0" in errors and "[2] stopping 2" in errors  # written after the SIGTERM
    assert "meshkit launch: process 1 exited with exit code 7; stopping the others" in errors


def test_output_held_open_by_an_escaped_process_is_named(tmp_path):
    """A process that started something in another session (outside its group, so not stopped
    with it) which keeps its output open: the launcher waits drain_s, then says so."""
    script = "import subprocess; p = subprocess.Popen(['sleep', '30'], start_new_session=True); print('bye', p.pid)"
    out = io.StringIO()
    start = time.monotonic()
    try:
        assert launch([PY, "-c", script], 1, output=out, drain_s=1) == 0
        assert time.monotonic() - start < 20
    finally:
        for pid in re.findall(r"\[0\] bye (\d+)", out.getvalue()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    assert "[0] bye " in out.getvalue()
    assert "meshkit launch: output of process(es) 0 may be cut short" in out.getvalue()


def test_success_and_signal_status():
    assert launch([PY, "-c", "pass"], 2, output=io.StringIO()) == 0
    out = io.StringIO()
    kill_self = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert launch([PY, "-c", kill_self], 1, output=out) == 128 + signal.SIGKILL
    assert "process 0 exited with signal SIGKILL" in out.getvalue()


def test_bad_arguments_and_busy_port():
    with pytest.raises(LaunchError, match="give the command to run after --"):
        launch([], 2)
    with pytest.raises(LaunchError, match="at least 1, got 0"):
        launch([PY, "-c", "pass"], 0)
    with pytest.raises(LaunchError, match="cannot start 'no-such-program-here'"):
        launch(["no-such-program-here"], 1, output=io.StringIO())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            LaunchError, match=f"port {port} is in use.*pick another with --port, or leave --port out"
        ):
            launch([PY, "-c", "pass"], 2, port=port)
        out = io.StringIO()  # without --port a free one is found
        echo = "import os; print(os.environ['MESHKIT_COORDINATOR_ADDRESS'])"
        assert launch([PY, "-c", echo], 1, output=out) == 0
        assert out.getvalue().startswith("[0] localhost:") and f":{port}\n" not in out.getvalue()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (zombies, which an init that does not reap leaves behind, do not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


_STUBBORN = textwrap.dedent("""
    import os, signal, subprocess, time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen(["sleep", "300"])  # inherits the ignored signals
    print("pids", os.getpid(), grandchild.pid, flush=True)
    time.sleep(300)
""")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launcher_leaves_no_process_behind(signum):
    runner = (
        "import sys; from meshkit.launch import launch; sys.exit(launch(sys.argv[1:], 2, signal_grace_s=1))"
    )
    launcher = subprocess.Popen(
        [PY, "-c", runner, PY, "-c", _STUBBORN], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    pids = []
    try:
        for line in launcher.stdout:
            if "] pids " in line:
                pids += [int(p) for p in line.split("pids ")[1].split()]
            if len(pids) == 4:
                break
        assert all(_alive(p) for p in pids)
        launcher.send_signal(signum)
        rest, _ = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum
    assert (
        f"got {signal.Signals(signum).name}; passing it on to all 2 process(es), 1 s to save and exit" in rest
    )
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]


@pytest.mark.slow
def test_sigkill_of_one_process_stops_the_job_and_names_it():
    out = io.StringIO()
    start = time.monotonic()
    code = launch(
        [PY, str(WORKERS / "fault_worker.py"), "--die-rank", "1", "--die-after", "30"],
        2,
        output=out,
        grace_s=2,
    )
    elapsed = time.monotonic() - start
    assert code == 128 + signal.SIGKILL, out.getvalue()[-3000:]
    assert "meshkit launch: process 1 exited with signal SIGKILL; stopping the others" in out.getvalue()
    assert "[0] ready 0" in out.getvalue() and "[1] ready 1" in out.getvalue()
    assert elapsed < 60


# --- the command ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_launch_runs_the_command_in_every_process():
    exe = Path(sys.executable).parent / "meshkit"
    code = "import os; print('rank', os.environ['MESHKIT_PROCESS_ID'], 'of', os.environ['MESHKIT_NUM_PROCESSES'])"
    out = subprocess.run(
        [str(exe), "launch", "-n", "2", "--timeout", "30", "--", PY, "-c", code],
        capture_output=True, text=True, timeout=limit(3),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[0] rank 0 of 2", "[1] rank 1 of 2"]
    fail = subprocess.run(
        [str(exe), "launch", "-n", "2", "--", PY, "-c", "import sys; sys.exit(4)"],
        capture_output=True, text=True, timeout=limit(3),
    )  # fmt: skip
    assert fail.returncode == 4 and "exited with exit code 4" in fail.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch", "-n", "0", "--", "true"], "error: the number of processes must be at least 1, got 0"),
        (["launch", "-n", "2"], "error: give the command to run after --"),
        (["launch", "--", "true"], "error: give the number of processes with -n N"),
        (["launch", "-n", "2", "--timeout", "0", "--", "true"], "error: --timeout must be a positive number"),
        (["launch", "-n", "2", "--devices-per-process", "0", "--", "true"], "error: --devices-per-process must be at least 1"),
        (["launch", "-n", "2", "--max-restarts", "-1", "--", "true"], "error: --max-restarts must be 0 or more, got -1"),
        (["launch", "-n", "2", "--stall-timeout", "0", "--", "true"], "error: --stall-timeout must be a positive number"),
    ],
)  # fmt: skip
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--mtls-cert", "/no/such.crt", "--mtls-key", "/no/k", "--mtls-ca", "/no/ca"],
         "error: cannot read the mutual-TLS certificate '/no/such.crt' (No such file or directory)"),
        (["--mtls-cert", "c.crt"], "error: mutual TLS needs a certificate, its key and the CA: set MESHKIT_MTLS_KEY, MESHKIT_MTLS_CA too"),
        (["--coordinator-bind-address", "host:0"], "error: coordinator bind address 'host:0': port 0 is not in 1..65535"),
        (["--heartbeat-timeout", "0"], "error: --heartbeat-timeout must be a positive number of seconds, got 0"),
    ],
)  # fmt: skip
def test_cli_global_job_options_are_checked_before_anything_starts(capsys, monkeypatch, options, message):
    for name in ("MESHKIT_MTLS_CERT", "MESHKIT_MTLS_KEY", "MESHKIT_MTLS_CA", "MESHKIT_COORDINATOR_BIND_ADDRESS",
                 "MESHKIT_HEARTBEAT_TIMEOUT_S"):  # fmt: skip
        monkeypatch.setenv(name, "")  # recorded, so the values the options set are undone afterwards
        monkeypatch.delenv(name)
    assert main([*options, "launch", "-n", "2", "--", PY, "-c", "print('ran')"]) == 2
    out = capsys.readouterr()
    assert out.err.startswith(message) and out.err.count("\n") == 1 and "ran" not in out.out


def test_no_place_for_the_jobs_certificates_is_one_line(monkeypatch):
    def refused(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("meshkit.launch._tls.tempfile.mkdtemp", refused)
    with pytest.raises(
        LaunchError, match=r"cannot make the job's certificates in .* \(Permission denied\): set TMPDIR"
    ):
        launch([PY, "-c", "pass"], 1, output=io.StringIO())


# --- restarts ---------------------------------------------------------------------------------------

EXE = str(Path(sys.executable).parent / "meshkit")
#: A tiny run of 6 steps with a checkpoint every 2, on 2 processes of one device each.
TRAIN6 = ["train", "--preset", "tiny", "--steps", "6", "--checkpoint-every", "2", "--eval-every", "0",
          "--sample-chars", "0", "--devices", "2"]  # fmt: skip
#: The restart test's commands: CPU seconds in all, measured (a job's start-up and a few steps; a restart
#: twice that), for their time limits (tests/_limits.py).
JOB_CPU_S = 36


def _job(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "launch", "-n", "2", "--devices-per-process", "1", *args],
                          capture_output=True, text=True, timeout=limit(JOB_CPU_S), env={**os.environ, **(env or {})})  # fmt: skip


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
# Tiers: launch's restart is core in test_a_process_that_stops_making_progress_is_restarted, a preempted
# run's save and resume in test_signals.py's
# test_sigterm_to_meshkit_train_saves_at_the_next_step_and_a_second_stops_at_once (a job's ranks stopping
# together at one step sweeps there); this run of both sweeps.
@pytest.mark.sweep
def test_a_killed_process_is_restarted_and_a_preempted_job_resumes_both_ending_as_an_uninterrupted_run(
    tmp_path,
):
    """Process 1 SIGKILLed as it starts step 3: the launcher (--max-restarts 1) restarts the job, which
    resumes from step 2's checkpoint; in that second start process 1 gets SIGTERM as it starts step 5:
    every process saves step 5 and the job exits 143, not restarted; `train --resume` ends it. Losses
    and final parameters equal bitwise those of an uninterrupted run (gloo's sum of two processes is
    deterministic on CPU). The uninterrupted run is one process of 2 devices: a sum of 2 terms has
    one rounding whoever adds them, so its bits are those of gloo's 2 processes (checked: equal losses
    and parameters), at a third of a launched job's CPU time. The stall watch (--stall-timeout) sees steps and never mistakes start-up,
    compilation or the final report for a stall. Was: --max-restarts did not exist; a killed process
    ended the job."""
    from meshkit.train.outputs import load_run
    from meshkit.verify import bitwise_equal

    straight, run = tmp_path / "straight", tmp_path / "run"
    done = subprocess.run(
        [EXE, *TRAIN6, "--run-dir", str(straight)], capture_output=True, text=True, timeout=limit(JOB_CPU_S)
    )
    assert done.returncode == 0, done.stderr[-3000:]

    worker = [PY, str(WORKERS / "restart_worker.py"), *TRAIN6, "--run-dir", str(run)]
    first = _job(
        "--max-restarts",
        "1",
        "--stall-timeout",
        "300",
        "--",
        *worker,
        env={"FAULTS": "0:1:3:KILL,1:1:5:TERM"},
    )
    assert first.returncode == 143, first.stdout[-2000:] + first.stderr[-3000:]
    said = [x for x in first.stderr.splitlines() if x.startswith("meshkit launch:")]
    assert said == [
        "meshkit launch: process 1 exited with signal SIGKILL; restarting the job from its latest checkpoint "
        "(restart 1 of 1)"
    ], first.stderr[-3000:]  # the orderly stop (143) of the second start is not restarted
    assert "[0] restart: resuming" in first.stdout and ", resuming at step 2" in first.stdout
    assert "[0] stopped by SIGTERM at step 5: checkpoint saved; continue with --resume" in first.stdout
    assert "Traceback" not in first.stdout + first.stderr

    resumed = _job("--", EXE, "train", "--resume", "--run-dir", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ", resuming at step 5" in resumed.stdout
    assert _losses(run) == _losses(straight) and sorted(_losses(run)) == list(range(1, 7))
    ours, want = load_run(run), load_run(straight)
    assert ours.step == want.step == 6 and bitwise_equal(ours.params, want.params)


def _attempts(text: str) -> list[str]:
    return sorted(x for x in text.splitlines() if "attempt " in x)


def test_restarts_are_reported_and_when_exhausted_end_with_the_failing_status():
    script = (
        "import os, sys; print('attempt', os.environ['MESHKIT_RESTART_ATTEMPT'], flush=True); sys.exit(3)"
    )
    out, err = io.StringIO(), io.StringIO()
    assert launch([PY, "-c", script], 1, output=out, error_output=err, max_restarts=2) == 3
    assert _attempts(out.getvalue()) == ["[0] attempt 0", "[0] attempt 1", "[0] attempt 2"]
    restart = (
        "meshkit launch: process 0 exited with exit code 3; restarting the job from its latest checkpoint"
    )
    assert err.getvalue().splitlines() == [
        f"{restart} (restart 1 of 2)", f"{restart} (restart 2 of 2)",
        "meshkit launch: process 0 exited with exit code 3 (no restarts left: 2 used)",
    ]  # fmt: skip
    out = io.StringIO()
    assert (
        launch([PY, "-c", "import os; assert 'MESHKIT_RESTART_ATTEMPT' not in os.environ"], 1, output=out)
        == 0
    )


@pytest.mark.parametrize(
    ("code", "said"),
    [(2, "process 0 exited with exit code 2; not restarting: exit code 2 means bad input, which a restart repeats"),
     (143, None), (130, None)],
)  # fmt: skip
def test_bad_input_and_orderly_stops_are_never_restarted(code, said):
    script = f"import os, sys; print('attempt', os.environ['MESHKIT_RESTART_ATTEMPT'], flush=True); sys.exit({code})"
    out = io.StringIO()
    assert launch([PY, "-c", script], 1, output=out, max_restarts=3) == code
    assert _attempts(out.getvalue()) == ["[0] attempt 0"]
    lines = [x for x in out.getvalue().splitlines() if x.startswith("meshkit launch:")]
    assert lines == ([f"meshkit launch: {said}"] if said else []), out.getvalue()


_STALLS = textwrap.dedent("""
    import os, time
    from meshkit.launch import report_progress
    attempt, rank = os.environ.get("MESHKIT_RESTART_ATTEMPT", "0"), os.environ["MESHKIT_PROCESS_ID"]
    print("attempt", attempt, flush=True)
    for step in range(3 if attempt == "1" else 600):  # the first start goes on until stopped...
        report_progress()
        time.sleep(0.1)
        while attempt == "0" and rank == "1" and step == 2:  # ...process 1 hangs after its third step
            time.sleep(1)
""")


def test_a_process_that_stops_making_progress_is_restarted():
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    assert launch([PY, "-c", _STALLS], 2, output=out, error_output=err, max_restarts=1, stall_timeout_s=5,
                  grace_s=2) == 0  # fmt: skip
    assert time.monotonic() - start < 120  # the stall is noticed within seconds, not at 60 s
    assert _attempts(out.getvalue()) == [f"[{r}] attempt {a}" for r in (0, 1) for a in (0, 1)]
    assert err.getvalue().splitlines() == [
        "meshkit launch: process 1 made no progress (no step) for 5 s (--stall-timeout); restarting the job from "
        "its latest checkpoint (restart 1 of 1)"
    ]
    out, err = io.StringIO(), io.StringIO()  # no restarts left: the stalled job ends with 75
    code = launch([PY, "-c", _STALLS], 2, output=out, error_output=err, stall_timeout_s=5, grace_s=2)
    assert code == 75 and "for 5 s (--stall-timeout); stopping the others" in err.getvalue()
