"""The Llama under the plans: float64 equality with one device, the ledger = the model (the
vocabulary split included), and the peak model within 10%."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from _reference import max_rel, one_device
from meshkit.models import gpt, llama
from meshkit.plans.tp_rules import VOCAB_TP_RULES, vocab_rules
from meshkit.spec import get_plan
from meshkit.train import Trainer

CFG = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64)

#: (plan, mesh, options): dp, ZeRO-3 with per-layer remat (loop form: meshkit.layer), fsdp+tp (the
#: vocabulary and the key/value heads split), 3D with 1F1B (the scanned form as Stages).
CASES = [
    ("dp", "data=8", {}),
    ("zero3", "data=8", {"remat": "layer"}),
    ("fsdp+tp", "data=4,model=2", {}),
    ("dp+tp+pp", "stage=2,data=2,model=2", {"microbatches": 4, "pipeline_schedule": "1f1b"}),
]


def _batch():
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(16, CFG.seq_len + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _model(plan: str, dtype: str = "float32"):
    """(config, loss, params) of the plan's form: Stages (scanned) under a pipeline, else the loop form."""
    pipeline = get_plan(plan).pipeline
    cfg = dataclasses.replace(CFG, dtype=dtype, scan_layers=pipeline)
    params = llama.init(jax.random.key(0), cfg)
    return cfg, (llama.stages(cfg) if pipeline else llama.make_loss(cfg)), params


def _trainer(plan, mesh, opts, dtype="float32"):
    cfg, loss, params = _model(plan, dtype)
    return Trainer(loss, params, optax.adam(1e-2), plan=plan, mesh=mesh, logical_axes=llama.logical_axes(params),
                   rules=vocab_rules(get_plan(plan)), units=llama.units(cfg), tokens_per_example=cfg.seq_len,
                   **opts)  # fmt: skip


@functools.cache
def _one_device_float64(scan: bool, steps: int):
    """``steps`` Adam steps on one device in float64 (the loop or the scanned form)."""
    cfg = dataclasses.replace(CFG, dtype="float64", scan_layers=scan)
    return one_device(
        llama.make_loss(cfg), llama.init(jax.random.key(0), cfg), _batch(), steps, optax.adam(1e-2)
    )


# Tiers: sweeps, every plan (each plan is core with the GPT). The Llama under fsdp+tp (the vocabulary and
# the key/value heads split: test_tensor_parallel_rules_split_heads_kv_heads_mlp_and_the_vocabulary below)
# is core in float64 against one device in test_packing.py's llama-fsdp+tp-data=4,model=2 and test_lora.py's
# fsdp+tp (the frozen base), its ledger against the model in test_lora.py's
# test_lora_ledger_memory_and_peak_match_the_model[fsdp+tp-data=4,model=2] (its model axis's all-reduces
# x1.000) and test_llama_cli.py's run (the vocabulary split's rows); in a pipeline: test_packing.py's
# llama-dp+pp-stage=2,data=4 and test_lora.py's dp+pp; under zero3: test_deterministic.py's llama-zero3.
@pytest.mark.sweep
@pytest.mark.parametrize(("plan", "mesh", "opts"), CASES, ids=[c[0] for c in CASES])
def test_llama_plan_matches_one_device_in_float64_and_its_cost_model(plan, mesh, opts):
    with jax.enable_x64(True):
        t = _trainer(plan, mesh, opts, "float64")
        for _ in range(2):
            t.step(_batch())
        ref = _one_device_float64(get_plan(plan).pipeline, 2)
        assert max_rel(t.params, ref) < 1e-10  # the same function, summed in another order
    t = _trainer(plan, mesh, opts)  # float32: the ledger (a pipeline's executed schedule after a step)
    if get_plan(plan).pipeline:
        t.step(_batch())
    r = t.report(_batch())
    assert r.ok, str(r)
    rows = {(c.op, c.axes): c for c in r.communication}
    if get_plan(plan).tensor:
        assert rows["all-reduce", "model"].ratio == pytest.approx(1.0, abs=1e-9)


