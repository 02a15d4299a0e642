"""``meshkit train --task grpo`` end to end: prompts prepared by ``meshkit data prepare --chat`` are sampled,
scored and trained on under a ZeRO-3 plan with the KL to the starting model; each rollout logs TRL's
metrics and the sampler's log-prob gap to the trainer's forward, evaluations the held-out prompts' greedy
reward, and the run writes reward.png and a ledger equal to its model. A reward that raises stops the run in
one line with the steps done saved; a run whose rollouts never scored answers apart ends as a failure."""

import json
import math
from pathlib import Path

import pytest

from meshkit.cli import main
from meshkit.data.prepare import prepare as prepare_data

LLAMA3 = Path(__file__).parent / "corpus" / "chat_templates" / "llama3"
BASE = ["train", "--preset", "tiny", "--model", "llama", "--task", "grpo", "--seq-len", "24", "--batch-size", "16",
        "--generations", "4", "--max-new-tokens", "4", "--sample-chars", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    rows = [{"prompt": f"{a} plus {b} is", "answer": str(a + b)} for a in range(6) for b in range(6)]
    (tmp / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    prepare_data([str(tmp / "p.jsonl")], tmp / "prompts", tokenizer=str(LLAMA3), chat=True)
    (tmp / "rewards.py").write_text(
        "def digits(prompts, completions, answer, **kw):\n"
        "    assert len(answer) == len(completions)  # the rows' columns, as lists\n"
        "    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]\n"
        "calls = {'n': 0}\n"
        "def flaky(prompts, completions, **kw):\n"
        "    calls['n'] += 1\n"
        "    if calls['n'] == 3:\n"
        "        raise ValueError('the grader is down')\n"
        "    return [float(len(c)) for c in completions]\n"
        "def same(prompts, completions, **kw):\n"
        "    return [1.0] * len(completions)\n"
    )
    return tmp


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_meshkit_train_task_grpo_samples_scores_and_proves_its_step(prompts, tmp_path, capsys):
    run = tmp_path / "run"
    args = [*BASE, "--data", str(prompts / "prompts"), "--reward", f"{prompts / 'rewards.py'}:digits",
            "--plan", "fsdp", "--beta", "0.04", "--epsilon-high", "0.28", "--updates-per-rollout", "2",
            "--steps", "6", "--eval-every", "3", "--run-dir", str(run)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    rows = _rows(run)
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 6 and all(math.isfinite(r["loss"]) and "kl" in r for r in steps)
    rollouts = [r for r in steps if "reward" in r]
    assert [r["step"] for r in rollouts] == [1, 3, 5]  # a rollout every --updates-per-rollout steps
    for r in rollouts:
        assert 0 <= r["reward"] <= 1 and 1 <= r["completions/mean_length"] <= 4
        assert r["logps/sampler_gap"] < 1e-4  # the sampler's log-probs are the trainer's (float32)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy starts as its reference
    assert steps[1]["kl"] > 0  # the rollout's second update: the policy has moved from its reference
    evals = [r for r in rows if "eval_reward" in r]
    assert len(evals) == 2 and all(0 <= e["eval_reward"] <= 1 for e in evals)
    report = json.loads((run / "report.json").read_text())
    assert report["checks_ok"] and "initial_reward" in report and "eval_reward" in report
    assert (run / "reward.png").stat().st_size > 0


def test_a_reward_that_raises_stops_in_one_line_keeping_the_steps_done(prompts, tmp_path, capsys):
    run = tmp_path / "flaky"
    args = [*BASE, "--data", str(prompts / "prompts"), "--reward", f"{prompts / 'rewards.py'}:flaky",
            "--plan", "dp", "--steps", "4", "--eval-every", "0", "--checkpoint-every", "4", "--run-dir", str(run)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("raised ValueError: the grader is down") and err.count("\n") == 1, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    assert [r["step"] for r in _rows(run)] == [1, 2]


# Tiers: sweeps; its check (rollout.nothing_learnt) reads the rows the core test above logs.
@pytest.mark.sweep
def test_rollouts_that_never_score_answers_apart_end_as_a_failure(prompts, tmp_path, capsys):
    run = tmp_path / "same"
    args = [*BASE, "--data", str(prompts / "prompts"), "--reward", f"{prompts / 'rewards.py'}:same",
            "--plan", "dp", "--steps", "2", "--eval-every", "0", "--run-dir", str(run)]  # fmt: skip
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "the policy learnt nothing from --reward" in " ".join(out.split())
    assert (run / "report.json").exists()  # the results are kept


def test_prompts_longer_than_the_context_are_refused_before_anything_is_written(prompts, tmp_path, capsys):
    run = tmp_path / "long"
    args = [*BASE, "--data", str(prompts / "prompts"), "--reward", "exact", "--plan", "dp", "--max-new-tokens",
            "20", "--steps", "1", "--run-dir", str(run)]  # fmt: skip
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "and --max-new-tokens 20 pass --seq-len 24: give --seq-len" in err and not run.exists(), err


# Tiers: the Gemma (local and global layers in the sampler's cache) is core, the GPT sweeps.
@pytest.mark.parametrize("model", ["gemma", pytest.param("gpt", marks=pytest.mark.sweep)])
def test_every_family_samples_its_rollouts_with_the_cache(model, prompts, tmp_path, capsys):
    """The Gemma and the GPT sample their rollouts with the key/value cache the Llama's do: the sampler's
    log-probabilities are the trainer's forward's (float32)."""
    run = tmp_path / model
    args = [*BASE, "--model", model, "--data", str(prompts / "prompts"), "--reward", f"{prompts / 'rewards.py'}:digits",
            "--plan", "dp", "--steps", "2", "--eval-every", "0", "--run-dir", str(run)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    rollout = _rows(run)[0]
    assert rollout["logps/sampler_gap"] < 1e-4 and 1 <= rollout["completions/mean_length"] <= 4
