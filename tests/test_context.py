"""Context parallelism (``plans._context``): the sequence split over the context axis, attention as a
ring of K/V passes or as Ulysses' all-to-all. Each form equals one device in float64 for the GPT and
the Llama, its ledger equals the model, per-device activation memory falls with the split, and bad
input is one line with exit 2 through ``meshkit train``."""

import dataclasses
import functools
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from _limits import limit
from _reference import max_rel, one_device
from _tiers import tiered
from meshkit.models import gpt, llama
from meshkit.spec import ParallelSpec, PlanError
from meshkit.train import Trainer

MODELS = {
    "gpt": (gpt, gpt.GPTConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4)),
    "llama": (
        llama,
        llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64),
    ),
}

#: (model, plan, mesh, attention form): the ring over all 8 devices, and each form beside a data axis
#: (the Llama's grouped key/value heads: 2, repeated for all-to-all, passed as they are round the ring).
CASES = [
    ("gpt", "cp", "context=8", "ring"),
    ("llama", "dp+cp", "data=2,context=4", "ring"),
    ("gpt", "dp+cp", "data=2,context=4", "all-to-all"),
    ("llama", "dp+cp", "data=2,context=4", "all-to-all"),
    ("llama", "dp+cp", "data=4,context=2", "all-to-all"),  # kv heads 2 divide over context=2: not repeated
]


def _batch():
    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 17)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _model(name: str, dtype: str = "float32", compute_dtype: str | None = None):
    module, cfg = MODELS[name]
    cfg = dataclasses.replace(cfg, dtype=dtype, compute_dtype=compute_dtype)
    return module.make_loss(cfg), module.init(jax.random.key(0), cfg)


@functools.cache
def _one_device_float64(name: str, steps: int):
    loss, params = _model(name, "float64")
    return one_device(loss, params, _batch(), steps, optax.adam(1e-2))


def _trainer(name, plan, mesh, form, dtype="float32", compute_dtype=None, **options):
    loss, params = _model(name, dtype, compute_dtype)
    spec = ParallelSpec(plan=plan, mesh=mesh, context_attention=form, **options)
    units = llama.units(MODELS[name][1]) if name == "llama" else None  # heads, kv heads: the ledger's
    return Trainer(loss, params, optax.adam(1e-2), spec=spec, tokens_per_example=16, units=units)


# Tiers: sweeps, every case. dp+cp's all-to-all on the Llama (data=2,context=4: its rotary positions under a
# split, its kv heads repeated) is core in float64 against one device in test_packing.py's
# llama-dp+cp-data=2,context=4 (the same Llama and mesh, packed), its ledger against the model in
# test_packing.py's test_context_ledger_counts_the_segment_exchange[...all-to-all...] (the same mesh),
# kv heads as they are on context=2 in test_fsdp_axes.py's llama-all-to-all (both checks); the ring is core
# with the same checks (one device in float64, ledger = model) in test_axis_combos.py's meshkit verify --plan
# cp+tp certificate (the GPT's ring on context=4,model=2), one device in float64 in test_packing.py's
# gpt-dp+cp ring (its peak here, test_context_peak_is_within_ten_percent_of_the_model[gpt-cp-ring], sweeps); the
# GPT's all-to-all (the GPT under dp+cp: the ring's gpt-dp+cp-ring-accumulate2 below) and the other meshes
# and forms, cp's ring over context=8 among them, sweep.
@pytest.mark.sweep
@pytest.mark.parametrize(
    ("name", "plan", "mesh", "form"), CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES]
)
def test_context_plan_matches_one_device_in_float64_and_its_ledger_the_model(name, plan, mesh, form):
    with jax.enable_x64(True):
        t = _trainer(name, plan, mesh, form, "float64")
        for _ in range(2):
            t.step(_batch())
        assert max_rel(t.params, _one_device_float64(name, 2)) < 1e-10
    r = _trainer(name, plan, mesh, form).report(_batch())
    assert r.ok, str(r)
    rows = {(c.op, c.axes): c for c in r.communication}
    op = "collective-permute" if form == "ring" else "all-to-all"
    assert rows[op, "context"].ratio == pytest.approx(1.0, abs=1e-9)
    assert rows[op, "context"].measured_runs == rows[op, "context"].model_runs
    assert rows["all-reduce", "+".join(a for a in ("data", "context") if a in mesh)].ok
    if form == "all-to-all":  # per layer 4 all-to-alls of q, k, v, out forward, 4 backward, each (C-1)/C
        cfg, c = MODELS[name][1], int(mesh.split("context=")[1])
        local = 8 * 16 // (8 // c) // c * 4  # bytes per unit of width: this device's tokens of its rows
        kv = cfg.kv_heads if name == "llama" and cfg.kv_heads % c == 0 else cfg.heads
        head_dim = cfg.width // cfg.heads
        moved = cfg.layers * 4 * local * (cfg.heads + kv) * head_dim * (c - 1) // c
        assert rows[op, "context"].measured_traffic_bytes == moved


