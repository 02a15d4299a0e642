"""The Gemma family against transformers 4.57.6 and 5.x (torch on CPU, conftest's ``reference_python``),
both ways: tiny random Gemma 1, Gemma 2 (soft caps that bind, alternating windows) and Gemma 3 (q/k
norms, a local rotary base, linear scaling of the global one, a layer pattern of 3 over 4 layers)
checkpoints made by transformers load into meshkit with float32 logits within 1e-5 of transformers' and
the same 32 greedy tokens as ``generate(do_sample=False)``, token by token, the prompt and its tokens
longer than the window; meshkit's exports load in transformers with meshkit's logits and tokens; written
back, every tensor is bitwise the one read; the config.json each transformers writes reads as the same
model. Each switch is seen by the tolerance: without it the logits move by far more (printed, and
asserted above 1e-3). ``-m reference``."""

import dataclasses
import json
import os
import subprocess

import jax
import numpy as np
import pytest

from conftest import REFERENCES, reference_interpreter
from meshkit import interop
from meshkit.interop.hf import Checkpoint, Source
from meshkit.models import gemma
from meshkit.models.generate import continue_prompts
from test_hf_reference import SCRIPT, TOL

# Tiers: sweeps, every case (its reference process makes every checkpoint, 16-19 s of a core run): Gemma's
# side of each is core in test_gemma.py: each type's config.json read and written, 5.x's form too, and its
# weights round trip bitwise (test_each_type_reads_its_switches_and_writes_its_own_model_type), a Gemma 2
# checkpoint trained from, exported as gemma2 and generated from over its window
# (test_a_run_from_a_gemma2_checkpoint_trains_exports_as_gemma2_and_generates), the scanned form and whole
# periods of stages beside the loop form's logits (test_the_scanned_form_and_whole_periods_of_stages_...),
# caps and windows under the plans (its certificates, test_attention.py's caps); the transformers reference
# itself (its script, a checkpoint made by 5.x read by meshkit, meshkit's export read by 5.x) is core in
# test_hf_families.py's Llama 3 cases.
pytestmark = [pytest.mark.reference, pytest.mark.sweep]
NEW = 32
PROMPT = [5, 17, 3, 42, 8, 61, 29]

COMMON = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 128,
          "num_attention_heads": 4, "head_dim": 16, "eos_token_id": None, "bos_token_id": None,
          "pad_token_id": None, "initializer_range": 0.1}  # fmt: skip
