"""The chapter's formulas: ZeRO memory, communication, bubble, conventions."""

import pytest

from meshkit import MeshkitError
from meshkit.analysis import bubble, convention, ring_traffic, zero_communication, zero_memory

PHI, N = 7e9, 64


def test_zero_memory_matches_the_chapter_table_for_16_bytes_per_parameter():
    total = {s: zero_memory(PHI, N, s).total for s in ("dp", "zero1", "zero2", "zero3")}
    assert total["dp"] == pytest.approx(16 * PHI)
    assert total["zero1"] == pytest.approx(4 * PHI + 12 * PHI / N)
    assert total["zero2"] == pytest.approx(2 * PHI + 14 * PHI / N)
    assert total["zero3"] == pytest.approx(16 * PHI / N)
    z1 = zero_memory(PHI, N, "zero1")
    assert (z1.params, z1.grads, z1.optimizer) == pytest.approx((2 * PHI, 2 * PHI, 12 * PHI / N))


def test_fp32_adam_and_user_conventions():
    z2 = zero_memory(1000, 4, "zero2", "fp32-adam")
    assert (z2.params, z2.grads, z2.optimizer) == pytest.approx((4000, 1000, 2000))
    c = convention("2,4,8")
    assert (c.param, c.grad, c.optimizer, c.total) == (2, 4, 8, 14)
    with pytest.raises(MeshkitError, match=r"unknown convention 'adam16'.*param,grad,optimizer"):
        convention("adam16")
    with pytest.raises(MeshkitError, match="negative"):
        convention("2,-2,12")


def test_zero_communication_dp_equals_zero12_and_zero3_is_one_and_a_half_times():
    f = (N - 1) / N
    dp = zero_communication(PHI, N, "dp")
    assert dp.traffic_bytes == pytest.approx(2 * f * 2 * PHI) and dp.collectives == ("all-reduce",)
    for stage in ("zero1", "zero2"):
        assert zero_communication(PHI, N, stage).traffic_bytes == pytest.approx(dp.traffic_bytes)
    z3 = zero_communication(PHI, N, "zero3")
    assert z3.traffic_bytes == pytest.approx(1.5 * dp.traffic_bytes)
    assert zero_communication(PHI, N, "zero3", regather_in_backward=False).traffic_bytes == pytest.approx(
        dp.traffic_bytes
    )


def test_bubble_and_ring_formulas():
    assert bubble(4, 1) == 0.75
    assert bubble(4, 64) < 0.05
    assert bubble(4, 16) == pytest.approx(3 / 19)
    assert ring_traffic("all-reduce", 800, 8) == pytest.approx(1400)
    assert ring_traffic("all-gather", 800, 8) == pytest.approx(700)
    assert ring_traffic("collective-permute", 800, 8) == 800
    assert ring_traffic("all-reduce", 800, 1) == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: zero_memory(-1, 8, "dp"), "parameter count must be positive"),
        (lambda: zero_memory(10, 0, "dp"), "device count must be a positive"),
        (lambda: zero_memory(10, 8, "zero4"), "unknown stage 'zero4'"),
        (lambda: bubble(0, 4), "at least 1 stage"),
        (lambda: ring_traffic("all-sum", 1, 2), "no ring model"),
    ],
)
def test_bad_inputs_say_what_is_wrong(call, message):
    with pytest.raises(MeshkitError, match=message):
        call()


def test_one_zero_rule_says_what_each_stage_shards_and_moves():
    """``plans.memory.zero_stage`` (``analysis.zero``) is the rule the chapter's formulas, the ledger and
    the planner ask: parts sharded by stage, bytes at rest, the collectives of a step."""
    from meshkit.plans.memory import zero_stage

    sharded = {
        s: tuple(p for p in ("params", "grads", "optimizer") if zero_stage(s).shards(p)) for s in range(4)
    }
    assert sharded == {
        0: (),
        1: ("optimizer",),
        2: ("grads", "optimizer"),
        3: ("params", "grads", "optimizer"),
    }
    z3 = zero_stage("zero3")
    assert z3.at_rest("params", 100.0, 4, sharded=40.0) == 70.0
    assert z3.shard_group(64, 8) == 8 and zero_stage("zero1").shard_group(64, 8) == 64
    ops = {
        s: [(r.op, r.count) for r in zero_stage(s).collectives(1.0, 1.0, microbatches=3, gathers=2)]
        for s in range(4)
    }
    assert ops == {
        0: [("all-reduce", 1)],
        1: [("reduce-scatter", 1), ("all-gather", 1)],
        2: [("reduce-scatter", 3), ("all-gather", 1)],
        3: [("all-gather", 6), ("reduce-scatter", 3)],
    }
    assert z3.across_replicas(8.0, 4).size_bytes == 2.0
    with pytest.raises(MeshkitError, match="unknown stage 'zero4'"):
        zero_stage("zero4")
