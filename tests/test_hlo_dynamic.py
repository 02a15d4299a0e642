"""HLO with dynamic dimensions in ``meshkit comm --hlo`` (issue 35: a module with a symbolic
dimension exited 2 where it had been read before).

XLA prints a bounded dynamic dimension as ``<=N`` and an unbounded one as ``?`` (the forms of
XLA's own tests, e.g. xla/hlo/translate/hlo_to_mhlo/tests/custom_call.hlo's ``f32[1,?]``, kept in
tests/fixtures/hlo_corpus/modules/0223.hlo). A bounded one is sized by its bound; a collective of an
unbounded one cannot be sized: it is left out of the totals and named in a warning (never counted as
0 bytes in silence), and the rest of the module is read as before. The modules below are written in
the style of XLA's parser tests (xla/hlo/parser/hlo_parser_test.cc)."""

import json
import subprocess
import sys
from pathlib import Path

from _limits import limit
from meshkit.analysis import communication

MODULE = """HloModule dynamic_collectives

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT add = f32[] add(x, y)
}

ENTRY main {
  p0 = f32[?,8]{1,0} parameter(0)
  p1 = f32[<=16,8]{1,0} parameter(1)
  n = f32[?,8]{1,0} negate(p0)
  ar0 = f32[?,8]{1,0} all-reduce(n), replica_groups={{0,1,2,3}}, to_apply=add
  ar1 = f32[<=16,8]{1,0} all-reduce(p1), replica_groups={{0,1,2,3}}, to_apply=add
  ROOT t = (f32[?,8]{1,0}, f32[<=16,8]{1,0}) tuple(ar0, ar1)
}
"""


def test_an_unbounded_collective_is_named_and_left_out_the_bounded_one_sized_by_its_bound():
    ledger = communication(MODULE)
    assert [r.name for r in ledger.records] == ["ar1"] and ledger.unsized == 1
    assert ledger.records[0].size_bytes == 16 * 8 * 4  # the bound
    (warning,) = [w for w in ledger.warnings if "unbounded" in w]
    assert warning.startswith("1 collective(s) move arrays of unbounded dynamic size and are not counted")
    assert "%ar0 in %main, line 13" in warning


def test_meshkit_comm_reads_it_exit_0_with_the_warning_and_in_json(tmp_path):
    path = tmp_path / "dynamic.hlo"
    path.write_text(MODULE)
    exe = str(Path(sys.executable).parent / "meshkit")
    done = subprocess.run([exe, "comm", "--hlo", str(path)], capture_output=True, text=True, timeout=limit(1))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "unknown number of device(s)" in out and "None device(s)" not in out
    assert "not counting 1 collective(s) of unknown size" in out
    done = subprocess.run(
        [exe, "comm", "--hlo", str(path), "--json"], capture_output=True, text=True, timeout=limit(1)
    )
    report = json.loads(done.stdout)
    assert done.returncode == 0 and [r["name"] for r in report["records"]] == ["ar1"]
    assert any("unbounded dynamic size" in w for w in report["warnings"])


def test_xlas_own_module_with_unbounded_dimensions_is_read():
    corpus = Path(__file__).parent / "fixtures" / "hlo_corpus" / "modules" / "0223.hlo"
    ledger = communication(corpus.read_text())  # its one collective sits in a computation never called
    assert ledger.records == () and ledger.unsized == 0 and any("never calls" in w for w in ledger.warnings)
