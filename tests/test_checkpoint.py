"""Checkpoints: round trip, resharding onto another plan, retention, errors, Ctrl-C and SIGKILL mid-save."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.mesh import make_mesh
from meshkit.models import gpt
from meshkit.train import Trainer
from meshkit.train.checkpoint import (
    CHECKSUMS,
    Checkpointer,
    CheckpointError,
    abstract,
    abstract_with,
    check_checksums,
)

META = {"step": 3, "data": {"epoch": 1, "position": 17}, "config_hash": "c0ffee", "metrics": {"loss": 1.25}}


def _state():
    mesh = make_mesh("data=4,model=2")
    rng = np.random.default_rng(0)
    host = {
        "w": rng.standard_normal((8, 16), dtype=np.float32),
        "b": rng.standard_normal((16,), dtype=np.float32),
        "layers": [{"k": rng.standard_normal((4, 8), dtype=np.float32)}],
    }
    specs = {"w": P("data", "model"), "b": P(), "layers": [{"k": P(None, "data")}]}
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), host, specs)
    opt_state = jax.jit(optax.adam(1e-3).init)(params)
    return params, opt_state


def _assert_same(got, want):
    """Bitwise-equal leaves, same tree structure."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), strict=True)


def _assert_shardings(tree, shardings):
    for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        assert a.sharding == s


def test_round_trip_same_mesh(tmp_path):
    params, opt_state = _state()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, params, opt_state, META)
        assert ck.latest_step() == 3
        got_params, got_state, meta = ck.restore(None, abstract(params), abstract(opt_state))
    _assert_same(got_params, params)
    _assert_same(got_state, opt_state)
    _assert_shardings(got_params, jax.tree.map(lambda a: a.sharding, params))
    _assert_shardings(got_state, jax.tree.map(lambda a: a.sharding, opt_state))
    assert meta == META


def _gpt_trainer(plan, mesh):
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=8)
    params = gpt.init(jax.random.key(0), cfg)
    kw = {"logical_axes": gpt.logical_axes(params)} if "tp" in plan else {}
    return Trainer(gpt.make_loss(cfg), params, optax.adam(1e-2), plan=plan, mesh=mesh, **kw)


def test_restore_onto_another_mesh_and_plan(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 64, size=(16, 17))
    batch = (tokens[:, :-1], tokens[:, 1:])
    fsdp = _gpt_trainer("fsdp", "data=8")
    fsdp.step(batch)
    fsdp.step(batch)
    saved = jax.device_get((fsdp.params, fsdp.opt_state))
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(2, fsdp.params, fsdp.opt_state, {"step": 2}, wait=False)
        loss_at_save = fsdp.step(batch)["loss"]  # donates the arrays being saved: the copy is already taken
        dptp = _gpt_trainer("dp+tp", "data=4,model=2")
        params_like = abstract_with(dptp.params, dptp.shardings.params)
        state_like = abstract_with(dptp.opt_state, dptp.shardings.opt_state)
        params, opt_state, meta = ck.restore(None, params_like, state_like)
    assert meta == {"step": 2}
    _assert_same(params, saved[0])
    _assert_same(opt_state, saved[1])
    _assert_shardings(params, dptp.shardings.params)
    _assert_shardings(opt_state, dptp.shardings.opt_state)
    assert any(s.spec != P() for s in jax.tree.leaves(dptp.shardings.params))  # really resharded
    dptp.params, dptp.opt_state = params, opt_state
    loss = dptp.step(batch)["loss"]
    assert np.isfinite(loss)
    np.testing.assert_allclose(loss, loss_at_save, rtol=1e-5)


def test_keep_deletes_old_steps(tmp_path):
    params, opt_state = _state()
    with Checkpointer(tmp_path, keep=2) as ck:
        for step in range(1, 5):
            ck.save(step, params, opt_state, {"step": step}, wait=step == 4)
        assert ck.all_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]
    assert not (tmp_path / ".deleted").exists()  # old steps are renamed there, then deleted
    with Checkpointer(tmp_path, keep=2) as ck:
        assert ck.all_steps() == [3, 4]
        assert ck.restore(3, abstract(params), abstract(opt_state))[2] == {"step": 3}


