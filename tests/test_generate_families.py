"""The key/value cache of every family (``meshkit.models.generate`` over each family's ``decode``): the GPT
(its learned positions; a dropless mixture of experts), the Gemma 2 (local and global layers, a window of
4 that the prompts and new tokens pass, soft caps that bind) and the Gemma 3 (its local rotary base, q/k
norms, the scanned form). In float64 each sampled token's log-probability equals the family's training
forward (``apply``) on the same sequence to 1e-12, greedy tokens are the forward's argmax at every
position and the window's way's (no cache), and under fsdp+tp's split (data=4,model=2, the cache's
key/value heads on model) the tokens and log-probabilities are one device's."""

import dataclasses

import jax
import numpy as np
import pytest

from _placed import tp_placed
from _tiers import tiered
from meshkit.models import gemma, gpt, registry
from meshkit.models import generate as G

PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [5, 8, 9, 7, 9]]
NEW = 10
GEMMA = dict(vocab_size=48, seq_len=32, width=32, heads=4, kv_heads=2, ffn=64, dtype="float64")
MODELS = {
    "gpt": gpt.GPTConfig(vocab_size=48, seq_len=32, layers=2, width=32, heads=4, dtype="float64"),
    "gpt-moe": gpt.GPTConfig(vocab_size=48, seq_len=32, layers=2, width=32, heads=4, dtype="float64",
                             experts=4, capacity_factor=0.0, scan_layers=True),
    "gemma2": gemma.GemmaConfig(**GEMMA, layers=4, window=4, local_layers=(True, False) * 2, query_scalar=16.0,
                                attn_softcap=0.5, final_softcap=2.0, qk_norm=False),
    "gemma3": gemma.GemmaConfig(**GEMMA, layers=3, window=4, local_layers=(True, True, False), rope_theta=1e6,
                                local_rope_theta=100.0, rope_factor=4.0, scan_layers=True, tie_embeddings=False),
}  # fmt: skip


def _params(cfg):
    """Weights moved off N(0, 0.02) so that the next-token distributions are far from uniform."""
    module = registry.family_of(cfg).module
    params = module.init(jax.random.key(0), cfg)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape, a.dtype), params)


def _forward_logprobs(params, cfg, prompts, news):
    """The training forward on each prompt + its new tokens (right-padded): each new token's log-probability,
    and the forward's argmax where each new token was drawn."""
    seqs = [p + n for p, n in zip(prompts, news, strict=True)]
    batch = np.zeros((len(seqs), max(map(len, seqs)) - 1), np.int32)
    for row, seq in enumerate(seqs):
        batch[row, : len(seq) - 1] = seq[:-1]
    logp = np.asarray(jax.nn.log_softmax(registry.family_of(cfg).module.apply(params, batch, cfg), -1))
    rows = [
        (row, np.arange(len(p) - 1, len(s) - 1), s[len(p) :])
        for row, (p, s) in enumerate(zip(prompts, seqs, strict=True))
    ]
    return [logp[r, at, tok] for r, at, tok in rows], [
        np.argmax(logp[r, at], -1).tolist() for r, at, _ in rows
    ]


# Tiers: the GPT (learned positions) is core; the Gemma 2 (10 s, moved when make test measured 16:46: its
# windows and caps reach the cache in test_each_gemma_switch_reaches_the_cache, core), the GPT-MoE and the
# scanned Gemma 3 sweep.
@pytest.mark.parametrize("name", tiered([(n,) for n in MODELS], MODELS, core={"gpt"}))
def test_the_cache_of_every_family_is_its_training_forward(name):
    with jax.enable_x64(True):
        cfg = MODELS[name]
        params = _params(cfg)
        filtered = G.Sampling(temperature=0.8, top_k=8, top_p=0.95)
        tokens, lps = G.generate(params, cfg, PROMPTS, NEW, sampling=filtered, seed=3, logprobs=True)
        forward, _ = _forward_logprobs(params, cfg, PROMPTS, tokens)
        gap = max(float(np.max(np.abs(np.asarray(lp) - f))) for lp, f in zip(lps, forward, strict=True))
        assert gap <= 1e-12, gap
        greedy = G.generate(params, cfg, PROMPTS, NEW)
        assert len({tuple(g) for g in greedy}) == 3 and any(len(set(g)) > 2 for g in greedy)  # not degenerate
        assert _forward_logprobs(params, cfg, PROMPTS, greedy)[1] == greedy
        assert G.window_generate(params, cfg, PROMPTS[1], NEW) == greedy[1]
        mesh, placed = tp_placed(params, registry.family_of(cfg).module.logical_axes(params))
        split = G.generate(placed, cfg, PROMPTS, NEW, sampling=filtered, seed=3,
                           cache_sharding=G.kv_sharding(mesh, cfg), logprobs=True)  # fmt: skip
        assert split[0] == tokens
        assert np.max(np.abs(np.asarray(split[1]) - np.asarray(lps))) <= 1e-12


def test_each_gemma_switch_reaches_the_cache():
    """The window, the caps and the local rotary each change the cached tokens' log-probabilities: the cache
    computes them rather than a plain causal model's."""
    with jax.enable_x64(True):
        for name, switches in [
            ("gemma2", {"attn_softcap": None, "window": 32}),
            ("gemma3", {"local_rope_theta": 1e6}),
        ]:
            cfg = MODELS[name]
            params = _params(cfg)
            _, lps = G.generate(params, cfg, PROMPTS, NEW, logprobs=True)
            for field, off in switches.items():
                _, moved = G.generate(
                    params, dataclasses.replace(cfg, **{field: off}), PROMPTS, NEW, logprobs=True
                )
                assert np.max(np.abs(np.asarray(moved) - np.asarray(lps))) > 1e-3, field


PLANS = {"fsdp": "data=8", "dp+tp": "data=4,model=2", "fsdp+tp": "data=4,model=2"}


# Tiers: fsdp+tp (ZeRO-3's split over data and the tensor-parallel split at once) is core; fsdp (moved when
# make test measured 22 min: the split over data alone) and dp+tp (the split over model alone) sweep.
@pytest.mark.parametrize("plan, mesh", tiered(list(PLANS.items()), PLANS, core={"fsdp+tp"}))
def test_the_same_seed_draws_the_same_tokens_under_every_plan(plan, mesh):
    """The sampler on the parameters where a Trainer of each plan keeps them (ZeRO-3's split over data, the
    tensor-parallel split, both) and its cache laid out on that mesh: the same tokens as on one device and
    log-probabilities equal to 1e-12 (float64; the Gemma 2's local and global layers)."""
    import optax

    from meshkit import Trainer

    with jax.enable_x64(True):
        cfg = MODELS["gemma2"]
        params = _params(cfg)
        filtered = G.Sampling(temperature=0.8, top_k=8, top_p=0.95)
        one = G.generate(params, cfg, PROMPTS, NEW, sampling=filtered, seed=3, logprobs=True)
        t = Trainer(gemma.make_loss(cfg), params, optax.sgd(0.1), plan=plan, mesh=mesh,
                    logical_axes=gemma.logical_axes(params))  # fmt: skip
        split_leaves = [a for a in jax.tree.leaves(t.params) if not a.sharding.is_fully_replicated]
        assert split_leaves  # the parameters split, not gathered onto every device
        split = G.generate(t.params, cfg, PROMPTS, NEW, sampling=filtered, seed=3, logprobs=True,
                           cache_sharding=G.kv_sharding(t.mesh, cfg))  # fmt: skip
        assert split[0] == one[0]
        assert np.max(np.abs(np.asarray(split[1]) - np.asarray(one[1]))) <= 1e-12
