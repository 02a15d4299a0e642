"""`meshkit train` as a user meets it: defaults that scale, `--resume` from the run's config.json,
defaults in --help, errors naming the option, a failed report that keeps the results, TensorBoard."""

import json
import struct

import numpy as np
import pytest

from meshkit.cli import main
from meshkit.train import config as C
from meshkit.train import optim
from meshkit.train import resume as R


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- 1. warmup scales with steps ------------------------------------------------------------------
def test_warmup_defaults_to_a_tenth_of_the_steps():
    for steps, warmup in [(40, 4), (400, 40), (9, 0), (1, 0)]:
        cfg = C.default().replace(steps=steps)
        C.validate(cfg)  # `meshkit train --steps 40` used to be refused: the warmup was a fixed 40
        assert C.warmup_steps(cfg) == warmup
    lr = optim.lr_schedule(C.default())
    assert float(lr(0)) == 0.0 and float(lr(40)) == pytest.approx(3e-3)
    assert float(optim.lr_schedule(C.default().replace(steps=5))(0)) == pytest.approx(
        3e-3
    )  # no warmup: peak at once
    assert C.warmup_steps(C.default().replace(steps=40, warmup=7)) == 7


def test_resume_config_round_trips_and_applies_only_what_is_given(tmp_path):
    fields = set(C.OPTIONS) - {"run_dir"}
    assert fields == set(R.FIXED_ON_RESUME) | set(R.CHANGEABLE_ON_RESUME)  # every option is classified
    assert not set(R.FIXED_ON_RESUME) & set(R.CHANGEABLE_ON_RESUME)
    saved = C.tiny().replace(mesh="data=8", clip=None, tensorboard=True, run_dir="elsewhere")
    assert C.TrainConfig.from_json(json.loads(C.dumps(saved))) == saved
    same, lines = R.resumed(saved, {}, str(tmp_path))
    assert same == saved.replace(run_dir=str(tmp_path)) and lines == []
    given = {"plan": "fsdp+tp", "mesh": "data=4,model=2", "accumulate": 2, "clip": None}
    moved, lines = R.resumed(saved, given, "d")
    assert (moved.get("mesh"), moved.get("accumulate"), moved.optimizer.clip) == ("data=4,model=2", 2, None)
    assert lines == ["--plan: fsdp -> fsdp+tp", "--mesh: data=8 -> data=4,model=2", "--accumulate: 1 -> 2"]
    with pytest.raises(
        C.ConfigError, match="plan fsdp does not use mesh axis model=2"
    ):  # the spec's own check
        R.resumed(saved, {"mesh": "data=4,model=2"}, "d")


# -- 3. defaults in --help --------------------------------------------------------------------------
def test_train_help_shows_every_default(capsys):
    assert main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for shown in ["[default: (fsdp)]", "[default: (400; tiny: 12)]", "[default: (32; tiny: 16)]",
                  "[default: (a tenth of --steps, rounded down)]", "[default: (1)]", "[default: (0.003)]",
                  "[default: (adamw)]", "[default: (by platform: cpu fp32, gpu bf16, tpu bf16)]", "[default: (50; tiny: 6)]", "[default: (off)]"]:  # fmt: skip
        assert shown in out, shown


def test_every_option_of_every_command_shows_its_default(capsys):
    from meshkit.cli import _command

    command = _command()
    for name, sub in [("meshkit", command), *command.commands.items()]:
        for p in sub.params:
            if getattr(p, "param_type_name", "") != "option" or p.required or p.is_flag:
                continue
            said = isinstance(p.show_default, str) or "default" in (p.help or "").lower()
            assert said or (p.default is not None and p.show_default), (name, p.opts)
    for argv, shown in [(["devices", "--help"], "[default: (none)]"), (["verify", "--help"], "[default: dp]"),
                        (["budget", "--help"], "[default: (none)]"), (["--help"], "[default: (none)]")]:  # fmt: skip
        assert main(argv) == 0 and shown in capsys.readouterr().out, argv


