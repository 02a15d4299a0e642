"""Checkpoints in the background: the step loop goes on while a save is written, a step in flight is
never listed, and a SIGKILL while one is in flight leaves it invisible (resume continues from the
previous complete step, with the same losses).

A save is held at a chosen moment by a test-only wrapper around ``write_checksums`` (orbax's
post-finalization callback, the last thing before the step's directory is renamed into place): the
kill lands at a known point, with every file of the step written, and no sleep races it.
"""

import os
import select
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _limits import limit
from meshkit.cli import main
from meshkit.train import checkpoint
from meshkit.train.checkpoint import CHECKSUMS, Checkpointer, abstract
from meshkit.train.metrics import read_rows

TINY = ["train", "--preset", "tiny", "--warmup", "1", "--eval-every", "0", "--sample-chars", "0"]


def _tree(value: float):
    sh = NamedSharding(jax.make_mesh((8,), ("data",)), P("data"))
    return {"w": jax.device_put(np.full((8, 4), value, np.float32), sh)}


def test_a_step_in_flight_is_not_listed_until_it_is_on_disk(tmp_path, monkeypatch):
    """While step 2 is held just before its rename, the saver and a fresh reader list step 1 only,
    and on disk step 2 is a temporary directory; once released and waited for, it is step 2."""
    reached, release = threading.Event(), threading.Event()
    seal = checkpoint.write_checksums

    def held(step_dir):
        seal(step_dir)
        if step_dir.name.startswith("2."):
            reached.set()
            assert release.wait(60), "the test never released the save"

    monkeypatch.setattr(checkpoint, "write_checksums", held)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, _tree(1.0), {}, {"step": 1}, wait=False)
        ck.save(2, _tree(2.0), {}, {"step": 2}, wait=False)  # waits for step 1 first
        assert reached.wait(60), "step 2 never reached its rename"
        try:
            assert ck.all_steps() == [1] and ck.latest_step() == 1 and ck.in_flight() == 2
            with Checkpointer(tmp_path) as reader:
                assert reader.all_steps() == [1] and reader.latest_step() == 1
            names = {p.name for p in tmp_path.iterdir()}
            assert "2" not in names and any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names
        finally:
            release.set()
        ck.wait()
        assert ck.all_steps() == [1, 2] and ck.in_flight() is None
        assert (tmp_path / "2" / CHECKSUMS).is_file()
        params, _, meta = ck.restore(None, abstract(_tree(0.0)), {})
    assert meta == {"step": 2} and (np.asarray(params["w"]) == 2.0).all()


# The real command, with orbax's last step before the rename of step HOLD held for ever (its files
# and checksums written) and every Checkpointer.save announced on stderr.
_CHILD = """
import sys, threading
from meshkit.cli import main
from meshkit.train import checkpoint
hold, seal, save = sys.argv[1], checkpoint.write_checksums, checkpoint.Checkpointer.save

def held(step_dir):
    seal(step_dir)
    if step_dir.name.startswith(hold + "."):
        print("holding", hold, file=sys.stderr, flush=True)
        threading.Event().wait()

def announced(self, step, *args, **kwargs):
    print("save", step, file=sys.stderr, flush=True)
    return save(self, step, *args, **kwargs)

checkpoint.write_checksums, checkpoint.Checkpointer.save = held, announced
sys.exit(main(sys.argv[2:]))
"""


def _lines_until(child: subprocess.Popen, wanted: set[str], timeout: float) -> list[str]:
    """stderr lines of ``child`` until every line of ``wanted`` came (or it ended, or ``timeout``)."""
    deadline, seen = time.monotonic() + timeout, []
    while not wanted <= set(seen):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([child.stderr], [], [], left)[0]:
            raise AssertionError(f"not in {timeout} s: {sorted(wanted - set(seen))}; stderr so far: {seen}")
        line = child.stderr.readline()
        if not line:
            raise AssertionError(
                f"the run ended ({child.wait()}) before {sorted(wanted - set(seen))}: {seen}"
            )
        seen.append(line.strip())
    return seen


@pytest.mark.slow
def test_sigkill_during_a_background_save_leaves_no_visible_step_and_resume_continues(tmp_path):
    """``meshkit train`` saves every 2 steps; step 4's save is held just before its rename. The loop
    trains steps 5 and 6 meanwhile (the save does not block it) and then waits at step 6's save for
    step 4's: SIGKILL there. Step 4 is a temporary directory no reader lists (complete but for the
    rename); ``--resume`` continues from step 2, trains steps 3 to 6 to the same losses, and ends with
    the latest three steps and nothing unfinished."""
    run = tmp_path / "run"
    args = [*TINY, "--steps", "10", "--checkpoint-every", "2", "--run-dir", str(run)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen([sys.executable, "-c", _CHILD, "4", *args], env=env, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as child:  # fmt: skip
        try:
            # JAX's start and the first compile take most of it, on 2 busy cores
            seen = _lines_until(child, {"holding 4", "save 6"}, timeout=limit(4))
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=60) == -signal.SIGKILL
        finally:
            child.kill()
    assert seen.index("save 2") < seen.index("save 4") < seen.index("save 6"), seen
    killed = {r["step"]: r["loss"] for r in read_rows(run / "metrics.jsonl", warn=False) if "loss" in r}
    assert sorted(killed) == [1, 2, 3, 4, 5, 6]  # steps 5 and 6 ran while step 4 was being saved
    names = {p.name for p in (run / "checkpoints").iterdir()}
    partial = [n for n in names if n.startswith("4.orbax-checkpoint-tmp")]
    assert "4" not in names and "6" not in names and len(partial) == 1, names
    assert (run / "checkpoints" / partial[0] / CHECKSUMS).is_file()  # held after its last file
    with Checkpointer(run / "checkpoints") as reader:
        assert reader.all_steps() == [2]

    # --stop-after 8 of 10: without the end's evaluation and report (seconds of compiles)
    assert main(["train", "--run-dir", str(run), "--resume", "--stop-after", "8"]) == 0
    resumed = {r["step"]: r["loss"] for r in read_rows(run / "metrics.jsonl", warn=False) if "loss" in r}
    assert sorted(resumed) == list(range(1, 9))
    assert [resumed[s] for s in range(1, 7)] == [killed[s] for s in range(1, 7)]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4", "6", "8"]
