"""``meshkit train --task`` (issue 37), the trainer's side: the options checked in one line, a weighted
batch's step and held-out loss are the masked loss of the same parameters, and each step logs the
targets it learnt from: with a test's stream that gives plain token rows a known mask and documents,
and end to end on conversations ``meshkit data prepare --chat`` wrote."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from meshkit._errors import MeshkitError
from meshkit.cli import main
from meshkit.data.prepare import prepare as prepare_data
from meshkit.spec.batch import TokenBatch
from meshkit.train import config as C
from meshkit.train import loop, results
from meshkit.train import task as tasks
from meshkit.train.job import prepare

DOC = 8
"""Every row is documents of this many tokens, each's first half a prompt (weight 0)."""


def with_mask(pair) -> TokenBatch:
    """A plain ``(inputs, targets)`` batch as fine-tuning data: segments of ``DOC`` tokens, positions
    reset in each, weights the second half of each scaled by tokens / learnt tokens."""
    x, y = pair
    b, t = x.shape
    seg = np.broadcast_to(np.arange(t) // DOC + 1, (b, t)).astype(np.int32)
    pos = np.broadcast_to(np.arange(t) % DOC, (b, t)).astype(np.int32)
    mask = (pos >= DOC // 2).astype(np.float32)
    return TokenBatch(x, y, mask * (mask.size / mask.sum()), seg, pos)


class Masked:
    """A stream of the run's batches with ``with_mask`` applied."""

    def __init__(self, inner):
        self.inner = inner

    def __next__(self):
        return with_mask(next(self.inner))

    def __getattr__(self, name):
        return getattr(self.inner, name)


class MaskedData:
    """The run's data, its streams ``Masked``."""

    def __init__(self, inner):
        self.inner = inner

    def batches(self, **kw):
        return Masked(self.inner.batches(**kw))

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    ids = np.random.default_rng(0).integers(0, 48, size=4000).astype(np.int32)
    np.save(tmp / "ids.npy", ids)
    cfg = C.tiny().replace(run_dir=str(tmp / "run"), data=str(tmp / "ids.npy"), model="llama", seq_len=16,
                           plan="dp")  # fmt: skip
    job = prepare(cfg)  # token ids: a pretraining run's data, masked by the stream below
    job.cfg = job.cfg.replace(task="sft")
    job.batches, job.data = Masked(job.batches), MaskedData(job.data)
    return job


def test_sft_step_is_the_masked_loss_and_logs_its_trained_tokens(job):
    t = job.trainer
    local = next(job.data.batches(seq_len=16, global_batch=job.cfg.data.batch_size, seed=job.cfg.data.seed))
    want = float(job.eval_loss(t.params, local))  # the first training batch, before the step
    unweighted = float(job.eval_loss(t.params, local[:2]))
    row = loop._one_step(job, 1e-3)
    assert row["loss"] == pytest.approx(want, rel=1e-5) and abs(want - unweighted) > 1e-4
    assert row["trained_tokens"] == job.cfg.data.batch_size * job.cfg.data.seq_len // 2


def test_held_out_loss_uses_the_weights(job):
    out = results.evaluate(job)
    t, n = job.trainer, job.cfg.data.batch_size
    stream = job.data.batches(seq_len=16, global_batch=n, seed=job.cfg.data.seed, held_out=True)
    batches = [next(stream) for _ in range(job.cfg.run.eval_batches)]
    want = np.mean([float(job.eval_loss(t.params, b)) for b in batches])
    plain = np.mean([float(job.eval_loss(t.params, b[:2])) for b in batches])
    assert out["eval_loss"] == pytest.approx(want, rel=1e-6) and abs(want - plain) > 1e-4


def test_held_out_loss_is_per_learnt_target_and_a_batch_with_none_counts_nothing(job, monkeypatch):
    """Two held-out batches, the second with nothing to learn (a conversation cut before its answer):
    the loss is the first's, not the mean with the second's 0."""

    class Alternate(MaskedData):
        def batches(self, **kw):
            inner, n = Masked(self.inner.batches(**kw)), iter(range(10**6))

            class Stream:
                def __next__(self):
                    b = next(inner)
                    return b if next(n) % 2 == 0 else b._replace(weights=np.zeros_like(b.weights))

                def __getattr__(self, name):
                    return getattr(inner, name)

            return Stream()

    monkeypatch.setattr(job, "data", Alternate(job.data.inner))
    monkeypatch.setattr(job, "cfg", job.cfg.replace(eval_batches=2))
    first = next(
        job.data.batches(
            seq_len=16, global_batch=job.cfg.data.batch_size, seed=job.cfg.data.seed, held_out=True
        )
    )
    want = float(job.eval_loss(job.trainer.params, first))
    assert results.evaluate(job)["eval_loss"] == pytest.approx(want, rel=1e-6) and want > 0


def test_a_non_finite_loss_stops_the_run_before_it_saves(job, tmp_path, monkeypatch):
    """A run that starts from a nan weight (a checkpoint's, a config's eps) stops at its first step with
    one line, saving nothing; a later step's names the learning rate. report.json and metrics rows write
    a number that is not finite as null (strict JSON), never NaN."""
    import jax
    from rich.console import Console

    from meshkit.fmt import to_json

    t = job.trainer
    monkeypatch.setattr(t, "params", jax.tree.map(lambda p: p * np.nan, t.params))
    for name, value in [("run_dir", tmp_path), ("step", 0), ("history", [])]:
        monkeypatch.setattr(job, name, value)
    with pytest.raises(loop.DivergedError) as e:
        loop.train(job, Console(quiet=True))
    assert str(e.value) == (
        "step 1: the loss is nan and the gradient norm nan: training stopped before saving this step (nothing "
        "was saved): check the weights and config of the random init and the data"
    )
    assert not list((tmp_path / "checkpoints").glob("*")) and job.step == 1
    job.history.append({"loss": 2.0})  # a later step: the training diverged
    with pytest.raises(loop.DivergedError, match=r"^step 1: .*: lower --lr \(now 0.003\), or check the data"):
        loop.check_finite(job, {"loss": 1.0, "grad_norm": float("inf")}, None)
    assert json.loads(to_json({"eval_loss": float("nan"), "x": [float("-inf"), 1.5]})) == {
        "eval_loss": None,
        "x": [None, 1.5],
    }


def test_trained_tokens_counts_the_global_mask_from_any_rows():
    rng = np.random.default_rng(1)
    mask = (rng.random((8, 16)) < 0.3).astype(np.float32)
    weights = mask * (mask.size / mask.sum())
    x = np.zeros((8, 16), np.int32)
    assert tasks.trained_tokens(TokenBatch(x[:2], x[:2], weights[:2]), mask.size) == mask.sum()
    assert tasks.trained_tokens(TokenBatch(x, x, np.zeros_like(weights)), mask.size) == 0
    assert tasks.trained_tokens((x, x), mask.size) is None


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"task": "chat"}, "unknown --task 'chat': use pretrain, sft, dpo or grpo"),
        ({"task": "dpo"}, "--task dpo needs --data"),
        ({"task": "dpo", "data": "d", "plan": "dp+pp"}, "pipeline plans (pp, dp+pp"),
        ({"task": "dpo", "data": "d", "experts": 4, "plan": "ep"}, "does not train a mixture of experts"),
        ({"task": "dpo", "data": "d", "plan": "cp"}, "which plan cp splits over the context axis"),
        ({"beta": 0.2}, "--beta set(s) what only --task dpo or grpo trains"),
        ({"task": "dpo", "data": "d", "reward": "exact"}, "--reward set(s) what only --task grpo trains"),
        ({"task": "grpo", "data": "d"}, "--task grpo needs --reward"),
        ({"task": "grpo", "data": "d", "reward": "exact", "batch_size": 12}, "do not divide into groups"),
        (
            {
                "task": "grpo",
                "data": "d",
                "reward": "exact",
                "model": "llama",
                "seq_len": 64,
                "grpo_loss": "ppo",
            },
            "unknown GRPO loss 'ppo'",
        ),
        ({"task": "dpo", "data": "d", "preference_loss": "orpo"}, "unknown preference loss 'orpo'"),
        ({"task": "dpo", "data": "d", "preference_loss": "ipo", "label_smoothing": 0.1}, "ipo loss takes no"),
        ({"task": "sft"}, "--task sft needs --data"),
        ({"task": "sft", "data": "d", "plan": "dp+pp"}, "pipeline plans (pp, dp+pp"),
        ({"document_masks": True, "plan": "pp"}, "drop --document-masks"),
        ({"lora_alpha": 16.0}, "give their --lora-rank too"),  # LoRA's default, given: was ignored
        ({"lora_rank": 4, "lora_alpha": 0.0}, "LoRA alpha must be finite and not 0"),
    ],
)
def test_bad_task_options_are_one_line(changes, says):
    with pytest.raises(MeshkitError) as e:
        C.validate(C.tiny().replace(**changes))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_data_a_task_does_not_train_on_is_refused(job):
    with pytest.raises(tasks.TaskError, match="holds none: prepare them with meshkit data prepare --chat"):
        tasks.check_data(job.cfg, job.data.inner)
    with pytest.raises(tasks.TaskError, match="pass --task sft"):
        tasks.check_data(C.tiny(), type("Chat", (), {"chat": True, "source": "d"})())
    text = type("Text", (), {"chat": False, "source": "d", "tokenizer": "characters"})()
    with pytest.raises(tasks.TaskError, match="end-of-text id of token shards"):  # it split at id 0 ('\\n')
        tasks.check_data(C.tiny().replace(document_masks=True), text)
    assert tasks.batch_options(C.tiny().replace(document_masks=True)) == {"document_masks": True}
    assert tasks.batch_options(C.tiny().replace(task="sft", data="d")) == {}


