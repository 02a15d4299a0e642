"""The suite's own scheduling (tests/conftest.py): under xdist, whole files, the longest first, so that
no long file starts last and makes the run's tail, and each file's fixtures and caches are built once."""

import re
from pathlib import Path
from types import SimpleNamespace

import conftest

TESTS = Path(__file__).parent


def test_files_run_whole_and_longest_first_each_in_its_collected_order():
    ids = ["a.py::one", "a.py::two", "b.py::long", "b.py::three", "c.py::longer", "d.py::x", "d.py::y"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    order = [
        x.nodeid for x in conftest.longest_files_first(items, {"b.py::long": 10.0, "c.py::longer": 30.0})
    ]
    # c: 30 s; b: 10 s + UNRECORDED_S; a and d: 2 x UNRECORDED_S each, in collected order
    assert order == [
        "c.py::longer",
        "b.py::long",
        "b.py::three",
        "a.py::one",
        "a.py::two",
        "d.py::x",
        "d.py::y",
    ]


def test_durations_are_read_from_pytests_own_lines():
    text = """
============================= slowest durations =============================
12.50s call     tests/test_a.py::test_one[x y-2]
0.50s setup    tests/test_a.py::test_one[x y-2]
3.00s teardown tests/test_b.py::test_two
(12 durations < 1s hidden.  Use -vv to show these durations.)
"""
    assert conftest.recorded_seconds(text) == {
        "tests/test_a.py::test_one[x y-2]": 13.0,
        "tests/test_b.py::test_two": 3.0,
    }


def test_this_session_is_ordered_by_file_longest_first(request):
    seconds = conftest.recorded_seconds()
    files = [item.nodeid.partition("::")[0] for item in request.session.items]
    runs = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert len(runs) == len(set(runs)), "a file's tests are not together"
    length = {f: sum(seconds.get(x.nodeid, conftest.UNRECORDED_S) for x in request.session.items
                     if x.nodeid.startswith(f + "::")) for f in runs}  # fmt: skip
    assert [length[f] for f in runs] == sorted(length.values(), reverse=True)


def test_xdist_hands_out_whole_files_in_this_order(request):
    """xdist's default (--dist load) splits files over the workers in chunks; its own --dist loadfile
    reorders files by their number of tests."""
    if request.config.pluginmanager.hasplugin("xdist") and request.config.getoption("numprocesses"):
        assert request.config.getoption("dist") == "loadfile"
        assert request.config.getoption("loadscopereorder") is False


def test_every_recorded_test_still_exists():
    """A renamed or removed test would only lose its weight; the table is kept true instead."""
    seconds = conftest.recorded_seconds()
    assert len(seconds) >= 20
    stale = []
    for nodeid in seconds:
        path, _, name = nodeid.partition("::")
        file = TESTS.parent / path
        function = re.sub(r"\[.*\]$", "", name)
        if not file.is_file() or f"def {function}(" not in file.read_text():
            stale.append(nodeid)
    assert not stale, f"tests/conftest.py RECORDED_SECONDS names tests that no longer exist: {stale}"
