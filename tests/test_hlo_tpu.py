"""The ledger reads what XLA:TPU compiles (programs compiled by libtpu for abstract TPU devices:
tests/fixtures/hlo_tpu, sources in its README): loops whose trip count the compiler does not state are
counted from their counter, a reduce-scatter fused as an all-reduce and a slice is one reduce-scatter, and a
collective split into async-collective-fusion pieces is one collective."""

import gzip
from pathlib import Path

import pytest

from meshkit.analysis import communication

HERE = Path(__file__).parent / "fixtures" / "hlo_tpu"


def _ledger(name: str):
    return communication(gzip.decompress((HERE / name).read_bytes()).decode())


def test_scanned_layers_run_as_many_times_as_the_stack_is_deep():
    """XLA:TPU states no known_trip_count: the 3-layer stack's loops are read from their counter (0 to 3 by
    1), and every gather of a layer's weights runs 3 times (before: once, with a warning each)."""
    led = _ledger("llama_fsdp_v5e_2x2_L3.hlo.gz")
    assert not led.warnings
    looped = [r for r in led.records if r.in_loop]
    assert looped and all(r.exact and r.executions == 3 for r in looped)
    # the layer weights are gathered in the forward and again in the backward pass: 3 layers x 2
    gathers = {r.shapes for r in looped if r.op == "all-gather"}
    assert all(
        sum(r.executions for r in looped if r.op == "all-gather" and r.shapes == s) % 3 == 0 for s in gathers
    )


def test_a_fused_all_reduce_scatter_is_one_reduce_scatter():
    """fsdp+tp: XLA:TPU fuses reduce-scatters over the model axis as an all-reduce and its partition's
    slice (a kCustom fusion calling all-reduce-scatter.N): each is one reduce-scatter of its input."""
    led = _ledger("llama_fsdp_tp_v5e_2x2_L2.hlo.gz")
    fused = [r for r in led.records if r.computation.startswith("all-reduce-scatter")]
    assert len(fused) == 6 and all(r.op == "reduce-scatter" for r in fused)
    for r in fused:
        assert r.out_bytes * r.group_size == r.in_bytes == r.size_bytes
        assert r.traffic_bytes == pytest.approx(r.size_bytes * (r.group_size - 1) / r.group_size)


def test_a_collective_in_async_fusion_pieces_is_counted_once():
    """MaxText's 16B block on v5e:16x16 (2 of its layers, fsdp 256, remat full): 39 all-gather
    instructions in pieces of 14 collectives; the layer weights are gathered twice a layer (the forward
    and its recomputation), so the gathers move 2 x 2 layers' bf16 weights x 255/256 a chip."""
    led = _ledger("maxtext2023_16b_L2_v5e_16x16.hlo.gz")
    gathers = led.by_op()["all-gather"]
    assert gathers.instructions == 14
    d, heads, head_dim, mlp = 5120, 32, 256, 32768
    layer = 4 * d * heads * head_dim + 2 * d * mlp  # q, k, v, out; the ReLU MLP's two matrices
    layers = 2 * 2 * layer * 2 * 255 / 256  # two layers, gathered twice, bf16
    embed = 32768 * d * 2 * 255 / 256  # the tied embedding, gathered for the lookup and the logits
    assert gathers.traffic_bytes == pytest.approx(layers + 2 * embed, rel=0.02)
