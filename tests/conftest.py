"""Test set-up: 8 simulated CPU devices, configured once before JAX starts its backend.

The backend is started here, so no test can change the device count for the tests after it
(a CLI test that asks for another count must meet the "already started" error, in any order).
"""

import gc
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Python's bytecode cache on, for this process and every one a test starts (meshkit commands, ranks, docs
# blocks), even where the machine's environment turns it off (PYTHONDONTWRITEBYTECODE, as in many
# container images): each such process imports meshkit's ~33,000 lines, which from source costs 0.3 s of
# CPU more (the CLI's imports: 1.25 s against 0.97 s, 2026-12-06). The __pycache__ folders it writes are
# git-ignored; pytest keeps its rewritten test modules there too.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# One persistent compilation cache for the whole run, fresh each run: the controller makes it before
# the xdist workers start, and they and every process a test starts (meshkit commands, launched
# ranks, docs blocks) inherit it. The same tiny step compiled by many tests and subprocesses is then
# compiled once (a tiny `meshkit train`: 17 s of CPU cold, 7 s warm). Executables read from the cache
# keep their HLO text, memory and cost analyses, which the ledgers read.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshkit-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Records of verified token shards (meshkit.data.shards: one per prepared directory) go to a directory of
# this run's, not the user's ~/.cache: the suite prepares hundreds of temporary directories.
os.environ.setdefault("MESHKIT_DATA_CACHE", tempfile.mkdtemp(prefix="meshkit-tests-verified-"))

# The tests' programs are tiny and run a few steps: compiling them is most of the suite's CPU time, and
# XLA's backend optimisations (LLVM's passes) are most of a compile, so the suite turns them off, as
# JAX's own test suite does (JAX_DISABLE_MOST_OPTIMIZATIONS: backend optimisation level 0, no
# expensive LLVM passes; the HLO passes, hence sharding, collectives and buffer assignment, are
# unchanged). Inherited by every process a test starts; the docs blocks run as a user runs them.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax

from meshkit.devices import prepare_deterministic

sys.dont_write_bytecode = False  # (see above) for the test modules pytest rewrites, and what they import

# Deterministic mode needs XLA's fused multiply-adds off before the backend starts, and the backend
# starts here for every test (processes the tests start inherit the flag with XLA_FLAGS).
prepare_deterministic()
jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8


# -- the transformers references ------------------------------------------------------------------------
# The tests marked `reference` check meshkit's Hugging Face import and export against transformers itself,
# in Python 3.11 environments of their own (scripts/reference_env.sh, `make reference`): every such test
# that asks for `reference_python` runs once per release line, its id naming it (`-k transformers5`
# chooses one). 5.x writes config.json otherwise than 4.x (rope_parameters, dtype), so both are checked.
ROOT = Path(__file__).resolve().parents[1]
REFERENCES = {"transformers4": ".venv-ref", "transformers5": ".venv-ref5"}
"""Each reference's name (its test id) and venv: transformers 4.57.6 and 5.x."""


def reference_interpreter(name: str) -> str:
    """The Python of the reference ``name`` (a key of ``REFERENCES``); fails the test, naming the
    command that makes it, where it is missing."""
    py = ROOT / REFERENCES[name] / "bin" / "python"
    if not py.is_file():
        pytest.fail(f"no reference environment at {py}: run 'make reference' (scripts/reference_env.sh)")
    return str(py)


# Tiers: each reference test sweeps against 4.57.6 (CI runs both: `make test`, then `make sweeps`); against
# transformers 5.x, the release line users install now, the core tier keeps one checkpoint reference, Llama
# 3's (test_hf_families.py: its checkpoints read by meshkit, meshkit's export read by 5.x, and the Mixtral's
# experts), and one tokenizer reference, the chat templates' (test_chat_template.py); the other families'
# and files' 5.x cases sweep too (their Tiers comments name the core tests of meshkit's side of them).
@pytest.fixture(
    scope="session",
    params=[pytest.param(n, marks=() if n == "transformers5" else pytest.mark.sweep) for n in REFERENCES],
)
def reference_python(request) -> str:
    """The Python of one transformers reference: each test that asks for it runs against each."""
    return reference_interpreter(request.param)


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


# -- scheduling ---------------------------------------------------------------------------------------
# pytest-xdist's default `--dist load` hands each worker a consecutive chunk of the collection (a quarter
# of its share), then more chunks as it frees up: a file's tests are split over both workers (each
# builds the file's module fixtures and in-process caches: verify's references, compiled trainers), and
# a long file or test that starts late makes the run's tail. The suite instead hands out whole files
# (`--dist loadfile`), the longest first, in that order (`--no-loadscope-reorder`; xdist's own reorder
# is by number of tests): longest processing time first, so the two workers end within about a short
# file's length of each other, and every file's fixtures and caches are built once.
#
# A file's length: its tests' recorded seconds, in tests/durations.txt (pytest's own `--durations` lines,
# call, setup and teardown summed per test; every phase of a second or more of a full run, -n 2, on 2
# cores loaded by other jobs: 531 lines of 1,302 tests), plus UNRECORDED_S for each test not listed (that
# run's mean of the unlisted ones, 0.15 s: a file of many quick tests is not taken for a long one, and
# a file the table does not know yet weighs little, so it runs among the short ones at the end: record
# again when one is long). A renamed test only loses its weight (tests/test_suite_order.py names a
# stale entry). To record again (every phase that took a second or more):
#   pytest -n 2 -q --durations=0 --durations-min=1 | grep -E '^[0-9.]+s (call|setup|teardown) ' > tests/durations.txt
DURATIONS = Path(__file__).parent / "durations.txt"
UNRECORDED_S = 0.15


