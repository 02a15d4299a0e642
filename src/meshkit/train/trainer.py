"""``Trainer``: a user's loss, parameters and optax optimizer, trained under any plan.

The loss is a pure function of the parameters (and, as asked, the model's other state and a fresh
random key per step); the Trainer brings it to the plan's one internal form (``plans._step``),
checks every input before compiling, and saves and restores runs in the CLI's orbax format.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.analysis import CommLedger, MemoryLedger, communication, memory
from meshkit.analysis.peak import peak_report
from meshkit.mesh import as_auto, make_mesh
from meshkit.plans import (
    CommRow,
    Layout,
    MemoryRow,
    PlanError,
    StepShardings,
    build_step,
    compare_communication,
    device_bytes,
    expected_collectives,
    get_plan,
    make_layout,
    memory_formula,
    state_shardings,
)
from meshkit.plans._dataflow import batch_fed
from meshkit.plans._fsdp import PerLayer
from meshkit.plans._layout import DATA, Rules
from meshkit.train._inputs import check_params, check_state

_DEFAULT_MESH = {"dp": "data=-1", "zero1": "data=-1", "zero2": "data=-1", "zero3": "data=-1", "fsdp": "data=-1",
                 "tp": "model=-1", "dp+tp": "data=-1,model=2", "fsdp+tp": "data=-1,model=2",
                "pp": "stage=-1", "dp+pp": "stage=2,data=-1", "fsdp+pp": "stage=2,data=-1", "tp+pp": "stage=-1,model=2",
                "dp+tp+pp": "stage=2,data=-1,model=2", "fsdp+tp+pp": "stage=2,data=-1,model=2"}  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    """Measured communication and memory of one compiled step beside the plan's model."""

    plan: str
    mesh: dict[str, int]
    communication: list[CommRow]
    memory: list[MemoryRow]
    compiled_memory: MemoryLedger
    replicated: list[tuple[str, str]]
    ledger: CommLedger = field(repr=False)
    peak: dict | None = None
    """Measured peak (arguments + temporaries) beside ``meshkit.analysis.peak``'s model, and the
    layers the plan found in the loss."""
    pipeline: Any = None
    """Pipeline plans: the executed schedule beside the model (``_pipeline.PipelineReport``)."""

    @property
    def ok(self) -> bool:
        pipeline_ok = self.pipeline is None or self.pipeline.ok
        return all(r.ok for r in self.communication) and all(r.ok for r in self.memory) and pipeline_ok

    def to_json(self) -> dict:
        return {
            "plan": self.plan,
            "mesh": self.mesh,
            "ok": self.ok,
            "communication": [r.to_json() for r in self.communication],
            "memory": [r.to_json() for r in self.memory],
            "compiled_memory": self.compiled_memory.to_json(),
            "replicated_leaves": [{"path": p, "why": w} for p, w in self.replicated],
            "peak": self.peak,
            **({} if self.pipeline is None else {"pipeline": self.pipeline.to_json()}),
        }

    def tables(self) -> list:
        """The report as rich tables: communication, then memory."""
        from rich.table import Table

        from meshkit.cli._format import fmt_bytes

        comm = Table(title=f"plan {self.plan} on {_mesh_text(self.mesh)}: communication per step (ring model)",
                     title_justify="left")  # fmt: skip
        for c in ("op", "axes", "runs", "measured/device", "model", "ratio", ""):
            comm.add_column(c, justify="left" if c in ("op", "axes") else "right")
        for r in self.communication:
            comm.add_row(r.op, r.axes, str(r.measured_runs), fmt_bytes(r.measured_traffic_bytes),
                         fmt_bytes(r.model_traffic_bytes), "-" if r.ratio is None else f"{r.ratio:.4f}",
                         "ok" if r.ok else "FAIL")  # fmt: skip
        mem = Table(title="per-device memory", title_justify="left")
        for c in ("component", "measured", "formula", "ratio", ""):
            mem.add_column(c, justify="left" if c == "component" else "right")
        for m in self.memory:
            mem.add_row(m.component, fmt_bytes(m.measured_bytes), fmt_bytes(m.formula_bytes),
                        "-" if m.ratio is None else f"{m.ratio:.4f}", "ok" if m.ok else "FAIL")  # fmt: skip
        cm = self.compiled_memory
        mem.add_row("compiled: arguments", fmt_bytes(cm.argument_bytes), "", "", "")
        mem.add_row("compiled: temporaries", fmt_bytes(cm.temp_bytes), "", "", "")
        return [comm, mem] + ([] if self.pipeline is None else [self.pipeline.table()])

    def __rich__(self):
        from rich.console import Group
        from rich.text import Text

        verdict = Text("ok" if self.ok else "FAIL: measured differs from the model", style="bold")
        return Group(*self.tables(), verdict)

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=110, no_color=True, force_terminal=False, record=True, file=_Null())
        console.print(self)
        return console.export_text().rstrip() + "\n"


