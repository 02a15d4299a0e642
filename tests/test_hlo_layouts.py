"""The ledger on valid HLO in the layouts XLA's parser accepts, not only as compilers print it.

Every module here is first given to XLA's own parser (so it is valid HLO), its figures are
asserted by hand, and the ledger must read XLA's canonical re-print of it the same way.
"""

from __future__ import annotations

import pytest
from jax._src.lib import xla_client as xc

from meshkit import HloParseError
from meshkit.analysis import communication
from meshkit.cli import main

ADD = """
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
"""


def read(text: str, **kw):
    """The ledger of ``text``, checked to be valid HLO and read alike in XLA's canonical print."""
    canonical = xc.hlo.hlo_module_from_text(text).to_string()
    led = communication(text, **kw)
    again = communication(canonical, **kw)
    assert sorted((r.op, r.size_bytes, r.out_bytes, r.groups, r.executions) for r in led.records) == sorted(
        (r.op, r.size_bytes, r.out_bytes, r.groups, r.executions) for r in again.records
    )
    return {r.name: r for r in led.records}, led


def test_attributes_operands_and_calls_continued_on_following_lines():
    text = (
        "HloModule m, num_partitions=8\n"
        + ADD
        + """
wrapped {
  p = f32[64] parameter(0)
  ROOT rs = f32[16] reduce-scatter(p), channel_id=3, replica_groups=[2,4]<=[8],
      use_global_device_ids=true, dimensions={0}, to_apply=add
}

body {
  t = (s32[], f32[256]) parameter(0)
  i = s32[] get-tuple-element(t), index=0
  v = f32[256] get-tuple-element(t), index=1
  ar = f32[256] all-reduce(
      v),
      channel_id=1,
      replica_groups={{0,1,2,3},{4,5,6,7}},
      use_global_device_ids=true,
      to_apply=add
  ROOT r = (s32[], f32[256]) tuple(i, ar)
}

cond {
  t = (s32[], f32[256]) parameter(0)
  ROOT c = pred[] constant(true)
}

ENTRY main {
  x = f32[256] parameter(0)
  y = f32[64] parameter(1)
  z = s32[] constant(0)
  init = (s32[], f32[256]) tuple(z, x)
  w = (s32[], f32[256]) while(init), condition=cond, body=body,
      backend_config={"known_trip_count":
          {"n": "10"}}
  start = ((f32[64]), f32[16]) async-start(y),
      calls=wrapped
  done = f32[16] async-done(start)
  ROOT out = (s32[], f32[256]) tuple(z, x)
}
"""
    )
    recs, _ = read(text)
    assert sorted(recs) == ["ar", "rs"]
    ar = recs["ar"]  # groups read past the line end: 4 devices, not every one of 8
    assert (ar.group_size, ar.executions, ar.exact, ar.size_bytes) == (4, 10, True, 1024)
    rs = recs["rs"]  # the wrapped collective is reached through calls= on the next line
    assert (rs.group_size, rs.in_bytes, rs.out_bytes, rs.is_async, rs.executions) == (4, 256, 64, True, 1)


def test_spaces_inside_shapes_layouts_and_groups():
    text = (
        "HloModule m, num_partitions=4\n"
        + ADD
        + """
ENTRY main {
  x = f32[64, 128]{1, 0} parameter(0)
  ag = f32[256, 128]{1, 0} all-gather(x), channel_id=1, replica_groups={{0, 1, 2, 3}}, dimensions={0},
    use_global_device_ids=true
  x2 = bf16[8, 2]{1, 0} parameter(1)
  ROOT ar = (f32[64, 128]{1, 0}, bf16[8, 2]{1, 0}) all-reduce(x, x2), channel_id=2,
    replica_groups={{0, 2}, {1, 3}}, use_global_device_ids=true, to_apply=add
}
"""
    )
    recs, _ = read(text)
    ag, ar = recs["ag"], recs["ar"]
    assert (ag.in_bytes, ag.out_bytes, ag.size_bytes, ag.group_size) == (
        64 * 128 * 4,
        256 * 128 * 4,
        131072,
        4,
    )
    assert ar.shapes == ((64, 128), (8, 2)) and ar.size_bytes == 64 * 128 * 4 + 8 * 2 * 2
    assert ar.groups == ((0, 2), (1, 3))


