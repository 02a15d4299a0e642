"""Inputs that crashed or hung (issue 23, item 8): each is one line at once, and with ``--json`` a
JSON object on stdout, exit 2."""

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _limits import limit
from meshkit.analysis._groups import MAX_DEVICES
from meshkit.cli import main

_HLO = """HloModule huge{header}

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (p: f32[1024]) -> f32[1024] {{
  %p = f32[1024] parameter(0)
  ROOT %ar = f32[1024] all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add
}}
"""


def _one_line_at_once(capsys, argv: list[str], limit_s: float = 10) -> str:
    start = time.monotonic()
    code = main(argv)
    elapsed = time.monotonic() - start
    out = capsys.readouterr()
    assert code == 2 and elapsed < limit_s, (code, elapsed, out)
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("error: "), out
    return out.err


def test_plan_refuses_an_absurd_device_count_at_once():
    """Was: no output after 180 s (the search lists the count's divisors one by one)."""
    exe = str(Path(sys.executable).parent / "meshkit")
    for devices in ("1000000000000", str(MAX_DEVICES + 1), "0"):
        try:  # a hang fails the test instead of holding the suite
            proc = subprocess.run([exe, "plan", "--model", "gpt2-124m", "--devices", devices],
                                  capture_output=True, text=True, timeout=limit(2))  # fmt: skip
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"meshkit plan --devices {devices} still ran after {e.timeout:.0f} s")
        assert proc.returncode == 2 and proc.stdout == "", proc
        assert (
            proc.stderr
            == f"error: --devices {int(devices):,} is not a device count: give 1 to {MAX_DEVICES:,}\n"
        )


@pytest.mark.parametrize(
    ("header", "groups", "names"),
    [
        ("", "[100000000,2]<=[200000000]", "replica_groups=[100000000,2]<=[200000000]: 200,000,000 devices"),
        ("", "mesh['a'=100000,'b'=100000] {'a'}", "mesh [('a', 100000), ('b', 100000)]: 10,000,000,000 devices"),
        (", num_partitions=100000000000", "{}", "the module's num_partitions: 100,000,000,000 devices"),
        (", replica_count=4096, num_partitions=4096", "{}", "replica_count x num_partitions: 16,777,216 devices"),
    ],
)  # fmt: skip
def test_comm_refuses_replica_groups_beyond_any_machine(capsys, tmp_path, header, groups, names):
    """Was: a 1.3 KB file with replica_groups=[100000000,2]<=[200000000] took over 6 GB in 8 s."""
    hlo = tmp_path / "huge.hlo"
    hlo.write_text(_HLO.format(header=header, groups=groups))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    err = _one_line_at_once(capsys, ["comm", "--hlo", str(hlo)])
    assert names in err and f"more than the {MAX_DEVICES:,} meshkit reads" in err, err
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, grown_mib  # refused before expanding


def test_comm_still_reads_the_largest_iota_it_allows():
    from meshkit.analysis import communication

    ledger = communication(_HLO.format(header="", groups="[256,4096]<=[4096,256]T(1,0)"))
    (record,) = ledger.records
    assert (len(record.groups), record.group_size) == (256, 4096)
    assert record.groups[1][:3] == (1, 257, 513)  # the transpose: device i of group g is i * 256 + g


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["devices", "--devices", "abc", "--json"], "Invalid value for '--devices'"),
        (["comm", "--hlo", "/no/such.hlo", "--json"], "no HLO file '/no/such.hlo'"),
        (["memory", "no_such_module_here:fn", "--json"], "cannot import module 'no_such_module_here'"),
        (["budget", "--params", "1e9", "--devices", "8", "--convention", "bogus", "--json"], "unknown convention 'bogus'"),
        (["verify", "--plan", "bogus", "--json"], "unknown plan 'bogus'"),
        (["plan", "--devices", "1000000000000", "--json"], "--devices 1,000,000,000,000 is not a device count"),
        (["selftest", "--sizes", "12XB", "--json"], "bad size '12XB'"),
        (["--heartbeat-timeout", "0", "devices", "--json"], "--heartbeat-timeout must be a positive number"),
    ],
)  # fmt: skip
def test_json_commands_print_the_error_as_json_on_stdout(capsys, monkeypatch, argv, message):
    """Was: nothing on stdout (the one line went to stderr), so a program reading the JSON got none."""
    monkeypatch.setenv("MESHKIT_HEARTBEAT_TIMEOUT_S", "")  # the global option sets it: undone after
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.err == "" and out.out.count("\n") == 1, out
    error = json.loads(out.out)
    assert list(error) == ["error"] and message in error["error"], error


def test_launch_errors_stay_lines_when_the_command_it_runs_says_json(capsys):
    assert main(["launch", "-n", "0", "--", "meshkit", "comm", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: the number of processes must be at least 1")