# Tiers: both sweep: the Llama's peak is core under fsdp+tp with adapters (test_lora.py's
# test_lora_ledger_memory_and_peak_match_the_model[fsdp+tp-data=4,model=2], this size) and under
# fsdp+tp+cp (test_axis_combos.py's
# test_the_peak_model_holds_for_the_combinations[llama-fsdp+tp+cp-all-to-all]).
@pytest.mark.parametrize(
    ("plan", "mesh", "remat"),
    [
        pytest.param("zero3", "data=8", "layer", marks=pytest.mark.sweep),
        pytest.param("fsdp+tp", "data=4,model=2", "none", marks=pytest.mark.sweep),
    ],
)
def test_llama_peak_is_within_ten_percent_of_the_model(plan, mesh, remat):
    """At tests/test_peak.py's size (width 128, 4 layers, seq 32; at width 32 the model's fixed
    terms dominate and it over-predicts the GPT and the Llama alike, 0.85-0.86)."""
    cfg = llama.LlamaConfig(vocab_size=128, seq_len=32, layers=4, width=128, heads=4, kv_heads=2, ffn=256)
    params = llama.init(jax.random.key(0), cfg)
    tokens = np.zeros((16, 32), np.int32)
    t = Trainer(llama.make_loss(cfg), params, optax.adamw(1e-3), plan=plan, mesh=mesh, remat=remat,
                rules=vocab_rules(get_plan(plan)), logical_axes=llama.logical_axes(params), tokens_per_example=32)  # fmt: skip
    r = t.report((tokens, tokens))
    assert r.ok, str(r)
    assert 0.9 <= r.peak["ratio"] <= 1.1, r.peak


def test_tensor_parallel_rules_split_heads_kv_heads_mlp_and_the_vocabulary():
    """fsdp+tp on data=4,model=2: every matrix split on model (kv heads divide), the vocabulary of
    the embedding and the head included; kv heads that do not divide (model=4, 2 kv heads) stay whole
    on model, with the reason, while query heads split."""
    cfg, loss, params = _model("fsdp+tp")
    t = Trainer(loss, params, optax.adam(1e-2), plan="fsdp+tp", mesh="data=4,model=2",
                logical_axes=llama.logical_axes(params), rules=VOCAB_TP_RULES, units=llama.units(cfg))  # fmt: skip
    specs = {leaf.path: leaf.model_spec for leaf in t.placement.flat()}
    assert specs["tok_embed"] == ("model", None) and specs["unembed"] == (None, "model")
    assert specs["blocks/0/attn/wk"] == (None, "model") and specs["blocks/0/attn/wo"] == ("model", None)
    assert specs["blocks/0/mlp/w_down"] == ("model", None) and specs["blocks/0/mlp/w_up"] == (None, "model")
    assert t.placement.whole_on_model() == []
    wide = Trainer(loss, params, optax.adam(1e-2), plan="fsdp+tp", mesh="data=2,model=4",
                   logical_axes=llama.logical_axes(params), rules=VOCAB_TP_RULES, units=llama.units(cfg))  # fmt: skip
    whole = dict(wide.placement.whole_on_model())
    assert set(whole) == {f"blocks/{i}/attn/{w}" for i in range(2) for w in ("wk", "wv")}
    assert "2 kv_heads do not divide over model=4" in whole["blocks/0/attn/wk"]
    assert {leaf.path: leaf.model_spec for leaf in wide.placement.flat()}["blocks/0/attn/wq"] == (
        None,
        "model",
    )


def test_split_logits_stay_split():
    """The compiled dp+tp step holds no all-gather over model (the logits are never gathered), and its
    vocabulary rows are three all-reduces of one float per token."""
    from meshkit.analysis import communication

    t = _trainer("dp+tp", "data=4,model=2", {})
    ledger = communication(t.compiled(_batch()), mesh=t.mesh)
    assert not [r for r in ledger.records if r.op == "all-gather"]
    per_token = [r for r in ledger.records if r.op == "all-reduce" and (4, 16) in r.shapes]
    assert sum(s == (4, 16) for r in per_token for s in r.shapes) == 3


def test_both_forms_and_tied_embeddings_compute_the_same_function():
    """Loop and scanned forms give the same logits from the same initialisation (gpt's converters),
    and a tied model's head is its embedding."""
    params = llama.init(jax.random.key(1), CFG)
    scanned = llama.init(jax.random.key(1), dataclasses.replace(CFG, scan_layers=True))
    assert jax.tree.structure(gpt.to_scanned(params)) == jax.tree.structure(scanned)
    for x, y in zip(jax.tree.leaves(gpt.to_scanned(params)), jax.tree.leaves(scanned), strict=True):
        np.testing.assert_array_equal(x, y)
    tokens = _batch()[0][:2]
    a = llama.apply(params, tokens, CFG)
    b = llama.apply(scanned, tokens, dataclasses.replace(CFG, scan_layers=True))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    tied_cfg = dataclasses.replace(CFG, tie_embeddings=True)
    tied = llama.init(jax.random.key(1), tied_cfg)
    assert "unembed" not in tied
    as_untied = {**tied, "unembed": tied["tok_embed"].T}
    np.testing.assert_array_equal(llama.apply(tied, tokens, tied_cfg), llama.apply(as_untied, tokens, CFG))
    assert a.shape == (2, CFG.seq_len, CFG.vocab_size)
