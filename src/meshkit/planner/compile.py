"""The planner's check: a layout's GPT training step compiled ahead of time on simulated CPU devices.

The analytic model (``meshkit.planner.predict``) predicts what a layout costs on a cluster far larger
than this machine; this module measures what XLA makes of the same layout: meshkit's own step for
``layout.meshkit_plan()`` on ``layout.mesh_spec()``, compiled from abstract shapes (the parameters
are ``jax.eval_shape`` of the GPT's init in its scanned form, the batch a ``ShapeDtypeStruct``;
nothing is allocated), AdamW, bf16 compute when the job says bf16, exactly as ``meshkit train``
builds it (clipping, gradient norm, units of heads; pipeline plans through their schedule). It
reads the per-device peak (``memory_analysis()``: arguments + temporaries, the outputs alias the
donated parameters and optimizer state) and the collectives per mesh axis from meshkit's ledger.

The simulated device count is fixed when JAX starts its backend, so ``compile_layouts`` compiles
each layout in a fresh process (``python -m meshkit.planner.compile``), one after another (the
machine's cores go to XLA), with a progress bar and a per-compile timeout. A layout meshkit has
no plan for, or one its plans refuse, comes back as a ``Measured`` with ``error`` set (one line).

On CPU, XLA moves collectives of sub-32-bit floats as float32 (``Measured.comm_bytes`` are the
bytes as compiled here; a bf16 activation all-reduce or permute counts 4 bytes per element).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.planner.layout import Layout, ModelShape
from meshkit.spec import PRECISIONS, one_of

TIMEOUT_S = 900.0
"""Default limit per compile (a 1.3 B GPT over 64 simulated devices compiles in minutes)."""
CLIP = 1.0
"""``meshkit train``'s default global-norm clipping, compiled in as it runs."""
MEASURE_ONLY = {"xla_backend_optimization_level": 0}
"""Compiler options for a step compiled to be measured, never run: LLVM's optimization level (XLA:CPU's
code generation, after the HLO passes and buffer assignment) leaves the optimized HLO byte for byte
the same (checked on fsdp+tp with remat and dp+pp, bf16) and its memory figures with it, and the
compile takes about half the time (8 devices: 10-16 s -> 7-8 s per layout under load)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """One layout compiled (or why not): per-device bytes and collective traffic per step."""

    layout: Layout
    plan: str | None
    """The meshkit plan that ran it (None where meshkit has none)."""
    mesh: str
    error: str | None = None
    """One line: why the layout was not compiled (no plan, a plan's refusal, a timeout)."""
    argument_bytes: int = 0
    """Per device: parameters, optimizer state and the batch as the step takes them."""
    temp_bytes: int = 0
    """Per device: the compiler's temporaries (activations, gradients, gathered parameters, stash)."""
    output_bytes: int = 0
    alias_bytes: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    """The arguments by part: ``params``, ``optimizer``, ``batch`` (per-device shards), and ``temporaries``."""
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Per-device ring-model traffic per step, by mesh axes (``data``, ``model``, ``stage``,
    ``data+model``, ...), from meshkit's communication ledger of the compiled HLO, with the
    collectives inside a pipeline tick's forward or backward branch counted on the ``m v`` ticks a
    device runs that branch (the ledger, not knowing which branch runs, counts every tick)."""
    ledger_comm_bytes: dict[str, float] = field(default_factory=dict)
    """The same as the ledger counts it (every branch's collectives on every trip of their loop)."""
    comm_counts: dict[str, int] = field(default_factory=dict)
    """Collective executions per step, by the same keys."""
    compile_s: float = 0.0
    """Seconds to trace, lower and compile the step."""
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def peak_bytes(self) -> int:
        """Per-device peak: arguments + temporaries (what ``meshkit.analysis.peak`` measures)."""
        return self.argument_bytes + self.temp_bytes

    @property
    def total_comm_bytes(self) -> float:
        return float(sum(self.comm_bytes.values()))

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layout"] = self.layout.to_json()
        out["warnings"] = list(self.warnings)
        return {
            **out,
            "ok": self.ok,
            "peak_bytes": self.peak_bytes,
            "total_comm_bytes": self.total_comm_bytes,
        }

    @classmethod
    def from_json(cls, data: dict) -> Measured:
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in data.items() if k in names}
        return cls(
            **{**kept, "layout": Layout(**data["layout"]), "warnings": tuple(data.get("warnings", ()))}
        )


def failed(layout: Layout, why: str, compile_s: float = 0.0) -> Measured:
    return Measured(layout=layout, plan=layout.meshkit_plan(), mesh=layout.mesh_spec(), error=why,
                    compile_s=compile_s)  # fmt: skip


def _job_fields(job: Any) -> tuple[int, str]:
    """(global batch in sequences, precision) of the planner's job (any object with those attributes)."""
    batch, precision = int(job.global_batch), str(getattr(job, "precision", "fp32"))
    if precision not in PRECISIONS:
        raise MeshkitError(f"unknown precision {precision!r}: use {one_of(PRECISIONS)}")
    return batch, precision


def abstract_gpt_step(shape: ModelShape, layout: Layout, job: Any) -> tuple[Any, Any, dict[str, int], float]:
    """``(lowered step, mesh, per-device bytes of its params, optimizer and batch arguments, branch
    share)``: meshkit's step for ``layout`` on abstract GPT parameters and batch.

    The step ``meshkit train`` builds (``plans.assemble``, the Trainer's assembly, without allocating):
    the layout's ``ParallelSpec`` with the GPT's logical axes and whole heads, AdamW, clipping and the
    gradient norm, bf16 compute and (fsdp) bf16 gathers for bf16, the vocabulary split over the model
    axis (``tp_rules.vocab_rules``, every caller's default); pipeline plans with their schedule.

    The branch share is the fraction of a loop's trips on which a device runs each branch of a
    conditional in it: a pipeline's forward and backward branches run ``m v`` of the schedule's
    ticks each (1 without a pipeline)."""
    import jax
    import jax.numpy as jnp
    import optax

    from meshkit.models import gpt
    from meshkit.plans import assemble

    global_batch, precision = _job_fields(job)
    spec = layout.to_spec(global_batch, precision)
    if jax.device_count() < layout.devices:
        raise MeshkitError(
            f"{layout.label()} needs {layout.devices} devices, this process has {jax.device_count()}: "
            f"use compile_layouts (one process per layout)"
        )
    pipeline = spec.plan_info.pipeline
    cfg = gpt.GPTConfig.from_shape(shape, precision=precision, scan_layers=True)
    params = jax.eval_shape(lambda: gpt.init(jax.random.key(0), cfg))
    tokens = jax.ShapeDtypeStruct((global_batch, shape.seq), jnp.int32)
    step = assemble(gpt.stages(cfg) if pipeline else gpt.make_loss(cfg), params, optax.adamw(3e-4, weight_decay=0.01),
                    spec, devices=jax.devices()[: layout.devices], clip_norm=CLIP, grad_norm=True,
                    logical_axes=gpt.logical_axes(params), units={"heads": shape.heads})  # fmt: skip
    args = step.abstract_args(params, (tokens, tokens))
    lowered = step.step.lower(*args)
    parts = {"params": args[0], "optimizer": args[1], "batch": args[3]}
    s = step.pipeline.schedule if pipeline else None
    share = 1.0 if s is None else s.m * s.v / s.ticks
    return lowered, step.mesh, {k: _shard_bytes(v) for k, v in parts.items()}, share


def _shard_bytes(tree: Any) -> int:
    """Bytes of one device's shard of every leaf of an abstract tree with shardings."""
    import jax
    import numpy as np

    return int(sum(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))  # fmt: skip


def compile_layout(shape: ModelShape, layout: Layout, job: Any) -> Measured:
    """Compile ``layout``'s GPT step in this process (which must have ``layout.devices`` devices)
    and measure it; a layout meshkit cannot run comes back with ``error`` set."""
    from meshkit.analysis import communication, memory

    start = time.perf_counter()
    try:
        lowered, mesh, parts, share = abstract_gpt_step(shape, layout, job)
        compiled = lowered.compile(compiler_options=MEASURE_ONLY)
    except MeshkitError as e:
        return failed(layout, str(e).splitlines()[0], time.perf_counter() - start)
    seconds = time.perf_counter() - start
    mem = memory(compiled)
    ledger = communication(compiled, mesh=mesh)
    by = ledger.by_axes()
    executed: dict[str, float] = {}
    for r in ledger.records:  # a branch's collectives run on its share of the loop's trips
        bytes_ = (r.total_traffic_bytes or 0.0) * (share if r.in_conditional and r.in_loop else 1.0)
        executed[r.axes_label] = executed.get(r.axes_label, 0.0) + bytes_
    return Measured(
        layout=layout,
        plan=layout.meshkit_plan(),
        mesh=layout.mesh_spec(),
        argument_bytes=mem.argument_bytes,
        temp_bytes=mem.temp_bytes,
        output_bytes=mem.output_bytes,
        alias_bytes=mem.alias_bytes,
        parts={**parts, "temporaries": mem.temp_bytes},
        comm_bytes=executed,
        ledger_comm_bytes={k: float(v.traffic_bytes) for k, v in by.items()},
        comm_counts={k: int(v.executions) for k, v in by.items()},
        compile_s=seconds,
        warnings=ledger.warnings,
    )


# -- one process per layout -------------------------------------------------------------------------


def _request(shape: ModelShape, layout: Layout, job: Any) -> dict:
    global_batch, precision = _job_fields(job)
    return {"shape": dataclasses.asdict(shape), "layout": layout.to_json(),
            "job": {"global_batch": global_batch, "precision": precision}}  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    """The job as the child process needs it."""

    global_batch: int
    precision: str = "fp32"


def compile_in_subprocess(
    shape: ModelShape, layout: Layout, job: Any, *, timeout_s: float = TIMEOUT_S
) -> Measured:
    """``compile_layout`` in a fresh Python simulating ``layout.devices`` CPU devices."""
    try:  # no process to start for a layout meshkit cannot run
        layout.to_spec(job.global_batch, job.precision)
    except MeshkitError as e:
        return failed(layout, str(e))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "meshkit.planner.compile"], input=json.dumps(_request(shape, layout, job)),
                              capture_output=True, text=True, env=env, timeout=timeout_s, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return failed(layout, f"compile timed out after {timeout_s:.0f} s", time.perf_counter() - start)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return failed(
            layout, f"compile process failed (exit {done.returncode}): {tail}", time.perf_counter() - start
        )
    return Measured.from_json(json.loads(lines[-1]))


