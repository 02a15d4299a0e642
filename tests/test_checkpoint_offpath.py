"""A background save stays off the training loop's critical path (issues 35 and 39): the steps past
``keep`` are deleted by a thread of their own, only once the newer step is committed, never by the
loop and never visibly half-deleted; the save's writers run at low priority; on the CPU backend the
save reads buffers of its own, so the next step can donate the live ones; and the checksums,
hashed in chunks, still catch a changed byte.

The tests assert structure (which thread does what, in which order, at which priority), not speed:
the speed is benchmarks/bench_checkpoint.py's.
"""

import hashlib
import json
import os
import shutil
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.train import background, checkpoint
from meshkit.train.checkpoint import CHECKSUMS, Checkpointer, CheckpointError, abstract
from meshkit.train.checksums import _CHUNK


def _tree(value: float, rows: int = 8, *, noise: bool = False):
    """``{"w": (rows, 4) float32}`` over 8 devices: ``value`` everywhere, or random (incompressible)."""
    sh = NamedSharding(jax.make_mesh((8,), ("data",)), P("data"))
    w = (
        np.random.default_rng(0).standard_normal((rows, 4)).astype(np.float32)
        if noise
        else np.full((rows, 4), value, np.float32)
    )
    return {"w": jax.device_put(w, sh)}


def test_old_steps_are_deleted_off_the_loop_after_the_newer_step_is_committed(tmp_path, monkeypatch):
    """keep=1: saving step 3 confirms step 2, after which orbax has moved step 1 (with a big dummy
    file) into the trash. Its deletion is held: the loop's save of step 3 returns meanwhile (the
    loop's blocking does not depend on the deleted step at all), the deleting thread is not the
    loop's, step 2 was complete when it began, and no reader lists step 1. Released, step 3's
    save completes and the trash is gone."""
    deleting, release, seen = threading.Event(), threading.Event(), []
    rmtree = shutil.rmtree

    def held(path, *args, **kwargs):
        if os.path.basename(path) == ".deleted":
            step2 = tmp_path / "2"
            seen.append({
                "loop": threading.current_thread() is threading.main_thread(),
                "trash": sorted(os.listdir(path)) if os.path.isdir(path) else [],
                "dummy": (tmp_path / ".deleted" / "1" / "dummy").is_file(),
                "committed": step2.is_dir() and (step2 / CHECKSUMS).is_file(),
            })  # fmt: skip
            deleting.set()
            if threading.current_thread() is not threading.main_thread():
                assert release.wait(60), "the test never released the deletion"
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held)
    with Checkpointer(tmp_path, keep=1) as ck:
        ck.save(1, _tree(1.0), {}, {"step": 1})
        with open(tmp_path / "1" / "dummy", "wb") as f:  # a big old step: 1 GiB, sparse
            f.truncate(1 << 30)
        ck.save(2, _tree(2.0), {}, {"step": 2}, wait=False)
        try:
            ck.save(3, _tree(3.0), {}, {"step": 3}, wait=False)  # returns with the deletion held
            assert deleting.wait(60), "step 1 was never deleted"
            assert seen == [{"loop": False, "trash": ["1"], "dummy": True, "committed": True}]
            assert ck.in_flight() == 3
            with Checkpointer(tmp_path) as reader:  # the directory as a restart would list it
                assert reader.all_steps() == [2]
        finally:
            release.set()
        ck.wait()
        assert ck.all_steps() == [3]
    assert len(seen) == 2 and not seen[1]["loop"]  # step 2's deletion, at the close
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]


