"""The planner's time model calibrated on a chip at hand: what ``benchmarks/device_check.py`` measured.

The published runs (``planner.calibrate``) set one matmul efficiency per software stack and hardware
family; a measurement on one chip sets it for that chip's hardware (``tpu-v5e``), where it takes
precedence (``Calibration.efficiency_of``). ``device_check`` trains a Llama on every device present and
writes its step time; the efficiency is the one at which the planner's prediction of that very step
(the Llama's shape, fsdp over the devices, the run's batch, remat and precision, meshkit's runtime)
equals the measured time. Every other step it timed (one sequence instead of the batch; another size
in another file) is then predicted with it and set beside its measurement: that is the check.

    meshkit plan --calibration tpu-v5e ...          # a chip meshkit ships (planner/chips/tpu-v5e.json)
    meshkit plan --calibration device_check.json ...  # what device_check wrote on yours

meshkit ships the chips it was measured on (``CHIPS``): ``tpu-v5e``, one TPU v5e of 2026-12-06.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.planner.cluster import Cluster, Job
from meshkit.planner.hardware import Hardware, for_device
from meshkit.planner.layout import Layout, ModelShape
from meshkit.planner.stacks import CALIBRATION, Calibration

CHIPS = Path(__file__).resolve().parent / "chips"
"""device_check's JSON of each chip meshkit was measured on, by hardware name (``--calibration tpu-v5e``)."""
FITTED_RUN = "meshkit_fused"
"""The ``device_check`` run the efficiency is fitted on: meshkit's step at the chosen batch."""
CHECKED_RUNS = {"meshkit_fused_small": 1}
"""Other runs of the same file, by name, and the sequences per device each ran."""


@dataclass(frozen=True, kw_only=True)
class Timed:
    """One measured step beside the calibrated prediction of it."""

    label: str
    measured_s: float
    predicted_s: float

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.measured_s


@dataclass(frozen=True, kw_only=True)
class ChipCalibration:
    """The calibration a chip's measurement gives, and how well it predicts that chip's steps."""

    hardware: Hardware
    efficiency: float
    calibration: Calibration
    fitted: Timed
    checks: list[Timed] = field(default_factory=list)


def _setup(data: dict, batch: int) -> tuple[ModelShape, Layout, Cluster, Job]:
    model, devices = data["model"], int(data.get("devices", 1))
    hw = for_device(str(data.get("device_kind", "")))
    if hw is None:
        raise MeshkitError(
            f"device kind {data.get('device_kind')!r} is no accelerator of the planner's table: "
            f"a calibration needs a device_check run on a GPU or TPU"
        )
    shape = ModelShape(
        name=f"llama-{data.get('size', 'device-check')}",
        family="llama",
        layers=model["layers"],
        width=model["width"],
        heads=model["heads"],
        kv_heads=model.get("kv_heads", 0),
        ffn=model["ffn"],
        gated=True,
        vocab=model["vocab_size"],
        seq=int(data["seq"]),
    )
    layout = Layout(
        dp=devices,
        zero=3 if data.get("plan") == "fsdp" and devices > 1 else 0,
        remat=data["remat"],
        microbatch_size=batch,
    )
    job = Job(global_batch=batch * devices, precision=data["precision"], runtime="meshkit")
    return shape, layout, Cluster(hardware=hw, devices=devices, devices_per_host=devices), job


def _per_device(data: dict) -> int:
    """Sequences per device of device_check's run (its ``batch`` is the global one, over ``devices``)."""
    return int(data["batch"]) // int(data.get("devices", 1))


def _predicted_s(data: dict, batch: int, calibration: Calibration) -> float:
    from meshkit.planner.predict import predict

    shape, layout, cluster, job = _setup(data, batch)
    p = predict(shape, layout, cluster, job, calibration=calibration)
    if not p.valid:
        raise MeshkitError(f"the planner cannot price the measured step ({p.why}): not a calibration")
    return p.step_time_s


def with_efficiency(
    hw: Hardware, efficiency: float, source: str, base: Calibration = CALIBRATION
) -> Calibration:
    """``base`` with ``efficiency`` for the ``maxtext-xla`` stack (what meshkit runs) on ``hw``."""
    key = f"maxtext-xla/{hw.name}"
    return replace(
        base, efficiency={**base.efficiency, key: efficiency}, sources={**base.sources, key: source}
    )