def compile_layouts(shape: ModelShape, layouts: Sequence[Layout], job: Any, *, progress: bool = True,
                    timeout_s: float = TIMEOUT_S, console: Any = None) -> list[Measured]:  # fmt: skip
    """Compile each layout in its own process, in order, with a progress bar (``progress``) and a
    limit of ``timeout_s`` per compile; each result's ``error`` says why a layout was not compiled."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    _job_fields(job)  # a bad job fails here, once, not in every child
    out: list[Measured] = []
    columns = (
        TextColumn("compiling {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task("", total=len(layouts))
        for layout in layouts:
            bar.update(task, description=f"{layout.label()} on {layout.devices} devices")
            m = compile_in_subprocess(shape, layout, job, timeout_s=timeout_s)
            out.append(m)
            if not m.ok:
                bar.console.print(
                    f"{layout.label()}: not compiled: {m.error}", highlight=False, soft_wrap=True
                )
            bar.advance(task)
    return out


def _main() -> None:
    """Child process: a request (JSON on stdin) in, one line of ``Measured`` JSON out."""
    request = json.loads(sys.stdin.read())
    layout = Layout(**request["layout"])
    from meshkit.devices import simulate_devices

    simulate_devices(layout.devices)
    shape = ModelShape(**request["shape"])
    result = compile_layout(shape, layout, _Job(**request["job"]))
    sys.stdout.write(json.dumps(result.to_json()) + "\n")


if __name__ == "__main__":
    _main()
