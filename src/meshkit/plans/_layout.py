"""Where each parameter, gradient, optimizer-state leaf and batch lives under a plan.

A plan is data: which ZeRO stage runs on the ``data`` axis and whether tensor-parallel rules
shard leaves on the ``model`` axis. ``make_layout`` turns it, the parameter shapes and the mesh
into per-leaf decisions (``LeafLayout``) and the PartitionSpecs the step pins on input and output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshkit._errors import MeshkitError

DATA, MODEL = "data", "model"
STAGE = "stage"
"""The mesh axis pipeline plans split the layers over (``_pipeline``)."""
STAGES = ("dp", "zero1", "zero2", "zero3")


class PlanError(MeshkitError):
    """A plan cannot be applied to this model, mesh or optimizer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A parallel layout, as data."""

    name: str
    stage: str
    """ZeRO stage on the data axis: 'dp' (replicate everything), 'zero1' (shard optimizer state),
    'zero2' (also reduce-scatter gradients per micro-batch), 'zero3' (also shard parameters)."""
    tensor: bool
    """Whether tensor-parallel rules shard leaves on the model axis (Megatron column/row)."""
    needs: tuple[str, ...]
    """Mesh axes the plan requires."""
    pipeline: bool = False
    """Whether the stacked layers of a ``meshkit.Stages`` model are split over the stage axis."""

    @property
    def gathers_in_compute_dtype(self) -> bool:
        """Whether, under mixed precision, ZeRO-3's data-axis gathers and reduce-scatters move the
        parameters cast to the compute dtype (half the bytes for bf16). Not under tensor parallelism:
        XLA:CPU (JAX 0.12) aborts compiling low-precision shards gathered on data while the model axis
        is the partitioner's ("Invalid binary instruction opcode copy"), so fsdp+tp gathers in the
        parameters' dtype and the model casts them; nor in pipelines, which gather in their own way."""
        return self.stage == "zero3" and not self.tensor and not self.pipeline


PLANS: dict[str, Plan] = {
    "dp": Plan(name="dp", stage="dp", tensor=False, needs=(DATA,)),
    "zero1": Plan(name="zero1", stage="zero1", tensor=False, needs=(DATA,)),
    "zero2": Plan(name="zero2", stage="zero2", tensor=False, needs=(DATA,)),
    "zero3": Plan(name="zero3", stage="zero3", tensor=False, needs=(DATA,)),
    "fsdp": Plan(name="fsdp", stage="zero3", tensor=False, needs=(DATA,)),
    "tp": Plan(name="tp", stage="dp", tensor=True, needs=(MODEL,)),
    "dp+tp": Plan(name="dp+tp", stage="dp", tensor=True, needs=(DATA, MODEL)),
    "fsdp+tp": Plan(name="fsdp+tp", stage="zero3", tensor=True, needs=(DATA, MODEL)),
    "pp": Plan(name="pp", stage="dp", tensor=False, needs=(STAGE,), pipeline=True),
    "dp+pp": Plan(name="dp+pp", stage="dp", tensor=False, needs=(DATA, STAGE), pipeline=True),
    "fsdp+pp": Plan(name="fsdp+pp", stage="zero3", tensor=False, needs=(DATA, STAGE), pipeline=True),
    "tp+pp": Plan(name="tp+pp", stage="dp", tensor=True, needs=(MODEL, STAGE), pipeline=True),
    "dp+tp+pp": Plan(name="dp+tp+pp", stage="dp", tensor=True, needs=(DATA, MODEL, STAGE), pipeline=True),
    "fsdp+tp+pp": Plan(
        name="fsdp+tp+pp", stage="zero3", tensor=True, needs=(DATA, MODEL, STAGE), pipeline=True
    ),
}

#: Megatron rules over the reference models' logical axis names: attention heads and the MLP
#: hidden dimension go to the model axis (column-parallel in, row-parallel out).
DEFAULT_TP_RULES: dict[str, str] = {"heads": MODEL, "mlp": MODEL, MODEL: MODEL}
"""Default rules that match no axis of a model are ignored; rules a user passes must all match."""

Rules = Mapping[str, str] | Sequence[tuple[str, Sequence[str | None]]]


def get_plan(name: str | Plan) -> Plan:
    if isinstance(name, Plan):
        return name
    if name not in PLANS:
        raise PlanError(f"unknown plan {name!r}: choose one of {', '.join(PLANS)}")
    return PLANS[name]


