"""LoRA (``meshkit.models.lora``): adapters sharded like their weight, trained under the plans as on
one device (float64), merged for export; bad settings are one line."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

from _reference import max_rel, one_device_frozen
from _tiers import tiered
from meshkit.models import llama, lora, registry
from meshkit.plans.tp_rules import vocab_rules
from meshkit.spec import get_plan
from meshkit.train import Trainer

CFG = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64)
LORA = lora.LoraConfig(rank=4, alpha=8.0)

CASES = [
    ("dp", "data=8", {}),
    ("fsdp", "data=8", {"remat": "layer"}),
    ("fsdp+tp", "data=4,model=2", {}),
    ("dp+pp", "stage=2,data=4", {"microbatches": 2}),
    ("fsdp+tp", "data=4,model=2", {"family": "olmo2", "remat": "layer"}),
    ("dp+tp", "data=4,model=2", {"family": "phi3"}),
]
FAMILIES = {
    "olmo2": dataclasses.replace(CFG, post_norms=True, qk_norm_whole=True),
    "phi3": dataclasses.replace(CFG, fused=True, rotary_dim=4, window=4),
}
"""The Llama's other rows (``llama_hf.TYPES``) whose blocks differ: OLMo 2's norms after the sublayers and
over the heads' whole width (split on the model axis: their statistics summed over it), Phi-3's partial
rotary under a window."""


def _batch():
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(16, CFG.seq_len + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _adapted(cfg):
    return lora.add(jax.random.key(1), llama.init(jax.random.key(0), cfg), LORA)


# Tiers: fsdp+tp (the adapters' gradients over data and model, ZeRO-3's shards of the frozen base) and dp+pp
# are core; dp, fsdp and the OLMo 2's and the Phi-3's sweep (their blocks are core in test_families.py): LoRA under fsdp is core through meshkit train in
# test_meshkit_train_with_lora_proves_its_cost_and_exports_the_merged_model (its ledger checked), frozen
# leaves under ZeRO-3 (the rest trained as one device in float64) and its layer remat (no gradient of theirs
# moved) in test_frozen.py's zero3 cases.
@pytest.mark.parametrize(
    ("plan", "mesh", "opts"),
    tiered(CASES, [c[0] + "".join(f"-{c[2]['family']}" for _ in c[2:] if "family" in c[2]) for c in CASES],
           core={"fsdp+tp", "dp+pp"}),
)  # fmt: skip
def test_lora_under_the_plans_matches_one_device_in_float64(plan, mesh, opts):
    pipeline = get_plan(plan).pipeline
    opts = dict(opts)
    family = opts.pop("family", None)
    with jax.enable_x64(True):
        cfg = dataclasses.replace(FAMILIES.get(family, CFG), dtype="float64", scan_layers=pipeline)
        params = _adapted(cfg)
        loss = lora.wrap(llama.stages(cfg) if pipeline else llama.make_loss(cfg), LORA)
        t = Trainer(loss, params, optax.adam(1e-2), plan=plan, mesh=mesh, units=llama.units(cfg),
                    logical_axes=lora.logical_axes(params, llama.logical_axes), trainable=lora.trainable,
                    **opts)  # fmt: skip
        for _ in range(3):
            t.step(_batch())
        ref = one_device_frozen(lora.wrap(llama.make_loss(cfg), LORA), params, _batch(), 3, optax.adam(1e-2),
                                lora.trainable)  # fmt: skip
        assert max_rel(t.params, ref) < 1e-10
        assert max_rel(lora.base(t.params), lora.base(params)) == 0.0  # the base is frozen
        assert max_rel(t.params, params) > 1e-4  # the adapters trained
        if pipeline:  # the ledger: the frozen embedding and head sum no gradients over the stages
            r = t.report(_batch())
            assert r.ok, str(r)
    if family:  # the ledger of the float32 step (its model of the model axis counts float32 activations):
        # OLMo 2's norm statistics over the model axis, its row-parallel outputs redone under layer remat
        params = _adapted(FAMILIES[family])
        t = Trainer(lora.wrap(llama.make_loss(FAMILIES[family]), LORA), params, optax.adam(1e-2), plan=plan,
                    mesh=mesh, units=llama.units(cfg), logical_axes=lora.logical_axes(params, llama.logical_axes),
                    trainable=lora.trainable, **opts)  # fmt: skip
        r = t.report(_batch())
        assert r.ok, str(r)
    if get_plan(plan).tensor:  # the adapters split like their weight on the model axis
        specs = {leaf.path: leaf.model_spec for leaf in t.placement.flat()}
        assert specs["blocks/0/attn/wq_lora_b"] == (None, "model") and specs["blocks/0/attn/wq_lora_a"] == (
            None,
            None,
        )
        assert specs["blocks/0/attn/wo_lora_a"] == ("model", None)


def test_merge_folds_the_adapters_into_the_family_parameters():
    """The merged parameters are the family's own and give the adapted model's logits."""
    params = _adapted(CFG)
    params = jax.tree_util.tree_map_with_path(  # adapters B made nonzero, as after training
        lambda p, x: x + 0.01 if jax.tree_util.keystr(p).endswith("_lora_b']") else x, params
    )
    merged = lora.merge(params, LORA)
    assert jax.tree.structure(merged) == jax.tree.structure(llama.init(jax.random.key(0), CFG))
    tokens = _batch()[0]
    want = lora.wrap(lambda p, t: llama.apply(p, t, CFG), LORA)(params, tokens)
    np.testing.assert_allclose(llama.apply(merged, tokens, CFG), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [({"rank": 0}, "--lora-rank 8"), ({"targets": ("wx",)}, "match no matrix of the model")],
)
def test_bad_lora_settings_are_one_line(kwargs, fix):
    with pytest.raises(lora.LoraError, match=fix):
        lora.add(jax.random.key(0), llama.init(jax.random.key(0), CFG), lora.LoraConfig(**kwargs))


# Tiers: fsdp+tp is core (the adapters' gradients reduced over data and summed over the model axis, their
# state sharded). dp sweeps (dp's ledger is core in test_plans.py's dp-linear certificate, its peak in
# test_peak.py); so does zero2: its ledger under LoRA is core in the fsdp run of
# test_meshkit_train_with_lora_proves_its_cost_and_exports_the_merged_model (checks_ok), the frozen leaves'
# gradients left out of zero2's reduce-scatter in test_frozen.py's
# test_the_compiled_step_moves_no_gradient_of_a_frozen_leaf[zero2-none], zero2's peak in test_peak.py.
@pytest.mark.parametrize(
    ("plan", "mesh"),
    [
        pytest.param("dp", "data=8", marks=pytest.mark.sweep),
        pytest.param("zero2", "data=8", marks=pytest.mark.sweep),
        ("fsdp+tp", "data=4,model=2"),
    ],
)
def test_lora_ledger_memory_and_peak_match_the_model(plan, mesh):
    """The compiled step moves what the model says with only the adapters' gradients (x1.000; over the
    model axis the adapters' own gradient sums, and no input gradient where the frozen embedding asks for
    none), the
    optimizer state is the adapters' alone, as the memory formula counts it, and the peak is within 10%
    of the peak model's (at tests/test_peak.py's size: width 128, 4 layers, seq 32)."""
    cfg = llama.LlamaConfig(vocab_size=128, seq_len=32, layers=4, width=128, heads=4, kv_heads=2, ffn=256)
    params = lora.add(jax.random.key(1), llama.init(jax.random.key(0), cfg), LORA)
    t = Trainer(lora.wrap(llama.make_loss(cfg), LORA), params, optax.adamw(1e-3), plan=plan, mesh=mesh,
                logical_axes=lora.logical_axes(params, llama.logical_axes), trainable=lora.trainable,
                rules=vocab_rules(get_plan(plan)), units=llama.units(cfg), tokens_per_example=cfg.seq_len)  # fmt: skip
    tokens = np.zeros((16, 32), np.int32)
    r = t.report((tokens, tokens))
    assert r.ok, str(r)
    assert 0.9 <= r.peak["ratio"] <= 1.1, r.peak
    adapters = sum(x.nbytes for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if "lora" in str(p))
    assert {m.component: m.measured_bytes for m in r.memory}["optimizer"] <= 2 * adapters + 64


def test_meshkit_train_with_lora_proves_its_cost_and_exports_the_merged_model(tmp_path):
    """``meshkit train --lora-rank 4`` under fsdp: the ledger and the memory formula hold, and ``meshkit
    export`` writes the family's weights: the untargeted ones are their initialisation bit for bit (frozen),
    the targeted ones moved (their adapters merged in)."""
    from meshkit import interop
    from meshkit.cli import main
    from meshkit.train.job import model_config, saved_config

    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--preset", "tiny", "--model", "llama", "--kv-heads", "2", "--plan", "fsdp", "--lora-rank", "4",
                 "--steps", "3", "--eval-every", "0", "--checkpoint-every", "3", "--sample-chars", "0",
                 "--run-dir", str(run)]) == 0  # fmt: skip
    assert json.loads((run / "report.json").read_text())["checks_ok"]
    assert main(["export", str(run), str(out)]) == 0
    cfg = saved_config(run)
    init = llama.init(jax.random.key(cfg.data.seed), model_config(cfg, registry.family("llama"), 104))
    exported, _ = interop.load(out)
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(exported)[0], jax.tree.leaves(init), strict=True
    ):
        targeted = jax.tree_util.keystr(path).endswith(tuple(f"['{t}']" for t in lora.DEFAULT_TARGETS))
        assert np.array_equal(np.asarray(got), np.asarray(want)) != targeted, path


def test_meshkit_train_refuses_a_negative_lora_rank_in_one_line():
    from meshkit.train import config as C

    with pytest.raises(C.ConfigError, match="--lora-rank must be at least 0"):
        C.validate(C.tiny().replace(model="llama", lora_rank=-1))
    assert C.lora_config(C.tiny().replace(lora_rank=4, lora_targets="wq, w_up")).targets == ("wq", "w_up")