class _Null:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


def _check_optimizer(optimizer: Any) -> None:
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise PlanError(
            f"optimizer must be an optax.GradientTransformation (e.g. optax.adamw(3e-4)), got {type(optimizer).__name__}"
        )


def _base_key(rng: Any) -> jax.Array | None:
    """``rng=``: None, an int seed, a typed key, or a raw uint32 key (``jax.random.PRNGKey``)."""
    if rng is None:
        return None
    if isinstance(rng, int) and not isinstance(rng, bool):
        return jax.random.key(rng)
    if isinstance(rng, jax.Array | np.ndarray):
        if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ():
            if str(jax.random.key_impl(rng)) not in ("threefry2x32", "fry"):
                raise PlanError(
                    f"rng must be a threefry key (jax.random.key's default), got {jax.random.key_impl(rng)}"
                )
            return rng
        if rng.dtype == np.uint32 and rng.shape == (2,):
            return jax.random.wrap_key_data(jnp.asarray(rng))
    raise PlanError(
        f"rng must be an int seed or a single PRNG key (jax.random.key(0)), got {type(rng).__name__}"
    )


def as_step_loss(loss_fn: Callable, *, stateful: bool, rng: bool, has_aux: bool) -> Callable:
    """The user's loss in the plans' form ``(params, state, batch, key) -> (loss, (aux, state))``.

    User forms: ``loss_fn(params, batch)``; with ``state=``, ``loss_fn(params, state, batch)``
    returning ``(out, new_state)``; with ``rng=``, the step's key as a last argument; with
    ``has_aux``, ``out`` is ``(loss, aux)``, ``aux`` a dict of metrics.
    """
    form = "loss_fn(params, " + ("state, " if stateful else "") + "batch" + (", key" if rng else "") + ")"

    def inner(params, state, batch, key):
        args = (params, state, batch) if stateful else (params, batch)
        out = loss_fn(*args, *((key,) if rng else ()))
        if stateful:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise PlanError(
                    f"with state=, {form} must return (loss, new_state), got {type(out).__name__}"
                )
            out, new_state = out
            if jax.tree.structure(new_state) != jax.tree.structure(state):
                raise PlanError(
                    f"{form} returned a new state structured unlike state=: return the updated state, "
                    f"same leaves ({jax.tree.structure(state)} vs {jax.tree.structure(new_state)})"
                )
            new_state = jax.tree.map(lambda a, b: jnp.asarray(a, jnp.asarray(b).dtype), new_state, state)
        else:
            new_state = state
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
                raise PlanError(
                    f"with has_aux=True, {form} must return (loss, aux) with aux a dict of metrics"
                )
            out, aux = out
            if clash := {"loss", "grad_norm"} & set(aux):
                raise PlanError(f"aux metric name(s) {sorted(clash)} are taken by the trainer: rename them")
        else:
            aux = {}
            if isinstance(out, tuple):
                raise PlanError(f"{form} returned a tuple: pass has_aux=True if it is (loss, aux)")
        loss = jnp.asarray(out)
        if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
            raise PlanError(
                f"{form} must return a float scalar loss, got shape {loss.shape} dtype {loss.dtype}"
            )
        return loss, (aux, new_state)

    return inner


