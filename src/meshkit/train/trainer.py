"""``Trainer``: a user's loss, parameters and optax optimizer, trained under any plan.

The loss is a pure function of the parameters (and, as asked, the model's other state and a fresh
random key per step); the Trainer checks every input before compiling, builds the step of its
``ParallelSpec`` (``plans.assemble``: the same step the peak model and the planner compile), places
the parameters and optimizer state, and saves and restores runs in the CLI's orbax format.

Beside it: ``_arguments`` (how its keyword arguments are read), ``_inputs`` (what it is given,
checked), ``_plan_report`` (its ``report``: measured beside the plan's model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from meshkit.plans.assemble import Assembled, assemble
from meshkit.plans.placement import Placement
from meshkit.plans.tp_rules import Rules
from meshkit.spec import AUTO, ParallelSpec, Plan, PlanError
from meshkit.train._arguments import _check_key_argument, _mesh_text, _precision
from meshkit.train._inputs import base_key, check_optimizer, check_params, check_state
from meshkit.train._plan_report import plan_report
from meshkit.train.profile import Profile, Tracing, summary_of
from meshkit.train.report import PlanReport


class Trainer:
    """Train ``loss_fn`` with ``optimizer`` under ``plan`` on ``mesh``.

    ``loss_fn(params, batch) -> loss`` by default; ``state=`` (the model's other state: BatchNorm
    statistics, counters, RNG keys) makes it ``loss_fn(params, state, batch) -> (loss, new_state)``;
    ``rng=`` (a seed or key) passes a fresh key per step as a last argument (``fold_in(key, step)``,
    the same under every plan, and each device's rows of the batch draw what one device would draw
    on the whole batch); ``has_aux=True`` lets the loss return ``(loss, aux)`` with ``aux`` a dict
    of metrics, returned from ``step`` beside the loss. ``compute_dtype="bfloat16"`` (mixed
    precision, the loss casting to it anyway) has zero3/fsdp gather parameters and reduce-scatter
    gradients in that dtype: half the bytes; the optimizer still updates float32. ``attention=`` is how
    ``meshkit.plans.causal_attention`` runs on each device (``spec.ATTENTION_IMPLEMENTATIONS``; default
    auto: fused, written out for float64; ``trainer.assembled.attention.used`` names the kernels traced).
    ``logical_axes=`` (with ``rules=``): the parameters' logical axis names, a pytree like them with a tuple
    per leaf, or a model's function of the parameters giving it (``meshkit.models.llama.logical_axes``).
    ``units={"heads": n}`` makes a model axis
    that does not divide the head count an error before compiling. ``report`` reads a
    tensor-parallel model's tokens per example (the rows its split matmuls multiply per example: a
    token model's sequence length) from the loss; ``tokens_per_example=`` overrides it. A model
    from ``meshkit.from_nnx``,
    ``from_linen`` or ``from_equinox`` may be passed as ``params``: its state and logical axes
    are then taken from it and ``loss_fn`` is written against the framework's model.

    Pipeline plans (``pp``, ``dp+pp``, ``fsdp+pp``, mesh with a ``stage`` axis) take the model as
    ``meshkit.Stages`` (the loss_fn), ``microbatches=`` (default: one per stage), ``schedule=``
    ('gpipe', '1f1b' (default) or 'interleaved') and ``virtual_stages=``; ``trainer.last_schedule``
    is the schedule the last step executed and ``report`` counts the bubble from it.

    ``plan="auto"`` picks dp, zero1, zero2 or fsdp over all devices by meshkit's cost model (the
    fewest bytes per step whose state fits in half a device's memory; ``meshkit.planner.auto``) and
    says which and why in ``trainer.plan_choice`` (and the ``meshkit`` logger).

    ``trainer.step(batch)`` takes the global batch (host arrays or global jax.Arrays, leading dim =
    examples) and returns the metrics; ``trainer.params`` holds the global, sharded parameters
    (``trainer.state`` the state; ``trainer.model()`` the framework's model, for an adapted one);
    ``trainer.compiled(batch)`` is the compiled step for the ledgers; ``trainer.report(batch)``
    sets measured communication and memory beside the plan's model; ``trainer.save(dir)`` and
    ``Trainer.restore(dir, ...)`` use the checkpoint format of ``meshkit train``.

    ``remat`` is the activation-checkpoint policy per layer ('none', 'layer', 'dots', 'regather';
    see ``meshkit.plans._fsdp``); under zero3/fsdp a layer's parameters are gathered inside it; pipeline
    plans take 'none', 'layer' and 'dots', applied to each block inside a stage's backward (``_pipeline``). Layers
    are found in the loss: a ``lax.scan`` over stacked parameters, or blocks marked ``meshkit.layer``.
    ``sequence_parallel`` splits each layer's input and output over the model axis on the sequence
    (Megatron's sequence parallelism, ``ParallelSpec.sequence_parallel``).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        params: Any,
        optimizer: optax.GradientTransformation,
        *,
        spec: ParallelSpec | None = None,
        plan: str | None = None,
        mesh: str | Mesh | None = None,
        remat: str | None = None,
        sequence_parallel: bool | None = None,
        accumulate: int | None = None,
        microbatches: int | None = None,
        pipeline_schedule: str | None = None,
        virtual_stages: int | None = None,
        compute_dtype: Any = None,
        attention: str | None = None,
        state: Any = None,
        rng: Any = None,
        has_aux: bool = False,
        clip_norm: float | None = None,
        rules: Rules | None = None,
        logical_axes: Any = None,
        min_shard_size: int = 1,
        units: Mapping[str, int] | None = None,
        tokens_per_example: int | None = None,
        grad_norm: bool = False,
        donate: bool = True,
        deterministic: bool | int | None = None,
        trainable: Any = None,
    ) -> None:
        if not callable(loss_fn):
            raise PlanError(f"loss_fn must be a function, got {type(loss_fn).__name__}")
        user_loss, given_state = loss_fn, state is not None
        loss_fn, params, state, stateful, logical_axes = self._adapt(
            loss_fn, params, state, logical_axes, has_aux, rng
        )
        if callable(logical_axes):  # a model's function of its parameters (llama.logical_axes)
            logical_axes = logical_axes(params)
        check_optimizer(optimizer)
        check_params(params)
        check_state(state)
        given_mesh = mesh if isinstance(mesh, Mesh) else None
        pipeline = {"microbatches": microbatches, "pipeline_schedule": pipeline_schedule}
        steps = dict(
            accumulate=accumulate, virtual_stages=virtual_stages, deterministic=deterministic or None
        )
        how = dict(remat=remat, sequence_parallel=sequence_parallel, precision=_precision(compute_dtype),
                   attention=attention)  # fmt: skip
        spec = ParallelSpec.of(spec, plan=plan, mesh=_mesh_text(mesh), **pipeline, **steps, **how)
        if spec.deterministic is not None:  # on a CPU: fused multiply-adds off (meshkit.devices)
            from meshkit.devices import prepare_deterministic

            prepare_deterministic()
        self.plan_choice = None
        """With ``plan="auto"``: the plan chosen and why (``meshkit.planner.auto.Choice``)."""
        if spec.plan == AUTO:
            spec = self._auto(spec, params, optimizer, given_mesh, logical_axes)
        self._key = base_key(rng)
        _check_key_argument(user_loss, self.adapted, given_state, rng is not None)
        carried = {"state": state, "stateful": stateful, "rng": rng is not None, "has_aux": has_aux}
        grads = {"clip_norm": clip_norm, "grad_norm": grad_norm, "donate": donate, "trainable": trainable}
        layout = dict(rules=rules, logical_axes=logical_axes, min_shard_size=min_shard_size, units=units)
        self.assembled: Assembled = assemble(
            loss_fn, params, optimizer, spec, mesh=given_mesh, **carried, **grads, **layout
        )
        self.spec = spec
        self.optimizer = optimizer
        self.tokens_per_example = tokens_per_example
        self.steps_done = 0
        """Optimizer steps taken (the per-step key is ``fold_in(rng, steps_done)``)."""
        self._param_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), params)
        self._place(params, state, self.assembled.optimizer)
        self._step = self.assembled.step
        self.last_schedule: jax.Array | None = None
        """Pipeline plans: the schedule the last step executed, ``(ticks, stages, 3)`` (see ``_pipeline``)."""
        self._compiled: dict[Any, jax.stages.Compiled] = {}
        self.last_compiled: jax.stages.Compiled | None = None
        """The executable the last step ran (its ledger is the profile's)."""

    def _adapt(
        self, loss_fn: Any, params: Any, state: Any, logical_axes: Any, has_aux: bool, rng: Any
    ) -> tuple:
        """``(loss, params, state, stateful, logical_axes)`` as the step takes them: an adapted model's
        (``meshkit.from_nnx`` ...: ``self.adapted``) taken apart, anything else as given."""
        from meshkit.adapters import Adapted

        self.adapted = params if isinstance(params, Adapted) else None
        if self.adapted is None:
            return loss_fn, params, state, state is not None, logical_axes
        if state is not None:
            raise PlanError("state= is taken from the adapted model: drop state=")
        loss_fn = self.adapted.loss(loss_fn, has_aux=has_aux, rng=rng is not None)
        axes = self.adapted.logical_axes if logical_axes is None else logical_axes
        return loss_fn, self.adapted.params, self.adapted.state, True, axes

    def _place(self, params: Any, state: Any, optimizer: optax.GradientTransformation) -> None:
        """The parameters and state on the plan's shardings, and the optimizer state made there."""
        sh = self.shardings
        # A fresh copy: steps donate their inputs, and device_put may hand back the caller's buffers.
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=(sh.params, sh.state))
        self.params, self.state = copy(_to_host_if_off_mesh((params, state), self.mesh))
        self.opt_state = jax.jit(optimizer.init, out_shardings=sh.opt_state)(self.params)

    # -- what was built ---------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        return self.assembled.mesh

    @property
    def plan(self) -> Plan:
        return self.spec.plan_info

    @property
    def placement(self) -> Placement:
        return self.assembled.placement

    @property
    def pipeline(self) -> Any:
        return self.assembled.pipeline

    @property
    def per_layer(self) -> Any:
        return self.assembled.per_layer

    @property
    def shardings(self) -> Any:
        return self.assembled.shardings

    @property
    def accumulate(self) -> int:
        return self.spec.accumulate

    @property
    def compute_dtype(self) -> jnp.dtype | None:
        return None if self.spec.compute_dtype is None else jnp.dtype(self.spec.compute_dtype)

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.shape.values())

    def _auto(
        self, spec: ParallelSpec, params: Any, optimizer: Any, mesh: Any, logical_axes: Any
    ) -> ParallelSpec:
        """``plan="auto"``: the ZeRO ladder by meshkit's cost model (``meshkit.planner.auto``), logged."""
        import logging

        from meshkit.planner.auto import choose_generic

        if mesh is not None or spec.mesh is not None:
            raise PlanError("plan='auto' chooses the mesh too: drop mesh=, or name a plan")
        self.plan_choice = choose_generic(params, optimizer, logical_axes=logical_axes)
        logging.getLogger("meshkit").info(self.plan_choice.line())
        return spec.replace(plan=self.plan_choice.plan, mesh=self.plan_choice.mesh)

    # -- data -------------------------------------------------------------------------------
    def put_batch(self, batch: Any) -> Any:
        """Place a global batch with the plan's batch sharding, after checking it divides."""
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise PlanError("the batch is empty: pass arrays whose leading dim counts examples")
        n = leaves[0].shape[0] if np.ndim(leaves[0]) else 0
        if any(np.ndim(a) == 0 or a.shape[0] != n for a in leaves):
            raise PlanError("every batch array needs the same leading (examples) dim")
        self.check_examples(n)
        return jax.tree.map(
            lambda a: (
                a
                if isinstance(a, jax.Array) and a.sharding == self.shardings.batch
                else jax.device_put(_host_if_off_mesh(a, self.mesh), self.shardings.batch)
            ),
            batch,
        )

    def check_examples(self, n: int) -> None:
        """Raise unless a global batch of ``n`` examples divides over the data axis and micro-batches."""
        self.assembled.check_examples(n)

    # -- steps ------------------------------------------------------------------------------
    def step(self, batch: Any) -> dict[str, jax.Array]:
        """One optimizer step on the global batch; returns {'loss'}, the aux metrics and, when
        computed, 'grad_norm'."""
        batch = self.put_batch(batch)
        key = self._step_key()
        self.last_compiled = self._executable(batch)
        self.params, self.opt_state, self.state, metrics = self.last_compiled(
            self.params, self.opt_state, self.state, batch, key
        )
        self.last_schedule = metrics.pop("schedule", None)
        self.steps_done += 1
        return metrics

    def _step_key(self) -> jax.Array:
        """``fold_in(rng, steps_done)``, made by a jitted function so every process of a job holds it."""
        if not hasattr(self, "_keygen"):
            data = None if self._key is None else np.asarray(jax.random.key_data(self._key))

            def keygen(i):
                return (
                    jax.random.key(0)
                    if data is None
                    else jax.random.fold_in(jax.random.wrap_key_data(data), i)
                )

            self._keygen = jax.jit(keygen, out_shardings=self.shardings.scalar)
        return self._keygen(np.uint32(self.steps_done))

    def profile(self, batches: Iterable[Any], directory: str | Path) -> Profile:
        """One step on each batch under ``jax.profiler``, the trace written into ``directory`` in
        TensorBoard's layout (``plugins/profile/<time>/``), and where the steps' time went
        (``meshkit.analysis.trace.summarize``, beside the ledger of the executable they ran). The steps
        train as ``step`` does; they are compiled before the trace starts."""
        placed = [self.put_batch(b) for b in batches]
        if not placed:
            raise PlanError("profile: give at least one batch")
        for b in placed:
            self._executable(b)
        jax.block_until_ready((self.params, self.opt_state, self.state))  # earlier steps end before the trace
        tracing = Tracing(Path(directory))
        tracing.start()
        try:
            metrics = [self.step(b) for b in placed]
            jax.block_until_ready(metrics)
        finally:
            trace = tracing.stop()
        return Profile(trace=trace, summary=summary_of(self, trace), metrics=metrics)

    def compiled(self, batch: Any) -> jax.stages.Compiled:
        """The compiled step for a batch of this shape: the very executable ``step`` runs."""
        return self._executable(self.put_batch(batch))

    def _executable(self, placed: Any) -> jax.stages.Compiled:
        """Compile once per batch shape; the steps and the report share the executable."""
        key = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(placed))
        if key not in self._compiled:
            self._compiled[key] = self._step.lower(
                self.params, self.opt_state, self.state, placed, self._step_key()
            ).compile()
        return self._compiled[key]

    def model(self) -> Any:
        """The framework's model with the trained parameters and state (adapted models only)."""
        if self.adapted is None:
            raise PlanError(
                "model() needs a model from meshkit.from_nnx/from_linen/from_equinox; use .params"
            )
        return self.adapted.rebuild(self.params, self.state)

    # -- checkpoints ------------------------------------------------------------------------
    def save(self, directory: str | Path, *, keep: int = 3) -> int:
        """Save params, optimizer state (and model state) as step ``steps_done`` in ``directory``,
        in the orbax format of ``meshkit train``; returns the step."""
        from meshkit.train.checkpoint import Checkpointer

        with Checkpointer(directory, keep=keep) as ckpt:
            ckpt.save(self.steps_done, self.params, self._opt_item(self.opt_state, self.state), self._meta())
        return self.steps_done

    def _meta(self) -> dict:
        return {
            "step": self.steps_done,
            "trainer": {
                "plan": self.plan.name,
                "mesh": dict(self.mesh.shape),
                "model_state": bool(jax.tree.leaves(self.state)),
            },
        }

    def _opt_item(self, opt_state: Any, state: Any) -> Any:
        """The checkpoint's ``opt_state`` item: the optimizer state, with the model state beside it
        when there is one (keys as their uint32 data)."""
        if not jax.tree.leaves(state):
            return opt_state
        data = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)
        return {"optimizer": opt_state, "model_state": data}

    @classmethod
    def restore(
        cls,
        directory: str | Path,
        loss_fn: Callable[..., Any],
        params: Any,
        optimizer: optax.GradientTransformation,
        *,
        step: int | None = None,
        **kwargs: Any,
    ) -> Trainer:
        """A Trainer built as ``Trainer(loss_fn, params, optimizer, **kwargs)`` (``params`` gives the
        structure: the initial parameters or an adapted model), then loaded from ``directory``
        (a ``trainer.save`` or ``meshkit train`` checkpoint; the latest step unless ``step``),
        resharded onto this plan and mesh. Training continues where it stopped, keys included."""
        from meshkit.train.checkpoint import Checkpointer, abstract_with

        t = cls(loss_fn, params, optimizer, **kwargs)
        like_params = abstract_with(t.params, t.shardings.params)
        like_opt = t._opt_item(
            abstract_with(t.opt_state, t.shardings.opt_state),
            jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, t.state),
                t.shardings.state,
            ),
        )
        with Checkpointer(directory) as ckpt:
            p, opt, meta = ckpt.restore(step, like_params, like_opt)
        if jax.tree.leaves(t.state):
            opt, data = opt["optimizer"], opt["model_state"]
            t.state = jax.tree.map(
                lambda x, d: jax.random.wrap_key_data(d) if _is_key(x) else d, t.state, data
            )
        t.params, t.opt_state = p, opt
        t.steps_done = int(meta["step"])
        return t

    # -- proof ------------------------------------------------------------------------------
    def report(self, batch: Any) -> PlanReport:
        """Measured communication per step and per-device memory beside the plan's model
        (``meshkit.train._plan_report``)."""
        return plan_report(self, batch)


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host_if_off_mesh(a: Any, mesh: Mesh) -> Any:
    """An array laid out on another mesh (e.g. the user's Explicit one) is brought to the host first, and so
    is one on a single CPU device (where ``init`` leaves a model's parameters, and the host is the device: no
    transfer). Spread over the mesh from one device, JAX compiles a slicing program per shape (0.07 s of
    CPU each: 478 in a run of the test suite); from the host it slices without one."""
    if not isinstance(a, jax.Array):
        return a
    s = a.sharding
    other_mesh = isinstance(s, NamedSharding) and s.mesh != mesh
    one_cpu = isinstance(s, SingleDeviceSharding) and next(iter(s.device_set)).platform == "cpu"
    if other_mesh or one_cpu:
        if _is_key(a):
            return jax.random.wrap_key_data(np.asarray(jax.random.key_data(a)), impl=jax.random.key_impl(a))
        return np.asarray(a)
    return a


def _to_host_if_off_mesh(tree: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda a: _host_if_off_mesh(a, mesh), tree)