"""initializer_range 0.1: scores of a few tenths and logits near one, so that caps of 0.5 and 1 bind."""
REFERENCE_MODELS = {
    "hf-gemma2": {**COMMON, "model_type": "gemma2", "num_hidden_layers": 4, "num_key_value_heads": 2,
                  "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 0.5,
                  "final_logit_softcapping": 1.0},
    "hf-gemma3": {**COMMON, "model_type": "gemma3_text", "num_hidden_layers": 4, "num_key_value_heads": 1,
                  "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 3,
                  "rope_theta": 1e6, "rope_local_base_freq": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "hf-gemma3-untied": {**COMMON, "model_type": "gemma3_text", "num_hidden_layers": 2, "num_key_value_heads": 2,
                         "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
                         "tie_word_embeddings": False, "final_logit_softcapping": 1.0},
    "hf-gemma": {**COMMON, "model_type": "gemma", "num_hidden_layers": 2, "num_key_value_heads": 1,
                 "hidden_act": "gelu_pytorch_tanh"},
}  # fmt: skip
BASE = {"vocab_size": 64, "seq_len": 128, "width": 32, "heads": 4, "head_dim": 16, "ffn": 64}
MESHKIT_MODELS = {
    "gemma2": gemma.GemmaConfig(**BASE, layers=4, kv_heads=2, query_scalar=24.0, window=8, qk_norm=False,
                                local_layers=(True, False) * 2, attn_softcap=0.5, final_softcap=1.0),
    "gemma3": gemma.GemmaConfig(**BASE, layers=4, kv_heads=1, query_scalar=24.0, window=8, rope_theta=1e6,
                                rope_factor=4.0, local_rope_theta=100.0, local_layers=(True, True, False, True)),
    "gemma": gemma.GemmaConfig(**BASE, layers=2, kv_heads=1, qk_norm=False, sandwich=False, tie_embeddings=False),
}  # fmt: skip
"""meshkit's models written for transformers: the switches of each type, an untied Gemma 1."""
SWITCHES = {
    "hf-gemma2": [
        ("attn_softcap", None),
        ("final_softcap", None),
        ("local_layers", ()),
        ("query_scalar", 16.0),
    ],
    "hf-gemma3": [("local_rope_theta", 0.0), ("rope_factor", 1.0), ("qk_norm", False)],
}
"""What each checkpoint's logits are checked to depend on: the switch set otherwise."""


def _perturbed(cfg, seed):
    """Initial parameters with every leaf moved (norm offsets off 0), scaled up as the reference's are."""
    params = gemma.init(jax.random.key(seed), cfg)
    keys = iter(jax.random.split(jax.random.key(seed + 100), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda a: 5 * a + 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, reference_python):
    """meshkit's exports and transformers' own checkpoints, each run by transformers (logits and greedy
    tokens) in one reference process."""
    tmp = tmp_path_factory.mktemp("gemma")
    tokens = np.random.default_rng(1).integers(0, 64, size=(3, 24)).astype(np.int32)
    np.save(tmp / "tokens.npy", tokens)
    ours, jobs = {}, []
    for i, (name, cfg) in enumerate(MESHKIT_MODELS.items()):
        ours[name] = _perturbed(cfg, i)
        interop.save(ours[name], cfg, tmp / name, max_shard_bytes=20_000)
        jobs.append({"dir": str(tmp / name)})
    jobs += [{"make": config, "dir": str(tmp / name)} for name, config in REFERENCE_MODELS.items()]
    for job in jobs:
        job |= {"tokens": str(tmp / "tokens.npy"), "out": job["dir"] + ".npy",
                "generate": {"prompt": PROMPT, "new": NEW}}  # fmt: skip
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([reference_python, str(SCRIPT), str(tmp / "jobs.json")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, tokens, ours


def _agree(tmp, name, params, cfg, tokens):
    """meshkit's logits and greedy tokens against transformers' for the checkpoint ``name``."""
    mine = np.asarray(gemma.apply(params, tokens, cfg))
    theirs_logits = np.load(tmp / f"{name}.npy")
    diff = float(np.max(np.abs(mine - theirs_logits)))
    theirs = json.loads((tmp / f"{name}.npy.generated.json").read_text())
    assert theirs[: len(PROMPT)] == PROMPT and len(theirs) == len(PROMPT) + NEW
    greedy = continue_prompts(params, cfg, [PROMPT], NEW)[0]
    print(
        f"{name}: max |logit diff| {diff:.2e}, greedy {NEW} tokens equal: {greedy == theirs[len(PROMPT) :]}"
    )
    assert diff < TOL
    assert greedy == theirs[len(PROMPT) :]
    return theirs_logits


@pytest.mark.parametrize("name", list(REFERENCE_MODELS))
def test_transformers_checkpoint_gives_meshkit_its_logits_and_greedy_tokens(reference, name):
    tmp, tokens, _ = reference
    params, cfg = interop.load(tmp / name)
    theirs = _agree(tmp, name, params, cfg, tokens)
    for field, off in SWITCHES.get(name, []):  # each switch matters: without it the logits move
        moved = np.asarray(gemma.apply(params, tokens, dataclasses.replace(cfg, **{field: off})))
        print(f"{name}: without {field}: max |logit diff| {np.max(np.abs(moved - theirs)):.2e}")
        assert np.max(np.abs(moved - theirs)) > 1e-3
    interop.save(params, cfg, tmp / f"{name}-again")  # and back: the tensors it read, bitwise
    theirs_ckpt, again = Checkpoint(tmp / name), Checkpoint(tmp / f"{name}-again")
    assert again.names() <= theirs_ckpt.names()
    for n in again.names():
        whole = tuple(slice(None) for _ in again.shape(n))
        np.testing.assert_array_equal(again.read(Source(n), whole), theirs_ckpt.read(Source(n), whole))
    assert interop.read_config(tmp / f"{name}-again") == cfg
    written = json.loads((tmp / f"{name}-again" / "config.json").read_text())
    assert written["model_type"] == REFERENCE_MODELS[name]["model_type"]


@pytest.mark.parametrize("name", list(MESHKIT_MODELS))
def test_meshkit_export_gives_transformers_its_logits_and_greedy_tokens(reference, name):
    tmp, tokens, ours = reference
    _agree(tmp, name, ours[name], MESHKIT_MODELS[name], tokens)
    written = json.loads((tmp / name / "config.json").read_text())
    assert written["model_type"] == {"gemma2": "gemma2", "gemma3": "gemma3_text", "gemma": "gemma"}[name]


@pytest.mark.parametrize("name", list(REFERENCE_MODELS))
def test_the_scanned_form_and_the_stages_compute_the_checkpoints_logits(reference, name):
    """The scanned form (each layer's kind scanned beside its parameters) gives transformers' logits; so
    do the ``Stages`` a pipeline runs, one period of the layers per block, where the layers are whole
    periods (Gemma 3's pattern of 3 over 4 layers is not: a pipeline refuses it)."""
    from meshkit.models import gpt

    tmp, tokens, _ = reference
    params, cfg = interop.load(tmp / name)
    scanned, scfg = gpt.to_form(params, True), dataclasses.replace(cfg, scan_layers=True)
    assert np.max(np.abs(np.asarray(gemma.apply(scanned, tokens, scfg)) - np.load(tmp / f"{name}.npy"))) < TOL
    stages = gemma.stages(scfg)
    if cfg.layers % cfg.period:
        return
    top = {k: v for k, v in scanned.items() if k != "blocks"}
    logits = stages.head(top, stages.run_blocks(scanned["blocks"], stages.embed(top, (tokens,))))
    assert np.max(np.abs(np.asarray(logits) - np.load(tmp / f"{name}.npy"))) < TOL


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each config of ``REFERENCE_MODELS`` as transformers 4.57.6 and 5.x save it, one process each."""
    tmp = tmp_path_factory.mktemp("written")
    for ref in REFERENCES:
        jobs = [
            {"make": c, "dir": str(tmp / ref / n), "config_only": True} for n, c in REFERENCE_MODELS.items()
        ]
        (tmp / f"{ref}.json").write_text(json.dumps(jobs))
        done = subprocess.run([reference_interpreter(ref), str(SCRIPT), str(tmp / f"{ref}.json")], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    return tmp


# Tiers: sweeps, as the file (its fixture runs both references): config.json in 5.x's form, Gemma 3's
# rotary keyed by layer type included, is read in core by test_gemma.py's
# test_each_type_reads_its_switches_and_writes_its_own_model_type (each type's 5.x form); configs made by
# 5.x and 4.57.6 in test_transformers_checkpoint_gives_meshkit_its_logits_and_greedy_tokens (sweep).
@pytest.mark.parametrize("name", list(REFERENCE_MODELS))
def test_a_config_transformers_5_writes_reads_as_the_one_4x_writes(written, name):
    """config.json as transformers 5.x saves it (its rotary in ``rope_parameters``, Gemma 3's keyed by layer
    type) reads as the same meshkit model as 4.57.6's, and that model is the config's."""
    five = json.loads((written / "transformers5" / name / "config.json").read_text())
    assert five["transformers_version"].startswith("5.") and "rope_parameters" in five
    cfg = interop.read_config(written / "transformers5" / name)
    assert cfg == interop.read_config(written / "transformers4" / name)
    made = REFERENCE_MODELS[name]
    assert cfg.heads == made["num_attention_heads"] and cfg.rope_factor == made.get("rope_scaling", {}).get(
        "factor", 1.0
    )
