"""A Trainer's :class:`PlanReport`: the communication and memory its compiled step measured, beside
what the plan's model expects (collectives with their counts and bytes, the memory formula, the peak
model; a pipeline's schedule as executed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshkit.analysis import communication, memory
from meshkit.plans import (
    MemoryRow,
    compare_communication,
    dataflow,
    device_bytes,
    expected_collectives,
    memory_formula,
)
from meshkit.plans.peak import peak_report_later
from meshkit.plans.placement import Placement
from meshkit.spec import MODEL
from meshkit.spec.batch import extras
from meshkit.train.report import PlanReport


def _segment_bytes(batch: Any) -> int:
    """Bytes per segment id of a token batch of packed documents (0: none, or not a token batch)."""
    if not isinstance(batch, tuple) or len(batch) < 4:
        return 0
    seg = extras(batch)[1]
    return 0 if seg is None else int(np.dtype(seg.dtype).itemsize)


def plan_report(trainer: Any, batch: Any) -> PlanReport:
    """``trainer.report(batch)``: measured communication per step and per-device memory beside the
    plan's model."""
    compiled = trainer.compiled(batch)
    ledger = communication(compiled, mesh=trainer.mesh)
    n_examples = jax.tree.leaves(batch)[0].shape[0]
    per_example = trainer.tokens_per_example or 1
    if trainer.tokens_per_example is None and trainer.plan.split_axes("sequence"):  # the sequence it splits
        per_example = jax.tree.leaves(batch)[0].shape[1]
    fed = int8 = scales = normed = frozenset()
    if trainer.placement.model_size > 1:  # column-parallel matmuls on the batch itself need no input gradient
        shapes = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (trainer.params, trainer.state)
        )
        args = (trainer.assembled.loss, *shapes, trainer.put_batch(batch), trainer._step_key())
        flow = dataflow(*args, trainable=trainer.per_layer.trainable)  # one trace of the loss
        fed, int8, scales, normed = flow.batch_fed, flow.quantized, flow.norm_scales, flow.normed
        if trainer.tokens_per_example is None:
            per_example = _tokens_per_example(flow.rows, trainer.placement, n_examples)
    tokens = n_examples // (trainer.placement.batch_devices * trainer.accumulate) * per_example
    low = None
    if trainer.compute_dtype is not None and trainer.plan.gathers_in_compute_dtype:
        # XLA's CPU compiler moves sub-32-bit floats as f32
        cpu = trainer.mesh.devices.flat[0].platform == "cpu"
        low = max(trainer.compute_dtype.itemsize, 4) if cpu else trainer.compute_dtype.itemsize
    expected = expected_collectives(
        trainer.placement,
        trainer.accumulate,
        tokens_per_device=tokens,
        batch_fed=fed,
        gather_itemsize=low,
        per_layer=trainer.per_layer,
        form=trainer.spec.context_attention,
        segment_bytes=_segment_bytes(batch),
        quantized=int8,
        norm_scales=scales,
        normed=normed,
    )
    det = None
    if trainer.spec.deterministic is not None:  # its collectives over data (a pipeline's stage rows below)
        leaves = jax.tree.leaves(trainer._param_shapes)
        nbytes = sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in leaves)
        expected, det = trainer.assembled.deterministic_price(nbytes)
    if trainer.pipeline is not None:  # its data-axis rows as above (ZeRO-3: once per step); the rest its own
        expected = [
            *expected,
            *trainer.pipeline.expected(trainer._param_shapes, batch, trainer.per_layer.trainable),
        ]
    compiled_memory = memory(compiled)
    return PlanReport(
        peak_of=None  # the peak model describes the non-pipeline step; a pipeline reports its stash
        if trainer.pipeline is not None
        else peak_report_later(
            compiled_memory,
            trainer.assembled,
            trainer._param_shapes,
            batch,
            state=trainer.state,
            key=trainer._step_key(),
        ),
        plan=trainer.plan.name,
        mesh={k: int(v) for k, v in trainer.mesh.shape.items()},
        communication=compare_communication(ledger, expected),
        memory=_memory_rows(trainer),
        compiled_memory=compiled_memory,
        replicated=trainer.placement.replicated(),
        ledger=ledger,
        deterministic=det,
        pipeline=None
        if trainer.pipeline is None
        else trainer.pipeline.report(
            trainer.last_schedule, trainer._param_shapes, batch, compiled_memory.temp_bytes
        ),
    )


def _memory_rows(trainer: Any) -> list[MemoryRow]:
    """The parameters and the optimizer state as placed, beside the ZeRO formula's bytes per device."""
    formula = memory_formula(trainer.placement, trainer.assembled.optimizer, trainer._param_shapes)
    held = {"params": trainer.params, "optimizer": trainer.opt_state}
    return [
        MemoryRow(component=k, measured_bytes=device_bytes(v), formula_bytes=formula[k])
        for k, v in held.items()
    ]


def _tokens_per_example(rows: Mapping[str, int], placement: Placement, n_examples: int) -> int:
    """Rows per example the tensor-parallel matmuls multiply (a token model's sequence length), read
    from the loss's jaxpr traced on the whole batch: the model-axis traffic of a row- or
    column-parallel matmul is rows x width. 1 where no split leaf meets a matmul."""
    split = [rows[x.path] for x in placement.flat() if MODEL in x.model_spec and x.path in rows]
    return max(1, max(split, default=n_examples) // n_examples)