#: remat (both policies) and micro-batches under context plans, each beside one device in float64
UNDER = [
    ("gpt", "dp+cp", "data=2,context=4", "ring", {"remat": "layer"}),  # 4 passes: half context=8's step
    ("llama", "dp+cp", "data=2,context=4", "all-to-all", {"remat": "dots"}),
    ("gpt", "dp+cp", "data=2,context=4", "ring", {"accumulate": 2}),
]


# Tiers: micro-batches over the ring are core in gpt-dp+cp-ring-accumulate2; remat under a split (the
# all-to-alls recomputed, their ledger = model) is core in test_fsdp_axes.py's llama-all-to-all (layer
# remat), the dots policy in test_fsdp.py's zero2-gpt-scan-None-dots-2 certificate; both remat cases sweep.
@pytest.mark.parametrize(
    ("name", "plan", "mesh", "form", "options"),
    tiered(
        UNDER,
        ["gpt-dp+cp-ring-layer", "llama-dp+cp-all-to-all-dots", "gpt-dp+cp-ring-accumulate2"],
        core={"gpt-dp+cp-ring-accumulate2"},
    ),
)
def test_remat_and_accumulate_under_context_match_one_device_in_float64(name, plan, mesh, form, options):
    """Remat recomputes the ring's passes (or the all-to-alls) in the backward pass, and micro-batches
    split each device's rows: the result is still one device's, and under remat the ledger (the
    forward's permutes or all-to-alls twice) still the model."""
    with jax.enable_x64(True):
        t = _trainer(name, plan, mesh, form, "float64", **options)
        for _ in range(2):
            t.step(_batch())
        assert t.per_layer.remat == options.get("remat", "none")
        assert max_rel(t.params, _one_device_float64(name, 2)) < 1e-10
    if "remat" not in options:
        return
    r = _trainer(name, plan, mesh, form, **options).report(_batch())
    op = "collective-permute" if form == "ring" else "all-to-all"
    row = {(c.op, c.axes): c for c in r.communication}[op, "context"]
    assert row.measured_runs == row.model_runs and row.ratio == pytest.approx(1.0, abs=1e-9), str(r)


@pytest.mark.sweep  # bf16 compute is core beside a model axis (test_user_models.py) and under fsdp+tp (test_fuzz.py)
def test_bf16_under_context_is_as_close_to_float32_as_one_device_in_bf16():
    """bf16 compute (float32 parameters) under cp: its distance from one device's float32 run is within
    2x that of one device in bf16 (bf16's own rounding is the noise the split may not exceed), and
    above nothing (bf16 really ran)."""
    f32 = one_device(*_model("gpt"), _batch(), 2, optax.adam(1e-2))
    bf16 = one_device(*_model("gpt", compute_dtype="bfloat16"), _batch(), 2, optax.adam(1e-2))
    noise = max_rel(bf16, f32)
    t = _trainer("gpt", "cp", "context=8", "ring", compute_dtype="bfloat16")
    for _ in range(2):
        t.step(_batch())
    assert 0 < max_rel(t.params, f32) <= 2 * noise, (max_rel(t.params, f32), noise)


def test_bad_inputs_are_refused_with_the_fix():
    """Heads that do not divide over the context axis (all-to-all) and sequences that do not cut into
    2 x context chunks are refused when the step is traced, naming the fix."""
    with pytest.raises(PlanError, match="heads divisible by context=8"):
        _trainer("gpt", "cp", "context=8", "all-to-all").step(_batch())
    tokens = np.zeros((8, 24), np.int32)
    with pytest.raises(PlanError, match="multiple of 16"):
        _trainer("gpt", "cp", "context=8", "ring").step((tokens, tokens))
    with pytest.raises(PlanError, match="context_attention"):
        ParallelSpec(plan="cp", context_attention="ulysses")
    with pytest.raises(PlanError, match="needs a mesh axis 'context'"):
        ParallelSpec(plan="cp", mesh="data=8")
    # a loss with its own attention would see only each device's chunks: refused, not trained wrong
    own = lambda p, b: jax.numpy.mean((jax.numpy.tanh(b[0] @ p["w"]) - b[1]) ** 2)  # noqa: E731
    x = np.ones((8, 16, 4), np.float32)
    t = Trainer(
        own,
        {"w": np.ones((4, 4), np.float32)},
        optax.sgd(0.1),
        spec=ParallelSpec(plan="cp", mesh="context=8"),
    )
    with pytest.raises(
        PlanError, match=r"need the loss's attention through meshkit\.plans\.causal_attention"
    ):
        t.step((x, x))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--context-attention", "all-to-all"], "all-to-all attention needs heads divisible by context=8, but the model has 4 heads"),
        (["--seq-len", "24"], "sequence of 24 tokens does not split into 2 x context=8 equal chunks"),
    ],
    ids=["heads", "sequence"],
)  # fmt: skip
def test_meshkit_train_refuses_bad_context_input_in_one_line(tmp_path, options, message):
    exe = str(Path(sys.executable).parent / "meshkit")
    cmd = [exe, "train", "--preset", "tiny", "--plan", "cp", "--mesh", "context=8", "--steps", "1",
           "--eval-every", "0", "--sample-chars", "0", "--run-dir", str(tmp_path / "run"), *options]  # fmt: skip
    try:  # compiling on a busy 2-core machine takes a while; a hang fails the test instead of holding the suite
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit(3), cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"meshkit train {' '.join(options)} still ran after {e.timeout:.0f} s")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: " + message), proc.stderr


