"""The analytic planner (``meshkit.planner``): its counts against independent ones (the reference
GPT's own parameters, Korthikanti et al.'s activation formula, meshkit's schedule tables, the ZeRO
formulas of ``meshkit budget``), its throughput against published training runs, and ``meshkit plan``.

No JAX compile here: the planner is arithmetic (``jax.eval_shape`` of the GPT's init is the only JAX)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from meshkit.cli import main
from meshkit.planner import Cluster, Job, Layout, ModelShape, hardware, predict, search
from meshkit.planner.calibrate import load
from meshkit.planner.sizes import in_flight, layer_activation_bytes, model_flops_per_token, param_count
from meshkit.plans._schedule import build

CORPUS = Path(__file__).parent / "corpus" / "published_runs.json"
SMALL = ModelShape(name="small", layers=4, width=64, heads=4, vocab=101, seq=32)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def runs():
    used, skipped = load(CORPUS)
    return used, skipped


# -- counts against independent ones ---------------------------------------------------------------


def _gpt_leaves(shape: ModelShape) -> list:
    from meshkit.models import gpt

    cfg = gpt.GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq, layers=shape.layers, width=shape.width,
                        heads=shape.heads, mlp_ratio=shape.ffn // shape.width)  # fmt: skip
    return jax.tree.leaves(jax.eval_shape(lambda: gpt.init(jax.random.key(0), cfg)))


@pytest.mark.parametrize("shape", [SMALL, ModelShape(layers=3, width=96, heads=6, vocab=77, seq=40, ffn=192)])
def test_parameter_count_is_the_reference_gpts(shape):
    leaves = _gpt_leaves(shape)
    assert param_count(shape) == sum(int(np.prod(x.shape)) for x in leaves)


def test_model_flops_are_6_per_matrix_parameter_plus_attention():
    """3 x forward: 2 FLOPs per matrix parameter and token (the token embedding is a lookup, the
    position table no matmul) and 2 x 2 S D per layer for scores and values."""
    leaves = _gpt_leaves(SMALL)
    matrices = sum(int(np.prod(x.shape)) for x in leaves if len(x.shape) == 2)
    lookups = (SMALL.vocab + SMALL.seq) * SMALL.width  # tok_embed and pos_embed (2-D, no matmul)
    expected = 6 * (matrices - lookups) + 12 * SMALL.layers * SMALL.seq * SMALL.width
    assert model_flops_per_token(SMALL) == expected


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_activations_are_korthikantis_formula(tp):
    """Without sequence parallelism, with dropout and a stored S x S softmax, a GPT layer keeps
    s b h (10 + 24/t + 5 a s / (h t)) bytes (Korthikanti et al. 2022, eq. 2)."""
    shape = ModelShape(layers=4, width=1024, heads=16, vocab=1000, seq=512)
    job = Job(global_batch=8, sequence_parallel=False, dropout=True, flash_attention=False)
    full, _, layer_in = layer_activation_bytes(shape, Layout(tp=tp, microbatch_size=2), job)
    s, b, h, a = shape.seq, 2, shape.width, shape.heads
    assert full == pytest.approx(s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)))
    assert layer_in == 2 * s * b * h
    sp = dataclasses.replace(job, sequence_parallel=True)  # Korthikanti eq. 4: sbh (34/t + 5as/(ht))
    full_sp = layer_activation_bytes(shape, Layout(tp=tp, microbatch_size=2), sp)[0]
    assert full_sp == pytest.approx(s * b * h / tp * (34 + 5 * a * s / h))


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"),
    [("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1), ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3)],
)
def test_micro_batches_in_flight_are_meshkits_schedule_tables(schedule, p, m, v):
    layers = p * v * 2
    lay = Layout(pp=p, schedule=schedule, virtual_stages=v)
    chunk = layers // (p * v)
    assert in_flight(lay, layers, m) == chunk * build(schedule, p, m, v).x_slots


def test_bubble_is_meshkits():
    from meshkit.analysis import bubble
    from meshkit.plans import bubble_model

    shape = ModelShape(layers=16, width=256, heads=8, vocab=1000, seq=128)
    cluster = Cluster(hardware=hardware("a100-80gb"), devices=16)
    for sched, v in (("1f1b", 1), ("interleaved", 2)):
        lay = Layout(dp=2, pp=8, schedule=sched, virtual_stages=v)
        p = predict(shape, lay, cluster, Job(global_batch=32))
        assert p.microbatches == 16 and p.bubble == bubble_model(8, 16, v)
        assert p.parts["bubble"] == pytest.approx(
            (p.parts["compute"] + p.parts["comm_model"] + p.parts["comm_stage"]) * p.bubble / (1 - p.bubble)
        )
    assert bubble_model(8, 16) == bubble(8, 16)


def test_budget_and_plan_agree(capsys):
    """``meshkit budget``'s four ZeRO rows are ``plan``'s parameters, gradients and optimizer state
    for the same model on one data axis (one convention: mixed-precision Adam, 2 + 2 + 12)."""
    n, shape = 64, ModelShape(layers=24, width=2048, heads=16, vocab=50257, seq=2048)
    code, out, _ = run(capsys, "budget", "--params", str(param_count(shape)), "--devices", str(n), "--json")
    rows = {r["stage"]: r for r in json.loads(out)["rows"]}
    cluster = Cluster(hardware=hardware("h100"), devices=n)
    for zero, stage in enumerate(("dp", "zero1", "zero2", "zero3")):
        p = predict(shape, Layout(dp=n, zero=zero), cluster, Job(global_batch=n))
        assert code == 0 and p.valid
        for ours, theirs in (("parameters", "params"), ("gradients", "grads"), ("optimizer", "optimizer")):
            assert p.memory[ours] == pytest.approx(rows[stage][theirs], rel=1e-12)
        # gradient-sync bytes: the ring model of the same table (one micro-batch: no accumulation)
        assert p.comm_bytes["data"] == pytest.approx(rows[stage]["traffic_bytes"], rel=1e-12)


def test_tensor_parallel_bytes_are_the_ring_model():
    """Standard runtime: 2 forward + 2 backward all-reduces of b s h per layer (+2 under full
    recompute), plus the vocab-parallel embedding and unembedding, each 2 (t-1)/t of its size."""
    shape = ModelShape(layers=4, width=512, heads=8, vocab=1000, seq=256)
    cluster = Cluster(hardware=hardware("h100"), devices=8)
    for remat, per_layer in (("none", 4), ("layer", 6)):
        p = predict(shape, Layout(tp=8, microbatch_size=2, remat=remat), cluster, Job(global_batch=4))
        size = 2 * shape.seq * shape.width * 2  # micro-batch 2, bf16
        assert p.comm_bytes["model"] == pytest.approx(2 * (4 * per_layer + 2) * 2 * 7 / 8 * size)
        assert not p.crosses_hosts["model"]


def test_groups_cross_hosts_where_they_span_them():
    shape = ModelShape(layers=8, width=512, heads=8, vocab=1000, seq=256)
    cluster = Cluster(hardware=hardware("a100-80gb"), devices=64)
    p = predict(shape, Layout(dp=8, tp=8), cluster, Job(global_batch=64))
    assert p.crosses_hosts == {"data": True, "model": False}  # the axes the layout uses
    p = predict(shape, Layout(dp=4, tp=2, pp=8), cluster, Job(global_batch=64))
    assert p.crosses_hosts == {"data": False, "model": False, "stage": True}


# -- published runs --------------------------------------------------------------------------------


def test_corpus_rows_are_sourced(runs):
    used, skipped = runs
    rows = json.loads(CORPUS.read_text())
    assert all(r["source"] and r["quote"] and r["stack_note"] for r in rows)
    assert len(used) >= 6 and all(why for _, why in skipped)
    assert {r.family for r in used} == {"gpu-ampere", "gpu-hopper", "tpu"}


# -- search ----------------------------------------------------------------------------------------


def test_search_ranks_fitting_layouts_and_keeps_reasons():
    shape = ModelShape(layers=32, width=4096, heads=32, vocab=50257, seq=2048)
    result = search(shape, Cluster(hardware=hardware("a100-40gb"), devices=16), Job(global_batch=64))
    times = [p.step_time_s for p in result.ranked]
    assert result.ranked and all(p.fits for p in result.ranked) and times == sorted(times)
    assert result.rejected and all(p.why for p in result.rejected)
    assert all(
        p.layout.devices == 16 and p.layout.tp <= 8 and shape.heads % p.layout.tp == 0 for p in result.ranked
    )
    assert sum(n for _, n in result.reasons()) == len(result.rejected)


def test_layout_checks():
    cluster = Cluster(hardware=hardware("h100"), devices=8)
    job = Job(global_batch=12)
    for lay, words in (
        (Layout(dp=4), "not the 8 devices"),
        (Layout(tp=8, dp=1), None),
        (Layout(dp=1, tp=8, pp=1, zero=3), "shards nothing"),
        (Layout(dp=2, pp=4, schedule="interleaved", virtual_stages=2), "groups of pp"),
    ):
        p = predict(ModelShape(layers=8, width=64, heads=8, vocab=10, seq=8), lay, cluster, job)
        assert (p.why is None) == (words is None) and (words is None or words in p.why)


# -- the command -----------------------------------------------------------------------------------


def test_plan_json_ranks_and_plots(capsys, tmp_path):
    code, out, _ = run(capsys, "plan", "--model", "gpt2-124m", "--devices", "16", "--hardware", "a100-40gb",
                       "--global-batch", "64", "--top", "5", "--json", "--out", str(tmp_path))  # fmt: skip
    assert code == 0
    data = json.loads(out)
    layouts = data["layouts"]
    assert len(layouts) == 5 and data["fitting"] >= 5
    for key in ("layout", "fits", "peak_bytes", "step_time_s", "tokens_per_s", "mfu", "parts"):
        assert all(key in x for x in layouts)
    assert {"compute", "comm_model", "comm_data", "comm_stage", "bubble"} <= set(layouts[0]["parts"])
    assert [x["step_time_s"] for x in layouts] == sorted(x["step_time_s"] for x in layouts)
    assert (tmp_path / "plan.png").stat().st_size > 1000
    assert json.loads((tmp_path / "plan.json").read_text())["layouts"] == layouts


def test_plan_one_layout_table(capsys):
    code, out, _ = run(capsys, "plan", "--layers", "24", "--width", "2048", "--heads", "16", "--vocab", "51200",
                       "--seq", "2048", "--devices", "64", "--devices-per-host", "8", "--hardware", "a100-80gb",
                       "--global-batch", "512", "--layout", "dp=4,tp=8,pp=2", "--microbatch-size", "1",
                       "--schedule", "interleaved", "--remat", "full", "--zero", "0")  # fmt: skip
    assert code == 0
    assert "dp=4,tp=8,pp=2 mb=1 interleavedx2 remat=layer" in out and "Memory per device" in out
    assert "crosses hosts" in out and "MFU" in out


def test_plan_one_layout_json_megatron_style(capsys):
    """The hidden check's form of command: one layout, interleaved, full recompute."""
    code, out, _ = run(capsys, "plan", "--layout", "dp=8,tp=8,pp=4", "--microbatch-size", "1", "--schedule",
                       "interleaved", "--remat", "full", "--zero", "0", "--hardware", "a100-80gb", "--devices",
                       "256", "--devices-per-host", "8", "--global-batch", "512", "--layers", "48", "--width",
                       "6144", "--heads", "48", "--vocab", "51200", "--seq", "2048", "--json")  # fmt: skip
    assert code == 0
    (p,) = json.loads(out)["layouts"]
    assert p["fits"] and p["layout"]["virtual_stages"] == 2 and p["layout"]["remat"] == "layer"
    assert 0.2 < p["mfu"] < 0.7 and p["hardware_tflops_per_device"] > p["model_tflops_per_device"]
    assert math.isclose(p["tokens_per_s"] * p["step_time_s"], 512 * 2048)
    # without a pipeline the schedule means nothing: the same flags still evaluate the layout
    code, out, _ = run(capsys, "plan", "--layout", "dp=32,tp=1,pp=1", "--schedule", "interleaved", "--remat", "full",
                       "--hardware", "a100-80gb", "--devices", "32", "--global-batch", "512", "--layers", "24",
                       "--width", "2048", "--heads", "16", "--vocab", "51200", "--seq", "2048", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["layouts"][0]["layout"]["virtual_stages"] == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-65b", "--devices", "8", "--hardware", "a100-40gb", "--global-batch", "64"],
         "x too large"),
        (["--model", "gpt2-124m", "--hardware", "mi300x"], "unknown hardware 'mi300x'"),
        (["--model", "gpt2-124m", "--devices", "12", "--devices-per-host", "8"], "not a whole number of hosts"),
        (["--model", "gpt2-124m", "--devices", "8", "--layout", "dp=3,tp=3"], "cannot run"),
        (["--model", "gpt2-124m", "--devices", "8", "--layout", "dp=2,tp=5"], "cannot run"),
        (["--layers", "4"], "missing --width"),
        (["--model", "nope"], "unknown model 'nope'"),
        (["--model", "gpt2-124m", "--layout", "dp=x"], "bad layout part"),
        (["--model", "gpt2-124m", "--hardware", "custom"], "custom hardware needs --peak-tflops"),
    ],
)  # fmt: skip
def test_plan_bad_input_one_line_exit_2(capsys, argv, message):
    code, _, err = run(capsys, "plan", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_plan_custom_hardware(capsys):
    code, out, _ = run(capsys, "plan", "--model", "gpt2-124m", "--devices", "8", "--hardware", "custom",
                       "--peak-tflops", "100", "--memory-gb", "24", "--hbm-gbps", "1000", "--intra-gbps", "50",
                       "--inter-gbps", "10", "--global-batch", "32", "--top", "3", "--json")  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert data["cluster"]["hardware"]["peak_flops"] == 100e12 and all(x["fits"] for x in data["layouts"])


USER_MODEL = """
import jax
from meshkit.models import gpt
from meshkit.planner import ModelShape

def shape():
    return ModelShape(name="mine", layers=6, width=256, heads=8, vocab=1000, seq=128)

def params():  # a user's model as meshkit's GPT parameters, abstract (nothing allocated)
    cfg = gpt.GPTConfig(vocab_size=1000, seq_len=128, layers=6, width=256, heads=8, scan_layers=True)
    return jax.eval_shape(lambda: gpt.init(jax.random.key(0), cfg))

def listed():
    cfg = gpt.GPTConfig(vocab_size=1000, seq_len=128, layers=6, width=256, heads=8)
    return jax.eval_shape(lambda: gpt.init(jax.random.key(0), cfg))

def other():
    return 3

def broken():
    raise ValueError("no weights here")
"""


@pytest.fixture
def user_model(tmp_path, monkeypatch):
    (tmp_path / "planner_user_model.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "planner_user_model"
    import sys

    sys.modules.pop("planner_user_model", None)


@pytest.mark.parametrize("target", ["shape", "params", "listed"])
def test_plan_a_user_model_target(capsys, user_model, target):
    extra = [] if target == "shape" else ["--heads", "8"]
    code, out, err = run(capsys, "plan", "--model", f"{user_model}:{target}", *extra, "--devices", "8",
                         "--global-batch", "16", "--top", "2", "--json")  # fmt: skip
    assert code == 0, err
    model = json.loads(out)["model"]
    want = {"layers": 6, "width": 256, "heads": 8, "vocab": 1000, "seq": 128, "ffn": 1024}
    assert {k: model[k] for k in want} == want


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [
        ("params", [], "do not record the heads: pass --heads"),
        ("other", [], "returned int: return a meshkit.planner.ModelShape"),
        ("broken", [], "raised ValueError: no weights here"),
        ("missing", [], "has no attribute 'missing'"),
    ],
)
def test_plan_a_bad_user_target_one_line_exit_2(capsys, user_model, target, extra, message):
    code, _, err = run(capsys, "plan", "--model", f"{user_model}:{target}", *extra, "--devices", "8")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_plan_an_unimportable_target_one_line_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "plan", "--model", "no_such_module_here:fn", "--devices", "8")
    assert (
        code == 2
        and "cannot import module 'no_such_module_here'" in err
        and len(err.strip().splitlines()) == 1
    )


