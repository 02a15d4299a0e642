"""MFU: the model's FLOP/s over every device's peak, in metrics.jsonl, report.json and the summary; the
peak from --peak-tflops, else from the table by JAX's device kind at the run's precision."""

import io
import json

import pytest
from rich.console import Console

from meshkit.cli import main
from meshkit.planner.hardware import HARDWARE, for_device, peak_flops
from meshkit.train import config as C
from meshkit.train.job import prepare
from meshkit.train.loop import train
from meshkit.train.plots import summary
from meshkit.train.results import results

# device_kind strings as JAX reports them: TPUs as jax/_src/pallas/mosaic (ChipVersion) and libtpu name
# them, GPUs as the CUDA driver does (nvidia-smi's names).
KINDS = {
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H200": "h200",
    "NVIDIA B200": "b200",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "TPU v4": "tpu-v4",
    "TPU v5 lite": "tpu-v5e",
    "TPU v5": "tpu-v5p",
    "TPU v6 lite": "tpu-v6e",
    "NVIDIA H100 PCIe": None,  # another part's clocks: the user gives its peak
    "TPU v4 lite": None,
    "cpu": None,
}


@pytest.mark.parametrize("kind", KINDS)
def test_device_kinds_map_to_the_table(kind):
    hw = for_device(kind)
    assert (hw and hw.name) == KINDS[kind]


def test_the_peak_is_the_users_or_the_tables_at_the_runs_precision():
    assert peak_flops("cpu", "fp32", 2.5) == (2.5e12, "--peak-tflops 2.5")
    assert peak_flops("NVIDIA H200", "bf16")[0] == HARDWARE["h200"].peak_flops
    assert peak_flops("NVIDIA H200", "fp32")[0] == HARDWARE["h200"].fp32_flops < HARDWARE["h200"].peak_flops
    peak, why = peak_flops("cpu", "fp32")
    assert peak is None and "--peak-tflops" in why


def _run(tmp_path, **kw):
    cfg = C.tiny().replace(run_dir=str(tmp_path / "run"), steps=3, eval_every=0, sample_chars=0, **kw)
    job = prepare(cfg)
    job.run_dir.mkdir(parents=True)
    assert train(job, Console(file=io.StringIO()))
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    return (
        job,
        json.loads(json.dumps(results(job))),
        [r for r in rows if "loss" in r],
    )  # as report.json holds it


def test_mfu_with_a_given_peak_is_the_model_flops_over_every_devices_peak(tmp_path):
    job, report, rows = _run(tmp_path, peak_tflops=1e-3)
    devices, peak = report["devices"], 1e-3 * 1e12
    assert report["peak_flops_per_device"] == peak and report["peak_source"] == "--peak-tflops 0.001"
    assert report["mfu"] == pytest.approx(
        report["tokens_per_s"] * report["model_flops_per_token"] / (devices * peak)
    )
    for row in rows:
        assert row["mfu"] == pytest.approx(
            row["tokens_per_s"] * report["model_flops_per_token"] / (devices * peak)
        )
    out = io.StringIO()
    summary(report, job.run_dir, Console(file=out, width=200))
    assert f"{report['mfu']:.1%} of {devices} x 0.0 TFLOP/s (--peak-tflops 0.001)" in out.getvalue()


def test_on_a_cpu_without_a_peak_mfu_is_absent_and_the_summary_says_how_to_get_it(tmp_path):
    job, report, rows = _run(tmp_path)
    assert report["mfu"] is None and report["peak_flops_per_device"] is None
    # the precision resolved by platform, the attention asked and the kernels it traced
    assert report["precision"] == "fp32" and report["attention"] == "auto"
    assert report["attention_kernels"] == ["einsum"]  # auto on a CPU: no flash kernel
    assert all("mfu" not in r for r in rows)
    out = io.StringIO()
    summary(report, job.run_dir, Console(file=out, width=200))
    assert "give --peak-tflops" in out.getvalue()


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_a_bad_peak_is_one_line_and_exit_2(tmp_path, capsys, value):
    assert main(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "r"), "--peak-tflops", value]) == 2
    err = capsys.readouterr().err.strip()
    assert "--peak-tflops must be a positive finite number" in err and "\n" not in err
    assert not (tmp_path / "r").exists()
