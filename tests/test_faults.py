"""Faults around checkpoints, with real processes: SIGKILL at random moments of saves (30 times,
each followed by a resume that must continue bit for bit), a file-size limit and a read-only
directory during a save, a second run on a locked run directory, a corrupt latest checkpoint (in
one process, and in one of a job's two processes only: all must fall back to the same step)."""

import contextlib
import json
import os
import pickle
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import meshkit
from _limits import limit
from meshkit.cli import main
from meshkit.models import mlp
from meshkit.train.checkpoint import Checkpointer, abstract_with
from meshkit.train.lock import RunDirLockedError, lock_run_dir
from meshkit.verify import bitwise_equal

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
SIZES = [8, 16, 4]


def _trainer():
    return meshkit.Trainer(
        mlp.loss, mlp.init(jax.random.key(0), SIZES), optax.adam(1e-2), plan="dp", mesh="data=8"
    )


def _batch(step: int):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(16, SIZES[0])).astype(np.float32)
    return x, np.tanh(x[:, : SIZES[-1]])


@pytest.fixture(scope="module")
def trajectory():
    """(trainer, states): the states after steps 1..K of one uninterrupted run, on the host."""
    t = _trainer()
    states = []
    for step in range(1, 103):
        t.step(_batch(step))
        states.append(jax.device_get((t.params, t.opt_state)))
    return t, states


# The zygote imports everything once and forks a saver per round (no thread runs yet, so fork is
# safe): a round costs a fork and a few saves, not a Python start and JAX's imports.
_ZYGOTE = r"""
import os, pickle, sys
import jax, numpy
from meshkit.train.checkpoint import Checkpointer
assert __import__("threading").active_count() == 1
for line in sys.stdin:
    directory, states_path, last = line.split()
    go, ready = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready)
        os.read(go, 1)  # its pid is on stdout first: the test must not read a "start" line for it
        states = pickle.load(open(states_path, "rb"))
        ck = Checkpointer(directory, keep=3)
        for step in range((ck.latest_step() or 0) + 1, int(last) + 1):
            params, opt_state = jax.device_put(states[step - 1])
            os.write(1, f"start {step}\n".encode())  # one write: a kill never tears a line
            ck.save(step, params, opt_state, {"step": step, "data": {"position": step}})
            os.write(1, f"done {step}\n".encode())
        ck.close()
        os._exit(0)
    os.close(go)
    print(f"pid {pid}", flush=True)
    os.write(ready, b"x")
    os.close(ready)
    _, status = os.waitpid(pid, 0)
    print(f"exit {status}", flush=True)
"""


def _read_line(proc: subprocess.Popen, timeout: float | None = None) -> str:
    timeout = limit(0) if timeout is None else timeout  # a line a fraction of a CPU second apart
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise AssertionError(f"no output from the saver in {timeout} s")
    return proc.stdout.readline().strip()


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.0005)