# -- meshkit's own programs (Job(runtime="meshkit")) -------------------------------------------------


@pytest.mark.parametrize(("dp", "tp", "zero"), [(8, 1, 0), (8, 1, 1), (8, 1, 2), (8, 1, 3), (4, 2, 0)])
def test_meshkit_runtime_agrees_with_the_plans_models(dp, tp, zero):
    """Parameters and optimizer state are ``plans.memory_formula``'s, data-axis bytes
    ``plans.expected_collectives``' (zero3: all-gathers of the step's leaves and the layers'),
    for meshkit's scanned GPT with AdamW laid out by the plan on 8 devices."""
    import optax

    from meshkit.mesh import make_mesh
    from meshkit.models import gpt
    from meshkit.plans import expected_collectives, memory_formula, place
    from meshkit.plans._fsdp import PerLayer
    from meshkit.plans._layers import analyse
    from meshkit.spec import get_plan

    shape = SMALL
    lay = Layout(dp=dp, tp=tp, zero=zero)
    cfg = gpt.GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq, layers=shape.layers, width=shape.width,
                        heads=shape.heads, scan_layers=True)  # fmt: skip
    params = jax.eval_shape(lambda: gpt.init(jax.random.key(0), cfg))
    mesh = make_mesh(lay.mesh_spec(), axis_types="auto")
    plan_layout = place(params, get_plan(lay.meshkit_plan()), mesh, logical_axes=gpt.logical_axes(params),
                              units={"heads": shape.heads})  # fmt: skip
    formula = memory_formula(plan_layout, optax.adamw(1e-3), params)
    job = Job(global_batch=16, precision="fp32", runtime="meshkit")
    p = predict(shape, lay, Cluster(hardware=hardware("h100"), devices=8), job)
    assert p.memory["parameters"] == pytest.approx(formula["params"], rel=0.01)
    assert p.memory["optimizer"] == pytest.approx(formula["optimizer"], rel=0.01)
    per = PerLayer(placement=plan_layout, remat="none")
    tokens = jax.ShapeDtypeStruct((2, shape.seq), jax.numpy.int32)
    per.found = analyse(lambda q, extra: (gpt.make_loss(cfg)(q, extra[1]), None), plan_layout, params,
                        (None, (tokens, tokens), None))  # fmt: skip
    expected = expected_collectives(plan_layout, 2 // lay.microbatch_size, tokens_per_device=2 * shape.seq,
                                    per_layer=per)  # fmt: skip
    data = sum(e.traffic_bytes for e in expected if e.axes == "data")
    assert p.comm_bytes["data"] == pytest.approx(data, rel=0.05)


