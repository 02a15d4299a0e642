"""The run directory through ``meshkit train``: one run owns it (a second ``--resume`` beside a live
run is refused before it touches anything), checkpoints whose bytes changed on disk are not trained
on, metrics lines are never torn (and a torn one does not stop a resume), meshkit never writes
through a link, a new run never shares a directory, and odd ``--data`` paths are named."""

import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from _limits import limit
from meshkit.cli import main
from meshkit.files import _umask
from meshkit.train._orbax_noise import quiet_orbax_noise
from meshkit.train.lock import RunDirError, new_run_dir, write_atomic
from meshkit.train.metrics import read_rows

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
TINY = ["train", "--preset", "tiny", "--warmup", "1", "--eval-every", "0", "--sample-chars", "0"]
MESHKIT = str(Path(sys.executable).parent / "meshkit")


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_rows(run / "metrics.jsonl", warn=False) if "loss" in r]


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A tiny run stopped at step 12 of 16, with checkpoints 4, 8 and 12: each test resumes a copy."""
    run = tmp_path_factory.mktemp("first") / "run"
    args = [*TINY, "--steps", "16", "--stop-after", "12", "--checkpoint-every", "4", "--run-dir", str(run)]
    assert main(args) == 0
    return run


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


# --- item 3: a checkpoint whose bytes changed on disk -------------------------------------------


def _flip(path: Path, at: int, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + count] = bytes(b ^ 0xFF for b in data[at : at + count])
    path.write_bytes(bytes(data))


def _orbax_reads(params: Path):
    """The arrays orbax restores from a step's ``params`` on its own (no checksums), or None if it fails."""
    quiet_orbax_noise()  # the failures' tracebacks from orbax's threads
    try:
        with ocp.StandardCheckpointer() as reader:
            return [np.asarray(a) for a in jax.tree.leaves(reader.restore(params.absolute()))]
    except Exception:
        return None


def _a_flip_orbax_misses(step: Path, scratch: Path) -> tuple[Path, int]:
    """A file of the step and an offset where 64 flipped bytes (the file's size kept) restore without
    error, as different weights: where they fall in a compressed chunk's header orbax notices, in its
    data it does not. Tried on a copy of the step; the step itself is left intact."""
    intact = _orbax_reads(step / "params")
    files = sorted((step / "params").rglob("d/*"), key=lambda f: -f.stat().st_size)
    for file in files[:3]:
        for fraction in (0.5, 0.3, 0.7, 0.4, 0.6, 0.2, 0.8):
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.copytree(step, scratch)
            at = int(file.stat().st_size * fraction)
            _flip(scratch / file.relative_to(step), at)
            got = _orbax_reads(scratch / "params")
            if got is not None and not all(np.array_equal(g, w) for g, w in zip(got, intact, strict=True)):
                return file, at
    raise AssertionError("every flip tried was noticed by orbax or changed nothing")


def test_flipped_bytes_in_the_latest_checkpoint_fall_back_to_the_previous_one(stopped_run, tmp_path, capsys):
    """64 bytes flipped in step 12's array data, the file's size kept: orbax reads them without error
    (garbage weights, then a NaN loss); the checksums catch them."""
    run = _copy(stopped_run, tmp_path / "run")
    victim, at = _a_flip_orbax_misses(run / "checkpoints" / "12", tmp_path / "scratch")
    _flip(victim, at)
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--resume", "--stop-after", "12"]) == 0
    captured = capsys.readouterr()
    (warning,) = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    name = victim.relative_to(run / "checkpoints" / "12")
    assert warning.startswith(
        f"warning: checkpoint step 12 in '{run / 'checkpoints'}' cannot be read ({name} does not match its sha256"
    ), warning
    assert warning.endswith("; trying step 8") and "moved to .unreadable/12-" in warning
    assert "resuming at step 8" in captured.out and "Traceback" not in captured.err
    assert _losses(run) == _losses(stopped_run)  # steps 9..12 again, bit for bit: same final loss
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["12", "4", "8"]