@dataclass(frozen=True, kw_only=True, slots=True)
class LeafLayout:
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

    @property
    def model_sharded(self) -> bool:
        return MODEL in self.model_spec  # (a pipeline's stage split is in the spec too; it is not this)

    def spec(self, *, data: bool) -> P:
        """Global PartitionSpec: the TP split, plus the data split where ``data``."""
        dims = list(self.model_spec)
        if data and self.data_dim is not None:
            dims[self.data_dim] = DATA
        return P(*dims)

    def manual_spec(self, *, data: bool) -> P:
        """Spec over the data axis alone (what shard_map's manual region sees)."""
        if not data or self.data_dim is None:
            return P()
        return P(*[DATA if d == self.data_dim else None for d in range(len(self.shape))])


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Every leaf's decisions, in the parameter tree's structure, plus mesh sizes."""

    plan: Plan
    mesh: Mesh
    leaves: Any
    """Pytree of LeafLayout, structured like the parameters."""

    @property
    def data_size(self) -> int:
        return int(self.mesh.shape.get(DATA, 1))

    @property
    def model_size(self) -> int:
        return int(self.mesh.shape.get(MODEL, 1))

    @property
    def has_data_axis(self) -> bool:
        return DATA in self.mesh.shape

    def tree(self, fn) -> Any:
        return jax.tree.map(fn, self.leaves, is_leaf=lambda x: isinstance(x, LeafLayout))

    def flat(self) -> list[LeafLayout]:
        return jax.tree.leaves(self.leaves, is_leaf=lambda x: isinstance(x, LeafLayout))

    def param_specs(self) -> Any:
        return self.tree(lambda leaf: leaf.spec(data=self.plan.stage == "zero3"))

    def state_specs(self) -> Any:
        """Specs of parameter-shaped optimizer state (sharded on data from ZeRO-1 on)."""
        return self.tree(lambda leaf: leaf.spec(data=self.plan.stage != "dp"))

    def grad_specs(self) -> Any:
        return self.state_specs()

    def replicated(self) -> list[tuple[str, str]]:
        """(path, reason) of leaves a ZeRO plan keeps whole on the data axis."""
        if self.plan.stage == "dp":
            return []
        return [(leaf.path, leaf.why_replicated) for leaf in self.flat() if leaf.data_dim is None]


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _check_units(units: Mapping[str, int], rules: Rules, model_size: int) -> None:
    """Logical axes made of whole units (attention heads) must split into whole units per device."""
    if not isinstance(rules, Mapping):
        return
    for name, count in units.items():
        if rules.get(name) == MODEL and count % model_size:
            fits = [d for d in range(1, count + 1) if count % d == 0]
            raise PlanError(
                f"{count} {name} do not divide over model={model_size}: each device must hold whole {name}; "
                f"use a model axis of {', '.join(map(str, fits))}"
            )


def _model_specs(
    params: Any, plan: Plan, rules: Rules | None, logical_axes: Any, model_size: int, units: Mapping[str, int]
) -> dict:
    """Per-leaf TP spec by path; raises when a rule matches nothing or a split does not divide."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    out = {_path_str(p): (None,) * len(leaf.shape) for p, leaf in flat}
    if not plan.tensor:
        return out
    defaults = rules is None
    rules = DEFAULT_TP_RULES if defaults else rules
    _check_units(units, rules, model_size)
    if isinstance(rules, Mapping):
        if logical_axes is None:
            raise PlanError(
                f"plan {plan.name} maps logical axes {dict(rules)} but the model gives no logical_axes; "
                f"pass logical_axes=model.logical_axes(params), or path rules such as [('.*w_in', (None, 'model'))]"
            )
        names = jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0]
        shapes = {_path_str(p): leaf.shape for p, leaf in flat}
        used = set()
        for p, axes in names:
            key = _path_str(p)
            if key not in shapes:
                raise PlanError(
                    f"logical_axes names {key!r}, which is no parameter: give the parameters' structure"
                )
            if len(axes) > len(shapes[key]):
                raise PlanError(
                    f"logical_axes for {key} name {len(axes)} dims {axes} but the parameter has shape {shapes[key]}"
                )
            axes = (
                *axes,
                *(None,) * (len(shapes[key]) - len(axes)),
            )  # linen gives () for an unannotated bias
            spec = tuple(rules.get(a) if isinstance(a, str) else None for a in axes)
            used |= {a for a in axes if a in rules}
            out[key] = spec
        unused = sorted(set(rules) - used)
        if unused and not defaults:
            raise PlanError(
                f"tensor-parallel rule(s) for {unused} match no parameter: check the logical axis names"
            )
    else:
        for pattern, spec in rules:
            hits = [k for k in out if re.fullmatch(pattern, k)]
            if not hits:
                raise PlanError(
                    f"tensor-parallel rule {pattern!r} matches no parameter path (paths look like {next(iter(out))!r})"
                )
            for k in hits:
                out[k] = tuple(spec) + (None,) * (len(out[k]) - len(spec))
    shapes = {_path_str(p): leaf.shape for p, leaf in flat}
    for k, spec in out.items():
        for d, axis in enumerate(spec):
            if axis is not None and shapes[k][d] % model_size:
                raise PlanError(
                    f"parameter {k} dim {d} of size {shapes[k][d]} does not divide over model={model_size}; "
                    f"pick a model axis size that divides it"
                )
    if not any(any(s) for s in out.values()):
        raise PlanError(
            f"plan {plan.name}: the tensor-parallel rules shard no parameter; annotate logical axes "
            f"{sorted(rules) if isinstance(rules, Mapping) else ''} (e.g. nnx.with_partitioning(init, (None, 'mlp'))) or pass rules="
        )
    return out


