"""Where each parameter, gradient, optimizer-state leaf and batch lives under a plan.

A plan is data: which ZeRO stage runs on the ``data`` axis and whether tensor-parallel rules
shard leaves on the ``model`` axis. ``place`` turns it, the parameter shapes and the mesh
into per-leaf decisions (``LeafPlacement``) and the PartitionSpecs the step pins on input and output:
the split on ``model`` is the tensor-parallel rules' (``tp_rules``), the split on ``data`` the ZeRO
stage's (``_zero_split``), and an axis with a logical rule (``AxisRule.logical``: the experts) splits
the dims of that name here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshkit.plans._leaf_paths import logical_names, path_str
from meshkit.plans._zero_split import data_dim, layer_dims
from meshkit.plans.tp_rules import Rules, model_specs
from meshkit.spec import DATA, MODEL, REPLICA, AxisRule, Plan, PlanError, check_axes, plans_of


@dataclass(frozen=True, kw_only=True, slots=True)
class LeafPlacement:
    """Decisions for one parameter leaf."""

    path: str
    shape: tuple[int, ...]
    nbytes: int
    model_spec: tuple[str | None, ...]
    """Per-dim mesh axis from the TP rules (None = not split on the model axis)."""
    data_dim: int | None
    """The dim split on the data axis by ZeRO (None = replicated on data)."""
    why_replicated: str | None
    """Why a ZeRO plan keeps this leaf whole on the data axis."""
    why_whole_on_model: str | None = None
    """Why a default tensor-parallel rule left this leaf whole on the model axis (``WHERE_DIVIDES``)."""
    names: tuple[str | None, ...] = ()
    """The leaf's logical axis names, where the model gives them (``_expected`` reads the vocabulary's)."""

    @property
    def model_sharded(self) -> bool:
        return MODEL in self.model_spec  # (a pipeline's stage split is in the spec too; it is not this)

    def spec(self, *, data: bool) -> P:
        """Global PartitionSpec: the TP split, plus the data split where ``data``."""
        dims = list(self.model_spec)
        if data and self.data_dim is not None:
            dims[self.data_dim] = DATA
        return P(*dims)

    def manual_spec(self, *, data: bool, manual: tuple[str, ...] = ()) -> P:
        """Spec over the step's manual axes alone (what its shard_map region sees): the data split where
        ``data``, and the leaf's splits on the other ``manual`` axes (the expert split; the model axis is
        the compiler's, never named)."""
        dims = [a if a in manual and a != DATA else None for a in self.model_spec]
        if data and self.data_dim is not None:
            dims[self.data_dim] = DATA
        return P(*dims) if any(dims) else P()


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Every leaf's decisions, in the parameter tree's structure, plus mesh sizes."""

    plan: Plan
    mesh: Mesh
    leaves: Any
    """Pytree of LeafPlacement, structured like the parameters."""
    units: Mapping[str, int] = field(default_factory=dict)
    """Logical axes made of whole units (``{"heads": 8, "kv_heads": 2}``), where the caller named them."""

    @property
    def data_size(self) -> int:
        return int(self.mesh.shape.get(DATA, 1))

    @property
    def model_size(self) -> int:
        return int(self.mesh.shape.get(MODEL, 1))

    @property
    def has_data_axis(self) -> bool:
        return DATA in self.mesh.shape

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (``Plan.batch_axes``, those the mesh has)."""
        return tuple(a for a in self.plan.batch_axes if a in self.mesh.shape) or (
            (DATA,) if self.has_data_axis else ()
        )

    @property
    def replica_size(self) -> int:
        """Hybrid sharding's replicas (the ``replica`` axis): groups holding the same shards."""
        return int(self.mesh.shape.get(REPLICA, 1))

    def size(self, axis: str) -> int:
        """Devices on ``axis`` where the plan uses it, else 1."""
        return int(self.mesh.shape.get(axis, 1)) if axis in self.plan.needs else 1

    @property
    def batch_devices(self) -> int:
        """Devices the batch's rows are split over: the data axis, times the replicas under hybrid
        sharding, times every other axis that splits rows (the expert axis)."""
        return math.prod(int(self.mesh.shape[a]) for a in self.batch_axes)

    @property
    def region_axes(self) -> tuple[str, ...]:
        """The axes the step's gradient region is manual over (``_gradients.manual_gradients``): the batch
        axes, and those that split every sequence (``Plan.region_axes``: the context axis); the model
        axis is the compiler's."""
        return self.batch_axes + tuple(a for a in self.plan.split_axes("sequence") if a in self.mesh.shape)

    @property
    def live_axes(self) -> tuple[str, ...]:
        """The region's axes of more than one device: those gradients are summed over (XLA rejects a
        sum over an axis of one device where another axis is the partitioner's: fsdp+tp, data=1)."""
        return tuple(a for a in self.region_axes if self.mesh.shape[a] > 1)

    def sum_axes(self, leaf: LeafPlacement, live: tuple[str, ...] | None = None) -> tuple[str, ...]:
        """The axes a leaf's gradient is summed over after the micro-batch loop: every live axis but
        those the leaf is split on in the region: ``data`` where ZeRO reduce-scattered it there (its
        shards then summed over replica under hsdp, over context, over expert), an axis of a logical
        split (``AxisRule.logical``: an expert leaf's expert axis, whose gradient each device already
        sums over every device's tokens, through the all_to_all's transpose). The step's sums and the
        ledger's model (``_expected``) both ask this."""
        drop = {DATA} if leaf.data_dim is not None else set()
        drop |= {a for a in leaf.model_spec if a is not None}
        return tuple(a for a in (self.live_axes if live is None else live) if a not in drop)

    def batch_spec(self) -> P:
        """The batch's PartitionSpec: its rows over the batch axes."""
        axes = self.batch_axes
        return P(axes if len(axes) > 1 else axes[0]) if axes else P()

    def split(self, leaf: LeafPlacement) -> int:
        """Devices the leaf's non-data spec splits it over (the model axis; a pipeline's stage axis)."""
        n = 1
        for axis in {a for a in leaf.model_spec if a is not None}:
            n *= int(self.mesh.shape.get(axis, 1))
        return n

    def tree(self, fn) -> Any:
        return jax.tree.map(fn, self.leaves, is_leaf=lambda x: isinstance(x, LeafPlacement))

    def flat(self) -> list[LeafPlacement]:
        return jax.tree.leaves(self.leaves, is_leaf=lambda x: isinstance(x, LeafPlacement))

    def param_specs(self) -> Any:
        return self.tree(lambda leaf: leaf.spec(data=self.plan.shards_params))

    def state_specs(self) -> Any:
        """Specs of parameter-shaped optimizer state (sharded on data from ZeRO-1 on)."""
        return self.tree(lambda leaf: leaf.spec(data=self.plan.shards_optimizer))

    def grad_specs(self) -> Any:
        return self.state_specs()

    def replicated(self) -> list[tuple[str, str]]:
        """(path, reason) of leaves a ZeRO plan keeps whole on the data axis."""
        if not self.plan.shards_optimizer:
            return []
        return [(leaf.path, leaf.why_replicated) for leaf in self.flat() if leaf.data_dim is None]

    def whole_on_model(self) -> list[tuple[str, str]]:
        """(path, reason) of leaves a default tensor-parallel rule would split but that do not divide."""
        return [(leaf.path, leaf.why_whole_on_model) for leaf in self.flat() if leaf.why_whole_on_model]


