"""Test set-up: 8 simulated CPU devices, configured once before JAX starts its backend.

The backend is started here, so no test can change the device count for the tests after it
(a CLI test that asks for another count must meet the "already started" error, in any order).
"""

import os
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, fresh each run: the controller makes it before
# the xdist workers start, and they and every process a test starts (meshkit commands, launched
# ranks, docs blocks) inherit it. The same tiny step compiled by many tests and subprocesses is then
# compiled once (a tiny `meshkit train`: 17 s of CPU cold, 7 s warm). Executables read from the cache
# keep their HLO text, memory and cost analyses, which the ledgers read.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshkit-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# The tests' programs are tiny and run a few steps: compiling them is most of the suite's CPU time, and
# XLA's backend optimisations (LLVM's passes) are most of a compile, so the suite turns them off, as
# JAX's own test suite does (JAX_DISABLE_MOST_OPTIMIZATIONS: backend optimisation level 0, no
# expensive LLVM passes; the HLO passes, hence sharding, collectives and buffer assignment, are
# unchanged). Inherited by every process a test starts; the docs blocks run as a user runs them.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax

jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A user's folder as the current one (for ``module:function`` targets); sys.path and the
    modules the test imported from it (named ``mk_user_*`` or ``mk_pkg*``) as they were afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    names = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - names:
        if name.startswith(("mk_user_", "mk_pkg")):
            del sys.modules[name]