def test_omitted_result_types():
    text = (
        "HloModule m, num_partitions=2\n"
        + ADD
        + """
body {
  t = (s32[], f32[8]) parameter(0)
  i = get-tuple-element(t), index=0
  v = get-tuple-element(t), index=1
  ar = f32[8] all-reduce(v), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=add
  ROOT r = tuple(i, ar)
}

cond {
  t = (s32[], f32[8]) parameter(0)
  ROOT c = pred[] constant(true)
}

ENTRY main {
  x = f32[8] parameter(0)
  z = s32[] constant(0)
  init = tuple(z, x)
  w = while(init), condition=cond, body=body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT out = get-tuple-element(w), index=1
}
"""
    )
    recs, _ = read(text)
    ar = recs["ar"]  # its loop has no printed type; its operand's type is inferred from the result
    assert (ar.executions, ar.size_bytes, ar.group_size) == (3, 32, 2)


def test_async_done_with_calls_is_not_a_second_call():
    text = (
        "HloModule m, num_partitions=4\n"
        + ADD
        + """
wrapped {
  p = f32[32] parameter(0)
  ROOT ag = f32[128] all-gather(p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0},
    use_global_device_ids=true
}

ENTRY main {
  x = f32[32] parameter(0)
  start = ((f32[32]), f32[128]) async-start(x), calls=wrapped
  update = ((f32[32]), f32[128]) async-update(start), calls=wrapped
  ROOT done = f32[128] async-done(update), calls=wrapped
}
"""
    )
    recs, led = read(text)
    assert list(recs) == ["ag"] and led.count() == 1 and recs["ag"].size_bytes == 512


def test_group_sizes_follow_the_grouping_mode():
    """replica_count=2 x num_partitions=4: the same printed ids mean different devices by mode
    (XLA's GetCollectiveOpGroupMode / GetParticipatingDevicesGroups; device = r * 4 + p)."""
    text = (
        "HloModule m, replica_count=2, num_partitions=4\n"
        + ADD
        + """
ENTRY main {
  x = f32[8] parameter(0)
  replica = f32[8] all-reduce(x), replica_groups={{0,1}}, to_apply=add
  all_replicas = f32[8] all-reduce(x), replica_groups={}, to_apply=add
  partition = f32[8] all-to-all(x), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}
  both = f32[8] all-reduce(x), channel_id=2, replica_groups={{0,1}}, to_apply=add
  flat = f32[8] all-reduce(x), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}},
    use_global_device_ids=true, to_apply=add
  ROOT every = f32[32] all-gather(x), channel_id=4, replica_groups={}, dimensions={0}
}
"""
    )
    recs, led = read(text)
    assert led.num_devices == 8
    got = {k: (r.group_mode, r.group_size, r.groups) for k, r in recs.items()}
    assert got["replica"] == ("cross-replica", 2, ((0, 4), (1, 5), (2, 6), (3, 7)))
    assert got["all_replicas"] == got["replica"]
    assert got["partition"] == ("cross-partition", 2, ((0, 1), (4, 5), (2, 3), (6, 7)))
    assert got["both"] == ("cross-replica-and-partition", 8, (tuple(range(8)),))
    assert got["flat"] == ("flattened-id", 2, ((0, 1), (2, 3), (4, 5), (6, 7)))
    # all-gather with a channel and no use_global_device_ids: replicas x partitions, {} = every replica
    assert got["every"] == ("cross-replica-and-partition", 8, (tuple(range(8)),))
    assert recs["every"].traffic_bytes == pytest.approx(7 / 8 * 128)


def test_devices_option_reads_empty_groups_without_a_header_count(tmp_path, capsys):
    text = (
        "HloModule m\n"
        + ADD
        + """
ENTRY main {
  x = f32[16] parameter(0)
  ROOT ar = f32[16] all-reduce(x), replica_groups={}, to_apply=add
}
"""
    )
    with pytest.raises(HloParseError, match="device count is unknown: pass --devices"):
        read(text)
    recs, led = read(text, devices=4)
    assert (recs["ar"].group_size, led.num_devices) == (4, 4)
    f = tmp_path / "m.hlo"
    f.write_text(text)
    assert main(["comm", "--hlo", str(f), "--devices", "4", "--json"]) == 0
    assert '"group_size": 4' in capsys.readouterr().out
    f.write_text(text.replace("HloModule m", "HloModule m, num_partitions=8"))
    assert main(["comm", "--hlo", str(f), "--devices", "4"]) == 2
    err = capsys.readouterr().err
    assert "--devices 4 disagrees" in err and err.count("\n") == 1


