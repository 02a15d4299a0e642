"""``Trainer``: a user's loss, parameters and optax optimizer, trained under any plan."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.analysis import CommLedger, MemoryLedger, communication, memory
from meshkit.analysis.peak import peak_report
from meshkit.mesh import make_mesh
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
from meshkit.plans._fsdp import PerLayer
from meshkit.plans._layout import DATA, Rules

_DEFAULT_MESH = {"dp": "data=-1", "zero1": "data=-1", "zero2": "data=-1", "zero3": "data=-1", "fsdp": "data=-1",
                 "tp": "model=-1", "dp+tp": "data=-1,model=2", "fsdp+tp": "data=-1,model=2"}  # fmt: skip


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

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.communication) and all(r.ok for r in self.memory)

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
        }


def _check_optimizer(optimizer: Any) -> None:
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise PlanError(
            f"optimizer must be an optax.GradientTransformation (e.g. optax.adamw(3e-4)), got {type(optimizer).__name__}"
        )


class Trainer:
    """Train ``loss_fn(params, batch) -> scalar`` with ``optimizer`` under ``plan`` on ``mesh``.

    ``trainer.step(batch)`` takes the global batch (host arrays or global jax.Arrays, leading dim =
    examples) and returns the metrics; ``trainer.params`` holds the global, sharded parameters;
    ``trainer.compiled(batch)`` is the compiled step for the ledgers; ``trainer.report(batch)``
    sets measured communication and memory beside the plan's model.

    ``remat`` is the activation-checkpoint policy per layer ('none', 'layer', 'dots', 'regather';
    see ``meshkit.plans._fsdp``); under zero3/fsdp a layer's parameters are gathered inside it. Layers
    are found in the loss: a ``lax.scan`` over stacked parameters, or blocks marked ``meshkit.layer``.
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        params: Any,
        optimizer: optax.GradientTransformation,
        *,
        plan: str = "dp",
        mesh: str | Mesh | None = None,
        accumulate: int = 1,
        clip_norm: float | None = None,
        rules: Rules | None = None,
        logical_axes: Any = None,
        min_shard_size: int = 1,
        tokens_per_example: int = 1,
        grad_norm: bool = False,
        donate: bool = True,
        remat: str = "none",
    ) -> None:
        _check_optimizer(optimizer)
        self.plan = get_plan(plan)
        if accumulate < 1:
            raise PlanError(f"accumulate must be at least 1, got {accumulate}")
        if clip_norm is not None and clip_norm <= 0:
            raise PlanError(f"clip_norm must be positive, got {clip_norm}")
        spec = _DEFAULT_MESH[self.plan.name] if mesh is None else mesh
        self.mesh = spec if isinstance(spec, Mesh) else make_mesh(spec, axis_types="auto")
        self.layout: Layout = make_layout(
            params,
            self.plan,
            self.mesh,
            rules=rules,
            logical_axes=logical_axes,
            min_shard_size=min_shard_size,
        )
        self.optimizer = optimizer
        self.accumulate = accumulate
        self.tokens_per_example = tokens_per_example
        self._param_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), params)
        param_sh = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            self.layout.param_specs(),
            is_leaf=lambda x: isinstance(x, P),
        )
        self.shardings = StepShardings(
            params=param_sh,
            opt_state=state_shardings(optimizer, params, self.layout),
            batch=NamedSharding(self.mesh, P(DATA) if DATA in self.mesh.shape else P()),
            scalar=NamedSharding(self.mesh, P()),
        )
        # A fresh copy: steps donate their inputs, and device_put may hand back the caller's buffers.
        self.params = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=param_sh)(params)
        self.opt_state = jax.jit(optimizer.init, out_shardings=self.shardings.opt_state)(self.params)
        self.per_layer = PerLayer(layout=self.layout, remat=remat)
        self._loss_fn = loss_fn
        self._step = build_step(
            loss_fn,
            optimizer,
            self.layout,
            self.shardings,
            accumulate=accumulate,
            clip_norm=clip_norm,
            grad_norm=grad_norm,
            donate=donate,
            per_layer=self.per_layer,
        )
        self._compiled: dict[Any, jax.stages.Compiled] = {}

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
            lambda a: a if isinstance(a, jax.Array) and a.sharding == self.shardings.batch else jax.device_put(a, self.shardings.batch),
            batch,
        )  # fmt: skip

    def check_examples(self, n: int) -> None:
        """Raise unless a global batch of ``n`` examples divides over the data axis and micro-batches."""
        data = int(self.mesh.shape.get(DATA, 1))
        if n % (data * self.accumulate):
            raise PlanError(
                f"batch of {n} examples does not divide over data={data} x accumulate={self.accumulate}; "
                f"use a multiple of {data * self.accumulate}"
            )

    # -- steps ------------------------------------------------------------------------------
    def step(self, batch: Any) -> dict[str, jax.Array]:
        """One optimizer step on the global batch; returns {'loss'} and, when computed, 'grad_norm'."""
        batch = self.put_batch(batch)
        self.params, self.opt_state, metrics = self._executable(batch)(self.params, self.opt_state, batch)
        return metrics

    def compiled(self, batch: Any) -> jax.stages.Compiled:
        """The compiled step for a batch of this shape: the very executable ``step`` runs."""
        return self._executable(self.put_batch(batch))

    def _executable(self, placed: Any) -> jax.stages.Compiled:
        """Compile once per batch shape; the steps and the report share the executable."""
        key = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(placed))
        if key not in self._compiled:
            self._compiled[key] = self._step.lower(self.params, self.opt_state, placed).compile()
        return self._compiled[key]

    # -- proof ------------------------------------------------------------------------------
    def report(self, batch: Any) -> PlanReport:
        """Measured communication per step and per-device memory beside the plan's model."""
        compiled = self.compiled(batch)
        ledger = communication(compiled, mesh=self.mesh)
        n_examples = jax.tree.leaves(batch)[0].shape[0]
        tokens = n_examples // (int(self.mesh.shape.get(DATA, 1)) * self.accumulate) * self.tokens_per_example
        expected = expected_collectives(
            self.layout, self.accumulate, tokens_per_device=tokens, per_layer=self.per_layer
        )
        formula = memory_formula(self.layout, self.optimizer, self._param_shapes)
        mem = [
            MemoryRow(component="params", measured_bytes=device_bytes(self.params), formula_bytes=formula["params"]),
            MemoryRow(component="optimizer", measured_bytes=device_bytes(self.opt_state), formula_bytes=formula["optimizer"]),
        ]  # fmt: skip
        compiled_memory = memory(compiled)
        return PlanReport(
            peak=peak_report(
                compiled_memory,
                self._loss_fn,
                self.per_layer,
                self._param_shapes,
                batch,
                self.optimizer,
                self.accumulate,
            ),
            plan=self.plan.name,
            mesh={k: int(v) for k, v in self.mesh.shape.items()},
            communication=compare_communication(ledger, expected),
            memory=mem,
            compiled_memory=compiled_memory,
            replicated=self.layout.replicated(),
            ledger=ledger,
        )

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.shape.values())
