"""Deterministic mode across processes: `meshkit train --deterministic` on 2 processes x 4 devices (under
`meshkit launch`, gloo on localhost) has the same bits as on 1 process x 8 devices and on 1 device.

The three runs compile at XLA's default optimisation (the suite turns most of it off for speed), as a
user's run does: the bits must not depend on how the backend fuses the step on each mesh."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from _limits import limit
from meshkit.train.outputs import load_run

EXE = str(Path(sys.executable).parent / "meshkit")
RUN = ["train", "--preset", "tiny", "--deterministic", "--steps", "5", "--batch-size", "8", "--eval-every", "0",
       "--sample-chars", "0", "--checkpoint-every", "5"]  # fmt: skip
# three cold compiles at XLA's default level (four processes) side by side: CPU seconds of the slower
# test's commands in all, measured (tests/_limits.py)
CPU_S = 50


def _run_all(tmp_path, runs):
    """Every command side by side (each writes its run directory ``tmp_path / name``); their outputs."""
    # a user's run: XLA's default optimisation, and fused multiply-adds as meshkit train sets them
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_DISABLE_MOST_OPTIMIZATIONS", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    procs = {
        n: subprocess.Popen([*cmd, "--run-dir", str(tmp_path / n)], env=env, **out) for n, cmd in runs.items()
    }
    try:
        timeout = limit(CPU_S)
        outs = {name: p.communicate(timeout=timeout)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:  # a timeout: the launcher and the ranks it started, not just the launcher
                os.killpg(p.pid, signal.SIGKILL)
    for name, p in procs.items():
        assert p.returncode == 0, (name, outs[name][-3000:])
    return outs


def _same_bits(tmp_path, reference, others):
    want = [np.asarray(x) for x in jax.tree.leaves(load_run(tmp_path / reference).params)]
    for name in others:
        got = [np.asarray(x) for x in jax.tree.leaves(load_run(tmp_path / name).params)]
        same = [a.tobytes() == b.tobytes() for a, b in zip(want, got, strict=True)]
        assert all(same), f"{name}: {same.count(False)} of {len(same)} leaves differ from {reference}"


# Tiers: this file sweeps; the bits of 2 processes beside one process's meshes are core in
# test_verify_deterministic_mp.py (at the suite's optimisation level). Deterministic mode at XLA's
# default level is checked here only, so by `make sweeps` (and CI), not by `make test`.
@pytest.mark.sweep
def test_2_processes_x_4_devices_same_bits_as_1_x_8_and_1_device(tmp_path):
    outs = _run_all(tmp_path, {
        "2x4": [EXE, "launch", "-n", "2", "--devices-per-process", "4", "--", EXE, *RUN, "--plan", "zero3"],
        "1x8": [EXE, *RUN, "--plan", "zero3", "--devices", "8"],
        "1x1": [EXE, *RUN, "--plan", "dp", "--devices", "1"],
    })  # fmt: skip
    assert "8 cpu in 2 process(es)" in outs["2x4"]
    _same_bits(tmp_path, "1x1", ("2x4", "1x8"))


@pytest.mark.sweep
def test_a_pipeline_on_2_processes_x_4_devices_has_the_bits_of_its_2_stages_alone(tmp_path):
    """dp+pp on stage=2 x data=4 over 2 processes (2 micro-batches per replica) beside stage=2 x data=1 in
    one process (8 micro-batches): the same 8 micro-shards added in the same tree."""
    pp = [*RUN, "--plan", "dp+pp", "--layers", "2"]
    outs = _run_all(tmp_path, {
        "2x4": [EXE, "launch", "-n", "2", "--devices-per-process", "4", "--", EXE, *pp],
        "1x2": [EXE, *pp, "--devices", "2"],
    })  # fmt: skip
    assert "8 cpu in 2 process(es)" in outs["2x4"] and "{'stage': 2, 'data': 4}" in outs["2x4"]
    _same_bits(tmp_path, "1x2", ("2x4",))
