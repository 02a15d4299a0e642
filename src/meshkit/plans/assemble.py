"""The one step assembly: a loss, its parameters and an optimizer under a ``ParallelSpec``, as the
jitted training step with its mesh, placement, shardings and per-layer settings.

The Trainer trains with it, ``plans.peak.abstract_step`` measures it and the planner's compile
check (``planner.compile``) compiles it ahead of time, so the step that is measured is the step
that trains. In order: the mesh (from the spec, over the given or all devices, every axis
``Auto``: the plans write the data axis out by hand and leave the model axis to XLA), where
every leaf lives (``placement.place``: ZeRO on ``data``, tensor-parallel rules on ``model``), a
pipeline's schedule and staged placement, the shardings pinned on the step's inputs and outputs,
the per-layer settings (remat, ZeRO-3's per-layer gathers), and ``build_step``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.mesh import as_auto, make_mesh
from meshkit.plans._frozen import Trainable, optimizer_view
from meshkit.plans._fsdp import PerLayer
from meshkit.plans._loss import LossFn, step_loss
from meshkit.plans._pipeline import Pipeline
from meshkit.plans._stages import Stages
from meshkit.plans._step import StepShardings, build_step, state_shardings
from meshkit.plans.attention import Attention, in_force
from meshkit.plans.placement import Placement, place
from meshkit.plans.tp_rules import Rules
from meshkit.spec import DATA, ParallelSpec, PlanError


def spec_mesh(
    spec: ParallelSpec, mesh: Mesh | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """The mesh a step runs on: ``mesh`` itself (its axes made ``Auto``) or the spec's mesh over
    ``devices`` (default: all of them)."""
    if mesh is not None:
        return as_auto(mesh)
    return make_mesh(spec.mesh_text, axis_types="auto", devices=devices)


@dataclass(kw_only=True, slots=True)
class Assembled:
    """A plan's step and everything it was built from."""

    spec: ParallelSpec
    mesh: Mesh
    placement: Placement
    """Where every parameter leaf lives (a pipeline's staged placement under a pipeline plan)."""
    pipeline: Pipeline | None
    per_layer: PerLayer
    """Remat policy and ZeRO-3's per-layer gathers; records the layers found when the loss is traced."""
    shardings: StepShardings
    loss: LossFn
    """The loss in the plans' form ``(params, state, batch, key) -> (loss, (aux, state))``."""
    optimizer: optax.GradientTransformation
    step: Callable
    """The jitted ``(params, opt_state, state, batch, key) -> (params, opt_state, state, metrics)``."""
    attention: Attention
    """The attention implementation the loss is traced with (``spec.attention``) and, once traced, the
    kernels it used (``plans.attention``)."""

    @property
    def data_size(self) -> int:
        return int(self.mesh.shape.get(DATA, 1))

    @property
    def microbatches(self) -> int:
        """Micro-batches per step: the pipeline's, or ``accumulate``."""
        return self.spec.accumulate if self.pipeline is None else self.pipeline.microbatches

    def check_examples(self, examples: int) -> None:
        """Raise unless a global batch of ``examples`` divides over the data axis and micro-batches
        (deterministic mode: into its micro-shards, shared out over the batch devices)."""
        if self.spec.deterministic is not None and self.pipeline is None:
            from meshkit.plans._deterministic import check_batch

            check_batch(examples, self.spec.deterministic, self.placement.batch_devices)
        self.spec.check_examples(examples, self.placement.batch_devices, self.microbatches)

    def deterministic_price(self, param_bytes: int) -> tuple[list, dict]:
        """Deterministic mode's collectives per step (the model the measured ledger is set beside) and
        its price: bytes into each device per step beside the plan's normal collectives (ring model)."""
        from meshkit.plans._deterministic import expected, price

        shards = self.spec.deterministic
        summed = param_bytes
        if self.pipeline is not None:  # a stage's slice of the blocks and the embedding and head
            param_bytes, summed = self.pipeline.stage_bytes(), self.pipeline.summed_bytes()
        bytes_ = price(self.placement, summed, param_bytes)
        ratio = bytes_["deterministic"] / bytes_["normal"] if bytes_["normal"] else None
        det = {
            "shards": shards,
            "shards_per_device": shards // self.placement.data_size,
            "bytes_per_step": bytes_["deterministic"],
            "normal_bytes_per_step": bytes_["normal"],
            "bytes_ratio": ratio,
        }
        return expected(self.placement, param_bytes, summed=summed), det

    def abstract_args(self, params: Any, batch: Any, state: Any = None) -> tuple:
        """The step's arguments as abstract values with their shardings, from parameter and batch
        shapes (anything with ``.shape`` and ``.dtype``): nothing is allocated."""
        sh = self.shardings
        opt = jax.eval_shape(self.optimizer.init, params)
        key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=sh.scalar)
        return (
            _attach(params, sh.params),
            _attach(opt, sh.opt_state),
            None if state is None else _attach(state, sh.state),
            jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh.batch), batch),
            key,
        )

    def lower(self, params: Any, batch: Any, state: Any = None) -> jax.stages.Lowered:
        """The step lowered from shapes (``abstract_args``), for ahead-of-time compiles."""
        return self.step.lower(*self.abstract_args(params, batch, state))


