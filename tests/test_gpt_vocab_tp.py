"""The GPT's vocabulary on the model axis (``tp_rules.vocab_rules``, the Llama's rule): its token
embedding and head split on model as well as data, so the per-device state (parameters + Adam's
moments, read from the compiled step) is the total over the devices that split it; its loss (optax's
integer-label cross-entropy) keeps split logits split, the result equals one device in float64 and
the ledger's collectives equal the model."""

import functools
import math

import jax
import numpy as np
import optax
import pytest

from _reference import max_rel, one_device
from _tiers import tiered
from meshkit import verify
from meshkit.mesh import make_mesh
from meshkit.models import gpt
from meshkit.plans.tp_rules import vocab_rules
from meshkit.spec import get_plan
from meshkit.train import Trainer

#: A GPT's proportions: the token table and the head 40% of the parameters; the leaves no rule splits
#: on model (positions, norms, biases) 0.8% of them (at width 64 they were 1.3%: 1.022x).
BIG = gpt.GPTConfig(vocab_size=512, seq_len=8, layers=1, width=128, heads=4)


def _nbytes(tree) -> int:
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@functools.cache
def _big_report(plan: str, mesh: str):
    """``BIG`` under the Trainer's default rules, as a library user gets them (the same as ``meshkit train``
    and verify's workload give their GPT: ``vocab_rules``)."""
    params = gpt.init(jax.random.key(0), BIG)
    tokens = np.zeros((16, BIG.seq_len), np.int32)
    devices = jax.devices()[: math.prod(int(a.split("=")[1]) for a in mesh.split(","))]  # tp: model=2 of 8
    t = Trainer(gpt.make_loss(BIG), params, optax.adam(1e-3), plan=plan, mesh=make_mesh(mesh, devices=devices),
                logical_axes=gpt.logical_axes(params), units={"heads": BIG.heads}, tokens_per_example=BIG.seq_len)  # fmt: skip
    total = _nbytes(params) + _nbytes(optax.adam(1e-3).init(params))
    return t, t.report((tokens, tokens)), total, _nbytes((tokens, tokens))


#: (plan, mesh, the devices the state is split over): dp+tp replicates the state on data by design;
#: tp on 2 of the 8 devices (on 8 the unsplit 0.8% would be 7 x 0.8% of total / 8).
STATE_CASES = [("fsdp+tp", "data=4,model=2", 8), ("tp", "model=2", 2), ("dp+tp", "data=4,model=2", 2)]


# Tiers: the state per device is core under fsdp+tp, the vocabulary split under dp+tp and fsdp+tp;
# tp's cases and dp+tp's state sweep (tp's rules: the same split, core in the other two).
@pytest.mark.parametrize(
    ("plan", "mesh", "split"), tiered(STATE_CASES, [c[0] for c in STATE_CASES], core={"fsdp+tp"})
)
def test_gpt_state_per_device_is_the_total_over_data_times_model(plan, mesh, split):
    """The compiled step's arguments less the batch's block: params + Adam state = total / split
    within 2% (on c24a16a fsdp+tp held 1.41x, tp 1.40x: the embedding and head whole on model)."""
    t, r, total, batch_bytes = _big_report(plan, mesh)
    batch_per_device = batch_bytes / t.placement.batch_devices
    state = r.compiled_memory.argument_bytes - batch_per_device
    assert state / (total / split) == pytest.approx(1.0, abs=0.02), (state, total / split)
    rows = {m.component: m for m in r.memory}  # the ledger's rows (arrays as placed) agree with its formula
    assert rows["params"].ok and rows["optimizer"].ok, r.memory
    assert rows["params"].measured_bytes + rows["optimizer"].measured_bytes == pytest.approx(state, rel=1e-3)
    specs = {leaf.path: leaf.model_spec for leaf in t.placement.flat()}
    assert specs["tok_embed"] == ("model", None) and specs["unembed"] == (None, "model")


def test_gpt_vocab_split_ledger_equals_the_model_and_logits_stay_split():
    """fsdp+tp at the embedding-heavy size: every communication row = the model (x1.000), the
    vocabulary's all-reduces included, and no all-gather over model (the logits never gathered)."""
    _, r, _, _ = _big_report("fsdp+tp", "data=4,model=2")
    assert r.ok, str(r)
    rows = {(c.op, c.axes): c for c in r.communication}
    assert rows["all-reduce", "model"].ratio == pytest.approx(1.0, abs=1e-9)
    assert not any(op == "all-gather" and "model" in axes for op, axes in rows), sorted(rows)


CASES = [("tp", "model=8"), ("fsdp+tp", "data=4,model=2"), ("dp+tp", "data=2,model=4")]


@functools.cache
def _one_device_float64():
    """verify's GPT, 2 Adam steps on one device in float64: the reference of every case below."""
    with jax.enable_x64(True):
        w64 = verify.workload("gpt").in_float64()
        return one_device(w64.loss_fn, w64.params, w64.batch, 2, optax.adam(1e-2))


# Tiers: dp+tp is core; fsdp+tp and tp sweep (verify's GPT with these rules: float64 equality and the
# ledger, sequence parallelism on, in test_sequence_parallel.py's test_sequence_parallel_certificate[fsdp+tp-gpt-data=2,model=4-none];
# tp's rules, the same split without a data axis, in dp+tp here, plan tp's certificate in test_families.py's
# tp-qwen2).
@pytest.mark.parametrize(("plan", "mesh"), tiered(CASES, [c[0] for c in CASES], core={"dp+tp"}))
def test_gpt_vocab_tp_matches_one_device_in_float64(plan, mesh):
    """The reference GPT (verify.workload: the plan's default rules, the vocabulary split) under the plan,
    2 Adam steps in float64, equals one device to 1e-10; its float32 ledger = the model."""
    w = verify.workload("gpt")
    with jax.enable_x64(True):
        w64 = w.in_float64()
        t = Trainer(w64.loss_fn, w64.params, optax.adam(1e-2), plan=plan, mesh=mesh, rules=w64.rules,
                    logical_axes=w64.logical_axes, units=w64.units, tokens_per_example=w64.tokens_per_example)  # fmt: skip
        assert {leaf.path: leaf.model_spec for leaf in t.placement.flat()}["tok_embed"] == ("model", None)
        for _ in range(2):
            t.step(w64.batch)
        ref = _one_device_float64()
        assert max_rel(t.params, ref) < 1e-10
    t = Trainer(w.loss_fn, w.params, optax.adam(1e-2), plan=plan, mesh=mesh, rules=w.rules,
                logical_axes=w.logical_axes, units=w.units, tokens_per_example=w.tokens_per_example)  # fmt: skip
    r = t.report(w.batch)
    assert r.ok, str(r)
    assert {(c.op, c.axes): c.ratio for c in r.communication}["all-reduce", "model"] == pytest.approx(
        1.0, abs=1e-9
    )


def test_pipeline_plans_keep_the_gpt_vocabulary_whole_on_model():
    """Under a pipeline the default rules keep the vocabulary whole on model."""
    assert vocab_rules(True) == vocab_rules(get_plan("dp+tp+pp"))
    assert "vocab" not in vocab_rules(True) and "vocab" in vocab_rules(get_plan("dp+tp"))
