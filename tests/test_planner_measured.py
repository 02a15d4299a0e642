"""The planner's time model calibrated on a chip (``meshkit.planner.measured``): fitted on what
``benchmarks/device_check.py`` measured on one TPU v5e (src/meshkit/planner/chips/tpu-v5e.json, 2026-12-06), checked on
the steps it timed besides, and read by ``meshkit plan --calibration``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit._errors import MeshkitError
from meshkit.planner import measured
from meshkit.planner.cluster import Cluster, Job
from meshkit.planner.hardware import hardware
from meshkit.planner.layout import Layout
from meshkit.planner.predict import predict
from meshkit.planner.presets import preset
from meshkit.planner.stacks import CALIBRATION

ROOT = Path(__file__).resolve().parent.parent
V5E = ROOT / "src" / "meshkit" / "planner" / "chips" / "tpu-v5e.json"
V5E_05B = ROOT / "docs" / "device" / "tpu-v5e-0.5b.json"  # another size, the same chip, the same day


@pytest.fixture(scope="module")
def chip():
    return measured.from_device_check(json.loads(V5E.read_text()), others=(json.loads(V5E_05B.read_text()),))


def test_the_fitted_efficiency_predicts_the_measured_step_and_the_other_steps_within_ten_percent(chip):
    assert chip.hardware.name == "tpu-v5e"
    assert 0.5 < chip.efficiency < 1.0  # a fraction of peak a matmul-bound layer reaches
    assert chip.fitted.ratio == pytest.approx(1.0, abs=1e-3)
    assert chip.fitted.measured_s == pytest.approx(0.1616, abs=1e-3)  # the file's own figure
    small, other = chip.checks  # not fitted on, predicted: one sequence instead of two; a 0.5 B Llama
    assert "0.7b Llama, 1 x 2048" in small.label and "0.5b Llama, 4 x 2048" in other.label
    assert abs(small.ratio - 1) < 0.10 and abs(other.ratio - 1) < 0.10, chip.checks


def test_a_chips_efficiency_prices_its_own_hardware_only(chip):
    shape, job = preset("llama-7b"), Job(global_batch=64)
    lay = Layout(dp=64, zero=3, remat="layer")
    on = {name: Cluster(hardware=hardware(name), devices=64) for name in ("tpu-v5e", "h100")}
    v5e, v5e_cal = (predict(shape, lay, on["tpu-v5e"], job, calibration=c) for c in (None, chip.calibration))
    assert v5e_cal.efficiency_source.startswith("measured on one tpu-v5e")
    assert v5e_cal.efficiency / v5e.efficiency == pytest.approx(
        chip.efficiency / CALIBRATION.efficiency["maxtext-xla/tpu"]
    )
    assert v5e_cal.step_time_s != v5e.step_time_s
    h100, h100_cal = (predict(shape, lay, on["h100"], job, calibration=c) for c in (None, chip.calibration))
    assert h100_cal.step_time_s == h100.step_time_s and h100_cal.efficiency_source == h100.efficiency_source


def test_a_calibration_file_round_trips_and_a_wrong_file_is_one_line(chip, tmp_path):
    own = tmp_path / "cal.json"
    own.write_text(json.dumps(chip.calibration.to_json()))
    assert measured.load(own) == chip.calibration
    assert measured.load(V5E) == chip.calibration
    assert "tpu-v5e" in measured.shipped() and measured.load("tpu-v5e") == chip.calibration  # by name
    for text, says in (("[1, 2]", "neither"), ("{", "not JSON")):
        (bad := tmp_path / "bad.json").write_text(text)
        with pytest.raises(MeshkitError, match=says):
            measured.load(bad)
    with pytest.raises(MeshkitError, match=r"no such file, and no chip meshkit ships \(those: .*tpu-v5e"):
        measured.load(tmp_path / "absent.json")
    cpu = dict(json.loads(V5E.read_text()), device_kind="cpu")
    with pytest.raises(MeshkitError, match="no accelerator"):
        measured.from_device_check(cpu)


def test_a_run_on_several_devices_is_priced_per_device():
    data = dict(json.loads(V5E.read_text()), devices=8, batch=16)  # device_check's batch is the global one
    _, layout, cluster, job = measured._setup(data, measured._per_device(data))
    assert (layout.dp, layout.microbatch_size, job.global_batch, cluster.devices) == (8, 2, 16, 8)


def test_another_chips_file_is_refused_as_a_check(chip):
    data = json.loads(V5E.read_text())
    other = dict(data, device_kind="NVIDIA H100 80GB HBM3")
    with pytest.raises(MeshkitError, match="not a tpu-v5e"):
        measured.from_device_check(data, others=(other,))
    again = measured.from_device_check(data, others=(data,))
    assert again.checks[-1] == chip.fitted  # the fitted step, checked, is predicted exactly


def test_meshkit_plan_prices_with_the_chips_calibration(tmp_path):
    run = lambda *extra: subprocess.run(  # noqa: E731
        [str(Path(sys.executable).parent / "meshkit"), "plan", "--model", "llama-7b", "--hardware", "tpu-v5e", "--devices", "64",
         "--global-batch", "64", "--top", "1", "--json", *extra],
        capture_output=True, text=True, cwd=tmp_path, check=False,
    )  # fmt: skip
    plain, calibrated = run(), run("--calibration", "tpu-v5e")
    assert plain.returncode == 0 and calibrated.returncode == 0, calibrated.stderr
    a, b = json.loads(plain.stdout)["stack"], json.loads(calibrated.stdout)["stack"]
    assert "published" in a["efficiency_source"] and b["efficiency_source"].startswith(
        "measured on one tpu-v5e"
    )
    bad = run("--calibration", str(tmp_path / "absent.json"))
    assert bad.returncode != 0 and "Traceback" not in bad.stderr + bad.stdout
    assert "--calibration" in bad.stdout + bad.stderr and "no such file" in bad.stdout + bad.stderr
