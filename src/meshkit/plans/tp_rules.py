"""The tensor-parallel rules: which dims of each parameter leaf split over the ``model`` axis.

Logical rules map a model's logical axis names to the model axis (``DEFAULT_TP_RULES``, with the
vocabulary too where the plan allows it: ``vocab_rules``), updated by the user's; path rules
(``[(regex, spec)]``) then decide the leaves they match. ``model_specs`` applies them to the
parameters and refuses what does not fit (a rule that matches nothing, a split that does not divide),
naming the fix. Where each leaf then lives, with the data axis's ZeRO split beside this one, is
``placement.place``'s.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from meshkit.plans._leaf_paths import path_str
from meshkit.spec import ADAPTER_RANK, MODEL, Plan, PlanError

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


def _check_units(
    units: Mapping[str, int], names: Mapping[str, str | None], model_size: int, given: frozenset[str]
) -> None:
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
        key = path_str(p)
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
                    notes[key] = (
                        f"{count} {a} do not divide over model={model_size}: whole on the model "
                        f"axis; {WHERE_DIVIDES[a]}"
                    )
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


def model_specs(
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
    shapes = {path_str(p): tuple(leaf.shape) for p, leaf in flat}
    out = {k: (None,) * len(s) for k, s in shapes.items()}
    if not plan.tensor:
        return out
    names = _logical_rules(rules, plan)
    # the library's own rule sets are defaults too: none of their names must match
    given = (
        frozenset(rules)
        if isinstance(rules, Mapping) and rules not in (DEFAULT_TP_RULES, VOCAB_TP_RULES)
        else frozenset()
    )
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
