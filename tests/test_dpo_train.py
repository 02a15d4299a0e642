"""``meshkit train --task dpo`` end to end: preference rows prepared by ``meshkit data prepare --chat`` train
under a ZeRO-3 plan from a step whose loss is ln 2 (the policy is its own reference), the held-out pairs'
preference accuracy rises above chance, TRL's metrics are logged each step; under LoRA the reference is
the base; a run that cannot learn, and data of another task, are refused in one line."""

import json
import math
from pathlib import Path

import pytest

from meshkit.cli import main
from meshkit.data import load
from meshkit.data.prepare import prepare as prepare_data
from meshkit.train import config as C
from meshkit.train import task as tasks

LLAMA3 = Path(__file__).parent / "corpus" / "chat_templates" / "llama3"


def rows(n: int) -> list[dict]:
    """Counting up is preferred to counting down: a preference a small model learns in a few steps and
    that holds on held-out prompts."""
    out = []
    for i in range(n):
        k = 3 + i % 9
        up = " ".join(str(j) for j in range(1, k + 1))
        out.append(
            {"prompt": f"Count to {k}:", "chosen": f" {up}", "rejected": f" {' '.join(reversed(up.split()))}"}
        )
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    src = tmp / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows(160)), encoding="utf-8")
    prepare_data([str(src)], tmp / "pairs", tokenizer=str(LLAMA3), chat=True)
    return tmp / "pairs"


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_meshkit_train_task_dpo_learns_the_preference(pairs, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--model", "llama", "--task", "dpo", "--data", str(pairs),
            "--seq-len", "64", "--batch-size", "16", "--plan", "fsdp", "--beta", "0.5", "--lr", "3e-3",
            "--steps", "30", "--eval-every", "15", "--sample-chars", "0", "--run-dir", str(run)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    rows_ = _metrics(run)
    steps = [m for m in rows_ if "loss" in m]
    assert len(steps) == 30 and all("rewards/accuracies" in m and "rewards/margins" in m for m in steps)
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy is its own reference
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    evals = [m for m in rows_ if "eval_rewards/accuracies" in m]
    assert len(evals) == 2 and evals[-1]["eval_rewards/accuracies"] > 0.75, evals
    assert evals[-1]["eval_loss"] < math.log(2) and evals[-1]["eval_rewards/margins"] > 0
    report = json.loads((run / "report.json").read_text())
    assert report["checks_ok"], report.get("communication")  # the preference step: measured = model
    assert report["eval_rewards/accuracies"] == evals[-1]["eval_rewards/accuracies"]
    out = " ".join(capsys.readouterr().out.split())
    assert "; 143 preference pairs, a row each" in out and "held-out preference │ accuracy" in out, out


# Tiers: sweeps; the reference as the base under LoRA is frozen leaves' forward (lora.base), the
# preference step under LoRA's frozen leaves as any loss's (test_lora.py), DPO end to end in the core above.
@pytest.mark.sweep
def test_under_lora_the_reference_is_the_base(pairs, tmp_path, capsys):
    run = tmp_path / "lora"
    args = ["train", "--preset", "tiny", "--model", "llama", "--task", "dpo", "--data", str(pairs),
            "--seq-len", "64", "--batch-size", "8", "--plan", "dp", "--lora-rank", "4", "--steps", "3",
            "--eval-every", "0", "--sample-chars", "0", "--run-dir", str(run)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    steps = [m for m in _metrics(run) if "loss" in m]
    # the adapters start at zero: the policy is the base, its own reference; then it moves away from it
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert steps[-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-7)


def test_data_of_another_task_and_cut_answers_are_refused_in_one_line(pairs, tmp_path, capsys):
    base = ["train", "--preset", "tiny", "--model", "llama", "--data", str(pairs), "--seq-len", "64",
            "--steps", "1", "--sample-chars", "0"]  # fmt: skip
    assert main([*base, "--task", "sft", "--run-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "holds preference pairs (chosen, rejected): pass --task dpo" in err and err.count("\n") == 1, err
    assert not (tmp_path / "a").exists()
    data = load(str(pairs))
    cfg = C.tiny().replace(task="dpo", data=str(pairs), seq_len=8)
    with pytest.raises(tasks.TaskError) as e:
        tasks.check_learns(cfg, data.batches(seq_len=8, global_batch=2, seed=0))
    said = str(e.value)
    assert said.startswith(f"--seq-len 8 cuts an answer of every pair in {pairs}") and "\n" not in said
    need = int(said.split("use --seq-len ")[1].split()[0])
    tasks.check_learns(cfg.replace(seq_len=need), data.batches(seq_len=need, global_batch=2, seed=0))
