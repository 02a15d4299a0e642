"""The planner's check: a layout's training step compiled ahead of time, on simulated CPU devices or
for a TPU slice by libtpu's own compiler (``target``: ``v5e:16x16``, ``v5e-256``; no TPU needed).

The analytic model (``meshkit.planner.predict``) predicts what a layout costs on a cluster far larger
than this machine; this module measures what XLA makes of the same layout: meshkit's own step of the
model's family (``ModelShape.family``) for ``layout.meshkit_plan()`` on ``layout.mesh_spec()``, compiled
from abstract shapes (the parameters are ``jax.eval_shape`` of the family's init in its scanned form, the
batch a ``ShapeDtypeStruct``; nothing is allocated), AdamW, bf16 compute when the job says bf16, exactly
as ``meshkit train`` builds it (clipping, gradient norm, whole units; pipeline plans through their
schedule). It reads the per-device peak (``memory_analysis()``: arguments + temporaries, the outputs
alias the donated parameters and optimizer state; on a TPU the compiler's own peak) and the collectives
per mesh axis from meshkit's ledger.

The simulated device count is fixed when JAX starts its backend, so ``compile_layouts`` compiles
each layout in a fresh process (``python -m meshkit.planner.compile``), one after another (the
machine's cores go to XLA), with a progress bar and a per-compile timeout. A layout meshkit has
no plan for, one its plans refuse, or one XLA:TPU finds too large for a chip's HBM comes back as a
``Measured`` with ``error`` set (one line).

On CPU, XLA moves collectives of sub-32-bit floats as float32 (``Measured.comm_bytes`` are the
bytes as compiled here; a bf16 activation all-reduce or permute counts 4 bytes per element); a TPU
moves them as they are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
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
    """One line: why the layout was not compiled (no plan, a plan's refusal, a timeout, too large)."""
    no_fit: bool = False
    """The TPU compiler refused the step as larger than a chip's HBM (``error`` says by how much)."""
    platform: str = ""
    """The platform compiled for: ``cpu`` (simulated devices) or ``tpu`` (a target slice)."""
    device_kind: str = ""
    """The devices' kind (``TPU v5 lite``): the hardware table's row (``planner.hardware.for_device``)."""
    attention: tuple[str, ...] = ()
    """The attention kernels the step traced (``plans.attention``: ``splash`` on a TPU, ``einsum``...)."""
    argument_bytes: int = 0
    """Per device: parameters, optimizer state and the batch as the step takes them."""
    temp_bytes: int = 0
    """Per device: the compiler's temporaries (activations, gradients, gathered parameters, stash)."""
    output_bytes: int = 0
    alias_bytes: int = 0
    xla_peak_bytes: int | None = None
    """The compiler's own per-device peak (``memory_analysis().peak_memory_in_bytes``) where it states one."""
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
        """Per-device peak: on a TPU the compiler's own (its buffer assignment reuses argument space no
        longer read: arguments + temporaries overstate it, a 32 B step on v5e-256 by 40%, 16.0 GiB against
        11.5 GiB that fit its chips); elsewhere arguments + temporaries (what ``meshkit.analysis.peak``
        measures: XLA:CPU states no peak of its own)."""
        if self.platform == "tpu" and self.xla_peak_bytes:
            return self.xla_peak_bytes
        return self.argument_bytes + self.temp_bytes

    @property
    def total_comm_bytes(self) -> float:
        return float(sum(self.comm_bytes.values()))

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layout"] = self.layout.to_json()
        out["warnings"], out["attention"] = list(self.warnings), list(self.attention)
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
        tuples = {k: tuple(data.get(k, ())) for k in ("warnings", "attention")}
        return cls(**{**kept, "layout": Layout(**data["layout"]), **tuples})


def failed(layout: Layout, why: str, compile_s: float = 0.0, *, no_fit: bool = False) -> Measured:
    return Measured(
        layout=layout,
        plan=layout.meshkit_plan(),
        mesh=layout.mesh_spec(),
        error=why,
        no_fit=no_fit,
        compile_s=compile_s,
    )


def _job_fields(job: Any) -> tuple[int, str]:
    """(global batch in sequences, precision) of the planner's job (any object with those attributes)."""
    batch, precision = int(job.global_batch), str(getattr(job, "precision", "fp32"))
    if precision not in PRECISIONS:
        raise MeshkitError(f"unknown precision {precision!r}: use {one_of(PRECISIONS)}")
    return batch, precision


def _sequence_parallel(job: Any, layout: Layout) -> bool:
    """Whether meshkit's step of ``layout`` runs sequence parallelism for the planner's ``job`` (its
    ``sequence_parallel``, where meshkit runs it: ``planner.cluster.sequence_split``)."""
    from meshkit.planner.cluster import sequence_split

    return bool(getattr(job, "sequence_parallel", False)) and sequence_split(layout) > 1


@dataclass(frozen=True, kw_only=True, slots=True)
class UserModel:
    """A model that is no registry family's, to compile in place of the shape's family (a user's loss
    and parameters, the published anchors' 2023 MaxText block): ``loss(params, batch)`` as
    ``plans.assemble`` takes it, ``params`` abstract (``jax.eval_shape`` of an init), their logical axes
    (``"embed"``, ``"heads"``, ``"mlp"``, ``"vocab"``, ``"layers"``: the names meshkit's plans place)."""

    loss: Any
    params: Any
    logical_axes: Any = None
    units: dict[str, int] | None = None
    has_aux: bool = False


def layout_step(
    shape: ModelShape,
    layout: Layout,
    job: Any,
    devices: Sequence[Any] | None = None,
    model: UserModel | None = None,
) -> tuple[Any, Any, dict[str, int], float, tuple[str, ...]]:
    """``(lowered step, mesh, per-device bytes of its params, optimizer and batch arguments, branch
    share, attention kernels traced)``: meshkit's step for ``layout`` on abstract parameters and batch of ``shape``'s family
    (``ModelShape.family``: the GPT, the Llama, the Gemma), over ``devices`` (default: this process's;
    a TPU target's abstract chips, ``meshkit.targets.target_devices``, compile for that slice).

    The step ``meshkit train`` builds (``plans.assemble``, the Trainer's assembly, without allocating):
    the family's loss as a run trains it (``Family.training_loss``: its stages under a pipeline plan, a
    mixture of experts' metrics), the layout's ``ParallelSpec`` with the family's logical axes and whole
    units, AdamW, clipping and the gradient norm, bf16 compute and (fsdp) bf16 gathers for bf16, the
    vocabulary split over the model axis (``tp_rules.vocab_rules``, every caller's default); attention
    by the devices' platform (splash on a TPU).

    The branch share is the fraction of a loop's trips on which a device runs each branch of a
    conditional in it: a pipeline's forward and backward branches run ``m v`` of the schedule's
    ticks each (1 without a pipeline)."""
    import jax
    import jax.numpy as jnp
    import optax

    from meshkit.models import registry
    from meshkit.plans import assemble

    global_batch, precision = _job_fields(job)
    spec = layout.to_spec(global_batch, precision, sequence_parallel=_sequence_parallel(job, layout))
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < layout.devices:
        raise MeshkitError(
            f"{layout.label()} needs {layout.devices} devices, this process has {len(devices)}: "
            f"use compile_layouts (one process per layout)"
        )
    pipeline = spec.plan_info.pipeline
    if model is None:
        family = registry.family(shape.family)
        cfg = family.config.from_shape(shape, precision=precision, scan_layers=True)
        params = jax.eval_shape(lambda: family.module.init(jax.random.key(0), cfg))
        loss, aux = family.training_loss(cfg, pipeline=pipeline)
        model = UserModel(
            loss=loss, params=params, logical_axes=family.module.logical_axes(params),
            units=family.units(cfg), has_aux=aux,
        )  # fmt: skip
    params = model.params
    tokens = jax.ShapeDtypeStruct((global_batch, shape.seq), jnp.int32)
    step = assemble(
        model.loss,
        params,
        optax.adamw(3e-4, weight_decay=0.01),
        spec,
        devices=devices[: layout.devices],
        clip_norm=CLIP,
        grad_norm=True,
        has_aux=model.has_aux,
        logical_axes=model.logical_axes,
        units=model.units,
    )
    args = step.abstract_args(params, (tokens, tokens))
    sizes, share = step_figures(step, args)
    return step.step.lower(*args), step.mesh, sizes, share, tuple(step.attention.used)


def step_figures(step: Any, args: tuple) -> tuple[dict[str, int], float]:
    """``(per-device bytes of the params, optimizer and batch arguments, branch share)`` of an assembled
    step (``plans.Assembled``) and its abstract arguments (``abstract_args``): what ``measure`` takes
    beside the compiled program (the share: ``layout_step``'s docstring)."""
    sizes = {k: shard_bytes(args[i]) for k, i in (("params", 0), ("optimizer", 1), ("batch", 3))}
    s = step.pipeline.schedule if step.pipeline is not None else None
    return sizes, 1.0 if s is None else s.m * s.v / s.ticks


def shard_bytes(tree: Any) -> int:
    """Bytes of one device's shard of every leaf of an abstract tree with shardings."""
    import jax
    import numpy as np

    return int(
        sum(
            np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )
    )


def compile_layout(
    shape: ModelShape, layout: Layout, job: Any, *, target: str | None = None, model: UserModel | None = None
) -> Measured:
    """Compile ``layout``'s step in this process and measure it: on this process's devices (it must have
    ``layout.devices``), or for TPU slice ``target`` (``meshkit.targets.target_devices``: libtpu's
    compiler, any machine). A layout meshkit cannot run, or one the TPU compiler finds too large for
    its chips' HBM, comes back with ``error`` set (one line). ``model``: a ``UserModel`` compiled in place of
    the shape's family (the shape then only labels it)."""
    start = time.perf_counter()
    try:
        devices = None
        if target is not None:
            from meshkit.targets import target_devices

            devices = target_devices(target)
            if len(devices) != layout.devices:
                raise MeshkitError(
                    f"{layout.label()} is {layout.devices} devices; {target} has {len(devices)} chips"
                )
        lowered, mesh, parts, share, attention = layout_step(shape, layout, job, devices, model)
        platform = mesh.devices.flat[0].platform
        compiled = lowered.compile(compiler_options=MEASURE_ONLY if platform == "cpu" else None)
    except MeshkitError as e:
        return failed(layout, str(e).splitlines()[0], time.perf_counter() - start)
    except Exception as e:  # the TPU compiler's refusal of a program too large for HBM, or any other
        return compile_error(layout, e, time.perf_counter() - start)
    return measure(compiled, mesh, layout, parts, share, time.perf_counter() - start, attention)


def compile_error(layout: Layout, error: BaseException, seconds: float) -> Measured:
    """A compile that failed, as one line: XLA:TPU's refusal of a step larger than a chip's HBM as "does not
    fit" (``no_fit``), any other error by its type and first line (never a traceback from inside JAX)."""
    if (why := too_large(error)) is not None:
        return failed(layout, why, seconds, no_fit=True)
    first = next((line for line in str(error).splitlines() if line.strip()), "")
    return failed(layout, f"did not compile: {type(error).__name__}: {first}", seconds)


_HBM_OOM = re.compile(r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)")


def too_large(error: BaseException) -> str | None:
    """One line for XLA:TPU's compile-time refusal of a program larger than a chip's HBM (``RESOURCE_EXHAUSTED:
    ... CompileTimeHbmOom``), or None for any other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text or "HBM" not in text:
        return None
    found = _HBM_OOM.search(text)
    if found is None:
        return "does not fit: XLA:TPU finds the step larger than a chip's HBM (CompileTimeHbmOom)"
    need, have = (f"{n} {u}iB" if u else f"{n} bytes" for n, u in (found.group(1, 2), found.group(3, 4)))
    # XLA's G is GiB: a v5e chip's 15.75G are its 16.9e9 bytes
    return (
        f"does not fit: XLA:TPU needs {need} per chip for the step's temporaries alone, a chip has {have} of "
        f"HBM (CompileTimeHbmOom)"
    )


def measure(
    compiled: Any,
    mesh: Any,
    layout: Layout,
    parts: dict[str, int],
    share: float,
    seconds: float,
    attention: Sequence[str] = (),
) -> Measured:
    """A compiled step's per-device memory (``memory_analysis()``; XLA's own peak where the backend
    states it) and its collectives per mesh axis (meshkit's ledger; a branch's collectives on the
    share of their loop's trips it runs)."""
    from meshkit.analysis import communication, memory

    mem = memory(compiled)
    ledger = communication(compiled, mesh=mesh)
    by = ledger.by_axes()
    executed: dict[str, float] = {}
    for r in ledger.records:  # a branch's collectives run on its share of the loop's trips
        bytes_ = (r.total_traffic_bytes or 0.0) * (share if r.in_conditional and r.in_loop else 1.0)
        executed[r.axes_label] = executed.get(r.axes_label, 0.0) + bytes_
    platform = mesh.devices.flat[0].platform
    return Measured(
        layout=layout,
        plan=layout.meshkit_plan(),
        mesh=layout.mesh_spec(),
        platform=platform,
        device_kind=mesh.devices.flat[0].device_kind,
        attention=tuple(sorted(attention)),
        argument_bytes=mem.argument_bytes,
        temp_bytes=mem.temp_bytes,
        output_bytes=mem.output_bytes,
        alias_bytes=mem.alias_bytes,
        xla_peak_bytes=mem.peak_bytes,
        parts={**parts, "temporaries": mem.temp_bytes},
        comm_bytes=executed,
        ledger_comm_bytes={k: float(v.traffic_bytes) for k, v in by.items()},
        comm_counts={k: int(v.executions) for k, v in by.items()},
        compile_s=seconds,
        warnings=ledger.warnings,
    )


# -- one process per layout -------------------------------------------------------------------------


def _request(shape: ModelShape, layout: Layout, job: Any, target: str | None) -> dict:
    global_batch, precision = _job_fields(job)
    return {
        "shape": dataclasses.asdict(shape),
        "layout": layout.to_json(),
        "job": {
            "global_batch": global_batch,
            "precision": precision,
            "sequence_parallel": bool(getattr(job, "sequence_parallel", False)),
        },
        "target": target,
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    """The job as the child process needs it."""

    global_batch: int
    precision: str = "fp32"
    sequence_parallel: bool = False


def compile_in_subprocess(
    shape: ModelShape, layout: Layout, job: Any, *, timeout_s: float = TIMEOUT_S, target: str | None = None
) -> Measured:
    """``compile_layout`` in a fresh Python: simulating ``layout.devices`` CPU devices, or compiling for
    TPU slice ``target`` (its memory and time bounded by the process's end)."""
    try:  # no process to start for a layout meshkit cannot run
        layout.to_spec(job.global_batch, job.precision)
    except MeshkitError as e:
        return failed(layout, str(e))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "meshkit.planner.compile"],
            input=json.dumps(_request(shape, layout, job, target)),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return failed(layout, f"compile timed out after {timeout_s:.0f} s", time.perf_counter() - start)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return failed(
            layout, f"compile process failed (exit {done.returncode}): {tail}", time.perf_counter() - start
        )
    return Measured.from_json(json.loads(lines[-1]))


def compile_layouts(
    shape: ModelShape,
    layouts: Sequence[Layout],
    job: Any,
    *,
    progress: bool = True,
    timeout_s: float = TIMEOUT_S,
    console: Any = None,
    target: str | None = None,
) -> list[Measured]:
    """Compile each layout in its own process (on simulated CPU devices, or for TPU slice ``target``), in
    order, with a progress bar (``progress``) and a limit of ``timeout_s`` per compile; each result's
    ``error`` says why a layout was not compiled."""
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
            where = target or f"{layout.devices} devices"
            bar.update(task, description=f"{layout.label()} on {where}")
            m = compile_in_subprocess(shape, layout, job, timeout_s=timeout_s, target=target)
            out.append(m)
            if not m.ok and progress:
                bar.console.print(
                    f"{layout.label()}: not compiled: {m.error}", highlight=False, soft_wrap=True
                )
            bar.advance(task)
    return out


def _main() -> None:
    """Child process: a request (JSON on stdin) in, one line of ``Measured`` JSON out."""
    request = json.loads(sys.stdin.read())
    layout, target = Layout(**request["layout"]), request.get("target")
    if target is None:
        from meshkit.devices import simulate_devices

        simulate_devices(layout.devices)
    shape = ModelShape(**request["shape"])
    result = compile_layout(shape, layout, _Job(**request["job"]), target=target)
    sys.stdout.write(json.dumps(result.to_json()) + "\n")


if __name__ == "__main__":
    _main()
