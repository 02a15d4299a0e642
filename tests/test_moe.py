"""Mixture of experts (``plans._experts``) in the GPT and the Llama: the MoE MLP equals a NumPy float64
implementation written from the formulas (top-k by probability, ties to the lower expert, capacity
``ceil(cf T k / E)`` per sequence, slots in priority order, dropped slots counted, the Switch
load-balancing loss), both block forms agree, and the step reports the dropped slots."""

import dataclasses
import functools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _limits import limit
from _reference import max_rel
from _tiers import tiered
from meshkit._errors import MeshkitError
from meshkit.models import gpt, llama
from meshkit.plans import _experts
from meshkit.spec import ParallelSpec, PlanError, plans_of
from meshkit.train import Trainer

GPT = gpt.GPTConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, mlp_ratio=2, experts=4)
LLAMA = llama.LlamaConfig(
    vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=48, experts=4
)


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np_moe(x, router, expert, k, cf):
    """The MoE MLP from the formulas, one sequence and one slot at a time: ``(y, aux, dropped)``."""
    b, t, _ = x.shape
    e = router.shape[1]
    cap = math.ceil(cf * t * k / e)
    y, aux, dropped = np.zeros_like(x), 0.0, 0
    for s in range(b):
        logits = x[s] @ router
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        choices = [sorted(range(e), key=lambda j, i=i: (-probs[i, j], j))[:k] for i in range(t)]
        fill, counts = [0] * e, np.zeros(e)
        for r in range(k):  # every first choice in token order, then every second, ...
            for i in range(t):
                j = choices[i][r]
                counts[j] += 1
                if fill[j] < cap:
                    fill[j] += 1
                    y[s, i] += probs[i, j] * expert(j, x[s, i])
                else:
                    dropped += 1
        aux += e * np.sum(counts / (t * k) * probs.mean(0))
    return y, aux / b, dropped


def _gpt_expert(p):
    return lambda j, v: _gelu(v @ p["w_in"][j] + p["b_in"][j]) @ p["w_out"][j] + p["b_out"][j]


# Tiers: top2 and top1-drops are core; top3-roomy (another k, no slot dropped) sweeps.
@pytest.mark.parametrize(
    ("k", "cf"),
    [(2, 1.25), (1, 0.5), pytest.param(3, 2.0, marks=pytest.mark.sweep)],
    ids=["top2", "top1-drops", "top3-roomy"],
)
def test_moe_mlp_equals_numpy_float64(k, cf):
    rng = np.random.default_rng(k)
    e, d, f = 4, 8, 16
    p = {"w_in": rng.normal(size=(e, d, f)), "b_in": rng.normal(size=(e, f)),
         "w_out": rng.normal(size=(e, f, d)), "b_out": rng.normal(size=(e, d))}  # fmt: skip
    x, router = rng.normal(size=(3, 10, d)), rng.normal(size=(d, e))
    router[:, 3] = router[:, 2]  # experts 2 and 3 tie for every token: the lower index wins
    want = _np_moe(x, router, _gpt_expert(p), k, cf)
    with jax.enable_x64(True):
        y, aux, dropped = _experts.moe(gpt._experts, p, router, x, k=k, capacity_factor=cf)
        y, aux, dropped = np.asarray(y), float(aux), int(dropped)
    np.testing.assert_allclose(y, want[0], rtol=1e-12, atol=1e-12)
    assert aux == pytest.approx(want[1], rel=1e-12)
    assert dropped == want[2]
    if cf < 1:
        assert dropped > 0  # the case that drops: 10 first choices into 4 x ceil(0.5 x 10 / 4) = 12 slots