# Tiers: sweeps (thirty kills at random moments of saves: more draws of paths each core once): a SIGKILL
# inside a save keeps the previous step whole and the directory usable in test_checkpoint.py's
# test_sigkill_mid_save_keeps_the_previous_step, one between a save's last file and its rename leaves no
# visible step and --resume continues to the same losses in test_async_save.py's
# test_sigkill_during_a_background_save_leaves_no_visible_step_and_resume_continues, what a kill can leave of
# a step (a file missing, a step directory empty, garbage) falls back to the newest intact step in
# test_checkpoint.py's test_an_unreadable_latest_step_falls_back_to_the_newest_intact_one.
@pytest.mark.slow
@pytest.mark.sweep
def test_thirty_sigkills_mid_save_each_resume_continues_bit_for_bit(tmp_path, trajectory, capsys):
    trainer, states = trajectory
    last = len(states) - 2  # two more states to compare each continuation with
    states_path = tmp_path / "states.pkl"
    states_path.write_bytes(pickle.dumps(states))
    directory = tmp_path / "ck"
    rng = np.random.default_rng(0)
    zygote = subprocess.Popen(
        [sys.executable, "-c", _ZYGOTE], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    save_s, landed, started = 0.1, [], time.monotonic()
    like = (abstract_with(trainer.params, trainer.shardings.params),
            abstract_with(trainer.opt_state, trainer.shardings.opt_state))  # fmt: skip
    try:
        for round_ in range(30):
            zygote.stdin.write(f"{directory} {states_path} {last}\n")
            zygote.stdin.flush()
            kind, pid = _read_line(zygote).split()
            assert kind == "pid", kind  # (a saver that wrote first would make its step the pid: kill(1))
            pid = int(pid)
            target, delay = int(rng.integers(0, 3)), rng.uniform(0, 1.3 * save_s)
            # a save is committed (renamed into place) in its last tenth or so: a random delay rarely
            # lands there, so every third kill waits for the committed directory to appear instead
            # and falls among what follows the rename (old steps deleted, the manager's wait)
            after_commit = round_ % 3 == 2
            done, begun, t_start, committed = None, None, None, 0
            while True:  # let `target` saves finish, then kill the next one `delay` seconds in
                line = _read_line(zygote)
                kind, step = line.split()
                if kind == "start":
                    begun, t_start = int(step), time.monotonic()
                    if target == 0:
                        if after_commit:
                            _wait_for(directory / str(begun), timeout=limit(0))
                            committed = begun
                        else:
                            time.sleep(delay)
                        os.kill(pid, signal.SIGKILL)
                        break
                elif kind == "done":
                    done, target = int(step), target - 1
                    save_s = 0.8 * save_s + 0.2 * (time.monotonic() - t_start)
                else:
                    pytest.fail(f"the saver ended before it was killed: {line}")
            while not (line := _read_line(zygote)).startswith("exit "):  # reaped: nothing writes any more
                kind, step = line.split()  # what the saver printed before the kill reached it
                done, begun = (int(step), begun) if kind == "done" else (done, int(step))
            with Checkpointer(directory, keep=3) as ck:
                latest = ck.latest_step()
                assert latest in (done, begun) or (done is None and latest == begun - 1), (
                    done,
                    begun,
                    latest,
                )
                landed.append(latest == begun)
                assert latest >= committed, (committed, latest)  # a committed step is never lost
                params, opt_state, meta = ck.restore(None, *like)
            assert meta == {"step": latest, "data": {"position": latest}}
            assert bitwise_equal((params, opt_state), states[latest - 1])
            trainer.params, trainer.opt_state = params, opt_state  # --resume, then two more steps
            for step in (latest + 1, latest + 2):
                trainer.step(_batch(step))
                assert bitwise_equal((trainer.params, trainer.opt_state), states[step - 1]), step
            # a reader removes nothing: the killed save's directory waits for the next saver to clean it
            unfinished = sorted(p.name for p in directory.iterdir() if "tmp" in p.name)
            assert unfinished in ([], [f"{begun}.orbax-checkpoint-tmp"]), unfinished
    finally:
        zygote.stdin.close()
        zygote.kill()
        zygote.wait()
        zygote.stdout.close()
    err = capsys.readouterr().err
    assert "warning:" not in err and "Traceback" not in err  # no step was ever damaged
    # the kills fell both before and after the killed save was committed
    assert 0 < sum(landed) < len(landed), (landed, save_s, time.monotonic() - started)


# --- saves that fail ----------------------------------------------------------------------------------

_SAVER = r"""
import os, resource, signal, sys
import jax, numpy as np
from meshkit.train.checkpoint import Checkpointer, CheckpointError
directory, how = sys.argv[1], sys.argv[2]
small = jax.device_put(np.arange(64, dtype=np.float32))
ck = Checkpointer(directory)
ck.save(1, {"w": small}, {"mu": -small}, {"step": 1})
if how == "fsize":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
else:
    os.chmod(directory, 0o555)
    if os.getuid() == 0:  # root writes anywhere: become nobody
        os.setgid(65534)
        os.setuid(65534)
big = jax.device_put(np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32))  # incompressible
try:
    ck.save(2, {"w": big}, {"mu": big}, {"step": 2})
except CheckpointError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
print("saved", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fsize", "read-only"])
def test_a_failed_save_is_one_line_and_keeps_the_earlier_step(how):
    # a directory that nobody (uid 65534) can reach but not write, outside root's private /tmp/pytest-of-root
    base = Path(tempfile.mkdtemp(prefix="meshkit-fault-"))
    try:
        base.chmod(0o755)
        directory = base / "ck"
        proc = subprocess.run([sys.executable, "-c", _SAVER, str(directory), how], env=ENV,
                              capture_output=True, text=True, timeout=limit(2))  # fmt: skip
        directory.chmod(0o755)
        err = proc.stderr.strip()
        assert proc.returncode == 2, err[-3000:]
        assert err.count("\n") == 0 and "Traceback" not in err, err[-3000:]
        assert re.fullmatch(
            rf"error: cannot save step 2 in '{re.escape(str(directory))}' \(.+\); [\d.]+ [KMG]iB free there: "
            r"free space, fix permissions or pick another --run-dir; steps \[1\] are intact",
            err,
        ), err
        reason = {
            "fsize": r"File too large|EFBIG|Errno 27",
            "read-only": r"Permission denied|EACCES|Errno 13",
        }[how]
        assert re.search(reason, err), err
        like = jax.ShapeDtypeStruct(
            (64,), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
        )
        with Checkpointer(directory) as ck:
            assert ck.all_steps() == [1]
            params, opt_state, meta = ck.restore(None, {"w": like}, {"mu": like})
        assert meta == {"step": 1}
        np.testing.assert_array_equal(np.asarray(params["w"]), np.arange(64, dtype=np.float32))
        np.testing.assert_array_equal(np.asarray(opt_state["mu"]), -np.arange(64, dtype=np.float32))
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- one run per run directory -------------------------------------------------------------------------

_HOLDER = "import sys, time; from meshkit.train.lock import lock_run_dir; l = lock_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(120)"


@contextlib.contextmanager
def _held_by_another_process(run_dir: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir)], env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert _read_line(holder) == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_locked_run_directory_is_refused_naming_the_holder(tmp_path):
    with _held_by_another_process(tmp_path) as pid:
        with pytest.raises(RunDirLockedError) as e:
            lock_run_dir(tmp_path)
        assert str(e.value).startswith(f"run directory '{tmp_path}' is in use by another run (pid {pid}: ")
        assert str(e.value).endswith("wait for it to finish or stop it, or pass another --run-dir")
    with lock_run_dir(tmp_path):  # released when its holder died (SIGKILL): no stale lock
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(RunDirLockedError, match=f"pid {os.getpid()}"):
            lock_run_dir(tmp_path)  # the same process, twice: refused too
    lock_run_dir(tmp_path).release()


@pytest.mark.slow
def test_meshkit_train_on_a_directory_another_run_holds_exits_2(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with _held_by_another_process(run) as pid:
        code = main(["train", "--preset", "tiny", "--steps", "4", "--warmup", "1", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: run directory '{run}' is in use by another run (pid {pid}")
    assert [p.name for p in run.iterdir()] == [".lock"]  # the refused run wrote nothing


# --- a corrupt latest checkpoint ---------------------------------------------------------------------


# Tiers: sweeps; one process's fallback past a step its checksums reject is core in test_rundir.py's
# test_flipped_bytes_in_the_latest_checkpoint_fall_back_to_the_previous_one, garbage of another size (the
# size check) in test_checkpoint.py's test_an_unreadable_latest_step_falls_back_to_the_newest_intact_one
# [garbage in the array files].
@pytest.mark.slow
@pytest.mark.sweep
def test_resume_from_a_corrupt_latest_checkpoint_continues_from_the_previous_one(tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        "train",
        "--preset",
        "tiny",
        "--steps",
        "12",
        "--stop-after",
        "8",
        "--warmup",
        "1",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "4",
        "--run-dir",
        str(run),
    ]  # fmt: skip (stops at 8: no report to make)
    assert main(args) == 0
    straight = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for f in (run / "checkpoints" / "8" / "params").rglob("d/*"):
        f.write_bytes(os.urandom(32))  # step 8's arrays are garbage now; step 4 is intact
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: checkpoint step 8 in '{run / 'checkpoints'}' cannot be read ("
    ), err
    assert warnings[0].endswith("; trying step 4") and len(warnings[0]) < 400
    assert "Traceback" not in err and "Event loop is closed" not in err
    resumed = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    loss = lambda rows: [(r["step"], r["loss"]) for r in rows if "loss" in r]  # noqa: E731
    assert loss(resumed) == loss(straight)  # steps 5..8 again, bit for bit
    assert [p.name[:2] for p in (run / "checkpoints" / ".unreadable").iterdir()] == ["8-"]  # kept


@pytest.mark.slow
# Tiers: sweeps (44 CPU s, moved when make test measured 22 min): the fallback past an unreadable latest step
# is core in test_rundir.py's test_flipped_bytes_in_the_latest_checkpoint_fall_back_to_the_previous_one (one
# process, through meshkit train --resume), each process checking the files it wrote in test_checkpoint.py's
# test_each_process_checks_the_files_it_wrote, meshkit train as a job of 2 processes under meshkit launch in
# test_signals.py's test_a_local_job_listens_on_loopback_only_and_a_stalled_rank_ends_it_in_one_line.
@pytest.mark.sweep
def test_two_processes_agree_on_the_step_when_only_one_cannot_read_the_latest(tmp_path):
    """Step 8's shards written by process 1 are garbage: process 0 could read all it needs of step 8
    (its own shards and the replicated leaves), process 1 cannot. Unagreed, process 0 went on from
    step 8 and process 1 from step 4, and the job hung; agreed, both resume from step 4."""
    run, exe = tmp_path / "run", str(Path(sys.executable).parent / "meshkit")
    job = [exe, "launch", "-n", "2", "--devices-per-process", "4", "--", exe, "train"]
    first = [*job, "--preset", "tiny", "--plan", "zero3", "--steps", "12", "--stop-after", "8", "--warmup", "1",
             "--eval-every", "0", "--checkpoint-every", "4", "--sample-chars", "0", "--run-dir", str(run)]  # fmt: skip
    proc = subprocess.run(first, capture_output=True, text=True, env=ENV, timeout=limit(27))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    straight = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    garbage = list((run / "checkpoints" / "8").glob("*/ocdbt.process_1/d/*"))
    assert garbage, "process 1 wrote no files of its own: nothing to corrupt"
    for f in garbage:
        f.write_bytes(os.urandom(32))
    proc = subprocess.run([*job, "--run-dir", str(run), "--resume"], capture_output=True, text=True, env=ENV,
                          timeout=limit(27))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    warnings = [x for x in out.splitlines() if "warning:" in x]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"[0] warning: checkpoint step 8 in '{run / 'checkpoints'}' cannot be read (process 1 cannot read it)"
    ), out[-2000:]
    assert warnings[0].endswith("; trying step 4")
    assert "resuming at step 4" in out and "Traceback" not in out
    resumed = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    loss = lambda rows: [(r["step"], r["loss"]) for r in rows if "loss" in r]  # noqa: E731
    # each step once: one writer of metrics.jsonl, not two
    assert loss(resumed)[:8] == loss(straight) and [s for s, _ in loss(resumed)] == list(range(1, 13))
    assert [p.name[:2] for p in (run / "checkpoints" / ".unreadable").iterdir()] == ["8-"]
    # the job writes once (test_multiprocess.py's test_meshkit_train_under_launch_writes_once, a sweep,
    # checks it on a run of its own): process 0 alone prints the summary and writes the job's report
    assert "[0] " in proc.stdout and "Run summary" in proc.stdout
    assert "Run summary" not in "".join(x for x in proc.stdout.splitlines(True) if x.startswith("[1] "))
    report = json.loads((run / "report.json").read_text())
    assert (report["processes"], report["devices"], report["mesh"]) == (2, 8, {"data": 8})
    assert report["checks_ok"] and report["final_loss"] < report["initial_loss"]


def test_a_restart_resumes_a_named_run_directory_only_when_it_holds_a_checkpoint(tmp_path, monkeypatch):
    """``meshkit train --run-dir`` on a restart (``meshkit launch --max-restarts`` or a SLURM requeue)
    resumes; a first start, a run without a checkpoint yet, or an unnamed run directory trains anew."""
    from meshkit.train.config import ConfigError
    from meshkit.train.job import check_no_checkpoints, resume_on_restart

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for name in ("MESHKIT_RESTART_ATTEMPT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert not resume_on_restart(str(run))
    monkeypatch.setenv("MESHKIT_RESTART_ATTEMPT", "1")
    assert not resume_on_restart(str(run))  # killed before its first checkpoint
    # ... or during its first (background) save: only the save's temporary directory is there, and the
    # restart trains again from the start in the same directory (was: "already holds checkpoints", exit 2)
    (run / "checkpoints" / "2.orbax-checkpoint-tmp-1234").mkdir()
    assert not resume_on_restart(str(run))
    check_no_checkpoints(run)
    small = jax.device_put(np.arange(4, dtype=np.float32))
    with Checkpointer(run / "checkpoints") as ck:
        ck.save(2, {"w": small}, {"mu": small}, {"step": 2})
    assert resume_on_restart(str(run)) and not resume_on_restart(None)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        check_no_checkpoints(run)
    monkeypatch.setenv("MESHKIT_RESTART_ATTEMPT", "0")
    assert not resume_on_restart(str(run))  # the first start trains as asked (and refuses a used directory)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # sbatch --requeue
    assert resume_on_restart(str(run))