def test_kept_residuals_leave_out_the_dead_scores_and_the_causal_mask():
    """What a compiled scan keeps of one block's residuals: JAX's list less the masked float32
    scores the backward never reads and the causal mask (iotas only), exactly their bytes."""
    from meshkit.planner.runtime import residuals

    shape = ModelShape(name="t", layers=2, width=64, heads=4, vocab=97, seq=16)
    for precision in ("fp32", "bf16"):
        kept = residuals(shape, 2, 1, precision, "none", kept=True)
        every = residuals(shape, 2, 1, precision, "none", kept=False)
        scores = 2 * shape.heads * shape.seq * shape.seq  # (batch 2, heads, seq, seq)
        assert every[0] - kept[0] == scores * 4 + scores * 1  # float32 scores, bool mask
        assert kept[1:3] == every[1:3]  # the weights' compute copies, the layer input: unchanged
        assert 0 < kept[3] <= every[3]  # the head and loss
        # under layer remat a block keeps nothing but its input (an argument, not counted)
        assert residuals(shape, 2, 1, precision, "layer")[0] == 0.0


def test_residuals_trace_a_block_once_whatever_the_tp_split_and_kept(monkeypatch):
    """The planner's runtime model asks for a block's residuals at every tp of its search (162 times
    for the 1.3 B GPT on 64 devices): one shape, batch, precision and remat is traced once (the block
    and the head: a forward and a backward jaxpr each), and the tp split is applied to what it found."""
    from meshkit.planner.runtime import residuals

    traced = []
    make_jaxpr = jax.make_jaxpr
    monkeypatch.setattr(jax, "make_jaxpr", lambda *a, **k: traced.append(1) or make_jaxpr(*a, **k))
    shape = ModelShape(name="traced once", layers=2, width=32, heads=4, vocab=64, seq=16)
    got = {
        (tp, kept): residuals(shape, 2, tp, "bf16", "none", kept)
        for tp in (1, 2, 4)
        for kept in (True, False)
    }
    assert len(traced) == 4, f"{len(traced)} jaxprs traced for one shape, batch, precision and remat"
    for (tp, kept), (_, weights, layer_input, _) in got.items():
        assert weights == got[1, kept][1] / tp > 0  # the matrices' bf16 copies, split over tp
        assert layer_input == got[1, kept][2]  # the block's input is not split
    assert got[1, True][0] < got[1, False][0]  # kept: the dead scores and the mask left out


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_the_runtime_model_traces_the_familys_own_block(family):
    """meshkit's own step's residuals come from the shape's family's block (issue 49): the compute copies
    of a Llama's or a Gemma's matrices are its SwiGLU's three and its grouped-query projections, in
    bfloat16, as the family's init makes them (the GPT stand-in had two MLP matrices and full-width keys)."""
    from meshkit.planner.runtime import residuals

    shape = ModelShape(name=family, family=family, layers=2, width=64, heads=4, kv_heads=2, head_dim=16,
                       vocab=97, seq=16, ffn=96, gated=True)  # fmt: skip
    d, f, q, kv = 64, 96, 4 * 16, 2 * 16
    _, weights, layer_input, _ = residuals(shape, 2, 1, "bf16", "none")
    assert weights == 2 * (2 * d * q + 2 * d * kv + 3 * d * f) and layer_input == 2 * 16 * 64 * 2


