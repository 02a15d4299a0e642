"""Where each parameter, gradient, optimizer-state leaf and batch lives under a plan.

A plan is data: which ZeRO stage runs on the ``data`` axis and whether tensor-parallel rules
shard leaves on the ``model`` axis. ``place`` turns it, the parameter shapes and the mesh
into per-leaf decisions (``LeafPlacement``) and the PartitionSpecs the step pins on input and output.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshkit.spec import ADAPTER_RANK, DATA, MODEL, REPLICA, AxisRule, Plan, PlanError, check_axes, plans_of

#: Megatron rules over the reference models' logical axis names: attention heads and the MLP
#: hidden dimension go to the model axis (column-parallel in, row-parallel out); so do grouped-query
#: attention's key/value heads and the vocabulary of the embedding and the output head, where
#: they divide over it (``WHERE_DIVIDES``).
DEFAULT_TP_RULES: dict[str, str] = {"heads": MODEL, "kv_heads": MODEL, "mlp": MODEL, MODEL: MODEL}
"""A user's logical rules update these (a name mapped to None keeps that axis whole); default rules
that match no axis of a model are ignored, rules a user passes must each match some axis."""
VOCAB_TP_RULES: dict[str, str] = {**DEFAULT_TP_RULES, "vocab": MODEL}
"""The default rules plus the vocabulary of the embedding and the output head on the model axis, for
a loss that keeps split logits split (``meshkit.models.token_loss.cross_entropy``, every
token family's; optax's integer-label cross-entropy compiles to the same rows): the lookup is then an all-reduce of
``[tokens, width]`` and each reduction over the vocabulary one of ``[tokens]`` (``_expected``). Not under pipeline plans, whose model of the model axis has the blocks' rows only
(``vocab_rules``)."""
WHERE_DIVIDES: dict[str, str] = {
    "kv_heads": "each device then computes every key/value head and the model axis all-reduces "
    "their gradients",
    "vocab": "each device then holds the whole table and computes every logit",
}
"""Logical axes the default rules split only where the dim divides over the model axis; otherwise
the leaf stays whole on it, with the cost said (``LeafPlacement.why_whole_on_model``)."""

Rules = Mapping[str, str | None] | Sequence[tuple[str, Sequence[str | None]]]
"""Logical rules ``{logical name: mesh axis or None}``, combined with the plan's defaults (``vocab_rules``), or path
rules ``[(regex, spec)]``: searched for in each leaf's path (``a/b/c``), the first match deciding the
leaf, over what the default logical rules gave."""


def vocab_rules(plan: Plan | bool) -> dict[str, str]:
    """The default logical rules under ``plan`` (or True: a pipeline), what ``place`` starts from:
    ``VOCAB_TP_RULES``, or under a pipeline plan ``DEFAULT_TP_RULES`` (the embedding and head whole on
    the model axis)."""
    pipeline = plan if isinstance(plan, bool) else plan.pipeline
    return DEFAULT_TP_RULES if pipeline else VOCAB_TP_RULES


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
        """The axes the step's gradient region is manual over (``_step.manual_gradients``): the batch
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


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _check_units(units: Mapping[str, int], names: Mapping[str, str | None], model_size: int,
                 given: frozenset[str]) -> None:  # fmt: skip
    """Logical axes made of whole units (attention heads) must split into whole units per device
    (where a default rule of ``WHERE_DIVIDES`` splits them, they stay whole instead)."""
    for name, count in units.items():
        if name in WHERE_DIVIDES and name not in given:
            continue
        if names.get(name) == MODEL and count % model_size:
            fits = [d for d in range(1, count + 1) if count % d == 0]
            raise PlanError(
                f"{count} {name} do not divide over model={model_size}: each device must hold whole {name}; "
                f"use a model axis of {', '.join(map(str, fits))}"
            )


#: Logical names a model keeps whole on the model axis by convention (the width; a scanned model's
#: stacked layer axis; positions; the vocabulary, split only by VOCAB_TP_RULES): no warning names
#: them when a default rule matches nothing.
_WHOLE_BY_CONVENTION = frozenset({"embed", "layers", "seq", "vocab", ADAPTER_RANK})


def _logical_rules(rules: Rules | None, plan: Plan) -> dict[str, str | None]:
    """The logical rules in effect: the plan's defaults (``vocab_rules``: the vocabulary on the model
    axis but under pipelines, as every caller gets them, ``meshkit train`` and a library user alike),
    updated by the user's (a name mapped to None keeps that axis whole: it removes a default)."""
    merged: dict[str, str | None] = dict(vocab_rules(plan))
    if isinstance(rules, Mapping):
        for name, axis in rules.items():
            _check_rule_axes(f"rules[{name!r}]", (axis,))
        merged.update(rules)
    return merged


