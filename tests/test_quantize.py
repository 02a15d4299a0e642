"""``--quantize int8`` (``meshkit.models.quantize``): the blocks' matmuls through Qwix's quantized-training
``dot_general``. Its forward equals a NumPy float64 quantize-multiply-rescale written here; its backward is
int8 too; every family routes its projections through it; under every plan that splits the batch or the
model's matrices a Trainer's quantized step equals the one-device quantized step in float64 (the tie and the
weight gradient's per-device scales, the module docstring's two choices, are what make that hold: each is
shown to fail without its fix); the model axis's ledger carries the int8 scales; and what cannot quantize
is one line."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _tiers import tiered
from meshkit import Trainer
from meshkit.cli import main
from meshkit.models import gemma, gpt, llama, quantize
from meshkit.spec.batch import TokenBatch

LLAMA = llama.LlamaConfig(vocab_size=96, seq_len=16, layers=2, width=64, heads=8, kv_heads=4, ffn=64,
                          dtype="float64")  # fmt: skip


def _numpy_int8(x, w):
    """Symmetric int8 per row of ``x`` and per column of ``w``, the largest magnitude to 127, the integer
    products summed exactly, then scaled back: float64 NumPy, no Qwix."""
    sx = np.abs(x).max(-1, keepdims=True) / 127
    sw = np.abs(w).max(0, keepdims=True) / 127
    qx, qw = np.clip(np.rint(x / sx), -128, 127), np.clip(np.rint(w / sw), -128, 127)
    return (qx.astype(np.int64) @ qw.astype(np.int64)) * sx * sw


def test_the_int8_forward_is_numpys_and_the_backward_multiplies_int8():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 128, 48)), rng.normal(size=(48, 24))  # sequences of 128: Qwix's smallest
    # tile it multiplies in int8 (shorter ones are dequantized before the weight gradient's matmul)
    x[0, 0, 7] = -8.0  # a row whose largest magnitude is negative: -127, not the tie's -128
    with jax.enable_x64(True):
        with quantize.quantized("int8"):
            got = np.asarray(quantize.linear(jnp.asarray(x), jnp.asarray(w)))
            jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(jnp.sin(quantize.linear(x, w))), (0, 1)))(
                x, w
            )
        plain = np.asarray(quantize.linear(jnp.asarray(x), jnp.asarray(w)))  # outside the context: x @ w
    want = _numpy_int8(x, w)
    assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want))
    assert np.max(np.abs(plain - x @ w)) <= 1e-12
    assert 1e-4 < np.max(np.abs(got - plain)) / np.max(np.abs(plain)) < 0.05  # int8 rounds, a little
    int8 = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
            and all(v.aval.dtype == np.int8 for v in e.invars)]  # fmt: skip
    assert len(int8) == 3, int8  # forward, input gradient, weight gradient
    assert int8[2].params["dimension_numbers"][1] == ((0,), (0,))  # the weight gradient: one per sequence


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            if (sub := e.params.get(name)) is not None:
                yield from _eqns(getattr(sub, "jaxpr", sub))


FAMILIES = {
    "gpt": (gpt, gpt.GPTConfig(vocab_size=96, seq_len=16, layers=2, width=32, heads=4, dtype="float64")),
    "llama": (llama, LLAMA),
    "gemma2": (gemma, gemma.GemmaConfig(vocab_size=96, seq_len=16, layers=2, width=32, heads=4, kv_heads=2,
                                        ffn=64, window=8, local_layers=(True, False), dtype="float64")),
}  # fmt: skip


def _batch(vocab, b=8, t=16):
    tokens = np.random.default_rng(0).integers(0, vocab, (b, t + 1)).astype(np.int32)
    return TokenBatch(tokens[:, :-1], tokens[:, 1:], None)


@pytest.mark.parametrize("name", tiered([(n,) for n in FAMILIES], FAMILIES, core={"gemma2"}))
def test_every_familys_projections_are_quantized(name):
    """Each family's loss moves under int8 (by little), and its gradient program multiplies int8: the
    forward and input-gradient matmuls of each of a layer's projections (four attention, two or three
    MLP) in every layer (the weight gradient's tiles of 16 tokens are dequantized first: Qwix's rule)."""
    module, cfg = FAMILIES[name]
    with jax.enable_x64(True):
        params = module.init(jax.random.key(0), cfg)
        batch = _batch(cfg.vocab_size)
        loss = module.make_loss(cfg)
        plain, quantized = float(loss(params, batch)), float(quantize.wrap(loss, "int8")(params, batch))
        jaxpr = jax.make_jaxpr(jax.grad(quantize.wrap(loss, "int8")))(params, batch)
    assert 1e-7 < abs(quantized - plain) / plain < 0.01, (plain, quantized)
    int8 = sum(
        e.primitive.name == "dot_general" and e.invars[0].aval.dtype == np.int8 for e in _eqns(jaxpr.jaxpr)
    )
    mlp = 2 if name == "gpt" else 3
    assert int8 == 2 * cfg.layers * (4 + mlp), int8


PLANS = ["dp", "zero1", "fsdp", "hsdp", "tp", "dp+tp", "fsdp+tp", "fsdp+ep", "tp+ep"]


def _steps(loss, params, batch, plan, aux=False):
    """Two SGD steps of a Trainer under ``plan`` and the same by hand on one device: the largest gaps."""
    split = Trainer(
        loss, params, optax.sgd(0.5), plan=plan, logical_axes=llama.logical_axes(params), has_aux=aux
    )
    f = (lambda p, b: loss(p, b)[0]) if aux else loss
    one, gaps = params, []
    for _ in range(2):
        value, grads = jax.value_and_grad(f)(one, batch)
        one = jax.tree.map(lambda p, g: p - 0.5 * g, one, grads)
        gaps.append(abs(float(split.step(batch)["loss"]) - float(value)))
    leaves = jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), one, split.params
    )
    return max(gaps), max(jax.tree.leaves(leaves))


@pytest.mark.parametrize("plan", tiered([(p,) for p in PLANS], PLANS, core={"fsdp+tp"}))
def test_under_each_plan_the_quantized_step_is_one_devices(plan):
    """8 devices, float64: the Llama's int8 step (experts, unquantized, beside it under the expert
    plans) equals the same step on one device."""
    cfg = dataclasses.replace(LLAMA, experts=4, capacity_factor=0.0) if "ep" in plan else LLAMA
    with jax.enable_x64(True):
        params = llama.init(jax.random.key(1), cfg)
        loss = quantize.wrap(llama.make_loss(cfg, with_aux=bool(cfg.experts)), "int8")
        loss_gap, param_gap = _steps(loss, params, _batch(cfg.vocab_size), plan, aux=bool(cfg.experts))
    assert loss_gap <= 1e-10 and param_gap <= 1e-10, (loss_gap, param_gap)


@pytest.mark.sweep
@pytest.mark.parametrize("plan", ["fsdp", "fsdp+tp"])
def test_with_sequences_of_128_the_weight_gradient_in_int8_is_one_devices_too(plan):
    """At 128 tokens a sequence Qwix multiplies the weight gradient's tiles in int8 (shorter ones are
    dequantized first, as in the case above): the int32 matrix of each sequence, scaled and summed in
    float, still equals one device's."""
    cfg = dataclasses.replace(LLAMA, seq_len=128, layers=1)
    with jax.enable_x64(True):
        params = llama.init(jax.random.key(1), cfg)
        loss = quantize.wrap(llama.make_loss(cfg), "int8")
        batch = _batch(cfg.vocab_size, t=128)
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params, batch)
        tiled = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
                 and e.invars[0].aval.dtype == np.int8 and e.params["dimension_numbers"][1] == ((0,), (0,))]  # fmt: skip
        assert len(tiled) == 7, len(tiled)  # each projection's weight gradient, one int32 matrix per sequence
        loss_gap, param_gap = _steps(loss, params, batch, plan)
    assert loss_gap <= 1e-10 and param_gap <= 1e-10, (loss_gap, param_gap)


