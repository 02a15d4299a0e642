"""Dropless mixture of experts (``plans._experts._dropless``, issue 36): every token's ``k`` slots run,
grouped by expert in one ``jax.lax.ragged_dot`` per weight. The MoE MLP equals a NumPy float64
implementation written from the formulas (top-k by probability, ties to the lower expert, gates
renormalised where the family does it, no capacity); a step under every expert plan and the plans beside
them equals one device in float64; the ledger and the peak model hold under expert parallelism, where the
group's tokens are gathered and their outputs reduce-scattered back."""

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from _tiers import tiered
from meshkit.models import gpt, llama, llama_layers
from meshkit.plans import _experts
from meshkit.plans.tp_rules import vocab_rules
from meshkit.spec import ParallelSpec
from meshkit.train import Trainer
from test_moe import _gelu, _tokens

#: keeps the last gradient as its state and moves nothing (``meshkit.verify._keep_gradient``)
KEEP = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))
LLAMA = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=48, experts=8,
                          capacity_factor=0.0, router_renormalize=True)  # fmt: skip


def _np_dropless(x, router, expert, k, renormalize):
    """The MoE MLP from the formulas, one token at a time: every one of its top-k experts runs."""
    y = np.zeros_like(x)
    for s in range(x.shape[0]):
        for i in range(x.shape[1]):
            logits = x[s, i] @ router
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            top = sorted(range(router.shape[1]), key=lambda j: (-probs[j], j))[:k]
            gates = probs[top] / (probs[top].sum() if renormalize else 1.0)
            for j, g in zip(top, gates, strict=True):
                y[s, i] += g * expert(j, x[s, i])
    return y


def _silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize(
    ("family", "k", "renormalize"), [("gpt", 2, False), ("llama", 2, True), ("llama", 3, False)]
)
def test_dropless_moe_equals_numpy_float64(family, k, renormalize):
    rng = np.random.default_rng(k)
    e, d, f = 4, 8, 16
    if family == "gpt":
        p = {"w_in": rng.normal(size=(e, d, f)), "b_in": rng.normal(size=(e, f)),
             "w_out": rng.normal(size=(e, f, d)), "b_out": rng.normal(size=(e, d))}  # fmt: skip
        fn, one = (
            gpt._experts,
            lambda j, v: _gelu(v @ p["w_in"][j] + p["b_in"][j]) @ p["w_out"][j] + p["b_out"][j],
        )
    else:
        p = {"w_gate": rng.normal(size=(e, d, f)), "w_up": rng.normal(size=(e, d, f)),
             "w_down": rng.normal(size=(e, f, d))}  # fmt: skip
        fn = llama_layers.experts_mlp
        one = lambda j, v: (_silu(v @ p["w_gate"][j]) * (v @ p["w_up"][j])) @ p["w_down"][j]  # noqa: E731
    x, router = rng.normal(size=(3, 10, d)), rng.normal(size=(d, e))
    router[:, 3] = router[:, 2]  # experts 2 and 3 tie for every token: the lower index wins
    want = _np_dropless(x, router, one, k, renormalize)
    with jax.enable_x64(True):
        y, _, dropped = _experts.moe(fn, p, router, x, k=k, capacity_factor=0.0, renormalize=renormalize)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-12, atol=1e-12)
    assert float(dropped) == 0.0


def _trainer(plan, mesh, dtype="float32", optimizer=KEEP):
    cfg = dataclasses.replace(LLAMA, dtype=dtype)
    params = llama.init(jax.random.key(0), cfg)
    return Trainer(llama.make_loss(cfg, with_aux=True), params, optimizer, spec=ParallelSpec(plan=plan, mesh=mesh),
                   has_aux=True, tokens_per_example=16, units=llama.units(cfg),
                   logical_axes=llama.logical_axes(params), rules=vocab_rules(False))  # fmt: skip


@functools.cache
def _one_device():
    cfg = dataclasses.replace(LLAMA, dtype="float64")
    params = llama.init(jax.random.key(0), cfg)
    (loss, _), grads = jax.jit(jax.value_and_grad(llama.make_loss(cfg, with_aux=True), has_aux=True))(
        params, _tokens(8)
    )
    return float(loss), jax.tree.map(np.asarray, grads)


CASES = [("ep", "expert=8"), ("dp+ep", "data=2,expert=4"), ("tp+ep", "expert=4,model=2"),
         ("fsdp+ep", "data=2,expert=4"), ("fsdp", "data=8"), ("dp+tp", "data=4,model=2")]  # fmt: skip


# Tiers: the dropless step is core under ep (tokens gathered to their experts) and fsdp (every expert
# local), its ledger and peak under ep; the other plans sweep (fsdp+ep's dense ZeRO-3 beside experts over
# expert is core in test_fsdp_axes.py's llama, test_families.py's Mixtral under it sweeps).
@pytest.mark.parametrize(("plan", "mesh"), tiered(CASES, [c[0] for c in CASES], core={"ep", "fsdp"}))
def test_dropless_step_equals_one_device_in_float64(plan, mesh):
    with jax.enable_x64(True):
        t = _trainer(plan, mesh, "float64")
        metrics = t.step(_tokens(8))
        loss, grads = _one_device()
        got = t.opt_state[0].trace
        diff = max(float(np.max(np.abs(np.asarray(a) - b)))
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(grads), strict=True))  # fmt: skip
    assert abs(float(metrics["loss"]) - loss) <= 1e-10 and diff <= 1e-10, (plan, diff)
    assert float(metrics["dropped_fraction"]) == 0.0


@pytest.mark.parametrize(
    ("plan", "mesh"), tiered(CASES[:4:2] + CASES[3:4], ["ep", "tp+ep", "fsdp+ep"], core={"ep"})
)
def test_dropless_ledger_and_peak_under_expert_parallelism(plan, mesh):
    r = _trainer(plan, mesh, optimizer=optax.adam(1e-2)).report(_tokens(8))
    assert r.ok, str(r)
    assert 0.9 <= r.peak["ratio"] <= 1.1, r.peak
    rows = {(c.op, c.axes): c for c in r.communication}
    for op in ("all-gather", "reduce-scatter"):  # the group's tokens in, their outputs back
        assert rows[op, "expert"].measured_runs == rows[op, "expert"].model_runs == 4
    assert ("all-to-all", "expert") not in rows


# Tiers: sweeps; meshkit train --plan ep with --experts and --capacity-factor is core in test_moe.py's
# test_meshkit_train_ep_reports_dropped_tokens, the dropless step under ep (capacity 0) above in
# test_dropless_step_equals_one_device_in_float64[ep] and its ledger in
# test_dropless_ledger_and_peak_under_expert_parallelism[ep].
@pytest.mark.sweep
def test_meshkit_train_takes_a_dropless_mixture(tmp_path):
    exe = str(Path(sys.executable).parent / "meshkit")
    cmd = [exe, "train", "--preset", "tiny", "--model", "llama", "--plan", "ep", "--experts", "8",
           "--capacity-factor", "0", "--steps", "2", "--eval-every", "0", "--sample-chars", "0",
           "--run-dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "dropped_fraction" in r]
    assert len(steps) == 2 and all(r["dropped_fraction"] == 0.0 and np.isfinite(r["loss"]) for r in steps), (
        rows
    )
