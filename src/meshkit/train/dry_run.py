"""``meshkit train --dry-run``: the run's own step compiled, not run: on this process's devices, or for a
TPU slice (``--target v5e-256``) by libtpu's compiler on any machine, no TPU needed.

The step is the one ``meshkit train`` would train with these options: its model family and config (a
LoRA run's adapters beside the frozen base, an ``--init-from`` checkpoint's config), its loss (a
pipeline's stages, a mixture of experts' metrics), its optimizer, clipping, plan, mesh, remat and
precision (for a TPU target: bf16 compute unless ``--precision`` says otherwise), its global batch as
the data stream shapes it (a fine-tuning run's weights, segments and positions); attention as the
target's platform runs it (splash on a TPU). Nothing is allocated, read past the data's manifest and one
batch's structure, or written. What comes back is what a user asks before renting the slice: each
chip's memory against its HBM (XLA:TPU's own peak; a step too large is its compile-time refusal,
one line), the bytes each step moves per mesh axis, and the planner's predicted step time and MFU
for that chip beside the compiled figures.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import jax

from meshkit._errors import MeshkitError
from meshkit.models import lora, registry
from meshkit.plans.assemble import assemble
from meshkit.train import config as C
from meshkit.train import optim
from meshkit.train.job import _step_options, check_step, load_data, model_config
from meshkit.train.objective import loss_options
from meshkit.train.task import batch_options, check_data


@dataclass(frozen=True, kw_only=True, slots=True)
class DryRun:
    """One run's step compiled without training."""

    target: str | None
    """The TPU slice compiled for (None: this process's devices)."""
    cfg: C.TrainConfig
    """The run's config as it would train (precision resolved for the target's platform)."""
    shape: Any
    """The model's ``ModelShape`` (the planner's description of it)."""
    measured: Any
    """``planner.compile.Measured``: memory, collectives by axis, compile seconds; or why it was not compiled."""
    hardware: Any
    """The devices' row of ``planner.hardware`` (None where the table has none: a CPU)."""
    prediction: Any
    """``planner.predict``'s figures for the run's layout on those devices (None without hardware)."""
    parameters: int = 0
    """The run's parameters, counted on the family's own abstract tree (a LoRA run's adapters with them)."""

    @property
    def fits(self) -> bool | None:
        """Whether each device holds the step (None where not known: simulated CPU devices, a failed compile)."""
        if self.measured.no_fit:
            return False
        if not self.measured.ok or self.hardware is None or self.measured.platform == "cpu":
            return None
        return self.measured.peak_bytes <= self.hardware.memory_bytes

    def to_json(self) -> dict:
        p = self.prediction
        return {
            "target": self.target,
            "plan": self.cfg.parallel.plan,
            "mesh": self.measured.mesh,
            "precision": self.cfg.parallel.precision,
            "hardware": None if self.hardware is None else self.hardware.name,
            "parameters": self.parameters,
            "fits": self.fits,
            "compiled": self.measured.to_json(),
            "predicted": None
            if p is None
            else {
                "peak_bytes": p.peak_bytes,
                "comm_bytes": p.comm_bytes,
                "step_time_s": p.step_time_s,
                "mfu": p.mfu,
                "tokens_per_s": p.tokens_per_s,
            },
        }


def dry_run(cfg: C.TrainConfig, *, target: str | None = None) -> DryRun:
    """Compile ``cfg``'s training step for ``target``'s TPU chips (or this process's devices) and measure
    it beside the planner's prediction; raises (one line) where the options cannot train."""
    from meshkit.planner.compile import compile_error, measure, step_figures
    from meshkit.planner.layout import Layout

    cfg = C.by_platform(cfg, "tpu" if target else None)
    C.validate(cfg)
    if cfg.parallel.plan == "auto":
        raise C.ConfigError(
            "--dry-run compiles one plan: name it with --plan (meshkit plan --target ranks the layouts for a slice)"
        )
    if target is not None:
        from meshkit.targets import target_devices

        devices = target_devices(target)
    else:
        devices = jax.devices()
    family = registry.family(cfg.model.model)
    data = load_data(cfg)
    check_data(cfg, data)
    model = model_config(cfg, family, data.vocab_size)
    loss, shapes, axes_of = abstract_model(cfg, family, model)
    spec = cfg.parallel
    start = time.perf_counter()
    step = assemble(
        loss,
        shapes,
        optim.optimizer(cfg),
        spec,
        devices=devices,
        **_step_options(cfg, family, model, axes_of),
    )
    check_step(cfg, model, step)
    layout = Layout.from_spec(spec, len(step.mesh.devices.flat), cfg.data.batch_size)
    batch = abstract_batch(cfg, data)
    args = step.abstract_args(shapes, batch)
    parts, share = step_figures(step, args)
    try:
        compiled = step.step.lower(*args).compile()
        seconds = time.perf_counter() - start
        measured = measure(compiled, step.mesh, layout, parts, share, seconds, step.attention.used)
    except Exception as e:  # XLA:TPU's compile-time refusal of a step larger than a chip's HBM, or any other
        measured = compile_error(layout, e, time.perf_counter() - start)
    shape = model.shape(family.name)
    hardware, prediction = _predicted(shape, layout, devices, cfg)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    return DryRun(target=target, cfg=cfg, shape=shape, measured=measured, hardware=hardware,
                  prediction=prediction, parameters=count)  # fmt: skip


def abstract_model(cfg: C.TrainConfig, family: Any, model: Any) -> tuple[Any, Any, Any]:
    """``(loss, parameter shapes, logical axes)`` of the run's model as ``job.build_model`` makes it, from
    shapes alone: nothing initialised or read (a LoRA run's adapters beside the base)."""
    module = family.module
    loss, _ = family.training_loss(model, pipeline=cfg.parallel.plan_info.pipeline, **loss_options(cfg))
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), model))
    if (adapters := C.lora_config(cfg)) is not None:
        shapes = jax.eval_shape(lambda p: lora.add(jax.random.key(1), p, adapters), shapes)
        return lora.wrap(loss, adapters), shapes, lora.logical_axes(shapes, module.logical_axes)
    return loss, shapes, module.logical_axes(shapes)


def abstract_batch(cfg: C.TrainConfig, data: Any) -> Any:
    """The run's global batch as abstract values: the structure the data stream yields (tokens and
    targets; a fine-tuning run's weights, segments and positions), read from one small batch, with the
    run's ``--batch-size`` rows."""
    small = data.batches(seq_len=cfg.data.seq_len, global_batch=1, seed=cfg.data.seed, **batch_options(cfg))
    try:
        one = next(iter(small))
    finally:
        close = getattr(small, "close", None)
        if close is not None:
            close()
    rows = cfg.data.batch_size
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), one)


def _predicted(shape: Any, layout: Any, devices: list, cfg: C.TrainConfig) -> tuple[Any, Any]:
    """The devices' hardware row and the planner's prediction for the run's layout on them (None, None for
    devices the table lacks, a CPU among them)."""
    from meshkit.planner.cluster import Cluster, Job
    from meshkit.planner.hardware import for_device
    from meshkit.planner.predict import predict

    hw = for_device(devices[0].device_kind)
    if hw is None:
        return None, None
    job = Job(global_batch=cfg.data.batch_size, precision=cfg.parallel.precision, flash_attention=True)
    try:
        return hw, predict(shape, layout, Cluster(hardware=hw, devices=len(devices)), job)
    except MeshkitError:
        return hw, None
