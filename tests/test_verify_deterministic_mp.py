"""`meshkit verify --deterministic` under `meshkit launch` (2 processes x 4 devices, gloo on localhost).

The plan runs on the global mesh; each process trains the same steps on meshes of its own devices
(data=1, 2, 4) and compares their bits with the plan's parameters gathered to it, and the row
"2 processes x 4" says every process gathered the same bits of the plan's run. The runs inherit the
suite's settings (compile cache, XLA's backend optimisations off), as tests/test_multiprocess.py's
verify does; tests/test_deterministic_mp.py covers XLA's default level through `meshkit train`."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from _limits import limit
from meshkit._errors import MeshkitError
from meshkit.spec import ParallelSpec

EXE = str(Path(sys.executable).parent / "meshkit")
LAUNCH = [EXE, "launch", "-n", "2", "--devices-per-process", "4", "--"]
VERIFY = [EXE, "verify", "--deterministic", "--steps", "2", "--json"]
# two processes start gloo and compile about ten small programs each: the costliest job's CPU seconds,
# measured, for its time limit (tests/_limits.py)
CPU_S = 11
ALL_EQUAL = {"data=1": True, "data=2": True, "data=4": True, "2 processes x 4": True}


def launched(*args: str) -> tuple[int, dict[int, dict], str]:
    """Run ``meshkit verify --deterministic ARGS`` on 2 processes x 4 devices: its exit status, each
    rank's JSON certificate (its stdout lines carry the ``[rank] `` prefix) and stderr."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([*LAUNCH, *VERIFY, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit(CPU_S))
    finally:
        if proc.poll() is None:  # a timeout: the launcher and the ranks it started, not just the launcher
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    certs = {}
    for rank in (0, 1):
        text = "".join(line[4:] for line in out.splitlines(True) if line.startswith(f"[{rank}] "))
        if "{" in text:
            certs[rank] = json.loads(text[text.index("{") :])
    return proc.returncode, certs, out[-3000:] + err[-3000:]


# Tiers: dp is core; zero3 sweeps (its deterministic bits are core in test_deterministic.py).
@pytest.mark.parametrize("plan", ["dp", pytest.param("zero3", marks=pytest.mark.sweep)])
def test_every_mesh_row_has_the_bits_of_the_2_process_run(plan):
    code, certs, log = launched("--plan", plan, "--model", "linear")
    assert code == 0, log
    assert sorted(certs) == [0, 1], log
    for cert in certs.values():  # every process reaches the same verdict
        assert cert["bitwise_across_meshes"] == ALL_EQUAL
        assert cert["checks"]["bitwise across meshes"] is True and cert["ok"] is True
        assert cert["report"]["mesh"] == {"data": 8}


# A loss that depends on the process computing it (as one seeding dropout with jax.process_index()
# would): the 2-process run mixes two losses, each process alone trains on its own, so no mesh of one
# process has the plan's bits; the plan's own bits still agree between the processes (the gradient is
# summed on every device, and dp keeps a copy on each).
PER_PROCESS_LOSS = """
import jax
from meshkit import verify

def make():
    w = verify.workload("linear")
    scale = 1.0 + 1e-3 * jax.process_index()
    return {"loss": lambda p, b: scale * w.loss_fn(p, b), "params": w.params, "batch": w.batch}
"""


# Tiers: sweeps (moved when make test measured 22 min): meshkit verify --deterministic on 2 processes under
# meshkit launch, each mesh row against the plan's bits, is core in
# test_every_mesh_row_has_the_bits_of_the_2_process_run[dp], a failed check failing the certificate in
# test_verify.py's test_a_broken_step_fails_the_certificate, a path/to/file.py:function target (meshkit's
# user_code.resolve, as --model reads it) in test_grpo_train.py's --reward.
@pytest.mark.sweep
def test_a_loss_that_differs_between_processes_fails_the_local_rows(tmp_path):
    model = tmp_path / "per_process.py"
    model.write_text(PER_PROCESS_LOSS)
    code, certs, log = launched("--plan", "dp", "--model", f"{model}:make")
    assert code == 1, log
    assert sorted(certs) == [0, 1], log
    want = {"data=1": False, "data=2": False, "data=4": False, "2 processes x 4": True}
    for cert in certs.values():
        assert cert["bitwise_across_meshes"] == want
        assert cert["checks"]["bitwise across meshes"] is False and cert["ok"] is False


def test_uneven_devices_per_process_are_refused_in_one_line(monkeypatch):
    # each process compares meshes of its own devices: with 3 here and 5 there, the rows would differ
    from meshkit import verify

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "local_device_count", lambda: 3)
    with pytest.raises(
        MeshkitError, match=r"give every process as many \(--devices-per-process\), not 8 over 2"
    ):
        verify.check_meshes(ParallelSpec(plan="dp", deterministic=True))
    verify.check_meshes(ParallelSpec(plan="dp"))  # not deterministic: nothing to compare
