"""Generation with a key/value cache: greedy tokens equal the full forward pass's argmax at every
position, for a batch of prompts of different lengths, on one device and under a tensor-parallel
split; sampling's filters; bad input."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _placed import tp_placed
from meshkit._errors import MeshkitError
from meshkit.models import generate as G
from meshkit.models import llama

CFG = llama.LlamaConfig(vocab_size=48, seq_len=32, layers=2, width=32, heads=4, kv_heads=2, ffn=64)
PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [5, 8, 9, 7, 9]]
NEW = 12


def _params():
    """Initial weights moved far enough from N(0, 0.02) that the greedy path is not one repeated token."""
    params = llama.init(jax.random.key(0), CFG)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape), params)


PARAMS = _params()


def test_greedy_equals_the_full_forward_argmax_at_every_position():
    out = G.generate(PARAMS, CFG, PROMPTS, NEW)
    assert [len(o) for o in out] == [NEW] * 3
    assert len({tuple(o) for o in out}) == 3 and any(len(set(o)) > 2 for o in out)  # not a degenerate path
    for prompt, new in zip(PROMPTS, out, strict=True):
        seq = np.asarray(prompt + new, np.int32)
        logits = llama.apply(PARAMS, seq[None, :-1], CFG)[0]
        assert np.argmax(logits[len(prompt) - 1 :], -1).tolist() == new
    # the cache's way and the window's way (every token the whole model again) agree
    assert G.window_generate(PARAMS, CFG, PROMPTS[1], NEW) == out[1]


def test_cache_under_the_tensor_parallel_split_gives_the_same_tokens():
    """Parameters split as fsdp+tp's rules split them on data=4,model=2, the cache's key/value heads
    on model: the same greedy tokens as one device."""
    mesh, split = tp_placed(PARAMS, llama.logical_axes(PARAMS))
    cache = G.kv_sharding(mesh, CFG)
    assert cache.spec == P(None, None, None, "model", None)
    assert G.generate(split, CFG, PROMPTS, NEW, cache_sharding=cache) == G.generate(PARAMS, CFG, PROMPTS, NEW)


def test_sampling_filters_and_seeds():
    greedy = G.generate(PARAMS, CFG, PROMPTS[:2], 6)
    top1 = G.generate(PARAMS, CFG, PROMPTS[:2], 6, sampling=G.Sampling(temperature=1.0, top_k=1), seed=3)
    assert top1 == greedy  # one token left: the argmax
    nucleus = G.generate(
        PARAMS, CFG, PROMPTS[:2], 6, sampling=G.Sampling(temperature=1.0, top_p=1e-6), seed=3
    )
    assert nucleus == greedy  # the most likely token is always kept
    hot = G.Sampling(temperature=2.0, top_k=20, top_p=0.95)
    a, b = (G.generate(PARAMS, CFG, PROMPTS[:2], 6, sampling=hot, seed=s) for s in (0, 1))
    assert a == G.generate(PARAMS, CFG, PROMPTS[:2], 6, sampling=hot, seed=0)  # a seed fixes the draw
    assert a != b and all(0 <= t < CFG.vocab_size for row in a + b for t in row)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: G.generate(PARAMS, CFG, PROMPTS, 0), "--max-new-tokens must be at least 1"),
        (lambda: G.generate(PARAMS, CFG, [[1], []], 3), "every prompt needs at least one token"),
        (lambda: G.generate(PARAMS, CFG, [[1, 99]], 3), "token 99 is outside the model's vocabulary of 48"),
        (lambda: G.Sampling(top_p=0), r"--top-p must be in \(0, 1\]"),
        (lambda: G.Sampling(temperature=-1), "--temperature must be a finite number"),
    ],
)
def test_bad_input_is_one_line(call, message):
    with pytest.raises(MeshkitError, match=message) as e:
        call()
    assert "\n" not in str(e.value)