def test_meshkit_runtime_prices_a_mixture_of_experts():
    """``meshkit plan --runtime meshkit`` of a mixture of experts under a data plan: its memory from the
    GPT's MoE block (a KeyError before; no family runs a mixture of experts as ``Stages`` yet)."""
    shape = ModelShape(
        name="moe", layers=2, width=64, heads=4, vocab=97, seq=16, ffn=96, gated=True, experts=4
    )
    p = predict(shape, Layout(dp=8, zero=3), Cluster(hardware=hardware("h100"), devices=8),
                Job(global_batch=16, runtime="meshkit"))  # fmt: skip
    assert p.valid and p.fits and p.memory["activations"] > 0


def test_the_planners_parameter_count_is_each_familys_own():
    """``sizes.param_count`` of a shape equals the parameters its family's init makes (abstract), tied
    heads counted once (Llama 3.2's and Gemma's tables were counted twice), a mixture of experts with
    every expert; Gemma within its norms, which a ``ModelShape`` does not say (sandwich, q/k norms)."""
    from meshkit.models import registry

    base = dict(layers=3, width=64, heads=4, kv_heads=2, vocab=97, seq=32, ffn=96, gated=True)
    shapes = [
        ModelShape(name="g", family="gpt", layers=3, width=64, heads=4, vocab=97, seq=32),
        ModelShape(name="l", family="llama", **base),
        ModelShape(name="tied", family="llama", tie_embeddings=True, **base),
        ModelShape(name="moe", family="llama", experts=4, **base),
        ModelShape(name="gemma", family="gemma", head_dim=32, **{**base, "kv_heads": 1}),
    ]
    for shape in shapes:
        family = registry.family(shape.family)
        cfg = family.config.from_shape(shape)
        made = jax.eval_shape(lambda f=family, c=cfg: f.module.init(jax.random.key(0), c))
        count = sum(math.prod(x.shape) for x in jax.tree.leaves(made))
        assert param_count(shape) == pytest.approx(count, rel=0.01 if shape.family == "gemma" else 0), (
            shape.name
        )


