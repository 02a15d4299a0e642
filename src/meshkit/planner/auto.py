"""``plan="auto"``: the plan to train with on the devices present, and one line saying which and why.

Two rules, by what is known about the model:

- meshkit's GPT by its shape (``meshkit train --plan auto``, which knows the batch and precision
  too): the planner's search (``planner.search``, ``Job(runtime="meshkit")``) over the layouts of
  the devices present, kept to those meshkit executes (``Layout.meshkit_plan()``; pipelines with
  whole layers per stage), ranked by predicted step time among those that fit. The
  devices are the planner's hardware entry named in their ``device_kind`` (an H100, an A100 80GB,
  a TPU v5p...); devices it does not know (CPU, simulated) are ranked as h100s, and the line says so.
- any other model (``Trainer(plan="auto")``: a loss and parameters, no shapes of layers or batch):
  the ZeRO ladder on one data axis by meshkit's cost model. Each of dp, zero1, zero2, fsdp gets its
  per-device parameters, gradients and optimizer state (``memory_formula``) and its bytes per step
  (``expected_collectives``); the plans whose state fits in half the memory the device reports
  (the other half left for activations, which a loss alone does not tell) are ranked by bytes
  moved, then by simplicity (dp, zero1, zero2, fsdp: fewer collectives), and the first is chosen. Where a device reports no memory limit (CPU)
  every plan fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.planner.layout import Layout, ModelShape
from meshkit.spec import PLANS, ParallelSpec, get_plan

LADDER = tuple(name for name, p in PLANS.items() if p.data and not (p.axes or p.hybrid) and name != "zero3")
"""The plans ``auto`` climbs for a loss without layers, on one data axis: dp, zero1, zero2, fsdp."""
STATE_SHARE = 0.5
"""Fraction of a device's memory the generic rule lets parameters, gradients and optimizer state take."""
STAND_IN = "h100"
"""The planner's hardware for devices it has no entry for (CPU)."""
_KINDS = {"h200": "h200", "h100": "h100", "a100-sxm4-80gb": "a100-80gb", "a100 80gb": "a100-80gb",
          "a100": "a100-40gb", "tpu v4": "tpu-v4", "tpu v5 lite": "tpu-v5e", "tpu v5e": "tpu-v5e",
          "tpu v5p": "tpu-v5p", "tpu v5": "tpu-v5p"}  # fmt: skip
