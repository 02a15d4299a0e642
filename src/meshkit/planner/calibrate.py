"""The planner beside published training runs: each run's layout predicted, its throughput compared,
and the calibration (``predict.Calibration``) fitted to them.

A run is a row of ``tests/corpus/published_runs.json`` (model shape, cluster, layout, software stack,
measured throughput, its source). Its ``planner`` entry says how the row maps onto the planner
(fields the source left out and what was assumed for them) or why it is left out (FP8 runs, context
parallelism, a batch that does not divide). Published throughput becomes tokens/s: given directly,
from the step time, or from a published MFU or TFLOP/s per device through the planner's own FLOP
count (model FLOPs for MFU; with recompute where the source counts recompute).

Every used row is in one of two disjoint sets (``split``): ``calibrate`` rows set the calibration
(``fit``: one efficiency per stack and hardware family, at which the geometric mean of predicted /
published over that cell's rows is 1; ``fit_scale``: the overlap tax and the straggler spread, the
grid point with the least squared log error over all calibration rows); ``check`` rows are only
predicted, and their errors are what the planner claims for the cost of scale.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from meshkit._errors import MeshkitError
from meshkit.planner.cluster import Cluster, Job
from meshkit.planner.hardware import hardware
from meshkit.planner.layout import Layout, ModelShape
from meshkit.planner.predict import Prediction, predict
from meshkit.planner.sizes import layer_flops, model_flops_per_token
from meshkit.planner.stacks import CALIBRATION, Calibration

SPLITS = ("calibrate", "check", "extrapolate")
"""What a published run is for: setting the calibration, checking the model where the calibration
covers it (a stack and hardware family with calibration runs of its own, the dense matmuls those
runs measure), or extrapolating where nothing calibrates it (mixtures of experts: grouped expert
matmuls, token permutations and load imbalance no calibration run shows), held to its own band."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One published run, as the planner sees it."""

    name: str
    source: str
    shape: ModelShape
    layout: Layout
    cluster: Cluster
    job: Job
    published_tokens_per_s: float
    basis: str
    """How the published tokens/s were obtained (tokens/s, step time, MFU, TFLOP/s)."""
    split: str
    """``calibrate`` (sets the calibration), ``check`` or ``extrapolate`` (only predicted; ``SPLITS``)."""
    shard_group: int = 0
    """ZeRO-3's shard group where the run shards within groups and replicates across (hybrid)."""

    @property
    def family(self) -> str:
        return self.cluster.hardware.family

    @property
    def cell(self) -> str:
        """``stack/family``: the runs that share one calibrated efficiency."""
        return f"{self.job.stack}/{self.family}"

    def predict(self, calibration: Calibration | None = None) -> Prediction:
        return predict(self.shape, self.layout, self.cluster, self.job, calibration=calibration,
                       shard_group=self.shard_group)  # fmt: skip

    def ratio(self, calibration: Calibration | None = None) -> float:
        """Predicted over published tokens/s."""
        return self.predict(calibration).tokens_per_s / self.published_tokens_per_s


def _schedule(text: str | None, pp: int) -> str:
    text = (text or "").lower()
    if pp == 1:
        return "1f1b"
    if "interleaved" in text:
        return "interleaved"
    return "gpipe" if "gpipe" in text else "1f1b"


def _remat(text: str | None) -> str:
    text = (text or "none").lower()
    if text.startswith("full"):
        return "layer"
    if text.startswith(("selective", "minimal")):
        return "dots"
    return "none"


def run(row: dict) -> Run | None:
    """A row as a Run, or None where its ``planner`` entry leaves it out."""
    plan = row.get("planner", {})
    if not plan.get("use", True):
        return None
    get = lambda k: plan.get(k, row.get(k))  # noqa: E731  (the planner entry overrides the row)
    shape = ModelShape(name=row["name"], layers=get("layers"), width=get("width"), heads=get("heads"),
                       vocab=get("vocab"), seq=get("seq"), ffn=get("ffn") or 0, gated=bool(get("gated")),
                       kv_heads=get("kv_heads") or 0, head_dim=get("head_dim") or 0, experts=get("experts") or 0,
                       experts_per_token=get("experts_per_token") or 2,
                       capacity_factor=get("capacity_factor") or 1.0)  # fmt: skip
    pp = get("pp")
    layout = Layout(dp=get("dp"), tp=get("tp"), pp=pp, cp=get("cp") or 1, ep=get("ep") or 1, zero=get("zero") or 0,
                    microbatch_size=get("microbatch_size") or 1, schedule=_schedule(get("schedule"), pp),
                    virtual_stages=get("virtual_stages") or 1, remat=_remat(get("remat")))  # fmt: skip
    hw = hardware(get("device_type"))
    if plan.get("inter_host_gbps"):
        hw = replace(hw, inter_host_bytes_per_s=plan["inter_host_gbps"] * 1e9)
    cluster = Cluster(hardware=hw, devices=get("devices"), devices_per_host=get("devices_per_host") or 0)
    job = Job(global_batch=get("global_batch"), precision="bf16", flash_attention=bool(plan.get("flash", True)),
              dropout=bool(plan.get("dropout", False)), tp_overlap=float(plan.get("tp_overlap", 0.0)),
              stack=get("stack"))  # fmt: skip
    if row.get("split") not in SPLITS:
        raise MeshkitError(
            f"published run {row['name']!r}: split {row.get('split')!r}, choose one of {SPLITS}"
        )
    tokens = job.global_batch * shape.seq
    if row.get("tokens_per_s"):
        published, basis = row["tokens_per_s"], "tokens/s"
    elif row.get("tokens_per_s_per_device"):
        published, basis = row["tokens_per_s_per_device"] * cluster.devices, "tokens/s per device"
    elif row.get("step_time_s"):
        published, basis = tokens / row["step_time_s"], "step time"
    elif row.get("mfu"):
        per_token = model_flops_per_token(shape)
        published, basis = row["mfu"] * hw.peak_flops * cluster.devices / per_token, "MFU"
    elif row.get("tflops_per_device"):
        per_token = model_flops_per_token(shape)
        if row.get("tflops_counts_recompute") and layout.remat == "layer":
            per_token += shape.layers * layer_flops(shape)
        published, basis = row["tflops_per_device"] * 1e12 * cluster.devices / per_token, "TFLOP/s per device"
    else:
        raise MeshkitError(f"published run {row['name']!r} has no throughput")
    return Run(name=row["name"], source=row["source"], shape=shape, layout=layout, cluster=cluster, job=job,
               published_tokens_per_s=float(published), basis=basis, split=row["split"],
               shard_group=plan.get("shard_group", 0))  # fmt: skip


