"""Trackers: the metrics through one writer to metrics.jsonl, TensorBoard and Weights & Biases (offline:
no network), read back from the files each wrote."""

import json
import struct
import sys

import numpy as np
import pytest

from meshkit.cli import main
from meshkit.train.metrics import MetricsLog
from test_cli_train import read_events, rows

NAMES = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "eval_loss")


def wandb_history(run_dir):
    """The rows logged to the offline Weights & Biases run under ``run_dir/wandb``: its ``run-<id>.wandb``
    is a W&B header (':W&B', magic, version) then LevelDB-log records (crc, length, type; 32 KiB blocks)
    around ``Record`` protos."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, at, chunk, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + 7])
        chunk, at = chunk + data[at + 7 : at + 7 + length], at + 7 + length
        if kind in (1, 4):  # full, or last of a record split over blocks
            record, chunk = pb.Record.FromString(chunk), b""
            if record.WhichOneof("record_type") == "history":
                out.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
    return out


def same_scalars(logged, recorded, what):
    """``recorded``: {name: [(step, value)]}, the same numbers at the same steps as the JSONL rows."""
    for name in NAMES:
        expect = [(r["step"], r[name]) for r in logged if name in r]
        assert [s for s, _ in recorded[name]] == [s for s, _ in expect], (what, name)
        np.testing.assert_allclose([v for _, v in recorded[name]], [v for _, v in expect], rtol=1e-6)


def test_train_tracks_to_jsonl_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    args = ["--steps", "3", "--eval-every", "2", "--sample-chars", "0", "--tracker", "tensorboard,wandb",
            "--run-dir", str(run)]  # fmt: skip
    assert main(["train", "--preset", "tiny", *args]) == 0
    logged = rows(run)
    assert json.loads((run / "config.json").read_text())["run"]["tracker"] == "tensorboard,wandb"
    (events,) = run.glob("events.out.tfevents.*")
    same_scalars(logged, read_events(events), "tensorboard")
    history = wandb_history(run)
    by_name = {n: [(h["_step"], h[n]) for h in history if n in h] for n in NAMES}
    same_scalars(logged, by_name, "wandb")


def test_wandb_without_wandb_mode_runs_offline(tmp_path, monkeypatch):
    """No WANDB_MODE and no API key: offline, never a prompt or a wait on the network."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with MetricsLog(tmp_path, trackers=("wandb",), config={"plan": "fsdp"}) as log:
        for step in (1, 2):
            log.write({"step": step, "loss": 1.0 / step})
    assert [(h["_step"], h["loss"]) for h in wandb_history(tmp_path)] == [(1, 1.0), (2, 0.5)]


@pytest.mark.parametrize(
    "tracker, message",
    [("wandb", "--tracker wandb needs the wandb package: pip install 'meshkit[wandb]'"),
     ("jsonl,mlflow", "unknown --tracker 'mlflow': use a comma-separated list of jsonl, tensorboard, wandb")],
)  # fmt: skip
def test_a_tracker_that_cannot_be_is_one_line_and_writes_nothing(
    tmp_path, monkeypatch, capsys, tracker, message
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import fails, find_spec is None
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--tracker", tracker, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not run.exists()