@pytest.mark.sweep
def test_without_the_two_choices_fsdp_is_not_one_device(monkeypatch):
    """The fixes are needed: Qwix's default calibration (the tie) and one scale over all of the weight
    gradient's tokens (per device under fsdp) each move fsdp's quantized step away from one device's."""
    from qwix._src.core import dot_general_qt

    base = quantize._config(LLAMA.seq_len)
    for change in ({"drhs_tile_size": None}, {"lhs_calibration_method": "absmax", "rhs_calibration_method":
                                                 "absmax", "dlhs_grad_calibration_method": "absmax"}):  # fmt: skip
        monkeypatch.setattr(quantize, "_config", lambda _, c=change: dataclasses.replace(base, **c))
        assert isinstance(quantize._config(16), dot_general_qt.DotGeneralQtConfig)
        with jax.enable_x64(True):
            params = llama.init(jax.random.key(1), LLAMA)
            gaps = _steps(quantize.wrap(llama.make_loss(LLAMA), "int8"), params, _batch(96), "fsdp+tp")
        assert max(gaps) > 1e-8, (change, gaps)


def test_a_quantized_run_trains_and_its_ledger_holds_the_scales(tmp_path):
    """``meshkit train --quantize int8`` under fsdp+tp: the loss falls, and the compiled step's
    collectives (the int32 partial sums and the scales' all-reduces on the model axis) equal the
    ledger's model."""
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--model", "llama", "--plan", "fsdp+tp", "--quantize", "int8",
                 "--steps", "12", "--run-dir", str(run)]) == 0  # fmt: skip
    report = json.loads((run / "report.json").read_text())
    rows = {(r["op"], r["axes"]): r for r in report["communication"]}
    assert all(r["ok"] for r in rows.values()), rows
    assert rows[("all-reduce", "model")]["measured_runs"] > 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]  # fmt: skip
    assert losses[-1] < losses[0] - 0.3
    assert json.loads((run / "config.json").read_text())["model"]["quantize"] == "int8"


