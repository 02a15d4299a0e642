"""The plan table derived from the axes (``meshkit.spec.AXIS_RULES``, ``COMBINE``): every name parses
back, refusals name the pair, default meshes fit, and a new axis row yields its plans with no other edit."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from meshkit import spec
from meshkit.mesh import parse_mesh_spec
from meshkit.spec import AXIS_RULES, COMBINE, PLANS, ParallelSpec, PlanError, get_plan
from meshkit.spec import plans as spec_plans


def _tokens(name: str) -> list[str]:
    return [p for p in name.split("+") if p not in spec.DATA_PARTS]


def test_every_plan_is_its_axes_and_data_part():
    for name, plan in PLANS.items():
        tokens = _tokens(name)
        for rule in AXIS_RULES:
            assert getattr(plan, rule.field) == (rule.token in tokens), (name, rule.token)
        assert spec.canonical(name) == name
        data = [p for p in name.split("+") if p in spec.DATA_PARTS]
        assert plan.data == bool(data) and plan.zero == spec.DATA_PARTS[data[0] if data else "dp"]


def test_exactly_the_combining_sets_of_axes_are_plans():
    tokens = [r.token for r in AXIS_RULES]
    for k in range(1, len(tokens) + 1):
        for combo in itertools.combinations(tokens, k):
            ok = all(COMBINE[frozenset(pair)] == "" for pair in itertools.combinations(combo, 2))
            for data in ("", "dp+", "fsdp+", "zero1+", "hsdp+"):
                name = data + "+".join(combo)
                runs = ok and data in ("", "dp+", "fsdp+")
                assert (name in PLANS) == runs, name


def test_a_name_in_another_order_is_the_same_plan():
    assert get_plan("tp+fsdp") is PLANS["fsdp+tp"]
    assert get_plan("pp+tp+dp") is PLANS["dp+tp+pp"]


@pytest.mark.parametrize("pair", [p for p, why in COMBINE.items() if why])
def test_a_pair_that_does_not_combine_is_refused_with_its_reason(pair):
    name = "+".join(sorted(pair))
    with pytest.raises(PlanError) as err:
        get_plan(name)
    assert COMBINE[pair] in str(err.value) and "\n" not in str(err.value)


def test_a_data_part_that_runs_alone_is_refused_naming_those_that_combine():
    with pytest.raises(PlanError, match="zero2 runs alone; with other axes use dp or fsdp"):
        get_plan("zero2+tp")


def test_default_meshes_fit_eight_devices_and_name_every_axis_a_plan_needs():
    for name, plan in PLANS.items():
        sizes = ParallelSpec(plan=name).mesh_sizes(8)
        spec.check_axes(plan, sizes)
        assert [v for _, v in parse_mesh_spec(plan.default_mesh)].count(-1) == 1, name


def test_a_new_axis_row_yields_its_plans_default_meshes_and_refusals(monkeypatch):
    """The dry run of a new axis: one row (and its pairs) and the plan table, default meshes and
    deterministic refusal follow. The Plan field it sets is borrowed (expert's) since a row needs one."""
    toy = dataclasses.replace(
        AXIS_RULES[-1], token="xp", words="toy parallelism", nondeterministic="toy sums"
    )
    rules = (*AXIS_RULES[:-1], toy)
    pairs = {frozenset({"xp" if t == "ep" else t for t in pair}): why for pair, why in COMBINE.items()}
    monkeypatch.setattr(spec_plans, "AXIS_RULES", rules)
    monkeypatch.setattr(spec_plans, "COMBINE", pairs)
    plans = spec_plans._plans()
    assert {"xp", "dp+xp", "fsdp+xp"} <= set(plans) and not any("ep" in n.split("+") for n in plans)
    assert plans["dp+xp"].default_mesh == "data=2,expert=-1"
    with pytest.raises(PlanError, match="toy sums"):
        spec_plans.check_deterministic_plan(plans["xp"], 1)


def _toy_rows_axis(monkeypatch):
    """A toy axis that splits the batch's rows (``splits="rows"``): one row and its pairs, nothing else."""
    toy = spec.AxisRule(token="xp", axis="pod", field="pod", words="toy pods", splits="rows", fills=0)
    pairs = {**COMBINE, **{frozenset({"xp", r.token}): "" for r in AXIS_RULES}}
    monkeypatch.setattr(spec_plans, "AXIS_RULES", (*AXIS_RULES, toy))
    monkeypatch.setattr(spec_plans, "COMBINE", pairs)
    monkeypatch.setattr(spec_plans, "PLANS", spec_plans._plans())


def _linear(params, batch):
    x, y = batch
    return jax.numpy.mean((x @ params["w"] + params["b"] - y) ** 2)


def test_a_new_rows_axis_trains_as_one_device_with_no_other_edit(monkeypatch):
    """The dry run of a new axis at full depth: a row that splits rows is a plan that trains, its batch
    split over the axis, every gradient summed over it, equal to one device in float64, and the ledger's
    model of it the compiled program's (the step, the placement and the ledger ask the row)."""
    import optax

    from meshkit.train import Trainer

    _toy_rows_axis(monkeypatch)
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        params = {"w": rng.normal(size=(8, 4)), "b": np.zeros(4)}
        batch = (rng.normal(size=(16, 8)), rng.normal(size=(16, 4)))
        keep = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))  # keeps the gradient, moves nothing
        t = Trainer(_linear, params, keep, spec=ParallelSpec(plan="fsdp+xp", mesh="data=2,pod=4"))
        assert t.placement.batch_axes == ("data", "pod") and t.placement.batch_devices == 8
        loss = float(t.step(batch)["loss"])
        want, grads = jax.value_and_grad(_linear)(params, batch)
        assert abs(loss - float(want)) <= 1e-12
        got = t.opt_state[0].trace
        assert max(float(np.max(np.abs(np.asarray(got[k]) - grads[k]))) for k in grads) <= 1e-12
    small = jax.tree.map(lambda a: np.asarray(a, np.float32), (params, batch))
    r = Trainer(_linear, small[0], optax.adam(1e-2), spec=ParallelSpec(plan="fsdp+xp", mesh="data=2,pod=4"))
    r = r.report(small[1])
    rows = {(c.op, c.axes): c for c in r.communication}
    assert r.ok and ("all-reduce", "pod") in rows, str(r)  # the ZeRO shards summed over the toy axis
