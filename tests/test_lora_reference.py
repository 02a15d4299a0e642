"""A LoRA model merged for export loads in Hugging Face ``transformers`` (the reference environments of
``tests/test_hf_reference.py``) and gives meshkit's logits of the adapted model, within 1e-5 in float32: a
Llama, a Phi-3 (its adapted q, v and up merged into the fused ``qkv_proj`` and ``gate_up_proj``), an
OLMo 2, a Qwen2-MoE (its routed experts' and its shared expert's up projections adapted) and a GPT-OSS (its
experts' adapted up projections interleaved back into ``gate_up_proj``) and a GLM-4.5 (DeepSeek-V3's router and
ungated shared experts)."""

import dataclasses
import json
import os
import subprocess

import jax
import numpy as np
import optax
import pytest

from _limits import limit
from meshkit import interop
from meshkit.models import llama, lora
from meshkit.train import Trainer
from test_hf_reference import SCRIPT, TOL

# Tiers: sweeps; the merged parameters are the family's own and give the adapted model's logits in
# test_lora.py's test_merge_folds_the_adapters_into_the_family_parameters, a run's merged export in its
# test_meshkit_train_with_lora_proves_its_cost_and_exports_the_merged_model, a Llama exported by meshkit
# read by transformers with meshkit's logits in test_hf_families.py's
# test_meshkit_export_gives_transformers_its_logits_and_greedy_tokens[transformers5-llama3].
pytestmark = [pytest.mark.reference, pytest.mark.sweep]
CFG = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64)
LORA = lora.LoraConfig(rank=4, alpha=8.0, targets=("wq", "wv", "w_up"))
FAMILIES = {
    "llama": CFG,
    "phi3": dataclasses.replace(CFG, fused=True, rotary_dim=4, window=8),
    "olmo2": dataclasses.replace(CFG, post_norms=True, qk_norm_whole=True),
    "qwen2_moe": dataclasses.replace(
        CFG, qkv_bias=True, experts=4, ffn=16, capacity_factor=0.0, shared_ffn=24
    ),
    "gpt_oss": dataclasses.replace(
        CFG,
        qkv_bias=True,
        o_bias=True,
        sinks=True,
        wide_norms=True,
        experts=4,
        ffn=16,
        capacity_factor=0.0,
        router_renormalize=True,
        moe_bias=True,
        swiglu_limit=7.0,
        window=8,
        sliding=(True, False),
    ),
    "glm4_moe": dataclasses.replace(
        CFG,
        experts=4,
        ffn=16,
        capacity_factor=0.0,
        sigmoid_router=True,
        router_renormalize=True,
        shared_ffn=16,
        shared_gate=False,
        rotary_dim=4,
        qkv_bias=True,
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_lora_export_loads_in_transformers_with_meshkits_logits(tmp_path, reference_python, family):
    cfg = FAMILIES[family]
    params = lora.add(jax.random.key(1), llama.init(jax.random.key(0), cfg), LORA)
    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 17)).astype(np.int32)
    t = Trainer(lora.wrap(llama.make_loss(cfg), LORA), params, optax.adam(3e-2), plan="dp", mesh="data=8",
                logical_axes=lora.logical_axes(params, llama.logical_axes), trainable=lora.trainable)  # fmt: skip
    for _ in range(3):  # adapters away from their zero start
        t.step((tokens[:, :-1], tokens[:, 1:]))
    adapted = jax.device_get(t.params)
    interop.save(lora.merge(adapted, LORA), cfg, tmp_path / "hf")
    np.save(tmp_path / "tokens.npy", tokens[:, :-1])
    job = {
        "dir": str(tmp_path / "hf"),
        "tokens": str(tmp_path / "tokens.npy"),
        "out": str(tmp_path / "out.npy"),
    }
    (tmp_path / "jobs.json").write_text(json.dumps([job]))
    done = subprocess.run([reference_python, str(SCRIPT), str(tmp_path / "jobs.json")], capture_output=True, text=True,
                          timeout=limit(5), env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ours = lora.wrap(lambda p, x: llama.apply(p, x, cfg), LORA)(adapted, tokens[:, :-1])
    theirs = np.load(tmp_path / "out.npy")
    assert np.max(np.abs(theirs - np.asarray(ours))) <= TOL * max(1.0, float(np.max(np.abs(ours))))
    assert np.max(np.abs(ours - llama.apply(llama.init(jax.random.key(0), cfg), tokens[:, :-1], cfg))) > 1e-3
