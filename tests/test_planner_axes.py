"""The planner's context (cp) and expert (ep) axes and mixture-of-experts shapes (issue 27): sizes
against the published counts, the context and expert traffic against the chapter's formulas, the
conversion to meshkit's plans, the published runs that use them, and ``meshkit plan``'s ranking.

No JAX here: the planner is arithmetic."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from meshkit.cli import main
from meshkit.planner import Cluster, Job, Layout, ModelShape, hardware, predict
from meshkit.planner.calibrate import load
from meshkit.planner.presets import preset
from meshkit.planner.sizes import active_param_count, layer_params, model_flops_per_token, param_count
from meshkit.plans.axes.context import CONTEXT_MIN_TOKENS
from meshkit.spec import PLANS

CORPUS = Path(__file__).parent / "corpus" / "published_runs.json"
H100 = hardware("h100")
MOE = ModelShape(name="moe", layers=4, width=256, heads=8, kv_heads=2, vocab=1000, seq=4096, ffn=512, gated=True,
                 experts=8, experts_per_token=2)  # fmt: skip
EXTRAPOLATE_BOUND = (1.0, 1.6)
"""Predicted / published tokens/s on the mixture-of-experts runs (``split: extrapolate``): the model
prices expert matmuls at the dense efficiency its calibration measured (narrowed by the experts'
width), the token permutations by their bytes and the all-to-alls exposed, and nothing for load
imbalance, routing kernels or grouped-GEMM launches, so it reads optimistic, never pessimistic; 1.6
bounds how far (the two NeMo releases of the same Qwen3-30B row differ 2x, a published MoE figure
is no firmer than that)."""


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- mixture-of-experts sizes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "total", "active", "rounding"),
    [("mixtral-8x7b", 46.7e9, 12.9e9, 0.1e9), ("mixtral-8x22b", 141e9, 39e9, 1e9)],
)
def test_mixtral_counts_are_the_published_ones(name, total, active, rounding):
    """Mixtral-8x7B: 46.7 B parameters, 12.9 B active (Jiang et al. 2024); 8x22B: 141 B, 39 B (Mistral
    AI): from the shape alone, within the rounding of the published figure (half its last digit)."""
    shape = preset(name)
    assert abs(param_count(shape) - total) <= rounding / 2
    assert abs(active_param_count(shape) - active) <= rounding / 2


def test_moe_flops_count_the_routed_experts_and_the_router():
    """A token through k experts of width F costs what one dense MLP of width k F does, plus the
    router's 2 D E per layer (x 3 for training); a dense model's count is unchanged."""
    dense = dataclasses.replace(MOE, experts=0, ffn=MOE.ffn * MOE.experts_per_token)
    extra = model_flops_per_token(MOE) - model_flops_per_token(dense)
    assert extra == pytest.approx(3 * MOE.layers * 2 * MOE.width * MOE.experts)
    assert active_param_count(dense) == param_count(dense)


def test_expert_weights_shard_over_ep_and_their_state_with_them():
    """ep holds experts / ep of each layer's experts (the router and attention whole); the predicted
    parameters, gradients and optimizer state shrink by the experts' share."""
    expert = 3 * MOE.width * MOE.ffn
    assert layer_params(MOE, 1, 1) - layer_params(MOE, 1, 4) == pytest.approx(expert * MOE.experts * 3 / 4)
    cluster, job = Cluster(hardware=H100, devices=8), Job(global_batch=8)
    one = predict(MOE, Layout(dp=8), cluster, job)
    four = predict(MOE, Layout(dp=2, ep=4), cluster, job)
    saved = MOE.layers * expert * MOE.experts * 3 / 4 * 16  # 2 + 2 + 12 bytes a parameter
    state = lambda p: p.memory["parameters"] + p.memory["gradients"] + p.memory["optimizer"]  # noqa: E731
    assert state(one) - state(four) == pytest.approx(saved)


# -- the traffic of the new axes -------------------------------------------------------------------


def test_expert_all_to_all_is_dispatch_and_combine_forward_and_backward():
    """Per MoE layer and micro-batch: 4 all-to-alls (dispatch and combine, forward and backward) of
    k x capacity x tokens x D activations, (ep - 1) / ep of each leaving the device (the chapter's
    table); 6 under layer remat (the forward recomputed)."""
    cluster, job = Cluster(hardware=H100, devices=8), Job(global_batch=8)
    for remat, count in (("none", 4), ("layer", 6)):
        p = predict(MOE, Layout(dp=2, ep=4, remat=remat), cluster, job)
        tokens = MOE.seq  # one sequence a micro-batch
        size = tokens * MOE.experts_per_token * MOE.capacity_factor * MOE.width * 2
        assert p.comm_bytes["expert"] == pytest.approx(p.microbatches * count * MOE.layers * 3 / 4 * size)
    assert "expert" not in predict(MOE, Layout(dp=8), cluster, job).comm_bytes


