"""Generation one token at a time (``generate.stream``): for the same seed the tokens of the one-program
sampler, on one device and under fsdp+tp's split; ``continue_prompts(until=)`` ends each row where it is
told and stops drawing once every row has ended; and the text rules of streaming (``settled``: what later
tokens cannot change; ``stop_at``: where a stop string cuts)."""

import jax
import numpy as np
import pytest

from _placed import tp_placed
from meshkit.models import gemma, llama
from meshkit.models import generate as G
from meshkit.train.outputs import settled, stop_at

PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [5, 8, 9, 7, 9]]
MODELS = {
    "llama": llama.LlamaConfig(vocab_size=48, seq_len=48, layers=2, width=32, heads=4, kv_heads=2, ffn=64),
    "gemma": gemma.GemmaConfig(vocab_size=48, seq_len=48, layers=2, width=32, heads=4, kv_heads=2, ffn=64,
                               window=4, local_layers=(True, False), attn_softcap=0.5, tie_embeddings=False),
}  # fmt: skip


def _params(cfg, module):
    params = module.init(jax.random.key(0), cfg)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape, a.dtype), params)


# Tiers: the Gemma (local and global layers, a window, capped scores in the cache) is core; the Llama sweeps
# (moved when make test measured 22 min: streaming is the same loop over any family's cache, the Llama's
# cache under fsdp+tp's split core in test_generate.py's test_cache_under_the_tensor_parallel_split_...).
@pytest.mark.parametrize("name", [pytest.param("llama", marks=pytest.mark.sweep), "gemma"])
def test_streamed_tokens_are_the_one_program_samplers(name):
    cfg = MODELS[name]
    module = llama if name == "llama" else gemma
    params = _params(cfg, module)
    how = G.Sampling(temperature=0.9, top_k=12)
    whole = G.generate(params, cfg, PROMPTS, 20, sampling=how, seed=11)
    steps = list(G.stream(params, cfg, PROMPTS, 20, sampling=how, seed=11))
    assert len(steps) == 20 and np.stack(steps, 1).tolist() == whole
    mesh, placed = tp_placed(params, module.logical_axes(params))
    split = G.stream(placed, cfg, PROMPTS, 20, sampling=how, seed=11,
                     cache_sharding=G.kv_sharding(mesh, cfg))  # fmt: skip
    assert np.stack(list(split), 1).tolist() == whole


def test_until_ends_each_row_where_it_says_and_drawing_stops_when_all_have():
    cfg = MODELS["llama"]
    params = _params(cfg, llama)
    whole = G.generate(params, cfg, PROMPTS, 24)
    asked = []

    def until(row, tokens):
        asked.append(row)
        return len(tokens) == 3 + 2 * row  # rows end after 3, 5 and 7 tokens

    rows = G.continue_prompts(params, cfg, PROMPTS, 24, until=until)
    assert rows == [whole[r][: 3 + 2 * r] for r in range(3)]
    assert len(asked) == 3 + 5 + 7  # nothing asked of an ended row; no token drawn after the last ended
    stop = whole[1][4]  # a stop id ends its row before it, as without until
    plain = G.continue_prompts(params, cfg, PROMPTS, 24, stop={stop})
    assert G.continue_prompts(params, cfg, PROMPTS, 24, stop={stop}, until=lambda r, t: False) == plain
    assert plain[1] == whole[1][: whole[1].index(stop)]


def test_settled_text_and_stop_strings():
    assert settled("caf\ufffd", ()) == "caf"  # a character whose bytes have not all come
    assert settled("one\n", ["\n\n"]) == "one"  # could begin the stop string
    assert settled("one\nx", ["\n\n"]) == "one\nx"
    assert settled("the END", ["ENDING", "D."]) == "the "  # the longest end that begins one
    assert stop_at("a, b. c.", [".", ", b"]) == 1 and stop_at("abc", ["x"]) is None
