"""meshkit's preference losses against Hugging Face TRL's own trainers (``tests/reference/trl_preference.py``
in ``.venv-ref``: trl 0.25.1 beside transformers 4.57.6): the same two Llama checkpoints (the policy and
a reference apart from it), the same pairs of ids, and the loss and TRL's metrics of that batch within
1e-5 in float32, for DPO's sigmoid loss with label smoothing and IPO (``DPOTrainer``) and SimPO
(``CPOTrainer``, ``cpo_alpha=0``). meshkit lays each pair out as one row (``PairRows``: the chosen document,
then the rejected one), TRL as two padded sequences; a sequence's log-prob is the same sum either way."""

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
from meshkit.models import llama
from meshkit.models import preference as P
from meshkit.spec.batch import TokenBatch

# Tiers: sweeps, as every reference against transformers 4.57.6 (conftest); meshkit's side of each objective
# against NumPy float64 is core in test_dpo.py's test_each_objective_equals_numpy_float64.
pytestmark = [pytest.mark.reference, pytest.mark.sweep]
SCRIPT = Path(__file__).parent / "reference" / "trl_preference.py"
CFG = llama.LlamaConfig(vocab_size=64, seq_len=64, layers=2, width=32, heads=4, kv_heads=2, ffn=64)
LENGTHS = [(3, 5, 2), (5, 1, 6), (1, 4, 4), (4, 3, 7)]
"""(prompt, chosen, rejected) lengths of the pairs: one-token prompts and answers among them."""
JOBS = [
    {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.1},
    {"loss_type": "ipo", "beta": 0.5, "label_smoothing": 0.0},
    {"loss_type": "simpo", "beta": 2.0, "label_smoothing": 0.1, "gamma": 0.7},
]


def _pairs(rng) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [tuple(rng.integers(1, CFG.vocab_size, size=n) for n in lengths) for lengths in LENGTHS]


def trl_layout(pairs) -> dict[str, np.ndarray]:
    """The pairs as TRL's collator pads them: prompts on the left, answers on the right, with masks."""
    out = {}
    for k, name in enumerate(("prompt", "chosen", "rejected")):
        width = max(len(p[k]) for p in pairs)
        ids, mask = np.zeros((len(pairs), width), np.int64), np.zeros((len(pairs), width), np.int64)
        for r, p in enumerate(pairs):
            n = len(p[k])
            span = slice(width - n, width) if name == "prompt" else slice(0, n)
            ids[r, span], mask[r, span] = p[k], 1
        out[name], out[f"{name}_mask"] = ids, mask
    return out


def pair_rows(pairs, width: int = 32) -> TokenBatch:
    """The pairs as meshkit's ``PairRows`` lays them out: a row per pair, prompt + chosen (segment 1) then
    prompt + rejected (segment 2), the answers' targets weighted 1."""
    rows = len(pairs)
    ids, seg, pos, mask = (np.zeros((rows, width + 1), np.int32) for _ in range(4))
    for r, (prompt, *answers) in enumerate(pairs):
        at = 0
        for side, answer in enumerate(answers, 1):
            doc = np.concatenate([prompt, answer])
            n = len(doc)
            ids[r, at : at + n], seg[r, at : at + n], pos[r, at : at + n] = doc, side, np.arange(n)
            mask[r, at + len(prompt) : at + n] = 1
            at += n
    target = mask[:, 1:] * (seg[:, 1:] == seg[:, :-1]) * (seg[:, 1:] > 0)
    return TokenBatch(ids[:, :-1], ids[:, 1:], target.astype(np.float32), seg[:, :-1], pos[:, :-1])


def test_dpo_ipo_and_simpo_equal_trls_trainers(tmp_path):
    rng = np.random.default_rng(0)
    policy, frozen = llama.init(jax.random.key(0), CFG), llama.init(jax.random.key(1), CFG)
    perturb = lambda p, seed: jax.tree.map(  # noqa: E731  (random-init logits are near uniform: spread them)
        lambda a: a + 0.3 * jax.random.normal(jax.random.key(seed), a.shape, a.dtype), p
    )
    policy, frozen = perturb(policy, 10), perturb(frozen, 11)
    interop.save(policy, CFG, tmp_path / "policy")
    interop.save(frozen, CFG, tmp_path / "reference")
    pairs = _pairs(rng)
    np.savez(tmp_path / "batch.npz", **trl_layout(pairs))
    jobs = [{**j, "policy": str(tmp_path / "policy"), "reference": str(tmp_path / "reference"),
             "batch": str(tmp_path / "batch.npz"), "out": str(tmp_path / f"{j['loss_type']}.json")}
            for j in JOBS]  # fmt: skip
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([reference_interpreter("transformers4"), str(SCRIPT), str(tmp_path / "jobs.json")],
                          capture_output=True, text=True, timeout=limit(5),
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    apply = lambda p, x, **kw: llama.apply(p, x, CFG, **kw)  # noqa: E731
    batch = pair_rows(pairs)
    batch = batch._replace(reference=jax.jit(P.reference_fn(apply))(frozen, batch))
    for job in jobs:
        theirs = json.loads(Path(job["out"]).read_text())
        pref = P.Preference(loss=job["loss_type"], beta=job["beta"], label_smoothing=job["label_smoothing"],
                            gamma=job.get("gamma", 0.5))  # fmt: skip
        loss, metrics = jax.jit(P.make_loss(apply, pref))(policy, batch)
        ours = {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}}
        want = {"loss": theirs["loss"], **{k: theirs["metrics"][k] for k in P.METRICS}}
        for key, value in want.items():
            assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (job["loss_type"], key, ours, want)
        assert 0 < want["rewards/accuracies"] < 1, want  # the two models disagree on some pairs