def attending(loss_fn: Any, record: Attention) -> Any:
    """``loss_fn`` with ``record``'s attention in force whenever it is traced (``plans.attention``): a
    function wrapped, or a ``Stages``' four functions (a pipeline traces them apart)."""

    def wrap(f: Callable) -> Callable:
        @functools.wraps(f)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with in_force(record):
                return f(*args, **kwargs)

        return inner

    if isinstance(loss_fn, Stages):
        return dataclasses.replace(
            loss_fn,
            embed=wrap(loss_fn.embed),
            block=wrap(loss_fn.block),
            head=wrap(loss_fn.head),
            loss=wrap(loss_fn.loss),
        )
    return wrap(loss_fn)


def _state_layout(optimizer: optax.GradientTransformation, placement: Placement, params: Any) -> tuple:
    """``state_shardings``' arguments: the optimizer state's own (``_frozen.optimizer_view``)."""
    optimizer, placement, params = optimizer_view(optimizer, placement, params)
    return optimizer, params, placement


def _refuse(spec: ParallelSpec, clip_norm: float | None, stateful: bool) -> None:
    """Options the step cannot take, refused before anything is built."""
    if clip_norm is not None and clip_norm <= 0:
        raise PlanError(f"clip_norm must be positive, got {clip_norm}")
    if spec.deterministic is not None and stateful:
        raise PlanError(
            "deterministic mode covers losses without state: the state threads through the "
            "micro-shards in an order the mesh sets; drop state= or deterministic"
        )


def _shardings(
    mesh: Mesh, placement: Placement, optimizer: optax.GradientTransformation, params: Any, state: Any
) -> StepShardings:
    """The shardings pinned on the step's inputs and outputs: the parameters' and the optimizer state's
    by the placement, the batch's rows over the batch axes, the rest replicated."""
    replicated = NamedSharding(mesh, P())
    return StepShardings(
        params=jax.tree.map(
            lambda s: NamedSharding(mesh, s), placement.param_specs(), is_leaf=lambda x: isinstance(x, P)
        ),
        opt_state=state_shardings(*_state_layout(optimizer, placement, params)),
        batch=NamedSharding(mesh, placement.batch_spec()),
        scalar=replicated,
        state=jax.tree.map(lambda _: replicated, state),
    )


def _attach(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), tree, shardings)