def from_device_check(data: dict, *, others: tuple[dict, ...] = ()) -> ChipCalibration:
    """The efficiency at which the planner predicts ``device_check``'s measured step exactly (bisection:
    the step time falls as the efficiency rises), and the prediction of every other step timed in
    ``data`` and in ``others`` (more device_check JSONs from the same hardware) with it."""
    runs = data.get("runs", {})
    if FITTED_RUN not in runs or "step_s" not in runs[FITTED_RUN]:
        raise MeshkitError(
            f"no timed '{FITTED_RUN}' run in the file: is it benchmarks/device_check.py's JSON?"
        )
    hw = _setup(data, 1)[2].hardware
    measured, batch = float(runs[FITTED_RUN]["step_s"]), _per_device(data)
    source = (
        f"measured on one {hw.name} ({data.get('device_kind')}, JAX {data.get('jax', '?')}): "
        f"benchmarks/device_check.py's step of a {data.get('size', '')} Llama"
    )
    lo, hi = 0.01, 1.5
    for _ in range(60):
        mid = (lo + hi) / 2
        if _predicted_s(data, batch, with_efficiency(hw, mid, source)) > measured:
            lo = mid
        else:
            hi = mid
    eff = (lo + hi) / 2
    cal = with_efficiency(hw, eff, source)
    if abs(_predicted_s(data, batch, cal) / measured - 1) > 1e-3:
        raise MeshkitError(
            f"no efficiency in (0.01, 1.5] predicts the measured {measured * 1e3:.1f} ms step: the planner's "
            f"other terms alone exceed it"
        )

    def timed(d: dict, run: str, b: int) -> Timed:
        label = f"{d.get('size', '')} Llama, {b} x {d['seq']} per device, remat {d['remat']} ({run})"
        return Timed(
            label=label, measured_s=float(d["runs"][run]["step_s"]), predicted_s=_predicted_s(d, b, cal)
        )

    checks = [timed(data, run, b) for run, b in CHECKED_RUNS.items() if "step_s" in runs.get(run, {})]
    for other in others:
        if for_device(str(other.get("device_kind", ""))) != hw:
            raise MeshkitError(
                f"{other.get('device_kind')} is not a {hw.name}: check a calibration on its own chip"
            )
        checks.append(timed(other, FITTED_RUN, _per_device(other)))
    return ChipCalibration(
        hardware=hw, efficiency=eff, calibration=cal, fitted=timed(data, FITTED_RUN, batch), checks=checks
    )


def shipped() -> list[str]:
    """The chips meshkit ships a measurement of (``--calibration NAME``)."""
    return sorted(p.stem for p in CHIPS.glob("*.json"))


def load(path: str | Path) -> Calibration:
    """``meshkit plan --calibration``'s file: a ``device_check`` JSON (fitted here), a calibration's own
    JSON (``Calibration.to_json``), or the name of a chip meshkit ships (``shipped``); refused in one line
    where it is none of these."""
    path = Path(path)
    if not path.exists() and str(path) in shipped():
        path = CHIPS / f"{path}.json"
    try:
        data: Any = json.loads(path.read_text())
    except FileNotFoundError:
        raise MeshkitError(
            f"--calibration {path}: no such file, and no chip meshkit ships (those: {', '.join(shipped())})"
        ) from None
    except (OSError, ValueError) as e:
        raise MeshkitError(f"--calibration {path}: not JSON ({e})") from None
    if isinstance(data, dict) and "runs" in data and "model" in data:
        return from_device_check(data).calibration
    if isinstance(data, dict) and {"efficiency", "overlap_tax", "straggler"} <= data.keys():
        keys = ("efficiency", "overlap_tax", "straggler", "comm_efficiency", "sources")
        return Calibration(**{k: data[k] for k in keys if k in data})
    raise MeshkitError(
        f"--calibration {path}: neither benchmarks/device_check.py's JSON nor a calibration (efficiency, "
        f"overlap_tax, straggler)"
    )
