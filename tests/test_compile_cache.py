"""JAX's persistent compilation cache, on by default for meshkit's commands: ``meshkit train`` writes
its compiled step into ``$XDG_CACHE_HOME/meshkit/jax``; ``off`` writes nothing, not even into a
cache the user configured for JAX; a user's ``JAX_COMPILATION_CACHE_DIR`` is used as it is; a
directory that cannot be used is one line and exit 2.

Every case runs in a process of its own (the suite's own cache, ``tests/conftest.py``, must not be
touched), with the JAX and meshkit cache settings of this environment removed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _limits import limit

MESHKIT = str(Path(sys.executable).parent / "meshkit")
TINY = ["train", "--preset", "tiny", "--warmup", "1", "--eval-every", "0", "--sample-chars", "0"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    drop = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JAX_ENABLE_COMPILATION_CACHE", "MESHKIT_COMPILE_CACHE")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path / "xdg"), **extra}


def _entries(directory: Path) -> list[str]:
    return (
        sorted(p.name for p in directory.iterdir() if p.name.endswith("-cache")) if directory.is_dir() else []
    )


@pytest.mark.slow
def test_meshkit_train_caches_its_step_in_the_default_place(tmp_path):
    # --stop-after: the step compiled and run, without the end's evaluation and report (seconds of compiles)
    proc = subprocess.run([MESHKIT, *TINY, "--steps", "2", "--stop-after", "1", "--run-dir", str(tmp_path / "run")],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=limit(7))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = _entries(tmp_path / "xdg" / "meshkit" / "jax")
    assert any(name.startswith("jit_step-") for name in entries), entries  # the train step, compiled in < 1 s


# A command's start (meshkit.cli.main sets the cache up), then one jitted function compiled.
_COMPILE = """
import sys
from meshkit import compile_cache
where = compile_cache.configure(sys.argv[1] or None)
import jax, jax.numpy as jnp
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(5.0)).block_until_ready()
print(where)
"""


#: A cache the user configured for JAX, with their own threshold (every program, as the function is fast).
USERS = {"JAX_COMPILATION_CACHE_DIR": "{tmp}/users", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


@pytest.mark.parametrize(
    "how, choice, extra, lands",
    [
        ("--compile-cache DIR", "{tmp}/mine", {}, "mine"),
        ("MESHKIT_COMPILE_CACHE=DIR", "", {"MESHKIT_COMPILE_CACHE": "{tmp}/mine"}, "mine"),
        ("the user's JAX cache", "", USERS, "users"),
        ("--compile-cache off", "off", USERS, None),
        ("MESHKIT_COMPILE_CACHE=off", "", {"MESHKIT_COMPILE_CACHE": "off"}, None),
    ],
)
def test_where_the_cache_is(tmp_path, how, choice, extra, lands):
    extra = {k: v.format(tmp=tmp_path) for k, v in extra.items()}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, choice.format(tmp=tmp_path)], env=_env(tmp_path, **extra),
                          capture_output=True, text=True, timeout=limit(1))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == (str(tmp_path / lands) if lands else "None")
    places = {
        "mine": tmp_path / "mine",
        "users": tmp_path / "users",
        "xdg": tmp_path / "xdg" / "meshkit" / "jax",
    }
    for name, place in places.items():
        assert bool(_entries(place)) == (name == lands), (how, name, _entries(place))


def test_a_cache_directory_that_cannot_be_used_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    bad = tmp_path / "a-file" / "cache"
    proc = subprocess.run([MESHKIT, *TINY, "--compile-cache", str(bad), "--run-dir", str(tmp_path / "run")],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=limit(2))  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == (
        f"error: compilation cache '{bad}' cannot be used ({tmp_path / 'a-file'} is not a directory): "
        "give a directory you can write, or off\n"
    )
    assert not (tmp_path / "run").exists()


def test_help_leaves_no_cache_directory_behind(tmp_path):
    # the default directory is JAX's to create at its first compile: a command that compiles nothing
    # (here --help) leaves the user's cache home as it was
    proc = subprocess.run(
        [MESHKIT, "--help"], env=_env(tmp_path), capture_output=True, text=True, timeout=limit(1)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train" in proc.stdout
    assert not (tmp_path / "xdg").exists()
