"""Megatron's sequence parallelism under a model axis (``ParallelSpec.sequence_parallel``,
``plans._sequence``): the step equals one device in float64, its collectives equal the ledger's model
(the reduces and the sequence's all-gathers), what a layer keeps shrinks with the model axis, and the
plans it does not apply to are refused in one line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit.verify as V
from _tiers import tiered
from meshkit.models import gpt
from meshkit.spec import ParallelSpec, PlanError
from meshkit.train import Trainer

#: (plan, model, mesh, remat): the scanned GPT under fsdp+tp with layer remat (the anchors' layout), the
#: scanned Llama under dp+tp (weights the step does not gather: the pins decide where the partitioner
#: moves tokens), the GPT's loop form (meshkit.layer blocks) without remat (the forward's gathered input
#: kept), tp alone under regather, and fsdp+tp+cp (the context axis splitting each sequence first).
CASES = [
    ("fsdp+tp", "gpt-scan", "data=2,model=4", "layer"),
    ("dp+tp", "llama-scan", "data=4,model=2", "layer"),
    ("fsdp+tp", "gpt", "data=2,model=4", "none"),
    ("fsdp+tp", "llama", "data=4,model=2", "dots"),
    ("tp", "gpt-scan", "model=8", "regather"),
    ("dp+tp", "gpt-scan", "data=2,model=4", "none"),
    ("fsdp+tp+cp", "gpt-scan", "data=2,context=2,model=2", "layer"),
]
IDS = ["-".join(c) for c in CASES]
CORE = {"fsdp+tp-gpt-scan-data=2,model=4-layer", "fsdp+tp-gpt-data=2,model=4-none"}


@pytest.mark.parametrize(("plan", "model", "mesh", "remat"), tiered(CASES, IDS, core=CORE))
def test_sequence_parallel_certificate(plan, model, mesh, remat):
    """Float64 equality with one device after 3 steps (a constraint changes no value), every collective
    per (op, axes) within 1% of the model (``plans.axes.model``'s reduces and ``_sequence_rows``), the
    peak within the certificate's bound."""
    cert = V.verify(plan, model, mesh=mesh, steps=3, remat=remat, sequence_parallel=True)
    assert cert.exact_vs_single_device < V.TOL_EXACT
    gathers = [r for r in cert.report.communication if (r.op, r.axes) == ("all-gather", "model")]
    assert gathers and gathers[0].measured_runs > 0  # the sequence is gathered over the model axis
    for row in cert.report.communication:
        assert row.ok, row
    assert cert.ok, cert.checks()


def _gpt_step(sequence_parallel: bool):
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=32, layers=4, width=256, heads=4, scan_layers=True)
    params = gpt.init(jax.random.key(0), cfg)
    t = Trainer(gpt.make_loss(cfg), params, optax.adam(1e-3), plan="fsdp+tp", mesh="data=2,model=4",
                remat="layer", sequence_parallel=sequence_parallel, logical_axes=gpt.logical_axes(params),
                units={"heads": cfg.heads}, tokens_per_example=cfg.seq_len)  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, cfg.seq_len + 1)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    temp = t.compiled(t.put_batch(batch)).memory_analysis().temp_size_in_bytes
    return temp, float(t.step(batch)["loss"])


def test_what_a_layer_keeps_splits_over_the_model_axis():
    """GPT of 4 layers (width 256, 4 sequences of 32 a data shard), fsdp+tp on data=2,model=4, layer
    remat: each layer's saved input is a quarter of its sequences a device with the split, so the step's
    temporaries fall by at least 3/4 of the 4 saved inputs (float32 4 x 32 x 256 each; measured 4.80 ->
    3.81 MB, the rest of one layer's working set split too); the losses are the same."""
    whole, split = _gpt_step(False), _gpt_step(True)
    assert whole[0] - split[0] >= 0.75 * 4 * (4 * 32 * 256 * 4), (split[0], whole[0])
    assert split[1] == pytest.approx(whole[1], rel=1e-6)


@pytest.mark.parametrize("plan", ["fsdp", "dp+tp+pp", "tp+ep"])
def test_plans_without_a_sequence_split_are_refused(plan):
    with pytest.raises(
        PlanError, match=rf"sequence_parallel .* not plan {re.escape(plan)}: drop --sequence-parallel"
    ):
        ParallelSpec(plan=plan, sequence_parallel=True)


def test_a_loss_without_layers_is_refused_in_one_line():
    """Sequence parallelism splits each layer's input: a loss whose layers meshkit cannot find is
    refused naming the fixes (not run unsplit as if it were split)."""
    params = {"w": np.ones((8, 16), np.float32)}
    t = Trainer(lambda p, x: jnp.mean((x @ p["w"]) ** 2), params, optax.sgd(0.1), plan="dp+tp",
                mesh="data=4,model=2", sequence_parallel=True, logical_axes={"w": ("embed", "mlp")})  # fmt: skip
    with pytest.raises(
        PlanError,
        match=r"sequence_parallel splits per layer, but the loss has no layers .* or drop --sequence-parallel",
    ):
        t.step(np.ones((8, 4, 8), np.float32))


def test_frozen_leaves_under_sequence_parallelism_are_refused_in_one_line():
    """LoRA under the split trains as one device (float64, 2e-14 measured) but its model-axis collectives
    are not the ledger's model (2-3x): refused, rather than a run that cannot prove its cost."""
    from meshkit.models import llama, lora

    cfg = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64)
    params = lora.add(
        jax.random.key(1), llama.init(jax.random.key(0), cfg), lora.LoraConfig(rank=4, alpha=8.0)
    )
    with pytest.raises(PlanError, match=r"sequence_parallel with frozen leaves .* drop --sequence-parallel"):
        Trainer(lora.wrap(llama.make_loss(cfg), lora.LoraConfig(rank=4, alpha=8.0)), params, optax.adam(1e-2),
                plan="fsdp+tp", mesh="data=4,model=2", units=llama.units(cfg), sequence_parallel=True,
                logical_axes=lora.logical_axes(params, llama.logical_axes), trainable=lora.trainable)  # fmt: skip