def test_async_start_sizes_come_from_the_printed_results():
    text = (
        "HloModule m, num_partitions=4\n"
        + ADD
        + """
ENTRY main {
  x = f32[64] parameter(0)
  y = bf16[16,8] parameter(1)
  rss = ((f32[64]), f32[16]) reduce-scatter-start(x), channel_id=1, replica_groups={{0,1,2,3}},
    use_global_device_ids=true, dimensions={0}, to_apply=add
  rsd = f32[16] reduce-scatter-done(rss)
  ags = (bf16[16,8], bf16[64,8]) all-gather-start(y), channel_id=2, replica_groups={{0,1,2,3}},
    dimensions={0}, use_global_device_ids=true
  agd = bf16[64,8] all-gather-done(ags)
  out = f32[64] parameter(2)
  off = s64[4] parameter(3)
  ROOT ra = f32[64] ragged-all-to-all(x, out, off, off, off, off), channel_id=3, replica_groups={{0,1,2,3}}
}
"""
    )
    recs, led = read(text)
    rs, ag, ra = recs["rss"], recs["ags"], recs["ra"]
    assert (rs.in_bytes, rs.out_bytes, rs.size_bytes) == (256, 64, 256)  # out: the result, not the tuple
    assert (ag.in_bytes, ag.out_bytes, ag.size_bytes) == (256, 1024, 1024)  # S: the printed result
    assert (ra.size_bytes, ra.shapes) == (256, ((64,),))  # the data, not the offset and size arrays
    assert led.count() == 3


MALFORMED = [
    (
        "  ar = f32[a,4] all-reduce(x), replica_groups={{0,1}}, to_apply=add\n",
        "instruction %ar (all-reduce, line",
        "dimension 'a'",
    ),
    ("  ar = f32[4] all-reduce(x, replica_groups={{0,1}}, to_apply=add\n", "instruction %ar", "unbalanced"),
    (
        "  ar = f32[4] all-reduce(x), replica_groups={{0,1}, to_apply=add\n",
        "instruction %ar",
        "replica_groups",
    ),
    ("  ar f32[4] all-reduce(x), replica_groups={{0,1}}, to_apply=add\n", "line", "cannot read"),
    ("  ar = f32[4] all-reduce(x), replica_groups=[2,3]<=[4], to_apply=add\n", "instruction %ar", "iota"),
    ("  ar = f32[4] all-reduce(x), replica_groups={{0,x}}, to_apply=add\n", "instruction %ar", "cannot read"),
    ("  c = f32[4] call(x), to_apply=nowhere\n", "instruction %c", "does not define"),
    (
        "  ar = f32[4] all-reduce(x), replica_groups=mesh['a'=x] {'a'}, to_apply=add\n",
        "instruction %ar",
        "mesh",
    ),
    ("  ar = q9[4] all-reduce(x), replica_groups={{0,1}}, to_apply=add\n", "instruction %ar", "element type"),
    ("  w = while(x), condition=cond\n  ROOT w2 = f32[4] negate(x\n", "instruction %w2", "unbalanced"),
    ("  w = f32[4] while(x), condition=add\n", "instruction %w (while", "needs condition= and body="),
    ('  c = f32[4] call(x), to_apply="add"\n', "instruction %c (call", "cannot read its to_apply= value"),
]


@pytest.mark.parametrize(("line", "names", "says"), MALFORMED)
def test_malformed_hlo_is_one_line_naming_the_instruction(tmp_path, capsys, line, names, says):
    text = (
        "HloModule m, num_partitions=2\n" + ADD + "\nENTRY main {\n  x = f32[4] parameter(0)\n" + line + "}\n"
    )
    with pytest.raises(HloParseError) as err:
        communication(text)
    assert names in str(err.value) and says in str(err.value) and "\n" not in str(err.value)
    f = tmp_path / "bad.hlo"
    f.write_text(text)
    assert main(["comm", "--hlo", str(f)]) == 2
    out, err_text = capsys.readouterr()
    assert err_text.startswith("error: ") and names in err_text and err_text.count("\n") == 1
    assert "Traceback" not in out + err_text