# --- items 4 and 7: a torn metrics line; temporary names planted as links --------------------------


def test_resume_reads_past_a_torn_metrics_line_and_writes_through_no_planted_link(
    stopped_run, tmp_path, capsys
):
    run = _copy(stopped_run, tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 13, "loss": 3.1, "tokens_')  # a write the full disk cut short
    victim = tmp_path / "victim.txt"
    victim.write_text("not meshkit's\n")
    for name in ("config.json.tmp", "metrics.jsonl.tmp", "report.json.tmp"):
        (run / name).symlink_to(victim)  # the names meshkit 0.x wrote through
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--resume", "--stop-after", "14"]) == 0
    err = capsys.readouterr().err
    (warning,) = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warning == (
        f"warning: {run / 'metrics.jsonl'}: line 13 of 13 not a whole metrics row (the last: a write cut short): "
        "dropped; the other rows are kept"
    )
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 15))  # every line whole
    assert _losses(run)[:12] == _losses(stopped_run)
    assert victim.read_text() == "not meshkit's\n"
    assert json.loads((run / "config.json").read_text())["run"]["steps"] == 16
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]


_FULL_DISK = r"""
import json, resource, signal, sys
from pathlib import Path
from meshkit.train.metrics import MetricsError, MetricsLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
with MetricsLog(Path(sys.argv[1])) as log:
    try:
        for step in range(1, 100):
            log.write({"step": step, "loss": 1.0 / step, "note": "x" * step})
    except MetricsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
"""


def test_a_metrics_row_the_disk_refuses_is_not_left_torn(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=limit(1),
    )  # fmt: skip  (no JAX: a second or two)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert re.fullmatch(
        rf"error: cannot write '{re.escape(str(tmp_path / 'metrics.jsonl'))}' \(.+\); .+ free there: free space, "
        r"then continue with --resume \(the rows before this one and the checkpoints are intact\)",
        line,
    ), line
    text = (tmp_path / "metrics.jsonl").read_text()
    assert 0 < len(text) <= 1000 and text.endswith("\n")
    steps = [json.loads(x)["step"] for x in text.splitlines()]  # whole rows only
    assert steps == list(range(1, len(steps) + 1))


# --- item 1: a second run beside a live one ----------------------------------------------------------

_HOLDER = "import sys, time; from meshkit.train.lock import lock_run_dir; l = lock_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(120)"


@contextlib.contextmanager
def _held(run_dir: Path):
    """``run_dir`` locked by another process (a live run, as far as the lock can tell): its pid."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run_dir)], env=ENV, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert select.select([holder.stdout], [], [], 60)[0], "the holder took no lock in 60 s"
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def _snapshot(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")}


def test_a_second_run_on_a_held_directory_touches_nothing(stopped_run, tmp_path, capsys):
    """The live run's save in flight (its temporary step directory) survives a second ``--resume``
    and a new run pointed at the directory: both are refused before they open the checkpoints."""
    run = _copy(stopped_run, tmp_path / "run")
    in_flight = run / "checkpoints" / "13.orbax-checkpoint-tmp"
    (in_flight / "params").mkdir(parents=True)
    (in_flight / "params" / "being-written").write_bytes(b"x" * 64)
    capsys.readouterr()
    with _held(run) as pid:
        before = _snapshot(run)
        for extra in (["--resume"], ["--preset", "tiny"]):
            assert main(["train", "--run-dir", str(run), *extra]) == 2
            line = _one_error_line(capsys.readouterr().err)
            assert line.startswith(f"error: run directory '{run}' is in use by another run (pid {pid}: ")
            assert line.endswith("wait for it to finish or stop it, or pass another --run-dir")
        assert _snapshot(run) == before


def _catch_a_save_in_flight(first: subprocess.Popen, runs: Path, timeout: float) -> Path:
    """Stop ``first`` (SIGSTOP) while one of its checkpoints is being written: the temporary step
    directory it leaves, which a second run must not remove."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()
        for in_flight in runs.glob("*/checkpoints/*.orbax-checkpoint-tmp"):
            os.kill(first.pid, signal.SIGSTOP)
            if in_flight.is_dir():
                return in_flight
            os.kill(first.pid, signal.SIGCONT)  # that save was committed meanwhile: catch the next
        time.sleep(0.002)
    raise AssertionError(f"no save of the live run caught in flight in {timeout} s")


