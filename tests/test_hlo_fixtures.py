"""The ledger on hand-written HLO text: forms CPU never emits, each with exact bytes and groups."""

from pathlib import Path

import pytest

from meshkit import HloParseError
from meshkit.analysis import communication

FIXTURES = Path(__file__).parent / "fixtures" / "hlo"


def ledger(name, mesh=None):
    return communication((FIXTURES / f"{name}.hlo").read_text(), mesh=mesh)


def by_name(led):
    return {r.name: r for r in led.records}


def test_async_pairs_count_once_with_exact_bytes():
    led = ledger("async_pairs")
    recs = by_name(led)
    assert sorted(recs) == ["ags", "ars", "cps", "rs"]  # no -done, no async wrapper counted twice
    ar = recs["ars"]
    assert (ar.op, ar.size_bytes, ar.group_size, ar.is_async) == ("all-reduce", 1024 * 4, 4, True)
    assert ar.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert ar.traffic_bytes == pytest.approx(2 * 3 / 4 * 4096)
    ag = recs["ags"]  # bf16[16,32] gathered 4 ways: S_out = 64*32*2
    assert (ag.op, ag.in_bytes, ag.out_bytes, ag.size_bytes, ag.group_size) == (
        "all-gather",
        1024,
        4096,
        4096,
        4,
    )
    assert ag.groups == ((0, 2, 4, 6), (1, 3, 5, 7))  # [2,4]<=[4,2]T(1,0)
    assert ag.traffic_bytes == pytest.approx(3 / 4 * 4096)
    cp = recs["cps"]
    assert (cp.op, cp.size_bytes, cp.traffic_bytes) == ("collective-permute", 256, 256)
    assert cp.groups == ((0, 1), (1, 2), (2, 3), (3, 0))
    rs = recs["rs"]  # inside async-start's wrapped computation
    assert (rs.op, rs.in_bytes, rs.out_bytes, rs.group_size, rs.is_async) == (
        "reduce-scatter",
        256,
        32,
        8,
        True,
    )
    assert rs.traffic_bytes == pytest.approx(7 / 8 * 256)
    assert led.count() == 4
    assert led.by_op()["all-reduce"].traffic_bytes == pytest.approx(6144)


def test_tuple_all_reduce_and_all_devices_and_typed_operands():
    recs = by_name(ledger("tuple_and_all"))
    ar = recs["ar"]
    assert ar.dtypes == ("f32", "bf16", "f32")
    assert ar.shapes == ((64,), (128, 4), ())
    assert ar.size_bytes == 64 * 4 + 128 * 4 * 2 + 4
    assert ar.traffic_bytes == pytest.approx(2 * 3 / 4 * 1284)
    a2a = recs["a2a"]  # replica_groups={} -> every one of num_partitions=8 devices
    assert (a2a.group_size, a2a.size_bytes) == (8, 8 * 16 * 4)
    assert a2a.traffic_bytes == pytest.approx(7 / 8 * 512)
    old = recs["old"]  # older syntax: the operand carries its type
    assert (old.size_bytes, old.group_size, old.groups[0]) == (256, 2, (0, 4))


def test_iota_groups_match_mesh_axes_or_say_they_do_not():
    recs = by_name(ledger("async_pairs", mesh=(("a", 4), ("b", 2))))
    assert recs["ags"].axes == ("a",)  # {0,2,4,6}: b fixed, a varies
    assert recs["ars"].axes is None  # {0,1,2,3} is half of a times b: no set of whole axes
    assert recs["ars"].axes_label == "groups of 4"
    assert recs["rs"].axes == ("a", "b")
    assert recs["cps"].axes == ("a", "b")  # 1->2 moves along a and b
    recs = by_name(ledger("async_pairs", mesh=(("data", 2), ("model", 4))))
    assert recs["ars"].axes == ("model",)


def test_loops_multiply_known_trip_counts_and_flag_unknown_ones():
    led = ledger("loops")
    recs = by_name(led)
    assert (recs["ar"].executions, recs["ar"].exact, recs["ar"].in_loop) == (12, True, True)
    assert recs["ar"].total_traffic_bytes == pytest.approx(12 * 2 * 1 / 2 * 1024)
    assert (recs["ag"].executions, recs["ag"].size_bytes) == (3 * 4, 1024)  # nested 3 x 4
    assert (recs["rs"].executions, recs["rs"].exact) == (1, False)
    assert any("rs" in w and "trip count" in w for w in led.warnings)
    cp = recs["cp"]
    assert (cp.in_loop, cp.in_conditional, cp.executions) == (False, True, 1)
    assert led.by_op()["all-gather"].executions == 12


def test_mesh_axis_form_with_sub_axes_and_device_order():
    led = ledger("mesh_axes")
    assert led.mesh == (("data", 4), ("model", 2))
    recs = by_name(led)
    assert recs["m"].groups == ((0, 1), (2, 3), (4, 5), (6, 7)) and recs["m"].axes == ("model",)
    assert recs["d"].groups == ((0, 2, 4, 6), (1, 3, 5, 7)) and recs["d"].group_size == 4
    assert recs["hi"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))  # the major half of 'data'
    assert recs["hi"].axes == ("data:(1)2",)
    assert set(map(frozenset, recs["ids"].groups)) == {frozenset(g) for g in ((0, 2), (4, 6), (1, 3), (5, 7))}
    both = recs["both"]
    assert (both.group_size, both.size_bytes, both.axes) == (8, 64, ("data", "model"))
    assert led.by_axes()["data"].traffic_bytes == pytest.approx(2 * 3 / 4 * 16)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty HLO text"),
        ("hello world\nthis is not hlo", "no HLO instructions found"),
        (
            "HloModule m\nENTRY %e (x: f32[4]) -> f32[4] {\n  %x = f32[4]{0} parameter(0)\n"
            "  ROOT %a = f32[4]{0} all-reduce(%x), replica_groups=weird, to_apply=%s\n}\n",
            "cannot read replica_groups",
        ),
        (
            "HloModule m\nENTRY %e (x: f32[4]) -> f32[4] {\n  %x = f32[4]{0} parameter(0)\n"
            "  ROOT %a = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%s\n}\n",
            "device count is unknown",
        ),
    ],
)
def test_bad_hlo_text_gives_one_line_error(text, message):
    with pytest.raises(HloParseError, match=message) as err:
        communication(text)
    assert "\n" not in str(err.value)
