"""The certificate of one plan on one model: its float32 and float64 runs beside one device's
(``meshkit.verify.reference``), the checks and their bounds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshkit.spec import ParallelSpec
from meshkit.train import PlanReport, Trainer
from meshkit.verify import compare
from meshkit.verify.compare import (
    TOL_EXACT,
    TOL_FLOAT64,
    _float_leaves,
    bitwise_equal,
    relative_difference,
)
from meshkit.verify.meshes import bitwise_meshes
from meshkit.verify.reference import _probe, _Reference
from meshkit.verify.workloads import Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class Certificate:
    """What ``meshkit verify`` proves about one plan on one model."""

    plan: str
    model: str
    steps: int
    accumulate: int
    exact_vs_single_device: float | None
    """Plan vs one device after K steps, both in float64 (None without a float64 twin)."""
    state_exact_vs_single_device: float | None = None
    """The same for the model's state (mutated collections: batch statistics); None without state
    or without a float64 twin."""
    first_step: float
    """The plan's float32 first step (its optimizer state after one step) vs ``first_step_vs``."""
    first_step_vs: str
    """'float64', 'one device in float32' (no float64 twin, or one drawing other random numbers),
    or why the first step is not checked."""
    first_step_noise: float | None
    """One device's own float32 first-step error: the largest over the batch orders."""
    first_step_bound: float | None
    """``TAIL * sqrt(1 + (partial_sums - 1) / log2(examples)) * first_step_noise``."""
    partial_sums: int
    """Partial sums the plan splits a gradient into: devices x micro-batches."""
    examples: int
    orders: int
    """Batch orders one device ran that are the same function as the given one."""
    vs_single_device: float
    """float32 plan vs one device after K steps (informational: see the module docstring)."""
    bitwise_vs_single_device: bool
    float32_noise: float | None
    """One device after K steps, float32 vs float64 (informational)."""
    float32_spread: float | None
    """One device after K steps in float32, reordered batches vs the given order: how far a correct
    reordering alone moves K float32 steps (informational)."""
    vs_float64: float | None
    """float32 plan after K steps vs NumPy float64 (linear, MLP)."""
    float64_twin: str | None
    """Why the model has no float64 twin, or None when it has one."""
    reproducible: bool
    final_loss: float
    report: PlanReport
    bitwise_across_meshes: dict[str, bool] | None = None
    """Deterministic mode: each mesh of ``comparison_meshes`` (``data=N`` on the first N devices, of each
    process's own under ``meshkit launch``) -> whether its K steps have the plan's bits, and on several
    processes ``2 processes x 4`` -> whether every process gathered the same bits of the plan's run
    (``bitwise_meshes``); None otherwise."""

    @property
    def checks(self) -> dict[str, bool]:
        out = {}
        if self.exact_vs_single_device is not None:
            out["float64: plan = one device"] = self.exact_vs_single_device <= TOL_EXACT
        if self.state_exact_vs_single_device is not None:
            out["float64: state = one device"] = self.state_exact_vs_single_device <= TOL_EXACT
        if self.first_step_bound is not None:
            out["float32: first step within rounding"] = self.first_step <= self.first_step_bound
        if self.vs_float64 is not None:
            out["float32: matches NumPy float64"] = self.vs_float64 <= TOL_FLOAT64
        out["bitwise reproducible"] = self.reproducible
        if self.bitwise_across_meshes is not None:
            out["bitwise across meshes"] = all(self.bitwise_across_meshes.values())
        out["communication = model"] = all(r.ok for r in self.report.communication)
        out["memory = formula"] = all(r.ok for r in self.report.memory)
        if self.report.pipeline is not None:
            out["executed schedule = model (bubble)"] = self.report.pipeline.ok
        return out

    @property
    def ok(self) -> bool:
        return all(self.checks.values())

    def to_json(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "report"}
        return {**fields, "checks": self.checks, "ok": self.ok, "report": self.report.to_json()}


def _bound(noise: float | None, partial_sums: int, examples: int) -> float | None:
    if noise is None:
        return None
    return compare.TAIL * math.sqrt(1 + (partial_sums - 1) / max(1.0, math.log2(examples))) * noise