# Tiers: sweeps (moved when make test measured 22 min): a --resume and a new run on a directory another
# process holds, refused in one line before they touch its save in flight, are core in
# test_a_second_run_on_a_held_directory_touches_nothing, runs/<time> taken giving runs/<time>-2 in
# test_new_run_dirs_are_distinct_when_created_at_once.
@pytest.mark.sweep
def test_a_live_run_gets_its_own_directory_and_a_second_resume_beside_it_is_refused(
    tmp_path, monkeypatch, capsys
):
    """Items 1 and 7. Every ``runs/<time>`` of the next two minutes is taken by another run (as when
    two start in the same second): the live run creates ``runs/<time>-2`` and leaves the others
    alone. Frozen in the middle of a save, it is joined by ``meshkit train --resume`` (through
    ``runs/latest``): refused in one line naming it, with the save in flight untouched; the live run
    then finishes with every checkpoint."""
    monkeypatch.chdir(tmp_path)
    now = time.time()
    taken = {time.strftime("%Y%m%d-%H%M%S", time.localtime(now + s)) for s in range(-1, 120)}
    for name in taken:
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "other-run.txt").write_text(name)
    first = subprocess.Popen([MESHKIT, *TINY, "--steps", "16", "--stop-after", "12", "--checkpoint-every", "1"],
                             env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        # JAX's start and the first compile take most of it, on 2 busy cores
        in_flight = _catch_a_save_in_flight(first, tmp_path / "runs", timeout=limit(6))
        try:
            capsys.readouterr()
            assert main(["train", "--resume"]) == 2
            line = _one_error_line(capsys.readouterr().err)
            assert in_flight.is_dir()  # the live run's save was not touched
        finally:
            os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=limit(6))
    finally:
        first.kill()
        first.wait()
    run = (tmp_path / "runs" / "latest").resolve()
    assert line.startswith(f"error: run directory '{run}' is in use by another run (pid {first.pid}: "), line
    assert first.returncode == 0, err[-3000:]
    assert "error" not in err and "Traceback" not in err, err[-3000:]
    assert "stopped after step 12 of 16" in out
    assert run.name.endswith("-2") and run.name[:-2] in taken and in_flight.resolve().parent.parent == run
    assert json.loads((run / "config.json").read_text())["run"]["run_dir"] == f"runs/{run.name}"
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["10", "11", "12"], names  # the latest three, nothing unfinished or set aside
    assert [s for s, _ in _losses(run)] == list(range(1, 13))
    for name in taken:
        assert [p.name for p in (tmp_path / "runs" / name).iterdir()] == ["other-run.txt"]


# --- item 7: links and odd files where meshkit writes; one directory per run ------------------------


