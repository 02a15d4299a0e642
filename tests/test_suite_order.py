"""The suite's own scheduling (tests/conftest.py): the longest recorded tests are handed to the xdist
workers first, so that no long test starts last and makes the run's tail."""

import re
from pathlib import Path
from types import SimpleNamespace

import conftest

TESTS = Path(__file__).parent


def test_the_longest_recorded_tests_run_first_and_the_others_keep_their_order():
    ids = ["a.py::one", "a.py::two", "b.py::long", "b.py::three", "c.py::longer", "c.py::four"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    order = [x.nodeid for x in conftest.longest_first(items, {"b.py::long": 10.0, "c.py::longer": 30.0})]
    assert order == ["c.py::longer", "b.py::long", "a.py::one", "a.py::two", "b.py::three", "c.py::four"]


def test_this_session_is_ordered_longest_first(request):
    seconds = conftest.recorded_seconds()
    ran = [seconds.get(item.nodeid, 0.0) for item in request.session.items]
    assert ran == sorted(ran, reverse=True)


def test_every_recorded_test_still_exists():
    """A renamed or removed test would only lose its head start; the table is kept true instead."""
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


def test_xdist_hands_out_one_test_at_a_time(request):
    """In longest-first order, xdist's default first chunk (a quarter of a worker's share, consecutive)
    would give one worker every long test."""
    if request.config.pluginmanager.hasplugin("xdist"):
        assert request.config.getoption("maxschedchunk") == 1