def test_ring_context_passes_kv_blocks_and_hides_behind_attention():
    """Ring: per layer, cp - 1 K/V blocks forward and twice that backward (K/V and dK/dV), each a
    collective-permute of the device's chunk; at 8192 tokens a device the attention hides them, so
    only the overlap tax's share shows. All-to-all: Q, K, V and the output, (cp - 1) / cp each."""
    shape = dataclasses.replace(preset("llama3-8b"), seq=65536)
    cluster = Cluster(hardware=H100, devices=64)
    ring = predict(shape, Layout(dp=8, cp=8), cluster, Job(global_batch=8))
    chunk = shape.seq // 8
    kv = shape.kv_heads * shape.head_dim
    block = chunk * 2 * kv * 2
    assert ring.comm_bytes["context"] == pytest.approx(ring.microbatches * shape.layers * 3 * 7 * block)
    assert ring.crosses_hosts["context"] is False  # 8 devices 1 apart: one host, NVLink
    raw = ring.comm_bytes["context"] / H100.intra_host_bytes_per_s
    assert ring.parts["comm_context"] < raw < ring.parts["compute"]
    a2a = predict(shape, Layout(dp=8, cp=8), cluster, Job(global_batch=8, context_attention="all-to-all"))
    q = shape.heads * shape.head_dim
    size = chunk * (2 * q + 2 * kv) * 2
    assert a2a.comm_bytes["context"] == pytest.approx(a2a.microbatches * shape.layers * 3 * 7 / 8 * size)


def test_context_splits_activations_and_checks_its_chunks():
    shape = dataclasses.replace(preset("llama3-8b"), seq=65536)
    """A device holds seq / cp tokens of a sequence: its activations are 1 / cp of a whole sequence's."""
    cluster, job = Cluster(hardware=H100, devices=8), Job(global_batch=8)
    one, eight = predict(shape, Layout(dp=8), cluster, job), predict(shape, Layout(cp=8), cluster, job)
    assert one.memory["activations"] == pytest.approx(8 * eight.memory["activations"])
    assert eight.microbatches == 8 and one.microbatches == 1
    odd = dataclasses.replace(shape, seq=65536 + 8)  # not 2 x cp balanced chunks
    assert "2*cp" in predict(odd, Layout(cp=8), cluster, job).why
    assert "no experts" in predict(shape, Layout(ep=8), cluster, Job(global_batch=8)).why
    six = dataclasses.replace(MOE, experts=6)
    assert "does not divide experts=6" in predict(six, Layout(dp=2, ep=4), cluster, Job(global_batch=8)).why


# -- layouts and meshkit's plans -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "zero", "name", "mesh"),
    [
        ("cp=8", 0, "cp", "context=8"),
        ("dp=2,cp=4", 0, "dp+cp", "data=2,context=4"),
        ("dp=2,cp=4", 3, "fsdp+cp", "data=2,context=4"),
        ("ep=8", 0, "ep", "expert=8"),
        ("dp=2,ep=4", 0, "dp+ep", "data=2,expert=4"),
    ],
)
def test_layouts_convert_to_the_context_and_expert_plans(text, zero, name, mesh):
    """``--layout ...,cp=..,ep=..`` parses; ``to_spec`` names the plan (cp, dp+cp, fsdp+cp, ep, dp+ep);
    a plan meshkit does not have yet is refused in one line naming it."""
    lay = Layout.parse(text, zero=zero)
    assert lay.plan_name() == name and lay.mesh_spec() == mesh
    if name in PLANS:
        spec = lay.to_spec(8)
        assert spec.plan == name and spec.mesh == mesh
    else:
        with pytest.raises(Exception, match=rf"no plan {re.escape(name)} for") as err:
            lay.to_spec(8)
        assert "\n" not in str(err.value)


def test_a_layout_part_not_a_degree_is_one_line():
    with pytest.raises(Exception, match="degrees dp, tp, pp, cp, ep"):
        Layout.parse("dp=2,xp=4")


@pytest.mark.parametrize("bad", [{"tp": 2.5}, {"dp": True}, {"zero": 3.0}, {"microbatch_size": 0}])
def test_a_degree_that_is_no_whole_number_is_refused_not_truncated(bad):
    """``Layout(tp=2.5)`` was a layout of tp=2 (``int`` truncates): a degree, a stage and a size must be whole
    numbers (a bool is none), and at least 1."""
    name, value = next(iter(bad.items()))
    with pytest.raises(
        Exception, match=rf"layout {name}={value!r}: (give a whole number|must be at least 1)"
    ):
        Layout(**bad)


# -- published runs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    return load(CORPUS)[0]


