"""``meshkit train --task`` (issue 37), the trainer's side: the options checked in one line, a weighted
batch's step and held-out loss are the masked loss of the same parameters, and each step logs the
targets it learnt from. The data stream is a test's wrapper that gives plain token rows a loss mask and
documents (the data side's own stream is tested with it)."""

import numpy as np
import pytest

from meshkit.cli import main
from meshkit.spec.batch import TokenBatch
from meshkit.train import config as C
from meshkit.train import loop
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
    cfg = C.tiny().replace(run_dir=str(tmp / "run"), task="sft", data=str(tmp / "ids.npy"), model="llama",
                           seq_len=16, plan="dp")  # fmt: skip
    job = prepare(cfg)
    job.batches, job.data = Masked(job.batches), MaskedData(job.data)
    return job


def test_sft_step_is_the_masked_loss_and_logs_its_trained_tokens(job):
    t = job.trainer
    local = next(job.data.batches(seq_len=16, global_batch=job.cfg.batch_size, seed=job.cfg.seed))
    want = float(job.eval_loss(t.params, local))  # the first training batch, before the step
    unweighted = float(job.eval_loss(t.params, local[:2]))
    row = loop._one_step(job, 1e-3)
    assert row["loss"] == pytest.approx(want, rel=1e-5) and abs(want - unweighted) > 1e-4
    assert row["trained_tokens"] == job.cfg.batch_size * job.cfg.seq_len // 2


def test_held_out_loss_uses_the_weights(job):
    out = loop.evaluate(job)
    t, n = job.trainer, job.cfg.batch_size
    stream = job.data.batches(seq_len=16, global_batch=n, seed=job.cfg.seed, held_out=True)
    batches = [next(stream) for _ in range(job.cfg.eval_batches)]
    want = np.mean([float(job.eval_loss(t.params, b)) for b in batches])
    plain = np.mean([float(job.eval_loss(t.params, b[:2])) for b in batches])
    assert out["eval_loss"] == pytest.approx(want, rel=1e-6) and abs(want - plain) > 1e-4


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
        ({"task": "chat"}, "unknown --task 'chat': use pretrain or sft"),
        ({"task": "sft"}, "--task sft needs --data"),
        ({"task": "sft", "data": "d", "plan": "dp+pp"}, "pipeline plans (pp, dp+pp"),
        ({"document_masks": True, "plan": "pp"}, "drop --document-masks"),
    ],
)
def test_bad_task_options_are_one_line(changes, says):
    with pytest.raises(C.ConfigError) as e:
        C.validate(C.tiny().replace(**changes))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_batches_a_task_does_not_train_on_are_refused():
    x = np.zeros((2, 16), np.int32)
    with pytest.raises(tasks.TaskError, match="gives no loss mask"):
        tasks.check_batch(C.tiny().replace(task="sft", data="d"), (x, x))
    with pytest.raises(tasks.TaskError, match="pass --task sft"):
        tasks.check_batch(C.tiny(), with_mask((x, x)))
    with pytest.raises(tasks.TaskError, match="no segment ids"):
        tasks.check_batch(C.tiny().replace(document_masks=True), (x, x))
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