def _logical_splits(
    model: dict[str, tuple], params: Any, names: dict[str, tuple], plan: Plan, mesh: Mesh
) -> dict[str, tuple]:
    """Every leaf's dims named by an axis's ``AxisRule.logical`` (``"expert"``) split over that axis where
    the plan uses it; refused where the model has none, or where they do not divide over the axis."""
    shapes = {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    out = dict(model)
    for rule in (r for r in plan.rules if r.logical is not None):
        counts = set()
        for key, axes in names.items():
            for d in (d for d, a in enumerate(axes) if a == rule.logical):
                out[key] = tuple(rule.axis if i == d else a for i, a in enumerate(out[key]))
                counts.add(shapes[key][d])
        for count in sorted(counts) or [0]:
            _check_logical(rule, count, int(mesh.shape.get(rule.axis, 1)))
    return out


def _check_logical(rule: AxisRule, count: int, n: int) -> None:
    """A logical split's dims (``count`` of them) must exist and divide evenly over the axis's ``n`` devices."""
    if count == 0:
        raise PlanError(
            f"{rule.field}-parallel plans ({', '.join(plans_of(rule.field))}) need {rule.model_needs}"
        )
    if count % n:
        fits = [d for d in range(1, count + 1) if count % d == 0]
        raise PlanError(
            f"{count} {rule.logical}s do not divide over {rule.axis}={n}: use an {rule.axis} axis of "
            f"{', '.join(map(str, fits))}, or a multiple of {n} {rule.logical}s"
        )


def place(
    params: Any,
    plan: Plan,
    mesh: Mesh,
    *,
    rules: Rules | None = None,
    logical_axes: Any = None,
    min_shard_size: int = 1,
    units: Mapping[str, int] | None = None,
) -> Placement:
    """Decide, for every parameter leaf, its model-axis split and its data-axis ZeRO split.

    ``units``: logical axes made of whole units, e.g. ``{"heads": 4}``: the model axis must divide
    the count (a head split across devices is a wrong placement, not only a slow one).
    """
    check_axes(plan, {str(k): int(v) for k, v in mesh.shape.items()})
    n = int(mesh.shape.get(DATA, 1))
    stacked = layer_dims(logical_axes)
    names = logical_names(logical_axes)
    notes: dict[str, str] = {}
    model = model_specs(params, plan, rules, logical_axes, int(mesh.shape.get(MODEL, 1)), units or {}, notes)
    model = _logical_splits(model, params, names, plan, mesh)

    def leaf(path, x) -> LeafPlacement:
        key = path_str(path)
        shape = tuple(x.shape)
        if not plan.shards_optimizer or DATA not in mesh.shape:
            dim, why = None, "data-parallel plan"
        else:
            dim, why = data_dim(
                shape,
                model[key],
                n,
                min_shard_size,
                two_d=plan.tensor and plan.shards_params,
                skip=stacked.get(key, frozenset()),
            )
        nbytes = int(x.size * x.dtype.itemsize) if hasattr(x, "dtype") else 0
        return LeafPlacement(
            path=key,
            shape=shape,
            nbytes=nbytes,
            model_spec=model[key],
            data_dim=dim,
            why_replicated=why,
            why_whole_on_model=notes.get(key),
            names=names.get(key, ()),
        )

    return Placement(
        plan=plan, mesh=mesh, leaves=jax.tree_util.tree_map_with_path(leaf, params), units=dict(units or {})
    )
