"""`meshkit train`: the job end to end, exact resume, resharding restore, Ctrl-C, bad input."""

import io
import json

import jax
import numpy as np
import pytest
from rich.console import Console

from meshkit.cli import main
from meshkit.train import config as C
from meshkit.train.job import prepare
from meshkit.train.loop import train
from meshkit.verify import bitwise_equal


def Quiet():
    """A console that keeps the loop's progress lines to itself."""
    return Console(file=io.StringIO())


def tiny(tmp_path, **kw):
    return C.tiny().replace(run_dir=str(tmp_path / "run"), **kw)


def test_tiny_run_writes_every_output(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "Run summary" in out and "measured = model" in out
    assert {p.name for p in run.iterdir()} >= {
        "config.json",
        "metrics.jsonl",
        "report.json",
        "loss.png",
        "cost.png",
        "checkpoints",
    }
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert set(steps[0]) == {"step", "loss", "tokens_per_s", "step_time_s", "lr", "grad_norm"}
    assert [r["step"] for r in rows if "eval_loss" in r] == [6, 12]
    report = json.loads((run / "report.json").read_text())
    assert report["final_loss"] < report["initial_loss"]
    assert report["checks_ok"] and report["devices"] == 8 and report["mesh"] == {"data": 8}
    assert all(c["ok"] for c in report["communication"]) and all(m["ok"] for m in report["memory"])
    assert report["achieved_flops_per_s"] == pytest.approx(
        report["tokens_per_s"] * report["model_flops_per_token"]
    )
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG" and (run / "cost.png").read_bytes()[
        :4
    ] == b"\x89PNG"
    assert json.loads((run / "config.json").read_text())["parallel"]["plan"] == "fsdp"


# Tiers: sweeps; a run stopped and resumed through meshkit train to the same losses bit for bit is core in
# test_data_mixture.py's test_a_mixture_run_stopped_and_resumed_trains_as_an_uninterrupted_one, the
# restored parameters and optimizer state the saved ones bit for bit (and the run then finishing) in
# test_pipeline.py's test_meshkit_train_dp_pp_resumes_under_fsdp_and_back_bitwise_and_writes_the_schedule.
@pytest.mark.sweep
def test_exact_resume_is_bitwise(tmp_path):
    straight = prepare(tiny(tmp_path / "a"))
    assert train(straight, Quiet())
    half = prepare(tiny(tmp_path / "b"))
    half.run_dir.mkdir(parents=True)
    (half.run_dir / "config.json").write_text(C.dumps(half.cfg))
    assert train(half, Quiet(), stop_after=6) and half.step == 6
    resumed = prepare(tiny(tmp_path / "b"), resume=True)
    assert resumed.step == 6
    assert train(resumed, Quiet())
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    assert bitwise_equal(resumed.trainer.params, straight.trainer.params)
    assert bitwise_equal(resumed.trainer.opt_state, straight.trainer.opt_state)


# Tiers: sweeps; a run resumed under another plan is core in test_cli_train.py's
# test_resume_takes_the_runs_config_and_changes_only_what_is_safe (fsdp -> dp), under another mesh in
# test_pipeline.py::test_meshkit_train_dp_pp_resumes_under_fsdp_and_back_bitwise_and_writes_the_schedule.
@pytest.mark.sweep
def test_restore_onto_another_mesh_and_plan(tmp_path):
    first = prepare(tiny(tmp_path, plan="fsdp", mesh="data=8"))
    first.run_dir.mkdir(parents=True)
    (first.run_dir / "config.json").write_text(C.dumps(first.cfg))
    train(first, Quiet(), stop_after=6)
    other = prepare(tiny(tmp_path, plan="dp+tp", mesh="data=4,model=2"), resume=True)
    assert other.step == 6 and dict(other.trainer.mesh.shape) == {"data": 4, "model": 2}
    assert bitwise_equal(other.trainer.params, first.trainer.params)
    wq = other.trainer.params["blocks"][0]["attn"]["wq"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert train(other, Quiet()) and other.step == 12
    assert np.isfinite(other.history[-1]["loss"])


def test_ctrl_c_saves_and_resume_continues(tmp_path, monkeypatch):
    job = prepare(tiny(tmp_path))
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "config.json").write_text(C.dumps(job.cfg))
    real_step = type(job.trainer).step

    def step(self, batch):
        if job.step == 4:
            raise KeyboardInterrupt
        return real_step(self, batch)

    monkeypatch.setattr(type(job.trainer), "step", step)
    assert train(job, Quiet()) is False
    monkeypatch.undo()
    again = prepare(tiny(tmp_path), resume=True)
    assert again.step == 4 and len(again.history) == 4


def test_bf16_and_sgd_run(tmp_path):
    job = prepare(tiny(tmp_path, precision="bf16", optimizer="sgd", lr=0.5, steps=6, eval_every=0))
    assert train(job, Quiet())
    assert job.history[-1]["loss"] < job.history[0]["loss"]
    assert job.trainer.params["unembed"].dtype == np.float32  # master weights stay float32


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "{missing}"], "no data file"),
        (["--data", "{empty}"], "is empty"),
        (["--data", "{short}", "--seq-len", "32"], "--seq-len 32 needs 33 held-out tokens"),
        (["--batch-size", "12"], "a global batch of 12 examples does not divide over data=8"),
        (["--plan", "zero9"], "unknown plan 'zero9'"),
        (["--mesh", "data=3"], "mesh data=3 = 3 devices, but 8 are available"),
        (["--resume"], "--resume: no checkpoint in"),
        (["--heads", "5"], "--heads 5 must divide --width 32"),
        (["--preset", "huge"], "unknown --preset 'huge'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, message):
    files = {
        "missing": tmp_path / "nope.txt",
        "empty": tmp_path / "empty.txt",
        "short": tmp_path / "short.txt",
    }
    files["empty"].write_text("")
    files["short"].write_text("too short")
    args = [a.format(**files) for a in args]
    run = tmp_path / "run"
    code = main(["train", "--preset", "tiny", "--run-dir", str(run), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not run.exists()