def test_llama3_long_context_phase_is_checked(runs):
    """Llama 3 405B's 131k-token phase (Dubey et al. 2024, Table 4: TP 8, CP 16, PP 16, 38% MFU) is a
    check run with cp 16 (not left out), inside the check band of every check run
    (``test_planner_scale.CHECK_BOUND``), and its context traffic hides behind attention."""
    from test_planner_scale import CHECK_BOUND

    (row,) = [r for r in runs if r.layout.cp > 1]
    assert row.split == "check" and row.layout.cp == 16 and row.shape.seq == 131072
    p = row.predict()
    assert p.fits and CHECK_BOUND[0] <= row.ratio() <= CHECK_BOUND[1]
    assert p.parts["comm_context"] < 0.1 * p.parts["compute"]


def test_moe_runs_are_extrapolated_within_their_band(runs):
    """Qwen3-30B-A3B (16 H100, EP 8) and Qwen3-235B-A22B (256 H100, EP 32 folded) from NeMo's
    published performance table: predicted / published inside ``EXTRAPOLATE_BOUND``."""
    moe = {r.name: r.ratio() for r in runs if r.shape.experts}
    assert len(moe) >= 2 and all(r.split == "extrapolate" for r in runs if r.shape.experts)
    assert all(r.layout.ep > 1 for r in runs if r.shape.experts)
    off = {k: round(v, 3) for k, v in moe.items() if not EXTRAPOLATE_BOUND[0] <= v <= EXTRAPOLATE_BOUND[1]}
    assert not off, off


# -- the command -----------------------------------------------------------------------------------


def test_plan_ranks_expert_layouts_for_mixtral(capsys):
    code, out, _ = run(capsys, "plan", "--model", "mixtral-8x7b", "--seq", "4096", "--devices", "64",
                       "--global-batch", "256", "--top", "40", "--json")  # fmt: skip
    assert code == 0
    layouts = json.loads(out)["layouts"]
    assert any(x["layout"]["ep"] > 1 for x in layouts[:5])
    assert all(8 % x["layout"]["ep"] == 0 for x in layouts)
    assert all("expert" in x["comm_bytes"] for x in layouts if x["layout"]["ep"] > 1)
    code, out, _ = run(capsys, "plan", "--model", "mixtral-8x7b", "--seq", "4096", "--devices", "64",
                       "--global-batch", "256", "--top", "3")  # fmt: skip
    assert code == 0 and "12.88 B active" in out
    header = next(line for line in out.splitlines() if "layout" in line)
    assert " cp " in header and " ep " in header


