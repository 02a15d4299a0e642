"""GRPO's loss (``meshkit.models.grpo``): each aggregation's loss and TRL's metrics equal a NumPy float64
computation from the model's log-probs (clipped ratios on both sides, the k3 KL, the temperature), the
advantages are TRL's group normalisation, and the GRPO step under dp, fsdp, tp and fsdp+tp equals one
device in float64 with its collectives equal to the ledger's model. TRL's own ``GRPOTrainer`` is the
reference of tests/test_grpo_reference.py."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from _reference import max_rel, one_device
from _tiers import tiered
from meshkit.models import grpo as G
from meshkit.models import llama, reference_np
from meshkit.spec.batch import TokenBatch
from meshkit.train import Trainer

CFG = llama.LlamaConfig(vocab_size=64, seq_len=24, layers=2, width=32, heads=8, kv_heads=4, ffn=64)
ROWS, MAX_NEW = 8, 12


def rollout(vocab: int, seed: int = 0) -> tuple[TokenBatch, np.ndarray]:
    """Rows of a prompt then a completion (segment 1, positions from 0), padding after (segment 0); the
    completion mask of the targets (``(B, T)``)."""
    rng = np.random.default_rng(seed)
    t = CFG.seq_len
    ids = rng.integers(1, vocab, size=(ROWS, t + 1)).astype(np.int32)
    seg, pos, mask = np.zeros((ROWS, t + 1), np.int32), np.zeros((ROWS, t + 1), np.int32), np.zeros((ROWS, t))
    for r in range(ROWS):
        prompt, new = int(rng.integers(2, 8)), int(rng.integers(1, MAX_NEW + 1))
        n = prompt + new
        seg[r, :n], pos[r, :n] = 1, np.arange(n)
        mask[r, prompt - 1 : n - 1] = 1  # target t predicts id t + 1: the completion's ids
        ids[r, n:] = 0
    return TokenBatch(ids[:, :-1], ids[:, 1:], None, seg[:, :-1], pos[:, :-1]), mask


def filled(batch, mask, how, sampled, reference, seed: int = 1):
    rewards = np.random.default_rng(seed).normal(size=ROWS)
    w, share = G.weights(mask, how, MAX_NEW)
    ref = {"advantages": G.advantages(rewards, 4, how.scale_rewards), "sampled": sampled, "tokens": share}
    if how.beta:
        ref["reference"] = reference
    return batch._replace(weights=w, reference=ref)


def numpy_loss(lp, batch, mask, how):
    r = batch.reference
    ratio = np.exp(lp - r["sampled"])
    adv = r["advantages"][:, None]
    token = -np.minimum(ratio * adv, np.clip(ratio, 1 - how.epsilon, 1 + how.high) * adv)
    out = {}
    n = mask.sum()
    if how.beta:
        kl = np.exp(r["reference"] - lp) - (r["reference"] - lp) - 1
        token = token + how.beta * kl
        out["kl"] = (kl * mask).sum() / n
    per_row = (token * mask).sum(1)
    out["loss"] = {"grpo": np.mean(per_row / mask.sum(1)), "dr_grpo": per_row.sum() / (ROWS * MAX_NEW)}.get(
        how.loss, (token * mask).sum() / n
    )
    low, high = (ratio < 1 - how.epsilon) & (adv < 0), (ratio > 1 + how.high) & (adv > 0)
    out |= {"clip_ratio/low_mean": (low * mask).sum() / n, "clip_ratio/high_mean": (high * mask).sum() / n,
            "clip_ratio/region_mean": ((low | high) * mask).sum() / n}  # fmt: skip
    return out


OBJECTIVES = [
    G.GRPO(loss="dapo", beta=0.04),
    G.GRPO(loss="grpo", beta=0.0, epsilon=0.1, epsilon_high=0.28),
    G.GRPO(loss="dr_grpo", beta=0.1, scale_rewards=False, temperature=0.7),
    G.GRPO(loss="bnpo", beta=0.0, temperature=1.3),
]


@pytest.mark.parametrize("how", OBJECTIVES, ids=lambda h: f"{h.loss}-b{h.beta}-t{h.temperature}")
def test_each_aggregation_equals_numpy_float64(how):
    with jax.enable_x64(True):
        cfg = dataclasses.replace(CFG, dtype="float64")
        policy, old, frozen = (llama.init(jax.random.key(k), cfg) for k in range(3))
        batch, mask = rollout(cfg.vocab_size)
        np_lp = lambda p: reference_np.token_logprobs(p, cfg, batch, how.temperature)  # noqa: E731
        full = filled(batch, mask, how, np_lp(old), np_lp(frozen))
        loss, metrics = jax.jit(G.make_loss(lambda p, x, **kw: llama.apply(p, x, cfg, **kw), how))(
            policy, full
        )
        want = numpy_loss(np_lp(policy), full, mask, how)
        got = {"loss": loss, **metrics}
        assert set(got) == set(want)
        for key, value in want.items():
            assert float(got[key]) == pytest.approx(value, rel=1e-12, abs=1e-14), key
        assert 0 < float(metrics["clip_ratio/region_mean"]) < 1  # the ratios clip on some tokens, not all


def test_advantages_are_trls_group_normalisation():
    r = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    got = G.advantages(r, 4, True)
    np.testing.assert_allclose(got[:4], (r[:4] - 0.5) / (np.std(r[:4], ddof=1) + 1e-4))
    assert np.all(got[4:] == 0)  # a group that all scored alike teaches nothing
    np.testing.assert_allclose(G.advantages(r, 4, False)[:4], r[:4] - 0.5)


CASES = [("dp", "data=8", {}), ("fsdp", "data=8", {"remat": "layer"}), ("tp", "model=8", {}),
         ("fsdp+tp", "data=4,model=2", {})]  # fmt: skip


# Tiers: fsdp+tp is core; the others sweep. Under tp on model=8 the key/value heads are 8 (test_dpo.py says why).
@pytest.mark.parametrize(("plan", "mesh", "opts"), tiered(CASES, [c[0] for c in CASES], core={"fsdp+tp"}))
def test_grpo_step_under_the_plans_equals_one_device_in_float64(plan, mesh, opts):
    how = G.GRPO(loss="grpo", beta=0.04, epsilon_high=0.28)
    base = dataclasses.replace(CFG, kv_heads=8) if plan == "tp" else CFG
    with jax.enable_x64(True):
        cfg = dataclasses.replace(base, dtype="float64")
        params, old, frozen = (llama.init(jax.random.key(k), cfg) for k in range(3))
        apply = lambda p, x, **kw: llama.apply(p, x, cfg, **kw)  # noqa: E731
        batch, mask = rollout(cfg.vocab_size)
        logps = jax.jit(G.logps_fn(apply, how.temperature))
        full = filled(batch, mask, how, logps(old, batch), logps(frozen, batch))
        loss = G.make_loss(apply, how)
        t = Trainer(loss, params, optax.adam(1e-2), plan=plan, mesh=mesh, units=llama.units(cfg),
                    logical_axes=llama.logical_axes(params), has_aux=True, **opts)  # fmt: skip
        first = t.step(full)
        t.step(full)
        ref = one_device(lambda p, b: loss(p, b)[0], params, full, 2, optax.adam(1e-2))
        assert max_rel(t.params, ref) < 1e-10 and max_rel(t.params, params) > 1e-3
        alone = jax.jit(loss)(params, full)[1]
        for key in G.METRICS:
            assert float(first[key]) == pytest.approx(float(alone[key]), rel=1e-10, abs=1e-13), key
    params = llama.init(jax.random.key(0), base)
    f32 = jax.tree.map(lambda a: np.asarray(a, np.float32) if np.issubdtype(np.asarray(a).dtype, np.floating) else a,
                       full)  # fmt: skip
    t = Trainer(G.make_loss(lambda p, x, **kw: llama.apply(p, x, base, **kw), how), params, optax.adam(1e-2),
                plan=plan, mesh=mesh, units=llama.units(base), logical_axes=llama.logical_axes(params),
                has_aux=True, **opts)  # fmt: skip
    assert (r := t.report(f32)).ok, str(r)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [({"loss": "ppo"}, "use dapo"), ({"beta": -1.0}, "at least 0"), ({"epsilon": 1.5}, "clip epsilons"),
     ({"temperature": 0.0}, "temperature must be above 0")],
)  # fmt: skip
def test_bad_settings_are_one_line(kwargs, says):
    with pytest.raises(G.GRPOError, match=says):
        G.GRPO(**kwargs)