def test_errors_are_one_line(tmp_path):
    params, opt_state = _state()
    with Checkpointer(tmp_path / "empty") as ck, pytest.raises(CheckpointError) as e:
        ck.restore(None, abstract(params), abstract(opt_state))
    assert str(e.value) == f"no checkpoint in '{tmp_path / 'empty'}': train first, or drop --resume"

    wider = {**params, "layers": [{"k": jnp.zeros((4, 16))}]}
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, params, opt_state, {})
        with pytest.raises(
            CheckpointError,
            match=r"^params/layers/0/k is shape \(4, 8\) in the checkpoint but shape \(4, 16\) in the model",
        ) as e:
            ck.restore(1, abstract(wider), abstract(opt_state))
        assert "\n" not in str(e.value)
        with pytest.raises(
            CheckpointError,
            match=r"^opt_state/0/count is shape \(\) in the checkpoint but absent in the model",
        ):
            ck.restore(1, abstract(params), abstract(()))
        with pytest.raises(CheckpointError, match=r"^no checkpoint for step 7 in .*: it holds steps \[1\]$"):
            ck.restore(7, abstract(params), abstract(opt_state))
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError, match="step 1 is already saved"):
        ck.save(1, params, opt_state, {})
    with (
        Checkpointer(tmp_path / "ck") as ck,
        pytest.raises(CheckpointError, match=r"^meta must be JSON .*ArrayImpl"),
    ):
        ck.save(2, params, opt_state, {"loss": jnp.float32(1.5)})
    with pytest.raises(CheckpointError, match="keep must be at least 1"):
        Checkpointer(tmp_path / "ck", keep=0)


def _flip(path, count=64):
    """Invert ``count`` bytes in the middle of ``path``, keeping its size."""
    data = bytearray(path.read_bytes())
    middle = max(0, len(data) // 2 - count // 2)
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def _largest_array_file(step_dir):
    return max((step_dir / "params").rglob("d/*"), key=lambda f: f.stat().st_size)


def _damage(step_dir, how):
    """Damage a saved step the ways disks and interrupted copies do."""
    if how == "bytes flipped, size kept":
        _flip(_largest_array_file(step_dir))
    elif how == "array file missing":
        _largest_array_file(step_dir).unlink()
    elif how == "checksums damaged":
        _flip(step_dir / CHECKSUMS, count=8)
    elif how == "garbage in the array files":
        for f in (step_dir / "params").rglob("d/*"):
            f.write_bytes(os.urandom(20))
    elif how == "truncated manifest":
        for f in (step_dir / "params").rglob("manifest.ocdbt"):
            f.write_bytes(f.read_bytes()[:10])
    elif how == "meta missing":
        shutil.rmtree(step_dir / "meta")
    elif how == "meta not JSON":
        (step_dir / "meta" / "metadata").write_text("{not json")
    elif how == "empty step directory":
        shutil.rmtree(step_dir)
        step_dir.mkdir()


@pytest.mark.parametrize(
    "how",
    [
        "bytes flipped, size kept",
        "array file missing",
        "checksums damaged",
        "garbage in the array files",
        "truncated manifest",
        "meta missing",
        "meta not JSON",
        "empty step directory",
    ],
)
def test_an_unreadable_latest_step_falls_back_to_the_newest_intact_one(tmp_path, capsys, how):
    params, opt_state = _state()
    later = jax.tree.map(lambda a: a + 1, params)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, params, opt_state, {"step": 1})
        ck.save(2, later, opt_state, {"step": 2})
    _damage(tmp_path / "2", how)
    with Checkpointer(tmp_path) as ck:
        got, got_state, meta = ck.restore(None, abstract(params), abstract(opt_state))
        assert meta == {"step": 1}
        _assert_same(got, params)
        _assert_same(got_state, opt_state)
        assert ck.all_steps() == [1]
        ck.save(2, later, opt_state, {"step": 2})  # the number is free again
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("warning:")]
    assert line.startswith(f"warning: checkpoint step 2 in '{tmp_path}' cannot be read (")
    assert line.endswith("; trying step 1") and "moved to .unreadable/2-" in line and len(line) < 400
    assert "Traceback" not in err and "Event loop is closed" not in err
    (kept,) = (tmp_path / ".unreadable").iterdir()  # kept for inspection, nothing deleted
    assert kept.name.startswith("2-")


def test_unreadable_steps_given_or_all_are_one_line_errors(tmp_path, capsys):
    params, opt_state = _state()
    with Checkpointer(tmp_path) as ck:
        ck.save(1, params, opt_state, {"step": 1})
        ck.save(2, params, opt_state, {"step": 2})
    _damage(tmp_path / "2", "garbage in the array files")
    with (
        Checkpointer(tmp_path) as ck,
        pytest.raises(CheckpointError, match=r"^step 2 in .* cannot be read: ") as e,
    ):
        ck.restore(2, abstract(params), abstract(opt_state))
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
    assert (tmp_path / "2").is_dir()  # an explicit step is reported, not moved
    _damage(tmp_path / "1", "meta missing")
    with Checkpointer(tmp_path) as ck, pytest.raises(CheckpointError) as e:
        ck.restore(None, abstract(params), abstract(opt_state))
    assert str(e.value) == (
        f"no readable checkpoint in '{tmp_path}': steps [2, 1] are corrupt or partial (moved to .unreadable/): "
        "train again without --resume, or into a fresh --run-dir"
    )
    assert len(capsys.readouterr().err.splitlines()) == 2  # one warning per step