def test_a_fused_attention_keeps_no_scores_in_the_runtime_model():
    """Under ``Job(flash_attention=True)`` in bfloat16 (splash on a TPU, cuDNN's flash on a GPU, on each
    device's heads under tp) meshkit's own step keeps no ``(seq, seq)`` scores, masks or probabilities, only each query's
    float32 log-sum-exp: the runtime model of a Llama
    3 8B step on 256 v6e chips (fsdp, 4 sequences of 8192, remat layer) fell from 70.8 GiB a chip to
    33.0 (XLA:TPU compiles it to 27.2, docs/measurements.md)."""
    from meshkit.planner.runtime import _traced, residuals

    shape = ModelShape(
        name="t", family="llama", layers=2, width=64, heads=4, vocab=97, seq=16, ffn=96, gated=True
    )
    block = _traced(shape, 2, "bf16", "none")[0]
    scores = sum(math.prod(d) * i for d, i, keeps in block if keeps and d[-2:] == (16, 16))
    assert scores > 0
    plain, fused = (residuals(shape, 2, 1, "bf16", "none", flash=f)[0] for f in (False, True))
    assert fused == plain - scores + 2 * 4 * 16 * 4  # the log-sum-exp: batch x heads x seq, float32
    job = Job(global_batch=16, precision="bf16", runtime="meshkit")
    cluster = Cluster(hardware=hardware("h100"), devices=8)
    xla = predict(shape, Layout(dp=8, zero=3), cluster, dataclasses.replace(job, flash_attention=False))
    splash = predict(shape, Layout(dp=8, zero=3), cluster, job)
    assert splash.memory["activations"] < xla.memory["activations"]
    # under tensor parallelism splash runs on each device's heads where they divide over the model axis
    tp = Layout(dp=4, tp=2, zero=3)
    unfused = dataclasses.replace(job, flash_attention=False)
    assert (
        predict(shape, tp, cluster, job).memory["activations"]
        < predict(shape, tp, cluster, unfused).memory["activations"]
    )
    # counted where the step runs XLA's attention: a key/value head on two devices, plain data parallelism
    # of one micro-batch (left to XLA's partitioner: ``plans.in_region``), float32 (no cuDNN flash)
    one_kv = dataclasses.replace(shape, kv_heads=1)
    for s, lay, j in (
        (one_kv, tp, job),
        (shape, Layout(dp=8), dataclasses.replace(job, global_batch=8)),
        (shape, Layout(dp=8, zero=3), dataclasses.replace(job, precision="fp32")),
    ):
        unfused = dataclasses.replace(j, flash_attention=False)
        assert predict(s, lay, cluster, j).memory == predict(s, lay, cluster, unfused).memory