class Trainer:
    """Train ``loss_fn`` with ``optimizer`` under ``plan`` on ``mesh``.

    ``loss_fn(params, batch) -> loss`` by default; ``state=`` (the model's other state: BatchNorm
    statistics, counters, RNG keys) makes it ``loss_fn(params, state, batch) -> (loss, new_state)``;
    ``rng=`` (a seed or key) passes a fresh key per step as a last argument (``fold_in(key, step)``,
    the same under every plan, and each device's rows of the batch draw what one device would draw
    on the whole batch); ``has_aux=True`` lets the loss return ``(loss, aux)`` with ``aux`` a dict
    of metrics, returned from ``step`` beside the loss. ``compute_dtype="bfloat16"`` (mixed
    precision, the loss casting to it anyway) has zero3/fsdp gather parameters and reduce-scatter
    gradients in that dtype: half the bytes; the optimizer still updates float32. ``units={"heads": n}`` makes a model axis
    that does not divide the head count an error before compiling. A model from ``meshkit.from_nnx``,
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
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        params: Any,
        optimizer: optax.GradientTransformation,
        *,
        plan: str = "dp",
        mesh: str | Mesh | None = None,
        state: Any = None,
        rng: Any = None,
        has_aux: bool = False,
        accumulate: int = 1,
        clip_norm: float | None = None,
        rules: Rules | None = None,
        logical_axes: Any = None,
        min_shard_size: int = 1,
        units: Mapping[str, int] | None = None,
        compute_dtype: Any = None,
        tokens_per_example: int = 1,
        grad_norm: bool = False,
        donate: bool = True,
        remat: str = "none",
        microbatches: int | None = None,
        schedule: str | None = None,
        virtual_stages: int = 1,
    ) -> None:
        from meshkit.adapters import Adapted

        if not callable(loss_fn):
            raise PlanError(f"loss_fn must be a function, got {type(loss_fn).__name__}")
        self.adapted = params if isinstance(params, Adapted) else None
        if self.adapted is not None:
            if state is not None:
                raise PlanError("state= is taken from the adapted model: drop state=")
            loss_fn = self.adapted.loss(loss_fn, has_aux=has_aux, rng=rng is not None)
            params, state = self.adapted.params, self.adapted.state
            logical_axes = self.adapted.logical_axes if logical_axes is None else logical_axes
            stateful = True
        else:
            stateful = state is not None
        _check_optimizer(optimizer)
        check_params(params)
        check_state(state)
        self.plan_choice = None
        """With ``plan="auto"``: the plan chosen and why (``meshkit.planner.auto.Choice``)."""
        if plan == "auto":
            plan, mesh = self._auto(params, optimizer, mesh, logical_axes)
        self.plan = get_plan(plan)
        if accumulate < 1:
            raise PlanError(f"accumulate must be at least 1, got {accumulate}")
        if clip_norm is not None and clip_norm <= 0:
            raise PlanError(f"clip_norm must be positive, got {clip_norm}")
        self._key = _base_key(rng)
        if compute_dtype is not None and not jnp.issubdtype(jnp.dtype(compute_dtype), jnp.floating):
            raise PlanError(
                f"compute_dtype must be a floating dtype such as 'bfloat16', got {compute_dtype!r}"
            )
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        spec = _DEFAULT_MESH[self.plan.name] if mesh is None else mesh
        if isinstance(spec, Mesh):
            self.mesh = as_auto(spec)
        elif isinstance(spec, str | Mapping | list | tuple):
            self.mesh = make_mesh(spec, axis_types="auto")
        else:
            raise PlanError(
                f"mesh must be a spec such as 'data=4,model=2' or a jax.sharding.Mesh, got {type(spec).__name__}"
            )
        self.layout: Layout = make_layout(
            params,
            self.plan,
            self.mesh,
            rules=rules,
            logical_axes=logical_axes,
            min_shard_size=min_shard_size,
            units=units,
        )
        self.pipeline = _pipeline_of(self.plan, loss_fn, params, self.layout, microbatches, schedule, virtual_stages,
                                     {"state=": stateful, "rng=": rng is not None, "has_aux=True": has_aux,
                                      "accumulate=": accumulate != 1}, remat)  # fmt: skip
        if self.pipeline is not None:
            self.layout = self.pipeline.layout
        self.optimizer = optimizer
        self.accumulate = accumulate
        self.tokens_per_example = tokens_per_example
        self.steps_done = 0
        """Optimizer steps taken (the per-step key is ``fold_in(rng, steps_done)``)."""
        self._param_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), params)
        param_sh = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            self.layout.param_specs(),
            is_leaf=lambda x: isinstance(x, P),
        )
        replicated = NamedSharding(self.mesh, P())
        self.shardings = StepShardings(
            params=param_sh,
            opt_state=state_shardings(optimizer, params, self.layout),
            batch=NamedSharding(self.mesh, P(DATA) if DATA in self.mesh.shape else P()),
            scalar=replicated,
            state=jax.tree.map(lambda _: replicated, state),
        )
        # A fresh copy: steps donate their inputs, and device_put may hand back the caller's buffers.
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=(param_sh, self.shardings.state))
        self.params, self.state = copy(_to_host_if_other_mesh((params, state), self.mesh))
        self.opt_state = jax.jit(optimizer.init, out_shardings=self.shardings.opt_state)(self.params)
        self._loss = as_step_loss(loss_fn, stateful=stateful, rng=rng is not None, has_aux=has_aux)
        self.per_layer = PerLayer(layout=self.layout, remat=remat)
        self._step = build_step(
            self._loss,
            optimizer,
            self.layout,
            self.shardings,
            accumulate=accumulate,
            clip_norm=clip_norm,
            grad_norm=grad_norm,
            donate=donate,
            compute_dtype=self.compute_dtype,
            per_layer=self.per_layer,
            gradients=None if self.pipeline is None else self.pipeline.gradients(),
        )
        self.last_schedule: jax.Array | None = None
        """Pipeline plans: the schedule the last step executed, ``(ticks, stages, 3)`` (see ``_pipeline``)."""
        self._compiled: dict[Any, jax.stages.Compiled] = {}

    def _auto(self, params: Any, optimizer: Any, mesh: Any, logical_axes: Any) -> tuple[str, str]:
        """``plan="auto"``: the ZeRO ladder by meshkit's cost model (``meshkit.planner.auto``), logged."""
        import logging

        from meshkit.planner.auto import choose_generic

        if mesh is not None:
            raise PlanError("plan='auto' chooses the mesh too: drop mesh=, or name a plan")
        self.plan_choice = choose_generic(params, optimizer, logical_axes=logical_axes)
        logging.getLogger("meshkit").info(self.plan_choice.line())
        return self.plan_choice.plan, self.plan_choice.mesh

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
            lambda a: a if isinstance(a, jax.Array) and a.sharding == self.shardings.batch else jax.device_put(_host_if_other_mesh(a, self.mesh), self.shardings.batch),
            batch,
        )  # fmt: skip

    def check_examples(self, n: int) -> None:
        """Raise unless a global batch of ``n`` examples divides over the data axis and micro-batches."""
        data = int(self.mesh.shape.get(DATA, 1))
        what, m = (
            ("accumulate", self.accumulate)
            if self.pipeline is None
            else ("microbatches", self.pipeline.microbatches)
        )
        if n % (data * m):
            raise PlanError(
                f"batch of {n} examples does not divide over data={data} x {what}={m}; use a multiple of {data * m}"
            )

    # -- steps ------------------------------------------------------------------------------
    def step(self, batch: Any) -> dict[str, jax.Array]:
        """One optimizer step on the global batch; returns {'loss'}, the aux metrics and, when
        computed, 'grad_norm'."""
        batch = self.put_batch(batch)
        key = self._step_key()
        self.params, self.opt_state, self.state, metrics = self._executable(batch)(
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
        return {"step": self.steps_done, "trainer": {"plan": self.plan.name, "mesh": dict(self.mesh.shape),
                "model_state": bool(jax.tree.leaves(self.state))}}  # fmt: skip

    def _opt_item(self, opt_state: Any, state: Any) -> Any:
        """The checkpoint's ``opt_state`` item: the optimizer state, with the model state beside it
        when there is one (keys as their uint32 data)."""
        if not jax.tree.leaves(state):
            return opt_state
        data = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)
        return {"optimizer": opt_state, "model_state": data}

    @classmethod
    def restore(
        cls, directory: str | Path, loss_fn: Callable[..., Any], params: Any, optimizer: optax.GradientTransformation,
        *, step: int | None = None, **kwargs: Any,
    ) -> Trainer:  # fmt: skip
        """A Trainer built as ``Trainer(loss_fn, params, optimizer, **kwargs)`` (``params`` gives the
        structure: the initial parameters or an adapted model), then loaded from ``directory``
        (a ``trainer.save`` or ``meshkit train`` checkpoint; the latest step unless ``step``),
        resharded onto this plan and mesh. Training continues where it stopped, keys included."""
        from meshkit.train.checkpoint import Checkpointer, abstract_with

        t = cls(loss_fn, params, optimizer, **kwargs)
        like_params = abstract_with(t.params, t.shardings.params)
        like_opt = t._opt_item(
            abstract_with(t.opt_state, t.shardings.opt_state),
            jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, t.state),
                         t.shardings.state),
        )  # fmt: skip
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
        """Measured communication per step and per-device memory beside the plan's model."""
        compiled = self.compiled(batch)
        ledger = communication(compiled, mesh=self.mesh)
        n_examples = jax.tree.leaves(batch)[0].shape[0]
        tokens = n_examples // (int(self.mesh.shape.get(DATA, 1)) * self.accumulate) * self.tokens_per_example
        fed = frozenset()
        if self.layout.model_size > 1:  # column-parallel matmuls on the batch itself need no input gradient
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (self.params, self.state))
            fed = batch_fed(self._loss, *shapes, self.put_batch(batch), self._step_key())
        low = None
        if self.compute_dtype is not None and self.plan.gathers_in_compute_dtype:
            # XLA's CPU compiler moves sub-32-bit floats as f32
            cpu = self.mesh.devices.flat[0].platform == "cpu"
            low = max(self.compute_dtype.itemsize, 4) if cpu else self.compute_dtype.itemsize
        expected = expected_collectives(self.layout, self.accumulate, tokens_per_device=tokens, batch_fed=fed,
                                        gather_itemsize=low, per_layer=self.per_layer)  # fmt: skip
        if self.pipeline is not None:  # its data-axis rows as above (ZeRO-3: once per step); the rest its own
            expected = [*expected, *self.pipeline.expected(self._param_shapes, batch)]
        formula = memory_formula(self.layout, self.optimizer, self._param_shapes)
        mem = [
            MemoryRow(component="params", measured_bytes=device_bytes(self.params), formula_bytes=formula["params"]),
            MemoryRow(component="optimizer", measured_bytes=device_bytes(self.opt_state), formula_bytes=formula["optimizer"]),
        ]  # fmt: skip
        compiled_memory = memory(compiled)
        return PlanReport(
            peak=None  # the peak model describes the non-pipeline step; a pipeline reports its stash
            if self.pipeline is not None
            else peak_report(
                compiled_memory,
                self._loss,
                self.per_layer,
                self._param_shapes,
                batch,
                self.optimizer,
                self.accumulate,
                state=self.state,
                key=self._step_key(),
            ),
            plan=self.plan.name,
            mesh={k: int(v) for k, v in self.mesh.shape.items()},
            communication=compare_communication(ledger, expected),
            memory=mem,
            compiled_memory=compiled_memory,
            replicated=self.layout.replicated(),
            ledger=ledger,
            pipeline=None
            if self.pipeline is None
            else self.pipeline.report(
                self.last_schedule, self._param_shapes, batch, compiled_memory.temp_bytes
            ),
        )

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.shape.values())