def test_flipped_bytes_are_named_by_their_checksum(tmp_path):
    """Bytes changed in place are caught by the checksums, naming the file; a step whose checksum file
    was deleted is unreadable, not read unchecked."""
    params, opt_state = _state()
    with Checkpointer(tmp_path) as ck:
        ck.save(1, params, opt_state, {"step": 1})
        ck.save(2, params, opt_state, {"step": 2})
    listed = json.loads((tmp_path / "1" / CHECKSUMS).read_text())["files"]
    on_disk = {str(f.relative_to(tmp_path / "1")) for f in (tmp_path / "1").glob("*/**/*") if f.is_file()}
    assert set(listed) == on_disk and any("/d/" in name for name in listed)  # every file of every item
    (tmp_path / "1" / CHECKSUMS).unlink()
    with Checkpointer(tmp_path) as ck, pytest.raises(CheckpointError) as e:
        ck.restore(1, abstract(params), abstract(opt_state))
    assert str(e.value) == (
        f"step 1 in '{tmp_path}' cannot be read: its {CHECKSUMS} is missing (every step meshkit saves has one)"
    )
    victim = _largest_array_file(tmp_path / "2")
    _flip(victim)
    with Checkpointer(tmp_path) as ck, pytest.raises(CheckpointError) as e:
        ck.restore(2, abstract(params), abstract(opt_state))
    assert str(e.value) == (
        f"step 2 in '{tmp_path}' cannot be read: {victim.relative_to(tmp_path / '2')} does not match its "
        "sha256: changed on disk since the save"
    )


def test_each_process_checks_the_files_it_wrote(tmp_path):
    """In a job of 2 processes, process 1 checks ``ocdbt.process_1/`` (and ``process_3/``, written by a
    4-process job), process 0 the rest: a file corrupt in process 1's share fails process 1 only."""
    step = tmp_path / "7"
    for name in ("params/ocdbt.process_1/d/a", "params/ocdbt.process_3/d/b", "params/d/c", "meta/metadata"):
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).write_bytes(name.encode())
    from meshkit.train.checkpoint import write_checksums

    write_checksums(step)
    _flip(step / "params/ocdbt.process_3/d/b", count=2)
    check_checksums(step, process=0, processes=2)
    with pytest.raises(Exception, match=r"^params/ocdbt.process_3/d/b does not match its sha256"):
        check_checksums(step, process=1, processes=2)
    with pytest.raises(Exception, match="process_3/d/b does not match"):
        check_checksums(step)  # one process checks everything


def test_opening_a_directory_to_read_deletes_nothing(tmp_path):
    """A live run's save in flight (its temporary step directory) and its trash survive a reader:
    listing and restoring never delete; the first save of a writer removes the unfinished step."""
    params, opt_state = _state()
    with Checkpointer(tmp_path) as ck:
        ck.save(1, params, opt_state, {"step": 1})
    in_flight = tmp_path / "2.orbax-checkpoint-tmp"
    (in_flight / "params").mkdir(parents=True)
    (in_flight / "params" / "half-written").write_bytes(b"x" * 100)
    (tmp_path / ".deleted" / "0").mkdir(parents=True)
    with Checkpointer(tmp_path) as ck:
        assert ck.all_steps() == [1] and ck.latest_step() == 1
        assert ck.restore(None, abstract(params), abstract(opt_state))[2] == {"step": 1}
    assert (in_flight / "params" / "half-written").is_file() and (tmp_path / ".deleted" / "0").is_dir()
    assert not (tmp_path / "never").exists()
    with Checkpointer(tmp_path / "never") as ck:  # a reader creates nothing either
        assert ck.all_steps() == []
    assert not (tmp_path / "never").exists()
    with Checkpointer(tmp_path) as ck:
        ck.save(3, params, opt_state, {"step": 3})
        assert ck.all_steps() == [1, 3]
    assert not in_flight.exists()  # the writer cleaned the unfinished step before saving