def test_cli_refuses_sft_under_a_pipeline_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(
        ["train", "--preset", "tiny", "--run-dir", str(run), "--task", "sft", "--data", "x", "--plan", "pp"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "pipeline plans" in err and err.count("\n") == 1, err
    assert not run.exists()


LLAMA3 = Path(__file__).parent / "corpus" / "chat_templates" / "llama3"


def test_a_run_that_would_learn_nothing_is_refused(tmp_path):
    """Every conversation cut before its answer by --seq-len, or none with an answer to learn (a template
    that renders no assistant turn): one line naming the fix, not a run of 0-token steps ending in 0."""
    from meshkit.data import load

    rows = [{"messages": [{"role": "user", "content": "Say the numbers from one to ten, please"},
                          {"role": "assistant", "content": "1 2 3"}]} for _ in range(6)]  # fmt: skip
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    prepare_data([str(src)], tmp_path / "chat", tokenizer=str(LLAMA3), chat=True)
    data = load(str(tmp_path / "chat"))
    cfg = C.tiny().replace(task="sft", data=str(tmp_path / "chat"))
    with pytest.raises(tasks.TaskError) as e:
        tasks.check_learns(cfg.replace(seq_len=8), data.batches(seq_len=8, global_batch=2, seed=0))
    first = int(re.search(r"use --seq-len (\d+) or more", str(e.value)).group(1))
    assert str(e.value).startswith(
        f"--seq-len 8 cuts every conversation in {tmp_path / 'chat'} before its answer"
    )
    tasks.check_learns(
        cfg, data.batches(seq_len=first, global_batch=2, seed=0)
    )  # the first answer token fits
    with pytest.raises(tasks.TaskError, match="--seq-len"):
        tasks.check_learns(cfg, data.batches(seq_len=first - 1, global_batch=2, seed=0))
    batches = data.batches(seq_len=64, global_batch=2, seed=0)
    masks = batches.packing.source.masks
    batches.packing.source.masks = type("None", (), {"read": lambda self, a, b: np.zeros(b - a, np.uint8)})()
    with pytest.raises(tasks.TaskError, match="has a token to learn: its chat template renders no assistant"):
        tasks.check_learns(cfg, batches)
    batches.packing.source.masks = masks
    tasks.check_learns(cfg, batches)


def test_meshkit_train_task_sft_on_prepared_conversations(tmp_path, capsys):
    """End to end: conversations prepared with their mask train under --task sft; each step logs the
    targets it learnt from, fewer than the batch's tokens, and the held-out loss is logged."""
    rows = [{"messages": [{"role": "user", "content": f"Count to {i % 40}"},
                          {"role": "assistant", "content": " ".join(map(str, range(1, i % 40 + 2)))}]}
            for i in range(160)]  # fmt: skip
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    prepare_data([str(src)], tmp_path / "chat", tokenizer=str(LLAMA3), chat=True)
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--model", "llama", "--task", "sft", "--data", str(tmp_path / "chat"),
            "--seq-len", "64", "--plan", "dp", "--steps", "4", "--eval-every", "2", "--sample-chars", "0",
            "--run-dir", str(run), "--export-hf"]  # fmt: skip
    assert main(args) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 4 and all(0 < m["trained_tokens"] < 16 * 64 for m in steps)
    assert any("eval_loss" in m for m in metrics)
    first = " ".join(capsys.readouterr().out.split())
    assert re.search(r"; 1\d\d conversations packed in \d+ rows \(\d+% filled", first), (
        first
    )  # the first line
    pretrain = [a if a != "sft" else "pretrain" for a in args[:-2]] + [str(tmp_path / "plain")]
    assert main(pretrain) == 2  # conversations with a mask, no --task sft
    err = capsys.readouterr().err
    assert "pass --task sft to train on them" in err and err.count("\n") == 1, err

    # LoRA on that checkpoint with a handful of conversations: the base is read into the layout of the full
    # model (the adapters are added after; it raised "freezes every parameter"), a vocabulary larger than
    # the data is no refusal (the checkpoint trained the embedding), a held-out conversation shorter than a
    # row is padded (it was refused as too few held-out tokens)
    src.write_text("".join(json.dumps(r) + "\n" for r in rows[:8]), encoding="utf-8")
    prepare_data([str(src)], tmp_path / "few", tokenizer=str(LLAMA3), chat=True)
    lora = [*args[:args.index("--data")], "--data", str(tmp_path / "few"), "--seq-len", "64", "--plan", "dp",
            "--steps", "2", "--eval-every", "2", "--sample-chars", "0", "--run-dir", str(tmp_path / "lora"),
            "--init-from", f"hf:{run / 'hf'}", "--lora-rank", "2"]  # fmt: skip
    capsys.readouterr()
    assert main(lora) == 0, capsys.readouterr().err
    out = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in m for m in out)
