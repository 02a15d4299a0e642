"""`meshkit train --config run.toml` and `--set section.key=value` (issue 25): the file, then --set, then
plain flags; every unknown key and wrong type named in one line, exit 2, nothing written. (A run made
from a file trains bitwise as the same flags do: tests/test_data_resume.py.)"""

import json

import pytest

from meshkit.cli import main
from meshkit.train import config as C
from meshkit.train import config_file


def test_every_option_is_in_exactly_one_table():
    tabled = [n for names in config_file.SECTIONS.values() for n in names]
    assert sorted(tabled) == sorted(C.OPTIONS) and len(tabled) == len(set(tabled))
    from meshkit.cli.train import ORDER  # every section's flags in meshkit train --help

    assert sorted(ORDER) == sorted(C.SECTIONS)


def _error(capsys, argv) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_the_file_then_set_then_flags(tmp_path, capsys):
    """The resolved values show in the one check that fails before anything is built: warmup < steps."""
    (tmp_path / "run.toml").write_text(
        'preset = "tiny"\n[run]\nsteps = 3\n[optimizer]\nwarmup = 4\nlr = 1e-2\n'
    )
    run = ["train", "--config", str(tmp_path / "run.toml"), "--run-dir", str(tmp_path / "run")]
    assert "--warmup 4 must be below --steps 3" in _error(capsys, run)
    assert "--warmup 4 must be below --steps 4" in _error(capsys, [*run, "--set", "run.steps=4"])
    assert "--warmup 4 must be below --steps 2" in _error(capsys, [*run, "--set", "steps=4", "--steps", "2"])
    assert "--warmup 9 must be below --steps 2" in _error(
        capsys, [*run, "--set", "optimizer.warmup=9", "--steps", "2"]
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("text", "sets", "messages"),
    [
        ("stepz = 3\n", [], ["unknown option 'stepz' (did you mean 'steps'?)"]),
        ("[optimizer]\nlr = 'fast'\nwidth = 3\n", [], ["--lr must be a number, got 'fast'", "'width' belongs in [model], not [optimizer]"]),
        ("[model]\nlayers = 1.5\n", ["run.tensorboard=3", "optimizer.lrr=1"],
         ["--layers must be a whole number, got 1.5", "--tensorboard must be true or false, got 3", "unknown option 'optimizer.lrr' (did you mean 'optimizer.lr'?)"]),
        ("preset = 'huge'\n", [], ["preset must be default or tiny, got 'huge'"]),
        ("model = 3\n", [], ["--model must be text, got 3"]),  # the option, beside the [model] table
        ("parallel = 3\n", [], ["'parallel' is a table of options: write [parallel]"]),
        ("steps = = 3\n", [], ["is not valid TOML"]),
        ("", ["seed"], ["--set 'seed' is not key=value"]),
    ],
)  # fmt: skip
def test_bad_config_is_one_line_naming_every_key(tmp_path, capsys, text, sets, messages):
    (tmp_path / "run.toml").write_text(text)
    argv = ["train", "--config", str(tmp_path / "run.toml"), "--run-dir", str(tmp_path / "run")]
    err = _error(capsys, [*argv, *(a for s in sets for a in ("--set", s))])
    assert all(m in err for m in messages), err
    assert not (tmp_path / "run").exists()


def test_a_runs_config_json_is_a_config_file(tmp_path, capsys):
    saved = C.tiny().replace(steps=3, warmup=5, run_dir=str(tmp_path / "old"))
    (tmp_path / "config.json").write_text(C.dumps(saved))
    assert "--warmup 5 must be below --steps 3" in _error(
        capsys, ["train", "--config", str(tmp_path / "config.json"), "--run-dir", str(tmp_path / "run")]
    )
    assert "--config" in _error(capsys, ["train", "--config", str(tmp_path / "missing.toml")])
    assert json.loads(C.dumps(saved))["parallel"]["plan"] == "fsdp"