# -- 4. errors name the option to change ----------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--accumulate", "4"],
            "a global batch of 16 examples does not divide over data=8 x accumulate=4: "
            "use a batch of 32 (a multiple of 32) or a smaller accumulate",
        ),
        (
            ["--mesh", "data=2,model=4", "--plan", "dp+tp", "--batch-size", "6", "--accumulate", "2"],
            "a global batch of 6 examples does not divide over data=2 x accumulate=2: use a batch of 4",
        ),
        (["--steps", "5", "--warmup", "5"], "--warmup 5 must be below --steps 5: lower --warmup"),
        (["--eval-every", "-1"], "--eval-every must be at least 0"),
        (["--stop-after", "0"], "--stop-after 0 must be after step 0"),
        (["--seq-len", "60000"], "--seq-len 60000 needs 60001 held-out tokens"),
        (["--width", "0"], "--width must be at least 1"),
        (["--plan", "tp", "--mesh", "model=8"], "4 heads do not divide over model=8"),
    ],
)
def test_bad_option_is_one_line_naming_it(tmp_path, capsys, args, message):
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--run-dir", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not run.exists()


# -- 2. --resume reads the run's config.json ------------------------------------------------------
def test_resume_takes_the_runs_config_and_changes_only_what_is_safe(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # runs/<time> and runs/latest, as a user gets them
    first = ["train", "--preset", "tiny", "--steps", "6", "--eval-every", "0", "--sample-chars", "0"]
    assert main([*first, "--stop-after", "3"]) == 0
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink() and json.loads((latest / "config.json").read_text())["run"]["steps"] == 6
    capsys.readouterr()
    assert main(["train", "--preset", "tiny", "--run-dir", str(latest)]) == 2  # a new run there: refused
    assert "already holds checkpoints: pass --resume" in capsys.readouterr().err
    for args, option in [(["--batch-size", "32"], "--batch-size was 16"), (["--steps", "12"], "--steps was 6"),
                         (["--seed", "1"], "--seed was 0"), (["--width", "64"], "--width was 32"),
                         (["--lr", "0.1"], "--lr was 0.003"), (["--precision", "bf16"], "--precision was 'fp32'"),
                         (["--clip", "0"], "--clip was 1.0"), (["--warmup", "3"], "--warmup was 0")]:  # fmt: skip
        assert main(["train", "--resume", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and option in err and f"drop {args[0]}" in err, err
    assert main(["train", "--resume", "--stop-after", "3"]) == 2
    assert "--stop-after 3 must be after the checkpoint's step 3" in capsys.readouterr().err
    assert (
        main(["train", "--resume", "--warmup", "0", "--plan", "dp", "--eval-every", "2", "--preset", "x"])
        == 0
    )
    out = capsys.readouterr().out
    assert "--preset x is not used with --resume" in out
    assert "resume: --plan: fsdp -> dp" in out and "resume: --eval-every: 0 -> 2" in out
    assert "--warmup" not in out  # the saved schedule's warmup, given again, is no change
    saved = json.loads((latest / "config.json").read_text())
    assert (
        saved["parallel"]["plan"],
        saved["run"]["eval_every"],
        saved["run"]["steps"],
        saved["data"]["batch_size"],
    ) == (
        "dp",
        2,
        6,
        16,
    )
    assert [r["step"] for r in rows(latest) if "loss" in r] == list(range(1, 7))
    assert [r["step"] for r in rows(latest) if "eval_loss" in r] == [4, 6]
    assert json.loads((latest / "report.json").read_text())["steps"] == 6


# Tiers: sweeps; a checkpoint of the other form converted on resume, both ways, is core in
# test_pipeline.py::test_meshkit_train_dp_pp_resumes_under_fsdp_and_back_bitwise_and_writes_the_schedule.
@pytest.mark.sweep
def test_resume_may_switch_the_gpt_form_and_continues_the_same_run(tmp_path, capsys):
    """A checkpoint of the Python-loop GPT resumes under --scan-layers (converted on restore) and the
    run continues as the uninterrupted one does (the two forms agree to float32 rounding)."""
    common = ["train", "--preset", "tiny", "--steps", "4", "--eval-every", "0", "--sample-chars", "0"]
    assert main([*common, "--run-dir", str(tmp_path / "whole")]) == 0
    assert main([*common, "--run-dir", str(tmp_path / "split"), "--stop-after", "2"]) == 0
    capsys.readouterr()
    assert (
        main(["train", "--resume", "--run-dir", str(tmp_path / "split"), "--scan-layers", "--remat", "layer"])
        == 0
    )
    out = capsys.readouterr().out
    assert "resume: --scan-layers: off -> on" in out and "resume: --remat: none -> layer" in out
    whole = [r["loss"] for r in rows(tmp_path / "whole") if "loss" in r]
    split = [r["loss"] for r in rows(tmp_path / "split") if "loss" in r]
    assert len(split) == 4 and split[:2] == whole[:2]
    np.testing.assert_allclose(split[2:], whole[2:], rtol=1e-5)
    assert json.loads((tmp_path / "split" / "config.json").read_text())["model"]["scan_layers"] is True


# -- 6. a report that cannot be made never costs the run its outputs -------------------------------
def _warnings(out):
    return [line for line in out.splitlines() if line.startswith("warning:")]


def test_failed_report_keeps_the_results_and_is_one_warning(tmp_path, monkeypatch, capsys):
    from meshkit.train.trainer import Trainer

    def broken(self, batch):
        raise RuntimeError("ledger could not read the program\nsecond line")

    monkeypatch.setattr(Trainer, "report", broken)
    run = tmp_path / "run"
    assert (
        main(["train", "--preset", "tiny", "--steps", "3", "--eval-every", "0", "--run-dir", str(run)]) == 0
    )
    (warning,) = _warnings(capsys.readouterr().out)
    assert "communication/memory report failed (RuntimeError: ledger could not read the program)" in warning
    assert {p.name for p in run.iterdir() if not p.name.startswith(".")} == {"config.json", "metrics.jsonl", "report.json", "loss.png",
                                               "checkpoints"}  # fmt: skip
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == 3 and report["checks_ok"] is None and "communication" not in report
    assert report["final_loss"] == [r for r in rows(run) if "loss" in r][-1]["loss"]
    assert report["report_problems"] == [warning.removeprefix("warning: ").split("; the training")[0]]
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(run.glob("events.out.tfevents.*"))  # no --tensorboard, no event files


def test_size_one_axis_mesh_run_keeps_its_results(tmp_path, capsys):
    """This trained all steps, then failed in the HLO reader and wrote no report and no plots."""
    run = tmp_path / "run"
    args = ["--plan", "dp+tp", "--mesh", "data=1,model=8", "--heads", "8", "--steps", "3", "--eval-every", "0",
            "--sample-chars", "0", "--run-dir", str(run)]  # fmt: skip
    assert main(["train", "--preset", "tiny", *args]) == 0
    out = capsys.readouterr().out
    report = json.loads((run / "report.json").read_text())
    assert (
        report["steps"] == 3
        and np.isfinite(report["final_loss"])
        and report["mesh"] == {"data": 1, "model": 8}
    )
    assert (run / "loss.png").exists()
    # the HLO reader's matching of size-1 axes is fixed elsewhere; until then, one warning and no cost.png
    assert report["checks_ok"] is True or len(_warnings(out)) == 1


# -- 7. TensorBoard event files beside metrics.jsonl ----------------------------------------------
def read_events(path):
    """Scalars of a TensorBoard event file: TFRecord framing (length, masked CRCs) around Event protos."""
    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data):
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    raw, scalars, at = path.read_bytes(), {}, 0
    while at < len(raw):
        header = raw[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", raw[at + 8 : at + 12])[0] == masked(header)
        data = raw[at + 12 : at + 12 + length]
        assert struct.unpack("<I", raw[at + 12 + length : at + 16 + length])[0] == masked(data)
        at += 16 + length
        event = Event.FromString(data)
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_events_hold_the_metrics_and_a_failed_plot_is_one_warning(tmp_path, monkeypatch, capsys):
    from meshkit.train import plots

    def broken(*args):
        raise ValueError("no font")

    monkeypatch.setattr(plots, "cost_plot", broken)  # one run for both checks: compiles are a test's cost
    run = tmp_path / "run"
    args = [
        "--steps",
        "3",
        "--eval-every",
        "2",
        "--sample-chars",
        "0",
        "--tensorboard",
        "--run-dir",
        str(run),
    ]
    assert main(["train", "--preset", "tiny", *args]) == 0
    (warning,) = _warnings(capsys.readouterr().out)
    assert "cost.png failed (ValueError: no font)" in warning
    assert not (run / "cost.png").exists() and (run / "loss.png").exists()
    assert json.loads((run / "report.json").read_text())["checks_ok"] is True
    (events,) = run.glob("events.out.tfevents.*")
    scalars = read_events(events)
    logged = rows(run)
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"):
        expect = [(r["step"], r[name]) for r in logged if name in r]
        assert [s for s, _ in scalars[name]] == [s for s, _ in expect], name
        np.testing.assert_allclose([v for _, v in scalars[name]], [v for _, v in expect], rtol=1e-6)
    assert [s for s, _ in scalars["eval_loss"]] == [2, 3]