def test_a_lock_file_that_is_a_link_is_refused_and_not_written_through(tmp_path, capsys):
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    run.mkdir()
    victim.write_text("precious\n")
    (run / ".lock").symlink_to(victim)
    assert main([*TINY, "--run-dir", str(run)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == (
        f"error: '{run / '.lock'}' is a symbolic link (to '{victim}'), not the run's lock file: meshkit never "
        "writes through it; remove it, or pass another --run-dir"
    )
    assert victim.read_text() == "precious\n" and [p.name for p in run.iterdir()] == [".lock"]


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_runs_latest_that_is_not_a_link_is_named_and_nothing_is_created(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.chdir(tmp_path)
    latest = Path("runs") / "latest"
    if kind == "directory":
        (latest / "mine").mkdir(parents=True)
    else:
        latest.parent.mkdir()
        latest.write_text("mine\n")
    assert main(TINY) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == (
        f"error: 'runs/latest' is a {kind if kind == 'directory' else 'regular file'}, not the link meshkit keeps "
        "to the newest run: move it away (e.g. mv runs/latest runs/latest.old), or pass --run-dir"
    )
    assert [p.name for p in Path("runs").iterdir()] == ["latest"]  # no run directory was created


def test_write_atomic_replaces_a_link_never_writes_through_it_and_leaves_no_temporary_file(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "config.json").symlink_to(victim)
    write_atomic(tmp_path / "config.json", "{}\n")
    assert victim.read_text() == "precious\n" and not (tmp_path / "config.json").is_symlink()
    assert (tmp_path / "config.json").read_text() == "{}\n"
    assert oct((tmp_path / "config.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    (tmp_path / "report.json").mkdir()
    with pytest.raises(RunDirError, match=r"^cannot write '.*report.json': it is a directory; move it away"):
        write_atomic(tmp_path / "report.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "report.json", "victim.txt"]


def test_new_run_dirs_are_distinct_when_created_at_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: new_run_dir(tmp_path / "runs" / "20250101-000000"), range(8)))
    assert sorted(p.name for p in made) == sorted(
        ["20250101-000000", *(f"20250101-000000-{n}" for n in range(2, 9))]
    )


# --- item 8 (part): --data that is not a file -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["a directory", "a FIFO (named pipe)"])
def test_data_that_is_not_a_file_is_named(tmp_path, capsys, kind):
    data = tmp_path / "corpus"
    if kind == "a directory":
        data.mkdir()
    else:
        os.mkfifo(data)  # reading it would block until a writer came: refused before it is opened
    run = tmp_path / "run"
    assert main([*TINY, "--data", str(data), "--run-dir", str(run)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    if kind == "a directory":  # a directory is token data (issue 25) when prepared
        assert line == (
            f"error: data '{data}' is a directory without a manifest.json: prepare it with 'meshkit data "
            f"prepare {data} --out DIR' and give --data DIR, or name a text file"
        )
    else:
        assert line == (
            f"error: data '{data}' is {kind}, not a file: give a UTF-8 text file or a .npy of token ids "
            "(copy what it streams into a file first)"
        )
    assert not run.exists()


def test_a_run_that_trains_again_from_the_start_in_its_directory_keeps_none_of_the_earlier_rows(tmp_path):
    """A restart before any complete checkpoint (or the same command run again) trains from step 1
    in the same directory: metrics.jsonl then holds this run's rows only (was: appended after the
    earlier attempt's, so steps 1..k appeared twice and a later --resume read both)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "2.orbax-checkpoint-tmp-99").mkdir(parents=True)  # an interrupted first save
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3))
    )
    assert main([*TINY, "--steps", "2", "--run-dir", str(run)]) == 0
    rows = [r for r in read_rows(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] != 9.0 for r in rows)


def test_the_reads_orbax_leaves_behind_a_failed_restore_are_not_printed(monkeypatch):
    """A read orbax abandoned after another failed ends in a coroutine nobody awaits: Python would print
    its error when collecting it (in a test suite: inside whichever test runs then). The hook drops
    exactly those; every other unraisable exception still reaches the hook before it."""
    from orbax.checkpoint._src.serialization import serialization

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    quiet_orbax_noise()
    fields = dict(global_shape=(4,), new_shard_shape=(4,), dtype=np.float32, byte_limiter=None, strict=True,
                  dll=None, memory_kind=None)  # fmt: skip
    left = serialization._read_array_index_and_device_put([], (), None, **fields)  # never run
    sys.unraisablehook(SimpleNamespace(exc_value=Exception("error while reading array index"), object=left))
    users = _a_users_coroutine()
    sys.unraisablehook(SimpleNamespace(exc_value=ValueError("a user's"), object=users))
    left.close(), users.close()
    assert [u.exc_value.args for u in seen] == [("a user's",)]


async def _a_users_coroutine():
    return None