def recorded_seconds(text: str | None = None) -> dict[str, float]:
    """Node id -> seconds (its call, setup and teardown), from pytest's ``--durations`` lines
    (``12.34s call     tests/test_x.py::test_y``): ``text``, or tests/durations.txt."""
    text = DURATIONS.read_text() if text is None else text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := re.fullmatch(r"([0-9.]+)s (?:call|setup|teardown) +(\S.*)", line.strip()):
            out[m[2]] = out.get(m[2], 0.0) + float(m[1])
    return out


def longest_files_first(items: list, seconds: dict[str, float]) -> list:
    """The items grouped by file, the files in order of their estimated length, longest first (ties
    and each file's tests in collected order: the same order on every xdist worker, which xdist
    requires)."""
    length: dict[str, float] = {}
    for item in items:
        file = item.nodeid.partition("::")[0]
        length[file] = length.get(file, 0.0) + seconds.get(item.nodeid, UNRECORDED_S)
    return sorted(items, key=lambda item: -length[item.nodeid.partition("::")[0]])


def pytest_configure(config):
    """Under xdist, whole files in the collected order (see above), unless another --dist was asked."""
    if config.pluginmanager.hasplugin("xdist") and config.getoption("dist") == "load":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after -k and -m deselect: the lengths are those of the tests that run
def pytest_collection_modifyitems(config, items):
    items[:] = longest_files_first(items, recorded_seconds())


# -- one file's programs at a time ---------------------------------------------------------------------
# Every program a process compiles maps its code into memory (3 to 14 mappings each, on the CPU) and stays
# there while JAX's caches hold it. A worker of the full suite compiles thousands: in one process, 6 test
# files reached 8,400 mappings in 5 minutes, and Linux gives a process 65,530 (vm.max_map_count), past
# which XLA's next mmap fails and it dies with a segmentation fault, in a compile or in the persistent
# cache's serialize (twice at 91-95% of a full run, 2026-12-05: the crash that held CI to its limit).
# So when a worker finishes a file (xdist deals whole files, see above), or holds more than
# MAPPINGS_HIGH after a test, it drops JAX's caches and collects what no test holds any more: 300 jitted
# programs' 4,082 mappings fall back to 76 after jax.clear_caches(). Programs a file shares are compiled
# once for it; the next file compiles its own. With the first rule alone a worker still reached 29,042
# mappings in a full run beside load (2026-12-05), and 30,796 with both in a quiet one: what a worker
# keeps after a clear (about 30,000 late in a run) is held by something JAX's caches do not own (not yet
# traced: live objects such as meshkit's process caches, or the allocator keeping its arenas), and the
# second rule clears again whenever a test leaves more.
MAPPINGS_HIGH = 30_000

# Python's cyclic garbage collector, less often: a worker holds a large heap (test modules, fixtures, the
# programs a file shares), and tracing makes many short-lived container objects, so the default young
# collections (every 2,000 allocations) and the full ones they cascade into walk that heap again and
# again. Young collections every 100,000 allocations, the older generations almost never on their own:
# the cleanup below collects everything when a file ends (or the mappings rise), so nothing waits longer
# than one file. test_plans.py and test_fsdp.py in one process: 91.8 s of CPU against 101.8 s with
# Python's thresholds (the medians of 4 alternated runs each, 2026-12-06), peak memory 860 MiB against 845.
# And what the collection built (the test modules, their constants, JAX's own objects: 409,000 objects, a
# full collection 0.26 s) is moved out of the collector's sight once collected: each file's cleanup then
# walks only what came after, instead of all of it again some 55 times a worker.
gc.set_threshold(100_000, 50, 1_000)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)  # the file's fixtures end here when nextitem is in another file
    finally:
        if nextitem is None or nextitem.path != item.path or mappings() > MAPPINGS_HIGH:
            jax.clear_caches()
            gc.collect()


def mappings() -> int:
    """How many memory mappings this process holds (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


# -- measured costs -----------------------------------------------------------------------------------
# With MESHKIT_TEST_CPU=FILE, each test appends a line to FILE: its node id, the CPU seconds (user +
# system) of the processes it started and waited for (theirs and their own children's: a launcher's
# ranks too), its wall seconds, the CPU seconds of the test's own process (the worker's, tracing and
# compiling in-process), the memory mappings the worker holds after it (see above), and the worker.
# The time limits of tests/_limits.py are set from the children's figures; the sum of both CPU columns
# is what the suite costs a loaded machine, test by test.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get("MESHKIT_TEST_CPU")
    if not out:
        return (yield)
    import resource
    import time

    def used(who: int) -> float:
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    kids, own, wall = used(resource.RUSAGE_CHILDREN), used(resource.RUSAGE_SELF), time.monotonic()
    try:
        return (yield)
    finally:
        line = (
            f"{item.nodeid}\t{used(resource.RUSAGE_CHILDREN) - kids:.2f}\t{time.monotonic() - wall:.2f}"
            f"\t{used(resource.RUSAGE_SELF) - own:.2f}\t{mappings()}"
            f"\t{os.environ.get('PYTEST_XDIST_WORKER', '')}\n"
        )
        with open(out, "a") as f:
            f.write(line)
