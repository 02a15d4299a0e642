"""`meshkit comm mymodule:fn` finds ./mymodule.py, as `python -m` would, and its errors say what is wrong."""

import json
import sys

from _limits import limit
from meshkit.cli import main

STEP = "import jax, jax.numpy as jnp\ndef make():\n    return jax.jit(lambda x: jnp.sum(x * 2)), (jnp.ones(8),)\n"


def test_module_in_the_current_folder_imports(folder, capsys):
    (folder / "mk_user_step.py").write_text(STEP)
    assert main(["comm", "mk_user_step:make", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == []


def test_package_module_in_the_current_folder_imports(folder, capsys):
    (folder / "mk_pkg").mkdir()
    (folder / "mk_pkg" / "__init__.py").write_text("")
    (folder / "mk_pkg" / "steps.py").write_text(STEP)
    assert main(["memory", "mk_pkg.steps:make", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["argument_bytes"] == 32


def test_missing_module_names_the_folder_searched(folder, capsys):
    assert main(["comm", "mk_user_absent:make"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"from the current folder '{folder}'" in err
    assert "run from the folder that holds mk_user_absent.py" in err


def test_missing_dependency_is_named_not_the_module(folder, capsys):
    (folder / "mk_user_dep.py").write_text("import mk_not_installed_anywhere\ndef make():\n    pass\n")
    assert main(["comm", "mk_user_dep:make"]) == 2
    err = capsys.readouterr().err
    assert "module 'mk_user_dep' imports 'mk_not_installed_anywhere', which is not installed" in err


def test_the_console_script_imports_from_the_current_folder(tmp_path):
    """The real case: the `meshkit` script puts its own bin folder first on sys.path, not the current one."""
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "mk_user_script.py").write_text(STEP)
    exe = str(Path(sys.executable).parent / "meshkit")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ""}
    proc = subprocess.run([exe, "comm", "mk_user_script:make", "--devices", "2", "--json"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=limit(2))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["records"] == []
