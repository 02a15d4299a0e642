"""meshkit's GRPO loss against Hugging Face TRL's own ``GRPOTrainer`` (``tests/reference/trl_grpo.py`` in
``.venv-ref``: trl 0.25.1 beside transformers 4.57.6; only its generation replaced by the given completions):
the same two Llama checkpoints (the policy, and a reference apart from it), the same prompts, completions,
rewards and sampling log-probs, and the advantages, the loss and TRL's metrics within 1e-5 in float32 for
each aggregation (dapo, grpo, dr_grpo), with and without the KL, both clip sides and a temperature."""

import json
import os
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

from _limits import limit
from conftest import reference_interpreter
from meshkit import interop
from meshkit.models import grpo as G
from meshkit.models import llama
from meshkit.train.rollout import rows_of

# Tiers: sweeps, as every reference against transformers 4.57.6 (conftest); meshkit's side of each aggregation
# against NumPy float64 is core in test_grpo.py's test_each_aggregation_equals_numpy_float64.
pytestmark = [pytest.mark.reference, pytest.mark.sweep]
SCRIPT = Path(__file__).parent / "reference" / "trl_grpo.py"
CFG = llama.LlamaConfig(vocab_size=64, seq_len=32, layers=2, width=32, heads=4, kv_heads=2, ffn=64)
GROUP, MAX_NEW = 4, 8
JOBS = [
    {"loss_type": "dapo", "beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "group"},
    {"loss_type": "grpo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "scale_rewards": "group"},
    {"loss_type": "dr_grpo", "beta": 0.04, "epsilon": 0.1, "epsilon_high": None, "scale_rewards": "none"},
    {"loss_type": "dapo", "beta": 0.04, "epsilon": 0.2, "epsilon_high": None, "scale_rewards": "group",
     "temperature": 0.7},
]  # fmt: skip


def test_grpo_losses_equal_trls_trainer(tmp_path):
    rng = np.random.default_rng(0)
    spread = lambda p, seed: jax.tree.map(  # noqa: E731  (random-init logits are near uniform: spread them)
        lambda a: a + 0.3 * jax.random.normal(jax.random.key(seed), a.shape, a.dtype), p
    )
    policy = spread(llama.init(jax.random.key(0), CFG), 10)
    frozen = spread(llama.init(jax.random.key(1), CFG), 11)
    interop.save(policy, CFG, tmp_path / "policy")
    interop.save(frozen, CFG, tmp_path / "reference")
    prompts = [rng.integers(1, CFG.vocab_size, size=n) for n in (3, 5)]
    ids = [p for p in prompts for _ in range(GROUP)]
    completions = [rng.integers(3, CFG.vocab_size, size=int(rng.integers(1, 7))).tolist() for _ in ids]
    rewards = rng.normal(size=len(ids)).round(1)
    rewards[GROUP:] = rewards[GROUP]  # the second group all alike: advantages 0
    apply = lambda p, x, **kw: llama.apply(p, x, CFG, **kw)  # noqa: E731
    batch, mask = rows_of(ids, completions, CFG.seq_len, 0)
    lp_policy = np.asarray(jax.jit(G.logps_fn(apply, 1.0))(policy, batch))
    old = lp_policy + rng.normal(scale=0.4, size=lp_policy.shape) * mask  # the sampler's: both clips occur
    npz = {"prompt": np.zeros((len(ids), 5), np.int64), "prompt_mask": np.zeros((len(ids), 5), np.int64),
           "completion": np.zeros((len(ids), 6), np.int64), "completion_mask": np.zeros((len(ids), 6), np.int64),
           "rewards": rewards, "old_logps": np.zeros((len(ids), 6))}  # fmt: skip
    for r, (p, c) in enumerate(zip(ids, completions, strict=True)):
        npz["prompt"][r, 5 - len(p) :], npz["prompt_mask"][r, 5 - len(p) :] = p, 1
        npz["completion"][r, : len(c)], npz["completion_mask"][r, : len(c)] = c, 1
        npz["old_logps"][r, : len(c)] = old[r, len(p) - 1 : len(p) - 1 + len(c)]
    np.savez(tmp_path / "batch.npz", **npz)
    jobs = [{**j, "policy": str(tmp_path / "policy"), "reference": str(tmp_path / "reference"),
             "batch": str(tmp_path / "batch.npz"), "num_generations": GROUP, "max_completion_length": MAX_NEW,
             "out": str(tmp_path / f"{k}.json")} for k, j in enumerate(JOBS)]  # fmt: skip
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([reference_interpreter("transformers4"), str(SCRIPT), str(tmp_path / "jobs.json")],
                          capture_output=True, text=True, timeout=limit(5),
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    for job in jobs:
        theirs = json.loads(Path(job["out"]).read_text())
        how = G.GRPO(loss=job["loss_type"], beta=job["beta"], epsilon=job["epsilon"], epsilon_high=job["epsilon_high"],
                     temperature=job.get("temperature", 1.0), scale_rewards=job["scale_rewards"] != "none")  # fmt: skip
        adv = G.advantages(rewards, GROUP, how.scale_rewards)
        np.testing.assert_allclose(adv, theirs["advantages"], rtol=1e-5, atol=1e-5)
        w, share = G.weights(mask, how, MAX_NEW)
        values = {
            "advantages": adv,
            "sampled": old,
            "tokens": share,
        }  # the sampler's, whatever the temperature
        if how.beta:
            values["reference"] = np.asarray(jax.jit(G.logps_fn(apply, how.temperature))(frozen, batch))
        loss, metrics = jax.jit(G.make_loss(apply, how))(policy, batch._replace(weights=w, reference=values))
        ours = {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}}
        for key in ours:
            assert ours[key] == pytest.approx(theirs["metrics"].get(key, theirs["loss"] if key == "loss" else None),
                                              rel=1e-5, abs=1e-6), (job["loss_type"], key, ours, theirs["metrics"])  # fmt: skip
        assert theirs["metrics"]["clip_ratio/region_mean"] > 0  # the test sees clipping
