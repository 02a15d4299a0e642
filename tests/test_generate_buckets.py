"""Generation compiles per bucket of lengths, not per length (issue 39: every new prompt length or
``max_new_tokens`` compiled a program, and the first token after an unseen length took 110x
transformers'; ``window_generate`` built its jit inside every call). The tokens are the same greedy
tokens as the full forward pass (the bucket's extra left padding is masked)."""

import jax
import numpy as np

from meshkit.models import generate as G
from meshkit.models import gpt, llama

CFG = llama.LlamaConfig(vocab_size=48, seq_len=64, layers=1, width=32, heads=4, kv_heads=2, ffn=64)


def _params(cfg, module):
    params = module.init(jax.random.key(0), cfg)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape), params)


def test_new_prompt_lengths_and_new_token_counts_reuse_their_buckets_program():
    params = _params(CFG, llama)
    G.generate(params, CFG, [[1, 2, 3]], 16)
    compiled = G._generate._cache_size()
    cases = [([[3, 1, 4, 1, 5]], 9), ([[1, 8, 2, 8, 1, 8, 2, 8, 4]], 12), ([[5] * 16], 16)]
    for prompts, new in cases:
        out = G.generate(params, CFG, prompts, new)
        assert [len(o) for o in out] == [new] * len(prompts)
        for prompt, tokens in zip(prompts, out, strict=True):
            seq = np.asarray(prompt + tokens, np.int32)
            logits = llama.apply(params, seq[None, :-1], CFG)[0]
            assert np.argmax(logits[len(prompt) - 1 :], -1).tolist() == tokens
    assert G._generate._cache_size() == compiled  # every case in the buckets of 16 prompt and 16 new tokens
    G.generate(params, CFG, [[1] * 17], 13)  # the next bucket: 32 prompt tokens
    assert G._generate._cache_size() == compiled + 1
    G.generate(params, CFG, [[2, 7], [1, 8, 2]], 3)  # another batch of prompts is another shape
    G.generate(params, CFG, [[2, 7, 1], [1, 8, 2, 8, 1]], 3)
    assert G._generate._cache_size() == compiled + 2
    assert [G.bucket(n) for n in (1, 16, 17, 33)] == [16, 16, 32, 64]
    assert [G.bucket(n, 1) for n in (1, 2, 3, 9)] == [1, 2, 4, 16]


def test_window_generate_compiles_once_per_model_and_sampling():
    cfg = gpt.GPTConfig(vocab_size=48, seq_len=16, layers=1, width=32, heads=4)
    params = _params(cfg, gpt)
    G.window_generate(params, cfg, [1, 2], 2)
    compiled = G._next_token._cache_size()
    for prompt in ([3, 4, 5], [6] * 9, [7] * 20):
        G.window_generate(params, cfg, prompt, 3)
    assert G._next_token._cache_size() == compiled