def _refuse_frozen(spec: ParallelSpec, frozen: Any) -> None:
    """What frozen leaves (``trainable=``) cannot run with: deterministic mode, and sequence parallelism
    (such a step trains as one device, float64 2e-14 with LoRA, but its model-axis collectives are 2-3x
    the ledger's model, so a run could not prove its cost)."""
    if frozen is not None and spec.deterministic is not None:
        raise PlanError("deterministic mode trains every parameter: drop trainable= or deterministic")
    if frozen is not None and spec.sequence_parallel:
        raise PlanError(
            "sequence_parallel with frozen leaves (LoRA) is not modelled yet: its collectives over the model "
            "axis would not match the ledger's model; drop --sequence-parallel for this run"
        )


def assemble(
    loss_fn: Callable,
    params: Any,
    optimizer: optax.GradientTransformation,
    spec: ParallelSpec,
    *,
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    state: Any = None,
    stateful: bool = False,
    rng: bool = False,
    has_aux: bool = False,
    clip_norm: float | None = None,
    grad_norm: bool = False,
    donate: bool = True,
    rules: Rules | None = None,
    logical_axes: Any = None,
    min_shard_size: int = 1,
    units: Mapping[str, int] | None = None,
    trainable: Any = None,
) -> Assembled:
    """Build the step of ``spec`` for ``loss_fn(params, batch)`` (the forms of ``_loss.step_loss``:
    ``stateful``, ``rng`` and ``has_aux`` say which) and ``optimizer``; ``params`` and ``state``
    may be arrays or abstract values. ``mesh`` overrides the spec's mesh (its devices and axes);
    ``devices`` are those the spec's mesh is made over. ``trainable`` (a tree of bools like ``params``,
    or a predicate on a leaf's path ``"a/b/c"``) freezes the other leaves (``_frozen``): no gradient,
    no gradient collective, no optimizer state; ``Assembled.optimizer`` is then ``optimizer`` over the
    trainable leaves."""
    _refuse(spec, clip_norm, stateful)
    plan = spec.plan_info
    frozen = Trainable.of(trainable, params)
    _refuse_frozen(spec, frozen)
    optimizer = optimizer if frozen is None else frozen.optimizer(optimizer)
    mesh = spec_mesh(spec, mesh, devices)
    # every trace of the loss (step, peak model) attends as asked, with the kernels of the devices it compiles for
    record = Attention(requested=spec.attention, platform=mesh.devices.flat[0].platform, devices=mesh.size)
    loss_fn = attending(loss_fn, record)
    placement = place(
        params, plan, mesh, rules=rules, logical_axes=logical_axes, min_shard_size=min_shard_size, units=units
    )
    pipeline = None
    if plan.pipeline:
        extras = {"state=": stateful, "rng=": rng, "has_aux=True": has_aux}
        pipeline = Pipeline.make(
            loss_fn, params, placement, spec, extras, norm=grad_norm or clip_norm is not None
        )
        placement = pipeline.placement
    shardings = _shardings(mesh, placement, optimizer, params, state)
    loss = step_loss(loss_fn, stateful=stateful, rng=rng, has_aux=has_aux)
    split = placement.model_size if spec.sequence_parallel else 0
    per_layer = PerLayer(placement=placement, remat=spec.remat, trainable=frozen, sequence_split=split)
    compute = None if spec.compute_dtype is None else jnp.dtype(spec.compute_dtype)
    step = build_step(
        loss,
        optimizer,
        placement,
        shardings,
        accumulate=spec.accumulate,
        clip_norm=clip_norm,
        grad_norm=grad_norm,
        donate=donate,
        compute_dtype=compute,
        per_layer=per_layer,
        gradients=None if pipeline is None else pipeline.gradients(),
        context_attention=spec.context_attention,
        deterministic=spec.deterministic,
    )
    return Assembled(
        spec=spec,
        mesh=mesh,
        placement=placement,
        pipeline=pipeline,
        per_layer=per_layer,
        shardings=shardings,
        loss=loss,
        optimizer=optimizer,
        step=step,
        attention=record,
    )
