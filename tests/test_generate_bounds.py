"""``meshkit generate``'s bounds (the probe's issue 13 and its one-line cases): a continuation ends at the end
of text its tokenizer (and the checkpoint it came from) names, as transformers' ``generate`` stops at
``eos_token_id``; new tokens are bounded by the model's positions (a billion asked allocated a cache of 971 GB),
and running past what the run trained on is said in one line; a prompt that is no text (a lone surrogate) is
one line. In-process on a one-layer Llama of width 16 (``generate_text`` takes any run-like object)."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from meshkit._errors import MeshkitError
from meshkit.models import generate as G
from meshkit.models import llama, registry
from meshkit.train import config as C
from meshkit.train.outputs import generate_text

CFG = llama.LlamaConfig(vocab_size=32, seq_len=16, layers=1, width=16, heads=2, kv_heads=1, ffn=32)
PARAMS = jax.tree.map(
    lambda a: a + 0.5 * jax.random.normal(jax.random.key(2), a.shape),
    llama.init(jax.random.key(0), CFG),
)
PROMPT = [3, 1, 4]


def _run(eot: int, trained: int = 16):
    """A run on a BPE tokenizer whose end of text is ``eot``; its text is the ids themselves."""
    bpe = SimpleNamespace(eot_id=eot, eos=("<|endoftext|>", eot), bos=None,
                          special=lambda i: "<|endoftext|>" if i == eot else None)  # fmt: skip
    corpus = SimpleNamespace(bpe=bpe, encode=lambda text: np.asarray(PROMPT, np.int32), decode=list)
    return SimpleNamespace(params=PARAMS, family=registry.family_of(CFG), model=CFG, corpus=corpus,
                           cfg=C.tiny().replace(seq_len=trained))  # fmt: skip


def test_generate_stops_at_the_end_of_text():
    greedy = G.generate(PARAMS, CFG, [PROMPT], 8)[0]
    at = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])  # a token not seen before it
    (out,) = generate_text(_run(eot=greedy[at]), ["x"], 8, sampling=G.Sampling())
    assert out == greedy[:at], (out, greedy)
    assert G.continue_prompts(PARAMS, CFG, [PROMPT], 8, stop={greedy[at]}) == [greedy[:at]]


def test_new_tokens_are_bounded_by_the_models_positions_and_said(capsys):
    """16 positions, a prompt of 3: 13 new tokens at most, said in one line; past the 8 the run trained on,
    another line. The library refuses what the command bounds."""
    (out,) = generate_text(_run(eot=99, trained=8), ["x"], 100, sampling=G.Sampling())
    err = capsys.readouterr().err.splitlines()
    assert len(out) == 13 and out == G.generate(PARAMS, CFG, [PROMPT], 13)[0]
    assert err == [
        "warning: --max-new-tokens 100: the model has 16 positions and the prompt takes 3; generating 13",
        "warning: the prompt and its new tokens reach position 16, past the 8 the run trained on (--seq-len 8): "
        "the model never saw such positions",
    ], err
    generate_text(_run(eot=99), ["x"], 5, sampling=G.Sampling())
    assert capsys.readouterr().err == ""  # within both: nothing said
    with pytest.raises(MeshkitError, match="passes the model's 16 positions: give at most 13"):
        G.generate(PARAMS, CFG, [PROMPT], 10**9)


def test_a_prompt_that_is_no_text_is_one_line():
    with pytest.raises(C.ConfigError) as e:
        generate_text(_run(eot=99), ["ok", "a\udcffb"], 4, sampling=G.Sampling())
    said = str(e.value)
    assert (
        "--prompt[1] holds a lone UTF-16 surrogate (\\udcff at character 1)" in said and "\n" not in said
    ), said