def test_plan_chooses_context_parallelism_for_long_sequences(capsys):
    """llama3-8b at 131072 tokens, 8 sequences on 64 H100: the best layout splits the sequence 8 ways,
    and is faster than the best that does not (tensor parallelism over the host)."""
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--seq", "131072", "--devices", "64",
                       "--global-batch", "8", "--top", "2000", "--json")  # fmt: skip
    assert code == 0
    layouts = json.loads(out)["layouts"]
    best, plain = layouts[0], next(x for x in layouts if x["layout"]["cp"] == 1)
    assert best["layout"]["cp"] > 1 and best["step_time_s"] < plain["step_time_s"]
    assert all(131072 // x["layout"]["cp"] >= CONTEXT_MIN_TOKENS for x in layouts)


def test_plan_one_context_layout_and_the_meshkit_runtime_note(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--seq", "65536", "--devices", "64",
                       "--global-batch", "8", "--layout", "dp=8,cp=8", "--runtime", "meshkit")  # fmt: skip
    assert code == 0
    assert "prices layouts with context (cp) or expert (ep) axes with the analytic model" in out
    assert any(line.split("│")[1].strip() == "context" for line in out.splitlines() if line.count("│") > 3)
    code, _, err = run(capsys, "plan", "--model", "llama3-8b", "--layout", "dp=2,ep=4", "--devices", "8")
    assert code == 2 and "has no experts" in err and len(err.strip().splitlines()) == 1


def test_plan_auto_keeps_to_layouts_meshkits_runtime_prices():
    """``--plan auto`` chooses among the layouts meshkit's runtime model prices: a context layout,
    which meshkit runs (plan dp+cp) but prices only analytically, is not one of them yet."""
    from meshkit.planner.auto import runnable

    shape = dataclasses.replace(preset("gpt2-124m"), seq=16384)
    assert Layout(dp=2, cp=4).meshkit_plan() == "dp+cp" and not runnable(Layout(dp=2, cp=4), shape)
    assert runnable(Layout(dp=8), shape)


def test_plan_takes_a_custom_moe_shape_and_context_attention(capsys):
    """--experts / --experts-per-token make any shape a mixture of experts; --context-attention
    all-to-all prices Ulysses' form; bad values are one line and exit 2."""
    base = ["plan", "--layers", "8", "--width", "1024", "--heads", "16", "--vocab", "32000", "--seq", "8192",
            "--gated", "--ffn", "2048", "--devices", "8", "--global-batch", "8"]  # fmt: skip
    code, out, _ = run(
        capsys, *base, "--experts", "8", "--experts-per-token", "2", "--layout", "ep=8", "--json"
    )
    assert code == 0
    (one,) = json.loads(out)["layouts"]
    assert one["layout"]["ep"] == 8 and one["comm_bytes"]["expert"] > 0
    code, out, _ = run(capsys, *base, "--layout", "dp=4,cp=2", "--context-attention", "all-to-all", "--json")
    assert code == 0 and json.loads(out)["job"]["context_attention"] == "all-to-all"
    for extra, words in ((["--experts", "1"], "experts=1"), (["--context-attention", "ulysses"], "ulysses"),
                         (["--experts", "8", "--capacity-factor", "-1"], "--capacity-factor")):  # fmt: skip
        code, _, err = run(capsys, *base, *extra)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name", [n for n in PLANS if n != "zero3"])
def test_a_spec_and_its_layout_convert_both_ways(name):
    """``Layout.from_spec`` and ``Layout.to_spec`` are one conversion each way: every plan on its default
    mesh of 8 devices comes back as the same plan with the same degree on every axis (``zero3`` comes
    back by its other name, ``fsdp``)."""
    from meshkit.spec import ParallelSpec

    spec = ParallelSpec(plan=name)
    layout = Layout.from_spec(spec, 8, 16)
    back = layout.to_spec(16)
    assert back.plan == name and back.degrees(8) == spec.degrees(8), (layout, back)
    assert layout.devices == 8 and layout.meshkit_plan() == name


def test_a_new_axis_is_priced_from_its_row_and_its_module_with_no_planner_edit(monkeypatch):
    """The planner's dry run of a new axis: a row that splits rows and a module whose ``flows`` says what it
    moves and whose ``check_layout`` refuses a degree. ``Layout`` takes its degree by the row's token, the
    batch and the ZeRO group span it, and ``predict`` prices and reports it under its mesh axis, with no
    line of the planner changed; the search tries the degrees the module proposes (issue 49)."""
    from meshkit.planner.network import collective_latency
    from meshkit.plans.axes import AXIS_PLANS, AxisPlan, Flow
    from meshkit.spec import AXIS_RULES, AxisRule
    from meshkit.spec import plans as spec_plans

    toy = AxisRule(token="xp", axis="pod", field="pod", words="toy pods", splits="rows", fills=0)
    monkeypatch.setattr(spec_plans, "AXIS_RULES", (*AXIS_RULES, toy))
    moved = 3e8

    class Pod(AxisPlan):
        axis = "pod"

        def flows(self, step):
            n = step.layout.degree("pod")
            if n == 1:
                return []
            return [
                Flow(axis="pod", op="all-reduce", nbytes=moved, count=2, stride=step.inner("pod"), size=n)
            ]

        def check_layout(self, shape, layout, job):
            return "xp=3: the toy pods pair up" if layout.xp == 3 else None

        def search_degrees(self, shape, cluster, job, devices):
            return [d for d in (1, 2) if devices % d == 0]

    monkeypatch.setitem(AXIS_PLANS, "pod", Pod())
    lay = Layout.parse("dp=2,xp=4", zero=1)
    assert (lay.xp, lay.devices, lay.batch_ways, lay.inner("pod")) == (4, 8, 8, 2)
    assert lay.mesh_spec() == "pod=4,data=2" and "xp=4" in lay.label() and lay.plan_name() == "zero1+xp"
    shape = ModelShape(layers=4, width=512, heads=8, vocab=1000, seq=256)
    cluster = Cluster(hardware=H100, devices=8)
    p = predict(shape, lay, cluster, Job(global_batch=16))
    assert p.valid, p.why
    assert p.comm_bytes["pod"] == moved and p.crosses_hosts["pod"] is False and p.microbatches == 2
    latency = 2 * collective_latency(cluster, "all-reduce", 2, 4)
    assert p.parts["comm_pod"] == pytest.approx(moved / H100.intra_host_bytes_per_s + latency)
    plain = predict(shape, Layout(dp=8, zero=1), cluster, Job(global_batch=16))  # the ZeRO group: dp x xp
    assert p.memory["optimizer"] == pytest.approx(plain.memory["optimizer"])
    assert p.comm_bytes["data"] == pytest.approx(plain.comm_bytes["data"])
    refused = predict(shape, Layout(dp=2, xp=3), Cluster(hardware=H100, devices=6), Job(global_batch=12))
    assert not refused.valid and refused.why == "xp=3: the toy pods pair up"
    from meshkit.planner import search

    found = search(shape, cluster, Job(global_batch=16))  # the search tries the degrees the module proposes
    assert {p.layout.xp for p in found.ranked} == {1, 2}
