"""The Llama's sliding window (``LlamaConfig.window``, in the layers ``sliding`` names: Mistral's and
Qwen2's) and its mixture of experts when generating: a one-layer model with a window is the model
without one run on the window's tokens alone (the rotary is relative: only the keys seen change the
output), layers of different windows run in the loop form and are refused in the scanned one,
generation with the cache honours each layer's window (greedy tokens equal the full forward pass's
argmax past the window) and runs experts dropless. The transformers side is test_hf_families.py."""

import dataclasses

import jax
import numpy as np
import pytest

from meshkit._errors import MeshkitError
from meshkit.models import generate as G
from meshkit.models import gpt, llama

CFG = llama.LlamaConfig(vocab_size=48, seq_len=64, layers=3, width=32, heads=4, kv_heads=2, ffn=64)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9], [2, 7]]


def _moved(cfg, scale=0.3):
    """Initial weights moved far from N(0, 0.02), so that the greedy path is not one repeated token."""
    params = llama.init(jax.random.key(0), cfg)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda a: a + scale * jax.random.normal(next(keys), a.shape), params)


# Tiers: sweeps; the window's mask is NumPy float64's in test_attention.py's
# test_both_forms_equal_numpy_float64_masks_and_grouped_heads_included[5-False], the Llama's forward with a
# window in every layer (loop and scanned forms) in
# test_layers_of_different_windows_run_in_the_loop_form_and_are_refused_scanned, and against transformers
# (the Mixtral's window of 8 over 24 tokens, logits within 1e-5) in test_hf_families.py's
# test_transformers_checkpoint_gives_meshkit_its_logits_and_greedy_tokens[transformers5-hf-mixtral]
# (Mistral's, [transformers5-hf-mistral], sweeps).
@pytest.mark.sweep
def test_one_layer_with_a_window_is_the_model_on_the_windows_tokens_alone():
    """Position t of a one-layer model with window w sees tokens t-w+1..t: its logits equal the
    windowless model's last logits on exactly those tokens (at positions 0..w-1: the rotary is relative).
    Without the window they differ, so the comparison sees it."""
    cfg = dataclasses.replace(CFG, layers=1, window=5)
    full = dataclasses.replace(cfg, window=None)
    params = _moved(cfg)
    tokens = np.random.default_rng(0).integers(0, 48, size=(2, 20)).astype(np.int32)
    got = np.asarray(llama.apply(params, tokens, cfg))
    want = np.stack(
        [np.asarray(llama.apply(params, tokens[:, max(0, t - 4) : t + 1], full))[:, -1] for t in range(20)], 1
    )
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.abs(np.asarray(llama.apply(params, tokens, full)) - want).max() > 1e-2


def test_layers_of_different_windows_run_in_the_loop_form_and_are_refused_scanned():
    mixed = dataclasses.replace(CFG, window=4, sliding=(False, True, True))
    assert mixed.layer_windows == (None, 4, 4)
    params = _moved(mixed)
    tokens = np.random.default_rng(1).integers(0, 48, size=(2, 24)).astype(np.int32)
    logits = {s: np.asarray(llama.apply(params, tokens, dataclasses.replace(CFG, window=4, sliding=s)))
              for s in [(False, True, True), (True, True, True), (False, False, True)]}  # fmt: skip
    assert (
        min(np.abs(a - b).max() for a, b in [(logits[k], logits[j]) for k in logits for j in logits if k < j])
        > 1e-3
    )
    # one window in every layer: the scanned form computes what the loop form does
    every = dataclasses.replace(CFG, window=4)
    scanned = np.asarray(
        llama.apply(gpt.to_scanned(params), tokens, dataclasses.replace(every, scan_layers=True))
    )
    np.testing.assert_allclose(scanned, np.asarray(llama.apply(params, tokens, every)), atol=1e-5)
    with pytest.raises(MeshkitError, match=r"runs in the layers form only: give scan_layers=False") as e:
        dataclasses.replace(mixed, scan_layers=True)
    assert "\n" not in str(e.value)
    with pytest.raises(MeshkitError, match="pipeline plans run one block function in every layer"):
        llama.stages(mixed)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"window": 0}, "window must be a whole number of tokens of at least 1"),
        ({"window": True}, "window must be a whole number"),
        ({"window": 4, "sliding": (True, False)}, "sliding must be 3 booleans"),
        ({"sliding": (True, False, True)}, "names the layers of a window but window is None"),
    ],
)
def test_a_bad_window_is_one_line(fields, says):
    with pytest.raises(MeshkitError, match=says) as e:
        dataclasses.replace(CFG, **fields)
    assert "\n" not in str(e.value)


def test_one_config_per_model():
    """Every layer sliding is ``sliding=None``; none sliding is no window at all (equal configs)."""
    assert dataclasses.replace(CFG, window=4, sliding=(True,) * 3) == dataclasses.replace(CFG, window=4)
    assert dataclasses.replace(CFG, window=4, sliding=[False] * 3) == CFG


def test_flops_count_the_keys_a_window_lets_a_query_see():
    """``12 L T (H h)`` with T the keys seen: min(T, window) in a layer with a window."""
    mixed = dataclasses.replace(CFG, window=8, sliding=(False, True, True))
    attention = 12 * CFG.heads * CFG.head_dim
    assert llama.flops_per_token(CFG, 64) - llama.flops_per_token(mixed, 64) == attention * 2 * (64 - 8)
    assert llama.flops_per_token(mixed, 8) == llama.flops_per_token(CFG, 8)


# Tiers: some-layers is core (the cache's per-layer mask); every-layer and experts sweep: the cache's mask
# in every layer is some-layers' mask in each, and a mixture of experts generating dropless from the cache
# with a window in every layer, 32 tokens past it, is core against transformers' greedy tokens in
# test_hf_families.py's test_transformers_checkpoint_gives_meshkit_its_logits_and_greedy_tokens
# [transformers5-hf-mixtral] (4 experts, 2 a token, renormalised, window 8).
@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"window": 4}, marks=pytest.mark.sweep),
        {"window": 3, "sliding": (False, True, False)},
        pytest.param(
            {"window": 4, "experts": 4, "capacity_factor": 0.0, "router_renormalize": True},
            marks=pytest.mark.sweep,
        ),
    ],
    ids=["every-layer", "some-layers", "experts"],
)
def test_generation_honours_each_layers_window(fields):
    """Greedy tokens from the cache equal the full forward pass's argmax at every position, prompt and
    generation far past the window (a cache that ignored the window would attend to more); a mixture of
    experts generates dropless, the model's own function."""
    cfg = dataclasses.replace(CFG, **fields)
    params = _moved(cfg)
    out = G.generate(params, cfg, PROMPTS, 20)
    for prompt, new in zip(PROMPTS, out, strict=True):
        logits = llama.apply(params, np.asarray(prompt + new, np.int32)[None, :-1], cfg)[0]
        assert np.argmax(logits[len(prompt) - 1 :], -1).tolist() == new
    windowless = dataclasses.replace(cfg, window=None, sliding=None)
    assert G.generate(params, windowless, PROMPTS, 20) != out  # the window changes the tokens