def _check_rule_axes(where: str, axes: Sequence) -> None:
    if bad := [a for a in axes if a not in (None, MODEL)]:
        raise PlanError(
            f"{where} names mesh axis {bad[0]!r}: tensor-parallel rules split on {MODEL!r} or None"
        )


def _logical_specs(
    shapes: dict[str, tuple[int, ...]],
    names: dict[str, str | None],
    logical_axes: Any,
    given: frozenset[str],
    units: Mapping[str, int],
    model_size: int,
    notes: dict[str, str],
) -> dict[str, tuple]:
    """Per leaf path the spec the logical rules give it; a rule the user gave that matches no axis
    is refused, a default that matches none while other names stay unmapped is warned about. A
    default rule of ``WHERE_DIVIDES`` whose dim does not divide over the model axis leaves it whole
    (the reason in ``notes``)."""
    flat = jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0]
    out, seen = {}, set()
    for p, axes in flat:
        key = _path_str(p)
        if key not in shapes:
            raise PlanError(
                f"logical_axes names {key!r}, which is no parameter: give the parameters' structure"
            )
        if len(axes) > len(shapes[key]):
            raise PlanError(
                f"logical_axes for {key} name {len(axes)} dims {axes} but the parameter has shape {shapes[key]}"
            )
        axes = (*axes, *(None,) * (len(shapes[key]) - len(axes)))  # linen gives () for an unannotated bias
        spec = [names.get(a) if isinstance(a, str) else None for a in axes]
        for d, a in enumerate(axes):
            if a in WHERE_DIVIDES and a not in given and spec[d] == MODEL:
                count = units.get(a, shapes[key][d])
                if count % model_size:
                    spec[d] = None
                    notes[key] = (f"{count} {a} do not divide over model={model_size}: whole on the model "
                                  f"axis; {WHERE_DIVIDES[a]}")  # fmt: skip
        out[key] = tuple(spec)
        seen |= {a for a in axes if isinstance(a, str)}
    if unused := sorted(given - seen):
        raise PlanError(
            f"tensor-parallel rule(s) for {unused} match no parameter: the model's logical axes are "
            f"{sorted(seen)}; check the names"
        )
    # (the rules of WHERE_DIVIDES are for some models only: GQA's kv heads)
    idle = sorted(
        n for n in set(DEFAULT_TP_RULES) - seen - given - set(WHERE_DIVIDES) if n != MODEL and names.get(n)
    )
    unmapped = sorted(seen - set(names) - _WHOLE_BY_CONVENTION)
    if idle and unmapped:
        warnings.warn(
            f"default tensor-parallel rule(s) {idle} -> model match no logical axis of the model, and its "
            f"axes {unmapped} map to no rule (kept whole): to split them pass rules={{{unmapped[0]!r}: 'model'}}",
            stacklevel=6,
        )
    return out


def _path_specs(out: dict[str, tuple], rules: Sequence[tuple[str, Sequence[str | None]]]) -> dict[str, tuple]:
    """Path rules over the specs so far: a rule's regex is searched for anywhere in a leaf's path
    (``re.search``: anchor it with ``^``/``$``), and the first rule that matches a leaf decides it."""
    decided: set[str] = set()
    paths = list(out)
    for pattern, spec in rules:
        try:
            regex = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise PlanError(
                f"tensor-parallel rule {pattern!r} is not a regular expression ({e}): fix it"
            ) from None
        hits = [k for k in paths if regex.search(k)]
        if not hits:
            raise PlanError(
                f"tensor-parallel rule {pattern!r} matches no parameter path (it is searched for in paths "
                f"such as {paths[0]!r})"
            )
        spec = tuple(spec) if isinstance(spec, Sequence) and not isinstance(spec, str) else (spec,)
        _check_rule_axes(f"tensor-parallel rule {pattern!r}", spec)
        for k in hits:
            if k not in decided:
                if len(spec) > len(out[k]):
                    raise PlanError(
                        f"tensor-parallel rule {pattern!r} gives {len(spec)} dims {spec} but {k} has "
                        f"{len(out[k])}: give one entry per dim"
                    )
                out[k] = spec + (None,) * (len(out[k]) - len(spec))
                decided.add(k)
    return out