def _tokens(b=4, t=16):
    tokens = np.random.default_rng(1).integers(0, 64, size=(b, t + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_moe_model_loss_metrics_and_forms(name):
    """Loss = cross-entropy + weight x load-balancing loss; the dropped share is the layers' dropped
    slots over ``B T k L``; the scanned form computes the same (value and gradients) as the loop."""
    module, cfg = (gpt, GPT) if name == "gpt" else (llama, LLAMA)
    cfg = dataclasses.replace(cfg, capacity_factor=0.5)  # drops slots
    params = module.init(jax.random.key(0), cfg)
    batch = _tokens()
    # each computation jitted (one program each): eagerly, every operation compiles on its own
    (loss, metrics), grads = jax.jit(jax.value_and_grad(module.make_loss(cfg, with_aux=True), has_aux=True))(
        params, batch
    )
    logits, stats = jax.jit(lambda p, x: module.forward(p, x, cfg))(params, batch[0])
    ce = float(jax.jit(module.make_loss(dataclasses.replace(cfg, router_aux_weight=0.0)))(params, batch))
    assert float(loss) == pytest.approx(ce + 0.01 * float(metrics["router_aux"]), rel=1e-6)
    assert float(metrics["dropped_fraction"]) * 4 * 16 * 2 * 2 == pytest.approx(float(stats[1]))
    assert 0 < float(metrics["dropped_fraction"]) < 1
    assert float(metrics["router_aux"]) >= 1.0 - 1e-6  # E sum f P >= 1, equality at perfect balance
    scanned = dataclasses.replace(cfg, scan_layers=True)
    (loss_s, _), grads_s = jax.jit(
        jax.value_and_grad(module.make_loss(scanned, with_aux=True), has_aux=True)
    )(gpt.to_scanned(params), batch)
    assert float(loss_s) == pytest.approx(float(loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(gpt.to_scanned(grads)), jax.tree.leaves(grads_s), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    assert jnp.isfinite(logits).all()
    # model FLOPs count what a token multiplies: k expert MLPs and the router (D x E) per layer
    dense = dataclasses.replace(cfg, experts=0)
    extra = module.matmul_params(cfg) - module.matmul_params(dense)
    one_mlp = 2 * 32 * 64 + 64 + 32 if name == "gpt" else 3 * 32 * 48
    assert extra == cfg.layers * ((cfg.experts_per_token - 1) * one_mlp + 32 * cfg.experts)


# -- expert parallelism ------------------------------------------------------------------------
MODELS = {"gpt": (gpt, GPT), "llama": (llama, LLAMA)}
EP_CASES = [
    ("gpt", "ep", "expert=8"),
    ("llama", "dp+ep", "data=2,expert=4"),
    ("gpt", "dp+ep", "data=4,expert=2"),
]


def _ep_model(name, dtype="float32", experts=8):
    module, cfg = MODELS[name]
    cfg = dataclasses.replace(cfg, dtype=dtype, experts=experts, capacity_factor=0.75)  # drops slots
    return module.make_loss(cfg, with_aux=True), module.init(jax.random.key(0), cfg)


@functools.cache
def _one_device(name, steps):
    """Parameters after ``steps`` Adam steps on one device in float64, and each step's dropped share."""
    loss, params = _ep_model(name, "float64")
    opt = optax.adam(1e-2)

    @jax.jit
    def step(p, s, batch):
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(p, batch)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, metrics["dropped_fraction"]

    state, dropped = opt.init(params), []
    for _ in range(steps):
        params, state, d = step(params, state, _tokens(8))
        dropped.append(float(d))
    return jax.tree.map(np.asarray, params), dropped


def _ep_trainer(name, plan, mesh, dtype="float32"):
    loss, params = _ep_model(name, dtype)
    spec = ParallelSpec(plan=plan, mesh=mesh)
    logical = MODELS[name][0].logical_axes(params)
    return Trainer(
        loss, params, optax.adam(1e-2), spec=spec, has_aux=True, logical_axes=logical, tokens_per_example=16
    )


# Tiers: dp+ep (the Llama) is core; the GPT's ep and dp+ep sweep (the GPT's experts are core beside
# tensor parallelism in test_axis_combos.py, the ep plan alone in test_moe_dropless.py).
@pytest.mark.parametrize(
    ("name", "plan", "mesh"),
    tiered(
        EP_CASES,
        [f"{c[0]}-{c[1]}-{c[2]}" for c in EP_CASES],
        core={"llama-dp+ep-data=2,expert=4"},
    ),
)
def test_expert_plan_matches_one_device_in_float64_and_its_ledger_the_model(name, plan, mesh):
    """Same parameters after 2 Adam steps (float64) and the same dropped slots per step as one device,
    the expert leaves split over the expert axis; all_to_all bytes over it = 4 per MoE layer x
    (E-1)/E x S with S = B_local x E x C x D x 8 bytes, every collective = the model."""
    slots = 8 * 16 * 2 * 2  # tokens x k x layers
    with jax.enable_x64(True):
        t = _ep_trainer(name, plan, mesh, "float64")
        dropped = [round(float(t.step(_tokens(8))["dropped_fraction"]) * slots) for _ in range(2)]
        want, want_dropped = _one_device(name, 2)
        assert max_rel(t.params, want) < 1e-10
        assert dropped == [round(d * slots) for d in want_dropped] and dropped[0] > 0
        w = t.params["blocks"][0]["moe"]["w_in" if name == "gpt" else "w_gate"]
        assert w.sharding.spec[0] == "expert"
        r = t.report(_tokens(8))
    assert r.ok, str(r)
    assert 0.9 <= r.peak["ratio"] <= 1.1, r.peak  # the peak model (plans.peak) of the step's memory
    a2a = {(c.op, c.axes): c for c in r.communication}["all-to-all", "expert"]
    e = int(mesh.split("expert=")[1])
    s = 1 * 8 * math.ceil(0.75 * 16 * 2 / 8) * 32 * 8  # a row per device, 8 experts, capacity 3, width 32
    assert a2a.model_traffic_bytes == pytest.approx(4 * 2 * (e - 1) / e * s)
    assert a2a.ratio == pytest.approx(1.0, abs=1e-9) and a2a.measured_runs == a2a.model_runs


def _meshkit(tmp_path, *options):
    exe = str(Path(sys.executable).parent / "meshkit")
    cmd = [exe, "train", "--preset", "tiny", "--steps", "2", "--eval-every", "0", "--sample-chars", "0",
           "--run-dir", str(tmp_path / "run"), *options]  # fmt: skip
    try:  # compiling on a busy 2-core machine takes a while; a hang fails the test instead of holding the suite
        return subprocess.run(cmd, capture_output=True, text=True, timeout=limit(10), cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"meshkit train {' '.join(options)} still ran after {e.timeout:.0f} s")


def test_meshkit_train_ep_reports_dropped_tokens(tmp_path):
    proc = _meshkit(tmp_path, "--plan", "ep", "--experts", "8", "--capacity-factor", "0.5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "dropped_tokens" in r]
    assert len(rows) == 2 and all(r["dropped_tokens"] > 0 for r in rows)
    assert all(r["dropped_tokens"] == round(r["dropped_fraction"] * 16 * 32 * 2 * 1) for r in rows)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["dropped_tokens"] == sum(r["dropped_tokens"] for r in rows)
    assert report["checks_ok"] is True
    assert "MoE dropped token-slots" in proc.stdout


@pytest.mark.parametrize(
    ("options", "message"),
    [(["--plan", "ep", "--experts", "6"], "6 experts do not divide over expert=8: use an expert axis of 1, 2, 3, 6"),
     (["--plan", "ep"], f"expert-parallel plans ({', '.join(plans_of('expert'))}) need a mixture-of-experts model: set experts"),
     (["--plan", "cp", "--experts", "8"], "a mixture of experts routes whole sequences and context plans")],
    ids=["indivisible", "dense", "context"],
)  # fmt: skip
def test_meshkit_train_refuses_bad_expert_input_in_one_line(tmp_path, options, message):
    proc = _meshkit(tmp_path, *options)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: " + message), proc.stderr
    assert not (tmp_path / "run").exists()
    assert ParallelSpec(plan="fsdp+ep").plan_info.expert  # built now (tests/test_fsdp_axes.py)


def test_moe_is_refused_where_routing_would_differ_from_one_device():
    """Context plans split sequences (capacity is per whole sequence); pipelines have no MoE stages yet."""
    loss, params = _ep_model("gpt")
    t = Trainer(loss, params, optax.adam(1e-2), spec=ParallelSpec(plan="cp", mesh="context=8"), has_aux=True)
    with pytest.raises(
        PlanError,
        match=re.escape(
            f"routes whole sequences and context plans ({', '.join(plans_of('context'))}) split them"
        ),
    ):
        t.step(_tokens(8))
    with pytest.raises(MeshkitError, match="pipeline plans do not run mixture-of-experts models yet"):
        gpt.stages(GPT)
