"""The sampler's certificate (issue 50): each sampled token's log-probability equals the trainer's forward
log-probability of the same sequence (float64, to 1e-12: the gap RL trainers patch with importance
weights, here none), on one device and under a tensor-parallel split; and the tokens drawn at
temperature 1 follow the model's distribution (a chi-square test over many draws), top-k and min-p
its renormalised head."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from _placed import tp_placed
from meshkit._errors import MeshkitError
from meshkit.models import generate as G
from meshkit.models import llama

CFG = llama.LlamaConfig(vocab_size=48, seq_len=32, layers=2, width=32, heads=4, kv_heads=2, ffn=64)
PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [5, 8, 9, 7, 9]]
NEW = 10


def _params(cfg):
    """Weights moved off N(0, 0.02) so that the next-token distributions are far from uniform."""
    params = llama.init(jax.random.key(0), cfg)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape, a.dtype), params)


def _trainer_logprobs(params, cfg, prompts, news):
    """The trainer's forward (``llama.apply``, as ``make_loss`` runs it) on each prompt + its new tokens
    (one batch, right-padded: a causal model's padding after a token changes nothing before it): the
    log-probability of each new token."""
    seqs = [p + n for p, n in zip(prompts, news, strict=True)]
    batch = np.zeros((len(seqs), max(map(len, seqs)) - 1), np.int32)
    for row, seq in enumerate(seqs):
        batch[row, : len(seq) - 1] = seq[:-1]
    logp = np.asarray(jax.nn.log_softmax(llama.apply(params, batch, cfg), -1))
    return [
        logp[row, np.arange(len(p) - 1, len(s) - 1), s[len(p) :]]
        for row, (p, s) in enumerate(zip(prompts, seqs, strict=True))
    ]


# Tiers: the filtered sampling (temperature, top-k, top-p and min-p at once) is core; greedy and plain
# temperature sweep (the same log-probability, fewer filters before the draw).
@pytest.mark.parametrize(
    "sampling",
    [pytest.param(G.Sampling(), id="greedy", marks=pytest.mark.sweep),
     pytest.param(G.Sampling(temperature=1.0), id="t1", marks=pytest.mark.sweep),
     pytest.param(G.Sampling(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05), id="filtered")],
)  # fmt: skip
def test_sampled_logprobs_are_the_trainers_in_float64(sampling):
    """Whatever the sampling (greedy, temperature, top-k/top-p/min-p), each token's log-probability is the
    model's, equal to the trainer's forward on the same sequence to 1e-12 in float64; under fsdp+tp's
    split (data=4,model=2, the cache's key/value heads on model) the same tokens and log-probabilities."""
    with jax.enable_x64(True):
        cfg = dataclasses.replace(CFG, dtype="float64")
        params = _params(cfg)
        tokens, lps = G.generate(params, cfg, PROMPTS, NEW, sampling=sampling, seed=7, logprobs=True)
        trainer = _trainer_logprobs(params, cfg, PROMPTS, tokens)
        gap = max(float(np.max(np.abs(np.asarray(lp) - t))) for lp, t in zip(lps, trainer, strict=True))
        assert gap <= 1e-12, gap
        assert all(np.all(np.asarray(lp) <= 0) for lp in lps)
        mesh, placed = tp_placed(params, llama.logical_axes(params))
        split = G.generate(placed, cfg, PROMPTS, NEW, sampling=sampling, seed=7,
                           cache_sharding=G.kv_sharding(mesh, cfg), logprobs=True)  # fmt: skip
        assert split[0] == tokens
        assert np.max(np.abs(np.asarray(split[1]) - np.asarray(lps))) <= 1e-12


DRAWS = 4000


# Tiers: the model's own distribution is core, top-k's and min-p's sweep (their filters are core above).
@pytest.mark.parametrize(
    "sampling",
    [pytest.param(G.Sampling(temperature=1.0), id="t1"),
     pytest.param(G.Sampling(temperature=1.0, top_k=6), id="top_k", marks=pytest.mark.sweep),
     pytest.param(G.Sampling(temperature=1.0, min_p=0.1), id="min_p", marks=pytest.mark.sweep)],
)  # fmt: skip
def test_tokens_drawn_follow_the_models_distribution(sampling):
    """4,000 first tokens after one prompt (one batch: a key per row's draw): their frequencies against
    the model's next-token distribution (renormalised over what top-k or min-p keeps; nothing outside it
    drawn), by a chi-square test at the 0.1% level (the seed is fixed: the same draw every run)."""
    params = _params(CFG)
    prompt = [3, 1, 4, 1, 5]
    drawn = np.asarray(G.generate(params, CFG, [prompt] * DRAWS, 1, sampling=sampling, seed=11))[:, 0]
    logits = np.asarray(llama.apply(params, np.asarray([prompt], np.int32), CFG)[0, -1], np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    keep = np.ones_like(probs, bool)
    if sampling.top_k:
        keep = probs >= np.sort(probs)[-sampling.top_k]
    if sampling.min_p:
        keep = probs >= sampling.min_p * probs.max()
    want = np.where(keep, probs, 0.0) / probs[keep].sum()
    counts = np.bincount(drawn, minlength=CFG.vocab_size)
    assert counts[~keep].sum() == 0  # filtered tokens never drawn
    assert keep.sum() >= 3 and np.max(want) < 0.9  # a distribution worth testing
    # categories expected at least 5 times; the rest pooled into one
    big = want * DRAWS >= 5
    observed = np.append(counts[big], counts[~big & keep].sum())
    expected = np.append(want[big], want[~big & keep].sum()) * DRAWS
    observed, expected = observed[expected > 0], expected[expected > 0]
    p = stats.chisquare(observed, expected).pvalue
    assert p > 1e-3, (p, observed, expected)


def test_min_p_is_checked():
    with pytest.raises(MeshkitError, match=r"--min-p must be in \[0, 1\)"):
        G.Sampling(min_p=1.0)
    assert jnp.all(G.token_logprob(jnp.zeros((2, 4)), jnp.asarray([0, 3])) == -np.log(4.0).astype(np.float32))