def test_a_cycle_in_the_call_graph_is_an_error_not_a_lost_collective():
    text = (
        "HloModule m, num_partitions=2\n"
        + ADD
        + """
f {
  p = f32[4] parameter(0)
  ar = f32[4] all-reduce(p), replica_groups={}, to_apply=add
  ROOT c = f32[4] call(ar), to_apply=g
}

g {
  p = f32[4] parameter(0)
  ROOT c = f32[4] call(p), to_apply=f
}

ENTRY main {
  x = f32[4] parameter(0)
  ROOT c = f32[4] call(x), to_apply=f
}
"""
    )
    with pytest.raises(HloParseError, match="cycle through computation"):
        communication(text)


def test_collectives_the_entry_never_calls_are_named_in_a_warning():
    text = (
        "HloModule m, num_partitions=2\n"
        + ADD
        + """
unused {
  p = f32[4] parameter(0)
  ROOT ar = f32[4] all-reduce(p), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=add
}

ENTRY main {
  ROOT x = f32[4] parameter(0)
}
"""
    )
    led = communication(text)
    assert led.records == () and led.warnings == (
        "1 collective(s) sit in computations the entry never calls and are not counted (first: %ar in %unused, line 11)",
    )


def test_collective_permute_in_place_counts_its_input_and_combined_counts_every_operand():
    text = """HloModule m, num_partitions=2

ENTRY main {
  x = f32[4,8] parameter(0)
  out = f32[8,8] parameter(1)
  y = f32[16] parameter(2)
  z = s32[] constant(0)
  four = s32[] constant(4)
  starts_in = (s32[], s32[]) tuple(z, z)
  starts_out = (s32[], s32[]) tuple(four, z)
  in_place = f32[8,8] collective-permute(x, out, starts_in, starts_out), channel_id=1,
    source_target_pairs={{0,1},{1,0}}, slice_sizes={{4,8}}
  ROOT combined = (f32[4,8], f32[16]) collective-permute(x, y), channel_id=2, source_target_pairs={{0,1},{1,0}}
}
"""
    recs, _ = read(text)
    assert (recs["in_place"].size_bytes, recs["in_place"].out_bytes) == (128, 256)
    assert recs["combined"].size_bytes == recs["combined"].out_bytes == 128 + 64
    assert recs["combined"].shapes == ((4, 8), (16,))


def test_headers_over_several_lines_and_execution_threads():
    text = """HloModule m,
  num_partitions=4

%reduce (a: f32[],
         b: f32[]) -> f32[] {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

%wrapped (p: f32[32]) -> f32[8] {
  p = f32[32] parameter(0)
  ROOT rs = f32[8] reduce-scatter(p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0},
    use_global_device_ids=true, to_apply=reduce
}, execution_thread="collectives"

ENTRY %main (x: f32[32])
    -> f32[8] {
  x = f32[32] parameter(0)
  start = ((f32[32]), f32[8]) async-start(x), async_execution_thread="collectives", calls=wrapped
  ROOT done = f32[8] async-done(start)
}
"""
    recs, led = read(text)
    assert list(recs) == ["rs"] and led.num_devices == 4
    assert (recs["rs"].group_size, recs["rs"].in_bytes, recs["rs"].is_async) == (4, 128, True)


def test_cross_replica_groups_with_one_replica_say_each_device_is_alone():
    text = (
        "HloModule m, num_partitions=4\n"
        + ADD
        + """
ENTRY main {
  x = f32[8] parameter(0)
  ROOT ar = f32[8] all-reduce(x), replica_groups={}, to_apply=add
}
"""
    )
    recs, led = read(text)
    assert (recs["ar"].group_size, recs["ar"].traffic_bytes, recs["ar"].group_mode) == (1, 0, "cross-replica")
    assert len(led.warnings) == 1 and "every device is alone" in led.warnings[0]