def _pipeline_of(plan, loss_fn, params, layout, microbatches, schedule, virtual_stages, extras, remat="none"):
    """A pipeline plan's ``Pipeline`` (checked), or None; other plans refuse the pipeline options."""
    from meshkit.plans._pipeline import Pipeline

    if plan.pipeline:
        return Pipeline.make(loss_fn, params, layout, microbatches=microbatches, schedule=schedule,
                             virtual_stages=virtual_stages, extras=extras, remat=remat)  # fmt: skip
    if microbatches is not None or schedule is not None or virtual_stages != 1:
        raise PlanError(
            f"microbatches=, schedule= and virtual_stages= are for pipeline plans (pp, dp+pp, fsdp+pp, tp+pp, dp+tp+pp, fsdp+tp+pp), not {plan.name}; "
            f"use accumulate= for micro-batches"
        )
    return None


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host_if_other_mesh(a: Any, mesh: Mesh) -> Any:
    """An array laid out on another mesh (e.g. the user's Explicit one) is brought to the host first."""
    if isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and a.sharding.mesh != mesh:
        if _is_key(a):
            return jax.random.wrap_key_data(np.asarray(jax.random.key_data(a)), impl=jax.random.key_impl(a))
        return np.asarray(a)
    return a


def _to_host_if_other_mesh(tree: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda a: _host_if_other_mesh(a, mesh), tree)