def test_save_in_a_keyboard_interrupt_handler(tmp_path, monkeypatch):
    """Ctrl-C while orbax starts a save is held until it has; the handler's save of that step finishes it."""
    params, opt_state = _state()
    start_save = ocp.CheckpointManager.save

    def interrupted(self, *args, **kwargs):
        started = start_save(self, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # lands before the Checkpointer has noted the save
        return started

    monkeypatch.setattr(ocp.CheckpointManager, "save", interrupted)
    # Python's own Ctrl-C handler, whatever an earlier test in this worker left installed (this test
    # failed once in a full run with "the Ctrl-C was lost"; not reproduced in 8 runs alone)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    ck = Checkpointer(tmp_path)
    try:
        ck.save(5, params, opt_state, {"step": 5}, wait=False)
        pytest.fail("the Ctrl-C was lost")
    except KeyboardInterrupt:
        ck.save(5, params, opt_state, {"step": 5}, wait=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    ck.close()
    with Checkpointer(tmp_path) as fresh:
        assert fresh.all_steps() == [5]
        _assert_same(fresh.restore(5, abstract(params), abstract(opt_state))[0], params)


# The child saves step 1, starts an asynchronous save of a large step 2, says so, and waits for it.
_CHILD = """
import sys
import jax
import numpy as np
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import NamedSharding, PartitionSpec as P
from meshkit.train.checkpoint import Checkpointer
directory, mib = sys.argv[1], int(sys.argv[2])
sh = NamedSharding(jax.make_mesh((8,), ("data",)), P("data"))
ck = Checkpointer(directory)
small = np.arange(64, dtype=np.float32).reshape(8, 8)
ck.save(1, {"w": jax.device_put(small, sh)}, {"mu": jax.device_put(-small, sh)}, {"step": 1})
big = np.random.default_rng(0).standard_normal((8, mib << 15), dtype=np.float32)
ck.save(2, {"w": jax.device_put(big, sh)}, {"mu": jax.device_put(-big, sh)}, {"step": 2}, wait=False)
print("saving", flush=True)
ck.wait()
print("saved", flush=True)
"""


def _kill_mid_save(directory, mib):
    """Run the child; SIGKILL it as soon as step 2 starts. True when step 2 was still being written."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), str(mib)], env=env, stdout=subprocess.PIPE, text=True
    )
    if not select.select([child.stdout], [], [], 120)[0]:
        child.kill()
        pytest.fail("the child printed nothing in 120 s")
    assert child.stdout.readline() == "saving\n", "the child failed before saving step 2"
    os.kill(child.pid, signal.SIGKILL)
    rest, _ = child.communicate()
    assert child.returncode == -signal.SIGKILL or (child.returncode == 0 and rest == "saved\n")
    names = {p.name for p in directory.iterdir()}
    return "2" not in names and any(n.startswith("2.orbax-checkpoint-tmp") for n in names)


def _like(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(make_mesh("data=8"), P("data")))


@pytest.mark.slow
def test_sigkill_mid_save_keeps_the_previous_step(tmp_path):
    small = np.arange(64, dtype=np.float32).reshape(8, 8)
    for attempt, mib in enumerate((32, 64, 128)):
        directory = tmp_path / str(attempt)
        landed = _kill_mid_save(directory, mib)
        with Checkpointer(directory) as ck:
            if not landed:  # step 2 finished first: it must be whole
                assert ck.all_steps() == [1, 2]
                big = np.random.default_rng(0).standard_normal((8, mib << 15), dtype=np.float32)
                params, opt_state, meta = ck.restore(None, {"w": _like(big.shape)}, {"mu": _like(big.shape)})
                np.testing.assert_array_equal(np.asarray(params["w"]), big)
                np.testing.assert_array_equal(np.asarray(opt_state["mu"]), -big)
                assert meta == {"step": 2}
                continue
            assert ck.latest_step() == 1
            params, opt_state, meta = ck.restore(None, {"w": _like((8, 8))}, {"mu": _like((8, 8))})
            np.testing.assert_array_equal(np.asarray(params["w"]), small)
            np.testing.assert_array_equal(np.asarray(opt_state["mu"]), -small)
            assert meta == {"step": 1}
            ck.save(2, params, opt_state, {"step": 2})  # the directory is usable again
        assert sorted(p.name for p in directory.iterdir() if "tmp" in p.name) == []
        return
    pytest.fail("every SIGKILL landed after step 2 was committed: raise the payload")


def test_orbax_noise_is_dropped_and_nothing_else():
    import logging

    from meshkit.train._orbax_noise import _OrbaxNoise

    keep = _OrbaxNoise()
    orbax_file = os.path.join(os.path.dirname(ocp.__file__), "checkpoint_manager.py")

    def record(path, level, msg, exc=None):
        return logging.LogRecord("absl", level, path, 1, msg, (1.4,), exc)

    wait = "Waiting for previous save to complete took %f seconds. If this number is high, consider checkpointing less frequently."
    assert not keep.filter(record(orbax_file, logging.WARNING, wait))  # meshkit waits on purpose
    assert not keep.filter(record(orbax_file, logging.ERROR, "save failed", (OSError, OSError("x"), None)))
    assert keep.filter(record(orbax_file, logging.WARNING, "another warning %f"))
    assert keep.filter(record(orbax_file, logging.ERROR, "an error without a traceback"))
    assert keep.filter(record("/elsewhere/train.py", logging.WARNING, wait))  # not orbax's: kept
