"""`meshkit selftest`: every collective against NumPy on 8 devices, the ledger's view of each, the CLI."""

import dataclasses
import json

import numpy as np
import pytest

from meshkit import selftest as st
from meshkit._errors import MeshkitError
from meshkit.analysis.cost import ring_traffic
from meshkit.cli import main

MIB = 2**20
EXPECTED_OPS = {
    "psum": "all-reduce",
    "pmean": "all-reduce",
    "pmax": "all-reduce",
    "all_gather": "all-gather",
    "psum_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "ppermute": "collective-permute",
}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def report():
    return st.selftest(sizes=(4096, 4 * MIB), repeats=1)


def test_every_collective_ok_small_and_large(report):
    assert report.ok and report.device_count == 8 and report.process_count == 1
    assert [(r.collective, r.size) for r in report.rows] == [
        (c, s) for s in (4096, 4 * MIB) for c in EXPECTED_OPS
    ]
    for r in report.rows:
        assert r.ok and r.max_abs_error == 0.0 and r.shards_checked == 8, r
        assert r.time_s > 0 and r.bus_gbps > 0


def test_ledger_finds_exactly_the_expected_collective(report):
    for r in report.rows:
        assert r.op == EXPECTED_OPS[r.collective]
        assert r.ops == (r.op,) and r.ledger_matches, r
        assert r.size_bytes == r.size  # S read from the compiled program
        group = 2 if r.op == "collective-permute" else 8
        assert r.traffic_bytes == pytest.approx(ring_traffic(r.op, r.size_bytes, group))
    big = [r for r in report.rows if r.size == 4 * MIB]
    assert all(r.size_bytes >= 4 * MIB for r in big)
    psum = next(r for r in big if r.collective == "psum")
    assert psum.traffic_bytes == 2 * 7 / 8 * 4 * MIB and psum.shape == (1, MIB)


def test_sizes_round_up_to_even_splits():
    rep = st.selftest(sizes=["1000"], repeats=1, collectives=["all_gather", "psum_scatter"])
    assert rep.ok and [r.size_bytes for r in rep.rows] == [1024, 1024]
    assert [r.shape for r in rep.rows] == [(1, 32), (1, 256)]


def test_inputs_are_exact_and_tell_devices_apart():
    x = st.inputs(8, 3 * 2**18)
    assert x.dtype == np.float32 and x.sum(0, dtype=np.float64).max() < 2**24
    assert np.array_equal(x.sum(0), x.sum(0, dtype=np.float64))
    assert all(len(set(col)) == 8 for col in x[:, :: 2**15].T)


def _broken(name, reference):
    return dataclasses.replace(st.CHECKS[name], reference=reference)


@pytest.mark.parametrize(
    ("name", "reference", "error"),
    [
        ("pmax", st._ref_psum, None),  # wrong values
        ("pmean", lambda x: st._ref_pmean(x) + 1e-3, pytest.approx(1e-3)),  # beyond float32 rounding
        ("ppermute", lambda x: x, 7.0),  # no shift: device 0 holds device 7's block
        ("all_to_all", lambda x: x, float("inf")),  # wrong shape
    ],
)
def test_a_broken_expectation_fails(monkeypatch, name, reference, error):
    monkeypatch.setitem(st.CHECKS, name, _broken(name, reference))
    rep = st.selftest(sizes=[4096], repeats=1, collectives=[name, "psum"])
    assert not rep.ok
    [bad] = rep.failures()
    assert bad.collective == name and not bad.ok and bad.max_abs_error > 0
    if error is not None:
        assert bad.max_abs_error == error
    assert next(r for r in rep.rows if r.collective == "psum").ok


def test_parse_sizes():
    assert st.parse_sizes(["64KiB,4MiB", "2M", "1kB", 7]) == (65536, 4 * MIB, 2 * MIB, 1000, 7)
    for bad in ("4XB", "0", "-1", "MiB"):
        with pytest.raises(MeshkitError, match="size"):
            st.parse_sizes([bad])
    with pytest.raises(MeshkitError, match="repeats"):
        st.selftest(repeats=0)
    with pytest.raises(MeshkitError, match="unknown collective 'psum2'"):
        st.selftest(collectives=["psum2"])


def test_cli_json(capsys):
    code, out, _ = run(
        capsys, "selftest", "--json", "--devices", "8", "--sizes", "4KiB,4MiB", "--repeats", "1"
    )
    data = json.loads(out)
    assert code == 0 and data["ok"] is True and data["device_count"] == 8
    assert len(data["rows"]) == 14 and all(r["ok"] and r["ledger_matches"] for r in data["rows"])
    assert {r["collective"] for r in data["rows"]} == set(EXPECTED_OPS)
    assert {r["size_bytes"] for r in data["rows"]} == {4096, 4 * MIB}
    assert all(r["bus_gbps"] > 0 for r in data["rows"])


def test_cli_table(capsys):
    code, out, _ = run(capsys, "selftest", "--sizes", "1KiB", "--repeats", "1")
    assert code == 0 and "Collectives vs NumPy" in out and "bus GB/s" in out
    assert "collective-permute" in out and "all 7 checks passed" in out


def test_cli_exit_code_on_failure(monkeypatch, capsys):
    monkeypatch.setitem(st.CHECKS, "pmax", _broken("pmax", st._ref_psum))
    code, out, _ = run(capsys, "selftest", "--sizes", "1KiB", "--repeats", "1")
    assert code == 1 and "FAIL" in out and "FAILED: 1 of 7 check(s): pmax@1.00 KiB" in out
    code, out, _ = run(capsys, "selftest", "--json", "--sizes", "1KiB", "--repeats", "1")
    assert code == 1 and json.loads(out)["ok"] is False


def test_cli_bad_size(capsys):
    code, _, err = run(capsys, "selftest", "--sizes", "4XB")
    assert code == 2 and err.startswith("error: bad size '4XB'")