def load(path: str | Path) -> tuple[list[Run], list[tuple[str, str]]]:
    """(the runs the planner uses, [(name, why left out)])."""
    rows = json.loads(Path(path).read_text())
    runs, skipped = [], []
    for row in rows:
        r = run(row)
        if r is None:
            skipped.append((row["name"], row.get("planner", {}).get("why", "")))
        else:
            runs.append(r)
    return runs, skipped


def log_error(runs: list[Run], calibration: Calibration | None = None) -> float:
    """Mean squared log of predicted / published over ``runs``."""
    return sum(math.log(r.ratio(calibration)) ** 2 for r in runs) / len(runs)


def _fit_cells(rows: list[Run], fixed: dict, tax: float, spread: float, comm: dict) -> dict[str, float]:
    """Efficiency per cell of ``rows`` at which each cell's geometric mean ratio is 1 (bisection:
    predicted throughput grows with efficiency)."""
    out: dict[str, float] = {}
    for cell in sorted({r.cell for r in rows}):
        mine = [r for r in rows if r.cell == cell]

        def log_mean(eff: float, mine=mine, cell=cell) -> float:
            cal = Calibration(efficiency={**fixed, **out, cell: eff}, overlap_tax=tax, straggler=spread,
                              comm_efficiency=comm)  # fmt: skip
            return sum(math.log(r.ratio(cal)) for r in mine) / len(mine)

        lo, hi = 0.05, 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if log_mean(mid) < 0 else (lo, mid)
        out[cell] = round((lo + hi) / 2, 3)
    return out


COMM_EFFICIENCIES = (1.0, 0.5, 0.25, 0.125, 0.0625)
"""The fractions of ring bandwidth ``fit`` tries for a stack's data-parallel collectives."""
COMM_GAIN = 0.01
"""A stack keeps the full ring bandwidth unless a lower fraction cuts its calibration runs' mean
squared log error by this much (a 10% rms error: runs whose communication shows, not noise)."""


def fit(runs: list[Run], *, overlap_tax: float | None = None, straggler: float | None = None) -> Calibration:
    """At the given overlap tax and straggler spread (default: the stated ones), per stack: the
    fraction of ring bandwidth its data-parallel collectives reach (``COMM_EFFICIENCIES``) and the
    efficiency of each hardware family it has calibration runs on, which make the geometric mean of
    predicted / published tokens/s 1 over each family's runs."""
    tax = CALIBRATION.overlap_tax if overlap_tax is None else overlap_tax
    spread = CALIBRATION.straggler if straggler is None else straggler
    mine = [r for r in runs if r.split == "calibrate"]
    efficiency: dict[str, float] = {}
    comm: dict[str, float] = {}
    for stack in sorted({r.job.stack for r in mine}):
        rows = [r for r in mine if r.job.stack == stack]
        best = None
        for c in COMM_EFFICIENCIES:
            cells = _fit_cells(rows, efficiency, tax, spread, {stack: c})
            err = log_error(rows, Calibration(efficiency=cells, overlap_tax=tax, straggler=spread,
                                              comm_efficiency={stack: c}))  # fmt: skip
            if best is None or err < best[0] - COMM_GAIN:
                best = (err, c, cells)
        efficiency.update(best[2])
        if best[1] != 1.0:
            comm[stack] = best[1]
    return Calibration(efficiency=efficiency, overlap_tax=tax, straggler=spread, comm_efficiency=comm)


TAXES = tuple(round(0.05 * i, 2) for i in range(15))
"""Overlap taxes ``fit_scale`` tries (0 to 0.7)."""
STRAGGLERS = tuple(round(0.005 * i, 3) for i in range(5))
"""Straggler spreads ``fit_scale`` tries (0 to 2% of a step per device)."""


def fit_scale(runs: list[Run], taxes=TAXES, stragglers=STRAGGLERS) -> Calibration:
    """``fit`` at every (overlap tax, straggler spread) of the grid; the one with the least squared log
    error over the calibration runs."""
    mine = [r for r in runs if r.split == "calibrate"]
    fits = [fit(runs, overlap_tax=t, straggler=s) for t in taxes for s in stragglers]
    return min(fits, key=lambda cal: log_error(mine, cal))