def _data_dim(
    shape: tuple[int, ...],
    model_spec,
    n: int,
    min_size: int,
    *,
    two_d: bool,
    skip: frozenset[int] = frozenset(),
) -> tuple[int | None, str | None]:
    """The dim a ZeRO plan splits over data: the largest that divides, other than a dim split on the
    model axis (``two_d``: fsdp+tp splits such a leaf on both axes, else it stays whole on data)
    or a ``skip``ped one (a scanned model's stacked layer axis, which its scan slices)."""
    if any(a is not None for a in model_spec) and not two_d:
        return None, "split on the model axis (a leaf is not split on both axes)"
    size = 1
    for s in shape:
        size *= s
    if size < max(min_size, 1) or not shape:
        return None, f"too small ({size} elements)"
    free = [d for d in range(len(shape)) if model_spec[d] is None and d not in skip]
    for d in sorted(free, key=lambda d: (-shape[d], d)):
        if shape[d] % n == 0:
            return d, None
    excluded = " other than its model-split and stacked-layer dims" if len(free) < len(shape) else ""
    return None, f"no dim of {shape}{excluded} divides over data={n}"


def _layer_dims(params: Any, logical_axes: Any) -> dict[str, frozenset[int]]:
    """Per leaf path, the dims the logical axes name ``"layers"`` (a scanned model's stacked axis)."""
    if logical_axes is None:
        return {}
    names = jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0]
    return {_path_str(p): frozenset(d for d, a in enumerate(axes) if a == "layers") for p, axes in names}


def make_layout(
    params: Any,
    plan: Plan,
    mesh: Mesh,
    *,
    rules: Rules | None = None,
    logical_axes: Any = None,
    min_shard_size: int = 1,
    units: Mapping[str, int] | None = None,
) -> Layout:
    """Decide, for every parameter leaf, its model-axis split and its data-axis ZeRO split.

    ``units``: logical axes made of whole units, e.g. ``{"heads": 4}``: the model axis must divide
    the count (a head split across devices is a wrong layout, not only a slow one).
    """
    example = {1: "stage=8", 2: "stage=4," + "".join(a for a in plan.needs if a != STAGE) + "=2",
               3: "stage=2,data=2,model=2"}[len(plan.needs)] if plan.pipeline else "data=4,model=2"  # fmt: skip
    for axis in plan.needs:
        if axis not in mesh.shape:
            raise PlanError(
                f"plan {plan.name} needs a mesh axis {axis!r}, but the mesh has "
                f"{', '.join(f'{k}={v}' for k, v in mesh.shape.items())}; add it, e.g. --mesh {example}"
            )
    for axis, size in mesh.shape.items():
        if axis not in plan.needs and size > 1:
            hints = {
                MODEL: "dp+tp or fsdp+tp",
                STAGE: "a pipeline plan (pp, dp+pp, fsdp+pp, tp+pp, dp+tp+pp, fsdp+tp+pp)",
                DATA: "dp+pp or fsdp+pp" if plan.pipeline else "",
            }
            hint = hints.get(axis) or "a mesh with only " + " and ".join(plan.needs)
            raise PlanError(f"plan {plan.name} does not use mesh axis {axis}={size}; use {hint}")
    n = int(mesh.shape.get(DATA, 1))
    stacked = _layer_dims(params, logical_axes)
    model = _model_specs(params, plan, rules, logical_axes, int(mesh.shape.get(MODEL, 1)), units or {})

    def leaf(path, x) -> LeafLayout:
        key = _path_str(path)
        shape = tuple(x.shape)
        if plan.stage == "dp" or DATA not in mesh.shape:
            dim, why = None, "data-parallel plan"
        else:
            dim, why = _data_dim(shape, model[key], n, min_shard_size, two_d=plan.tensor and plan.stage == "zero3",
                                 skip=stacked.get(key, frozenset()))  # fmt: skip
        nbytes = int(x.size * x.dtype.itemsize) if hasattr(x, "dtype") else 0
        return LeafLayout(
            path=key, shape=shape, nbytes=nbytes, model_spec=model[key], data_dim=dim, why_replicated=why
        )

    return Layout(plan=plan, mesh=mesh, leaves=jax.tree_util.tree_map_with_path(leaf, params))
