"""The planner beside published training runs: each run's layout predicted, its throughput compared,
and the one efficiency per hardware family fitted to them.

A run is a row of ``tests/corpus/published_runs.json`` (model shape, cluster, layout, measured
throughput, its source). Its ``planner`` entry says how the row maps onto the planner (fields the
source left out and what was assumed for them) or why it is left out (FP8 runs, context parallelism,
a batch that does not divide). Published throughput becomes tokens/s: given directly, from the step
time, or from a published MFU or TFLOP/s per device through the planner's own FLOP count (model
FLOPs for MFU; with recompute where the source counts recompute).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from meshkit._errors import MeshkitError
from meshkit.planner.hardware import hardware
from meshkit.planner.layout import Layout, ModelShape
from meshkit.planner.predict import (
    EFFICIENCY,
    Cluster,
    Job,
    Prediction,
    layer_flops,
    model_flops_per_token,
    predict,
)


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

    @property
    def family(self) -> str:
        return self.cluster.hardware.family

    def predict(self, efficiencies: dict[str, float] | None = None) -> Prediction:
        return predict(self.shape, self.layout, self.cluster, self.job, efficiencies=efficiencies)

    def ratio(self, efficiencies: dict[str, float] | None = None) -> float:
        """Predicted over published tokens/s."""
        return self.predict(efficiencies).tokens_per_s / self.published_tokens_per_s


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
                       kv_heads=get("kv_heads") or 0, head_dim=get("head_dim") or 0)  # fmt: skip
    pp = get("pp")
    layout = Layout(dp=get("dp"), tp=get("tp"), pp=pp, zero=get("zero") or 0,
                    microbatch_size=get("microbatch_size") or 1, schedule=_schedule(get("schedule"), pp),
                    virtual_stages=get("virtual_stages") or 1, remat=_remat(get("remat")))  # fmt: skip
    hw = hardware(get("device_type"))
    if plan.get("inter_host_gbps"):
        hw = replace(hw, inter_host_bytes_per_s=plan["inter_host_gbps"] * 1e9)
    cluster = Cluster(hardware=hw, devices=get("devices"), devices_per_host=get("devices_per_host") or 0)
    job = Job(global_batch=get("global_batch"), precision="bf16", flash_attention=bool(plan.get("flash", True)),
              dropout=bool(plan.get("dropout", False)), tp_overlap=float(plan.get("tp_overlap", 0.0)))  # fmt: skip
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
               published_tokens_per_s=float(published), basis=basis)  # fmt: skip


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


def fit(runs: list[Run]) -> dict[str, float]:
    """Per hardware family, the efficiency at which the geometric mean of predicted / published
    tokens/s over that family's runs is 1 (bisection: predicted throughput grows with efficiency)."""
    out = dict(EFFICIENCY)
    for family in sorted({r.family for r in runs}):
        mine = [r for r in runs if r.family == family]

        def log_mean(eff: float, mine=mine, family=family) -> float:
            effs = {**out, family: eff}
            return sum(math.log(r.ratio(effs)) for r in mine) / len(mine)

        lo, hi = 0.05, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if log_mean(mid) < 0 else (lo, mid)
        out[family] = round((lo + hi) / 2, 3)
    return out
