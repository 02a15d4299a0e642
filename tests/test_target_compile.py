"""A layout and a whole run compiled for a TPU slice from this CPU machine (issue 49): ``meshkit plan --target
v5e:2x2 --compile`` builds the model family's own step (here the Llama, splash attention) for libtpu's
compiler, and ``meshkit train --dry-run --target`` the run's; both report each chip's memory against its HBM,
the bytes moved per axis beside the planner's model, and one line where a step does not fit.

The compiles are XLA:TPU's own (libtpu 0.0.50.1, the version jax[tpu] 0.12.0.1 pins): a small Llama on a
2 x 2 v5e slice compiles in seconds; the anchors' pod-sized compiles run in ``make sweeps`` and
``scripts/measurements.py``.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshkit.planner.compile import Measured, compile_error, compile_in_subprocess, compile_layout, too_large
from meshkit.planner.layout import Layout, ModelShape

MESHKIT = str(Path(sys.executable).parent / "meshkit")
LLAMA = ModelShape(name="llama-small", layers=2, width=256, heads=4, vocab=512, seq=256, gated=True)


@dataclass(frozen=True)
class _Job:
    global_batch: int = 8
    precision: str = "bf16"


# Tiers: sweeps (moved when make test measured 22 min): the Llama's fsdp step compiled by XLA:TPU for v5e:2x2
# (TPU v5 lite, splash attention, the per-chip peak and each axis's bytes beside the planner's model) is core
# through meshkit plan in test_meshkit_plan_compiles_the_top_layout_for_a_target, the same layout on this
# CPU's simulated devices (the parts at rest) in test_planner_compile.py's layouts.
@pytest.mark.sweep
def test_a_layout_compiled_for_a_v5e_slice_is_the_llamas_own_step_with_splash():
    """The chips are libtpu's v5 lite; the step is the Llama's (its family, not a GPT stand-in), attending
    with the TPU's kernel; the per-chip peak is the compiler's own; the parameters and optimizer state at
    rest are the same shards as on simulated CPU devices (the placement does not depend on the platform)."""
    on_tpu = compile_layout(LLAMA, Layout(dp=4, zero=3), _Job(), target="v5e:2x2")
    on_cpu = compile_layout(LLAMA, Layout(dp=4, zero=3), _Job())
    assert on_tpu.ok and on_cpu.ok, (on_tpu.error, on_cpu.error)
    assert (on_tpu.platform, on_tpu.device_kind, on_tpu.attention) == ("tpu", "TPU v5 lite", ("splash",))
    assert on_cpu.platform == "cpu" and on_cpu.attention == ("einsum",)
    assert on_tpu.xla_peak_bytes and on_tpu.peak_bytes == on_tpu.xla_peak_bytes
    assert {k: on_tpu.parts[k] for k in ("params", "optimizer", "batch")} == {
        k: on_cpu.parts[k] for k in ("params", "optimizer", "batch")
    }
    # fsdp gathers the bf16 weights forward and backward and scatters the float32 gradient: XLA:TPU moves
    # bf16 as 2 bytes where XLA:CPU moves 4, so the TPU's data axis carries less than the CPU's
    assert 0 < on_tpu.comm_bytes["data"] < on_cpu.comm_bytes["data"]
    assert Measured.from_json(on_tpu.to_json()) == on_tpu


def test_a_plan_the_partitioner_splits_attends_with_xla_on_a_slice_from_a_one_device_process():
    # dp over 4 chips in one pass runs the partitioner's step, where a Pallas call cannot be split (JAX
    # refuses it at lowering): attention then takes XLA's. The slice's chip count decides, not the process's
    # (meshkit plan --target compiles in a child with one CPU device: it raised NotImplementedError there)
    m = compile_in_subprocess(LLAMA, Layout(dp=4, microbatch_size=2), _Job(global_batch=8), target="v5e:2x2")
    assert m.ok, m.error
    assert m.platform == "tpu" and m.attention == ("einsum",)


def test_a_step_larger_than_a_chips_hbm_is_one_line_from_the_compiler():
    big = ModelShape(name="big", layers=2, width=8192, heads=64, vocab=128256, seq=512, ffn=28672, gated=True,
                     kv_heads=8)  # fmt: skip
    m = compile_layout(big, Layout(dp=4), _Job(), target="v5e:2x2")
    assert not m.ok and m.no_fit and "\n" not in m.error
    assert m.error.startswith("does not fit: XLA:TPU needs ") and "a chip has 15.75 GiB of HBM" in m.error


def test_the_compilers_refusal_is_read_from_its_message_and_nothing_else():
    said = RuntimeError(
        "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
        "for HLO temporaries (74.26G) exceeds available HBM (15.75G). HLO module: jit_step."
    )
    assert too_large(said) == (
        "does not fit: XLA:TPU needs 74.26 GiB per chip for the step's temporaries alone, a chip has 15.75 GiB "
        "of HBM (CompileTimeHbmOom)"
    )
    assert too_large(RuntimeError("INVALID_ARGUMENT: bad sharding")) is None
    assert too_large(RuntimeError("RESOURCE_EXHAUSTED: host memory")) is None
    lay = Layout(dp=4)
    oom, other = (
        compile_error(lay, said, 1.0),
        compile_error(lay, NotImplementedError("\nMosaic: no.\nmore"), 1.0),
    )
    assert oom.no_fit and oom.error == too_large(said)
    assert not other.no_fit and other.error == "did not compile: NotImplementedError: Mosaic: no."


def _meshkit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return subprocess.run([MESHKIT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_meshkit_plan_compiles_the_top_layout_for_a_target(tmp_path):
    done = _meshkit("plan", "--model", "llama-7b", "--layers", "2", "--width", "256", "--heads", "4", "--vocab",
                    "512", "--seq", "256", "--ffn", "512", "--global-batch", "8", "--target", "v5e:2x2", "--layout", "dp=4",
                    "--zero", "3", "--compile", "1", "--json", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["target"] == "v5e:2x2" and out["cluster"]["devices"] == 4
    assert out["cluster"]["hardware"]["name"] == "tpu-v5e"
    (compiled,) = out["compiled"]
    assert compiled["ok"] and compiled["platform"] == "tpu" and compiled["fits"] is True
    assert compiled["attention"] == ["splash"] and compiled["plan"] == "fsdp"
    # the ring model's bytes for fsdp's gathers and scatters, beside the TPU program's
    predicted = compiled["predicted"]["comm_bytes"]["data"]
    assert compiled["comm_bytes"]["data"] == pytest.approx(predicted, rel=0.1)
    assert compiled["predicted"]["step_time_s"] > 0 and 0 < compiled["predicted"]["mfu"] < 1
    assert done.stderr == ""  # libtpu says nothing in the command's process or its compile's


def test_meshkit_plan_target_refuses_figures_that_contradict_it(tmp_path):
    done = _meshkit("plan", "--model", "llama-7b", "--target", "v5e:2x2", "--devices", "8", cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--target v5e:2x2 is 4 x tpu-v5e: drop --devices 8" in done.stderr + done.stdout


_RUN = ("train", "--model", "llama", "--layers", "2", "--width", "256", "--heads", "4", "--seq-len", "256",
        "--batch-size", "8", "--plan", "fsdp", "--mesh", "data=4", "--dry-run", "--target", "v5e:2x2")  # fmt: skip


def test_a_dry_run_compiles_the_runs_step_for_a_slice_and_writes_nothing(tmp_path):
    done = _meshkit(*_RUN, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "dry run: llama" in done.stdout and "fsdp on data=4, bf16, batch 8 x 256, for v5e:2x2" in done.stdout
    )
    assert (
        "compiled by XLA:TPU" in done.stdout and "fits: " in done.stdout and "of 15.75 GiB HBM" in done.stdout
    )
    assert list(tmp_path.iterdir()) == []  # no run directory, no runs/latest


def test_a_dry_run_of_a_step_too_large_says_so_and_fails(tmp_path):
    big = {"--width": "8192", "--heads": "64", "--plan": "dp"}
    done = _meshkit(*[big.get(flag, a) for flag, a in zip(("", *_RUN), _RUN, strict=False)], cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "does not fit: XLA:TPU needs" in done.stdout


def test_target_without_dry_run_is_refused(tmp_path):
    done = _meshkit("train", "--target", "v5e:2x2", cwd=tmp_path)
    assert done.returncode != 0 and "add --dry-run" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