def test_a_background_save_writes_at_low_priority_and_gets_the_loops_back_when_waited_for(
    tmp_path, monkeypatch
):
    """While step 1 is held in its writer (the checksums, just before the rename), the writer
    thread and tensorstore's pool threads run at nice 19 and the loop's thread keeps its own; when
    the loop waits for the save, they get the loop's priority back (where that is permitted)."""
    reached, release, writer = threading.Event(), threading.Event(), {}
    seal = checkpoint.write_checksums

    def held(step_dir):
        seal(step_dir)
        writer["tid"] = threading.get_native_id()
        reached.set()
        assert release.wait(60), "the test never released the save"

    monkeypatch.setattr(checkpoint, "write_checksums", held)
    loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with Checkpointer(tmp_path) as ck:
        ck.save(1, _tree(1.0, rows=4096), {}, {"step": 1}, wait=False)
        assert reached.wait(60), "step 1 never reached its checksums"
        try:
            pool = background.pool_threads()
            assert pool, "no tensorstore pool thread found"
            assert background.nice(writer["tid"]) == background.LOW
            assert {background.nice(t) for t in pool} - {None} == {background.LOW}
            assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop
            waiter = threading.Thread(target=ck.wait)
            waiter.start()
            for _ in range(600):  # the waiter raises them back before it blocks
                if background.nice(writer["tid"]) != background.LOW or not waiter.is_alive():
                    break
                threading.Event().wait(0.05)
            raised = background.nice(writer["tid"])
        finally:
            release.set()
        waiter.join(60)
        assert ck.all_steps() == [1]
    assert raised == (loop if _may_raise_priority() else background.LOW)


def _may_raise_priority() -> bool:
    """Whether this process may lower a thread's nice value again (CAP_SYS_NICE or RLIMIT_NICE)."""
    result = {}

    def probe():
        tid = threading.get_native_id()
        base = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, background.LOW)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, base)
            result["ok"] = True
        except OSError:
            result["ok"] = False

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return result["ok"]


def test_on_cpu_the_save_reads_buffers_of_its_own(tmp_path, monkeypatch):
    """orbax is handed copies (other buffers, same values and shardings), made once in ``save``:
    orbax's host "copy" on CPU is a view, which would keep the next step from reusing the buffers
    it donates; and the caller's arrays, donated and changed right after ``save`` returns, do not
    change what was saved."""
    handed = []
    save = ocp.CheckpointManager.save

    def spy(self, step, *args, **kwargs):
        handed.append(kwargs["args"]["params"].item)
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", spy)
    params = _tree(1.0)
    live = params["w"].addressable_shards[0].data.unsafe_buffer_pointer()
    with Checkpointer(tmp_path) as ck:
        ck.save(1, params, {}, {"step": 1}, wait=False)
        (got,) = handed
        assert got["w"].sharding == params["w"].sharding
        assert got["w"].addressable_shards[0].data.unsafe_buffer_pointer() != live
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(params["w"]))
        bumped = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)(params)
        np.testing.assert_array_equal(np.asarray(bumped["w"]), 2.0)
        restored, _, _ = ck.restore(1, abstract(_tree(0.0)), {})
    np.testing.assert_array_equal(np.asarray(restored["w"]), 1.0)


def test_digests_are_of_the_files_and_a_changed_byte_past_the_first_chunk_is_caught(tmp_path, capfd):
    """A 48 MiB array (6 MiB a device: however orbax groups its shards into files, the largest is
    longer than the 4 MiB chunks the writer hashes in), saved in the background: each recorded digest
    is hashlib's of the whole file; a byte changed past the first chunk makes the step unreadable
    (named), and restoring the latest falls back to step 1."""
    with Checkpointer(tmp_path) as ck:
        ck.save(1, _tree(1.0), {}, {"step": 1}, wait=False)
        ck.save(2, _tree(2.0, rows=3 << 20, noise=True), {}, {"step": 2}, wait=False)
    files = json.loads((tmp_path / "2" / CHECKSUMS).read_text())["files"]
    for name, (size, digest) in files.items():
        data = (tmp_path / "2" / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, digest), name
    name, (size, _) = max(files.items(), key=lambda kv: kv[1][0])
    assert size > _CHUNK + 12345, files
    with open(tmp_path / "2" / name, "r+b") as f:
        f.seek(size - 12345)
        byte = f.read(1)
        f.seek(size - 12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(CheckpointError, match=f"{name} does not match its sha256"):
            ck.restore(2, abstract(_tree(0.0, rows=3 << 20)), {})
        _, _, meta = ck.restore(None, abstract(_tree(0.0)), {})
    assert meta == {"step": 1}
    assert "checkpoint step 2" in capfd.readouterr().err