def _trainer(w: Workload, opt: optax.GradientTransformation, spec: ParallelSpec, mesh: Any = None) -> Trainer:
    """A Trainer of ``w`` under ``spec``, or with the spec's options on another ``mesh`` (a ``jax.sharding.Mesh``:
    deterministic mode's meshes)."""
    layout: dict[str, Any] = {"spec": spec}
    if mesh is not None:
        pipeline = {k: getattr(spec, k) for k in ("microbatches", "pipeline_schedule", "virtual_stages")}
        layout = {
            "plan": spec.plan,
            "mesh": mesh,
            "remat": spec.remat,
            "compute_dtype": spec.compute_dtype,
            "deterministic": spec.deterministic,
            **pipeline,
        }
    model = {"logical_axes": w.logical_axes, "rules": w.rules, "units": w.units, "has_aux": w.has_aux}
    return Trainer(
        w.loss_fn,
        w.params,
        opt,
        **layout,
        **model,
        state=w.state,
        rng=w.rng,
        tokens_per_example=w.tokens_per_example,
    )


def _certify(
    w: Workload, optimizer: optax.GradientTransformation, spec: ParallelSpec, steps: int, ref: _Reference
) -> Certificate:
    """Train ``w`` under ``spec`` (float32, again from the same start, float64) beside ``ref``."""
    probe = _probe(optimizer, w.params)

    def trainer(w: Workload, opt: optax.GradientTransformation = optimizer, mesh: Any = None) -> Trainer:
        return _trainer(w, opt, spec, mesh)

    def train(t: Trainer, steps: int) -> tuple[list[np.ndarray], float]:
        first, loss = [], jnp.nan
        for i in range(steps):
            loss = t.step(w.batch)["loss"]
            if i == 0:
                first = _float_leaves(t.opt_state)
        return first, float(loss)

    first32 = trainer(w)
    first, loss = train(first32, steps)
    if probe is not optimizer:
        first, _ = train(trainer(w, probe), 1)
    again = trainer(w)  # the same compiled program from the same start
    again._compiled = first32._compiled
    train(again, steps)
    exact = exact_state = None
    if ref.twin is not None:
        with jax.enable_x64(True):
            t64 = trainer(ref.twin)
            for _ in range(steps):
                t64.step(ref.twin.batch)
            exact = relative_difference(t64.params, ref.run64.params)
            if _float_leaves(ref.run64.state):
                exact_state = relative_difference(_float_leaves(t64.state), _float_leaves(ref.run64.state))
    single, *others = ref.runs
    partial_sums = spec.deterministic or first32.num_devices * first32.assembled.microbatches
    across = None
    if spec.deterministic is not None:

        def on(mesh: Any) -> Any:
            t = trainer(w, mesh=mesh)
            train(t, steps)
            return t.params

        across = bitwise_meshes(first32.params, on, spec)
    examples = int(jax.tree.leaves(w.batch)[0].shape[0])
    spread = [relative_difference(r.params, single.params) for r in others]
    return Certificate(
        plan=spec.plan,
        model=w.name,
        steps=steps,
        accumulate=spec.accumulate,
        exact_vs_single_device=exact,
        state_exact_vs_single_device=exact_state,
        first_step=relative_difference(first, ref.first),
        first_step_vs=ref.first_vs,
        first_step_noise=ref.noise,
        first_step_bound=_bound(ref.noise, partial_sums, examples),
        partial_sums=partial_sums,
        examples=examples,
        orders=len(ref.runs),
        vs_single_device=relative_difference(first32.params, single.params),
        bitwise_vs_single_device=bitwise_equal(first32.params, single.params),
        float32_noise=None if ref.run64 is None else relative_difference(single.params, ref.run64.params),
        float32_spread=max(spread) if spread else None,
        vs_float64=None if ref.numpy64 is None else relative_difference(first32.params, ref.numpy64),
        float64_twin=ref.float64_twin,
        reproducible=bitwise_equal(first32.params, again.params),
        final_loss=loss,
        report=first32.report(w.batch),
        bitwise_across_meshes=across,
    )