"""Substrings of ``device_kind`` (lower case), most specific first, and the hardware they name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """The spec ``auto`` picked (plan, mesh and the options that go with it), and why."""

    spec: ParallelSpec
    why: str

    @property
    def plan(self) -> str:
        return self.spec.plan

    @property
    def mesh(self) -> str:
        return self.spec.mesh_text

    def line(self) -> str:
        return f"plan auto: {self.plan} on {self.mesh}: {self.why}"

    def to_json(self) -> dict:
        return {"spec": self.spec.to_json(), "why": self.why}


def hardware_of(device_kind: str) -> tuple[Any, bool]:
    """(the planner's hardware for a device kind, whether it is a stand-in)."""
    from meshkit.planner.hardware import hardware

    kind = device_kind.lower()
    for key, name in _KINDS.items():
        if key in kind:
            return hardware(name), False
    return hardware(STAND_IN), True


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def runnable(layout: Layout, shape: ModelShape) -> bool:
    """Whether meshkit's Trainer executes ``layout`` for the GPT of ``shape`` and meshkit's runtime model
    prices it (context and expert layouts are priced by the analytic model only: not chosen yet)."""
    if layout.meshkit_plan() is None or layout.cp > 1 or layout.ep > 1:
        return False
    if layout.pp > 1:
        return shape.layers % (layout.pp * layout.virtual_stages) == 0
    return layout.virtual_stages == 1


def choose_gpt(shape: ModelShape, *, global_batch: int, precision: str, devices: int | None = None,
               devices_per_host: int | None = None, device_kind: str | None = None) -> Choice:  # fmt: skip
    """The fastest predicted layout meshkit runs for the GPT of ``shape`` (default: the devices JAX has)."""
    import jax

    from meshkit.fmt import fmt_bytes
    from meshkit.planner.cluster import Cluster, Job
    from meshkit.planner.search import search

    devices = devices or jax.device_count()
    kind = device_kind or jax.devices()[0].device_kind
    hw, stand_in = hardware_of(kind)
    cluster = Cluster(
        hardware=hw, devices=devices, devices_per_host=devices_per_host or jax.local_device_count()
    )
    job = Job(global_batch=global_batch, precision=precision, runtime="meshkit", flash_attention=False)
    found = search(shape, cluster, job)
    ranked = [p for p in found.ranked if runnable(p.layout, shape)]
    if not ranked:
        closest = found.closest()
        more = f"; closest: {closest.layout.label()}, {closest.why}" if closest is not None else ""
        raise MeshkitError(
            f"plan auto: no layout meshkit runs fits this GPT on {devices} {hw.name} device(s){more}: "
            f"pick a smaller model or batch, or give --plan"
        )
    best = ranked[0]
    lay = best.layout
    on = f"{devices} {kind} device(s) as {hw.name}" + (
        ", a stand-in: the planner has no entry for them" if stand_in else ""
    )
    why = (f"{lay.label()}: predicted {_seconds(best.step_time_s)} per step, {fmt_bytes(best.peak_bytes)} per device "
           f"of {fmt_bytes(best.limit_bytes)} usable; fastest of {len(ranked)} layouts meshkit runs that fit ({on})")  # fmt: skip
    return Choice(spec=lay.to_spec(global_batch, precision), why=why)


def choose_generic(params: Any, optimizer: Any, *, logical_axes: Any = None, devices: int | None = None,
                   memory_limit: float | None = None) -> Choice:  # fmt: skip
    """dp, zero1, zero2 or fsdp on ``data=devices`` by the rule of the module docstring."""
    import jax

    from meshkit.fmt import fmt_bytes
    from meshkit.mesh import make_mesh
    from meshkit.plans import expected_collectives, memory_formula, place
    from meshkit.plans.memory import zero_stage

    devices = devices or jax.device_count()
    if memory_limit is None:
        stats = jax.local_devices()[0].memory_stats() or {}
        memory_limit = stats.get("bytes_limit")
    mesh = make_mesh(f"data={devices}", axis_types="auto", devices=jax.devices()[:devices])
    rows = []
    for name in LADDER:
        placement = place(params, get_plan(name), mesh, logical_axes=logical_axes)
        formula = memory_formula(placement, optimizer, params)
        rule = zero_stage(placement.plan.zero)
        grads = sum(x.nbytes / (rule.split("grads", devices) if x.data_dim is not None else 1)
                    for x in placement.flat())  # fmt: skip
        state = formula["params"] + formula["optimizer"] + grads
        moved = sum(e.traffic_bytes for e in expected_collectives(placement, 1, tokens_per_device=0))
        rows.append((moved, state, name))
    budget = None if memory_limit is None else STATE_SHARE * memory_limit
    order = {name: i for i, (_, _, name) in enumerate(rows)}  # among equal bytes, the simpler plan
    fits = sorted(
        (r for r in rows if budget is None or r[1] <= budget), key=lambda r: (round(r[0]), order[r[2]])
    )
    if not fits:
        least = min(rows, key=lambda r: r[1])
        raise MeshkitError(
            f"plan auto: parameters, gradients and optimizer state need {fmt_bytes(least[1])} per device even "
            f"under {least[2]}, over half of the {fmt_bytes(memory_limit)} a device has: use more devices or a "
            f"smaller model"
        )
    moved, state, name = fits[0]
    limit = "no memory limit reported" if budget is None else f"half of {fmt_bytes(memory_limit)}"
    others = ", ".join(f"{n} {fmt_bytes(b)}" for b, _, n in rows if n != name)
    why = (f"state (parameters, gradients, optimizer) {fmt_bytes(state)} per device fits ({limit}); fewest bytes "
           f"per step among the plans that fit: {fmt_bytes(moved)} (others: {others})")  # fmt: skip
    return Choice(spec=ParallelSpec(plan=name, mesh=f"data={devices}"), why=why)