@pytest.mark.parametrize(
    "args, said",
    [(["--quantize", "int4"], "unknown --quantize 'int4': use none ("),
     (["--quantize", "int8", "--plan", "dp+pp"], "are not quantized yet"),
     (["--quantize", "int8", "--plan", "dp+cp"], "splits over the context axis"),
     (["--quantize", "int8", "--task", "dpo", "--data", "x"], "unquantized reference: drop --quantize")],
)  # fmt: skip
def test_what_cannot_quantize_is_one_line(args, said, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--steps", "1", *args, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_without_qwix_the_line_says_what_to_install(tmp_path):
    code = (
        "import sys; sys.modules['qwix'] = None; from meshkit.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    out = subprocess.run([sys.executable, "-c", code, "train", "--preset", "tiny", "--quantize", "int8",
                          "--run-dir", str(tmp_path / "r")], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "pip install 'meshkit[quantize]'" in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_remat_dots_keeps_the_rescaled_result_not_the_int32_sums(capsys):
    """``--remat dots`` keeps each matmul's output; for an int8 matmul that is its bf16 rescaled result
    (named by ``quantize.linear``), not the int32 sums jax's ``dots_saveable`` would keep at twice the
    bytes (a 0.7 B Llama's step at batch 3 then outgrew the v5e chip)."""
    from jax.ad_checkpoint import print_saved_residuals

    from meshkit.plans import INT8_RESULT, remat_policy

    x, w = jnp.ones((2, 128, 48), jnp.bfloat16), jnp.ones((48, 24), jnp.bfloat16)
    f = quantize.wrap(lambda x, w: jnp.sum(jnp.sin(quantize.linear(jnp.tanh(x), w))), "int8")
    print_saved_residuals(jax.checkpoint(f, policy=remat_policy("dots")), x, w)
    kept = capsys.readouterr().out
    assert f"bf16[2,128,24] named '{INT8_RESULT}'" in kept and "i32[" not in kept, kept
    print_saved_residuals(jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable), x, w)
    assert "i32[256,24] output of dot_general" in capsys.readouterr().out  # what the policy avoids