def _model_specs(
    params: Any,
    plan: Plan,
    rules: Rules | None,
    logical_axes: Any,
    model_size: int,
    units: Mapping[str, int],
    notes: dict[str, str],
) -> dict:
    """Per-leaf TP spec by path; raises when a rule matches nothing or a split does not divide (a
    default rule of ``WHERE_DIVIDES`` that does not divide leaves the dim whole, noted in ``notes``).

    How rules combine: logical rules (``{name: mesh axis}``) are the defaults (``DEFAULT_TP_RULES``)
    updated by the user's, applied to ``logical_axes``; path rules (``[(regex, spec)]``) then
    decide the leaves they match, over what the logical rules gave (see ``_path_specs``)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    shapes = {_path_str(p): tuple(leaf.shape) for p, leaf in flat}
    out = {k: (None,) * len(s) for k, s in shapes.items()}
    if not plan.tensor:
        return out
    names = _logical_rules(rules, plan)
    # the library's own rule sets are defaults too: none of their names must match
    given = frozenset(rules) if isinstance(rules, Mapping) and rules not in (DEFAULT_TP_RULES, VOCAB_TP_RULES) else frozenset()  # fmt: skip
    _check_units(units, names, model_size, given)
    path_rules = rules is not None and not isinstance(rules, Mapping)
    if logical_axes is not None:
        out.update(_logical_specs(shapes, names, logical_axes, given, units, model_size, notes))
    elif not path_rules:
        raise PlanError(
            f"plan {plan.name} maps logical axis names ({', '.join(sorted(k for k, v in names.items() if v))}) "
            f"to the model axis but the model gives no logical_axes: pass logical_axes= (like params, a tuple "
            f"of names per leaf, e.g. {{'w1': ('embed', 'mlp')}}) or path rules such as "
            f"rules=[(r'w1$', (None, 'model'))]"
        )
    if path_rules:
        out = _path_specs(out, rules)
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
            f"{sorted(k for k, v in names.items() if v)} (e.g. nnx.with_partitioning(init, (None, 'mlp'))) or pass rules="
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
        axis = next(a for a in model_spec if a is not None)  # the model axis, or the expert axis (fsdp+ep)
        return None, f"split on the {axis} axis (a leaf is not split on both axes)"
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


def _names(logical_axes: Any) -> dict[str, tuple]:
    """Per leaf path, its logical axis names (none without ``logical_axes``)."""
    if logical_axes is None:
        return {}
    names = jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0]
    return {_path_str(p): tuple(axes) for p, axes in names}


def _layer_dims(params: Any, logical_axes: Any) -> dict[str, frozenset[int]]:
    """Per leaf path, the dims the logical axes name ``"layers"`` (a scanned model's stacked axis)."""
    return {
        k: frozenset(d for d, a in enumerate(axes) if a == "layers")
        for k, axes in _names(logical_axes).items()
    }


def _logical_splits(model: dict[str, tuple], params: Any, names: dict[str, tuple], plan: Plan,
                    mesh: Mesh) -> dict[str, tuple]:  # fmt: skip
    """Every leaf's dims named by an axis's ``AxisRule.logical`` (``"expert"``) split over that axis where
    the plan uses it; refused where the model has none, or where they do not divide over the axis."""
    shapes = {_path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
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
    stacked = _layer_dims(params, logical_axes)
    names = _names(logical_axes)
    notes: dict[str, str] = {}
    model = _model_specs(params, plan, rules, logical_axes, int(mesh.shape.get(MODEL, 1)), units or {}, notes)
    model = _logical_splits(model, params, names, plan, mesh)

    def leaf(path, x) -> LeafPlacement:
        key = _path_str(path)
        shape = tuple(x.shape)
        if not plan.shards_optimizer or DATA not in mesh.shape:
            dim, why = None, "data-parallel plan"
        else:
            dim, why = _data_dim(shape, model[key], n, min_shard_size, two_d=plan.tensor and plan.shards_params,
                                 skip=stacked.get(key, frozenset()))  # fmt: skip
        nbytes = int(x.size * x.dtype.itemsize) if hasattr(x, "dtype") else 0
        return LeafPlacement(path=key, shape=shape, nbytes=nbytes, model_spec=model[key], data_dim=dim,
                             why_replicated=why, why_whole_on_model=notes.get(key),
                             names=names.get(key, ()))  # fmt: skip

    return Placement(
        plan=plan, mesh=mesh, leaves=jax.tree_util.tree_map_with_path(leaf, params), units=dict(units or {})
    )