# Tiers: sweeps (moved when make test measured 22 min): a device's share of a sequence split over the context
# axis, its compiled step's memory against the model, is core in test_fsdp_axes.py's llama-all-to-all and
# test_axis_combos.py's test_the_peak_model_holds_for_the_combinations[llama-fsdp+tp+cp-all-to-all].
@pytest.mark.sweep
def test_a_long_sequence_that_does_not_fit_a_budget_under_dp_fits_under_context_8():
    """Per-device temporaries from ``memory_analysis`` of the compiled step (GPT, 2 layers, width 64,
    8 heads, T = 512), each plan at its smallest batch: dp holds one whole sequence per device (8 in
    all), context=8 an eighth of one sequence per device. A budget of 24 MiB: dp's step is over it,
    cp's (ring and all-to-all) is under it, at about 1/8 of dp's."""
    from meshkit.analysis import memory

    t_len, budget = 512, 24 * 2**20
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=t_len, layers=2, width=64, heads=8)
    params = gpt.init(jax.random.key(0), cfg)

    def temp(plan, mesh, examples, form="ring"):
        tokens = np.zeros((examples, t_len), np.int32)
        spec = ParallelSpec(plan=plan, mesh=mesh, context_attention=form)
        t = Trainer(gpt.make_loss(cfg), params, optax.sgd(1e-3), spec=spec)
        return memory(t.compiled((tokens, tokens))).temp_bytes

    dp = temp("dp", "data=8", 8)
    ring, a2a = temp("cp", "context=8", 1), temp("cp", "context=8", 1, "all-to-all")
    assert dp > budget > max(ring, a2a), (dp, ring, a2a)
    assert ring < dp / 4 and a2a < dp / 4, (dp, ring, a2a)


#: an attention-heavy shape (T = 256 over width 64): the activations are most of the peak
PEAK_MODELS = {
    "gpt": (gpt, gpt.GPTConfig(vocab_size=64, seq_len=256, layers=2, width=64, heads=8)),
    "llama": (
        llama,
        llama.LlamaConfig(vocab_size=64, seq_len=256, layers=2, width=64, heads=8, kv_heads=4, ffn=128),
    ),
}


# Tiers: sweeps, both (the ring's, 19.5 CPU s, was core: moved when make test measured 22 min). The peak
# model under a context split (its activation term the loss compiled on the context axis's devices, the split
# in force) is core beside a data axis in test_fsdp_axes.py's llama-all-to-all (fsdp+cp, data=4,context=2)
# and with tensor parallelism in test_axis_combos.py's test_the_peak_model_holds_for_the_combinations
# [llama-fsdp+tp+cp-all-to-all]; the ring's own step against one device in float64 in test_attention.py's
# test_each_plan_caps_the_scores_as_one_device[cp], with its ledger in test_axis_combos.py's meshkit verify
# --plan cp+tp.
@pytest.mark.parametrize(
    ("name", "plan", "mesh", "examples", "form"),
    [pytest.param("gpt", "cp", "context=8", 2, "ring", marks=pytest.mark.sweep),
     pytest.param("llama", "dp+cp", "data=2,context=4", 4, "all-to-all", marks=pytest.mark.sweep)],
    ids=["gpt-cp-ring", "llama-dp+cp-all-to-all"],
)  # fmt: skip
def test_context_peak_is_within_ten_percent_of_the_model(name, plan, mesh, examples, form):
    """The compiled step's arguments + temporaries against ``predict_peak``, whose activation term is the
    loss compiled on the context axis's devices with the split in force (a device's queries attend over
    the whole sequence). Compiled on one device for T/C tokens, it read 1.91x (GPT, ring) and 1.71x
    (Llama, all-to-all) low here."""
    from meshkit.plans.peak import abstract_step

    module, cfg = PEAK_MODELS[name]
    params = jax.eval_shape(lambda: module.init(jax.random.key(0), cfg))
    tok = jax.ShapeDtypeStruct((examples, cfg.seq_len), np.int32)
    st = abstract_step(module.make_loss(cfg), params, (tok, tok), optax.adam(1e-3), plan=plan, mesh=mesh,
                       context_attention=form)  # fmt: skip
    model = st.predict()
    assert model.activations > 0.5 * model.total  # the shape is what the test says it is
    assert 0.9 <= st.measured_peak / model.total <= 1.1, (st.measured_peak, model)
