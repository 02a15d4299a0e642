"""Trainer inputs and features: bad leaves named with the fix, aux metrics, per-step keys, any
mesh, a readable report, save/restore in the CLI's checkpoint format. Tiny models, few compiles."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import meshkit
from meshkit.models import mlp
from meshkit.spec import PlanError
from meshkit.train import Trainer
from meshkit.verify import relative_difference

SIZES = [8, 16, 4]


def _params():
    return mlp.init(jax.random.key(0), SIZES)


def _batch(n=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, SIZES[0])).astype(np.float32)
    return x, np.sin(x @ np.ones((SIZES[0], SIZES[-1]), np.float32) / 4)


class _Lin(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x)


def _bad_inputs():
    p = _params()
    eqx = pytest.importorskip("equinox")
    return [
        ({**p[0], "step": jnp.zeros((), jnp.int32)}, "params leaf step has dtype int32: only floating arrays are trained; pass counters"),
        ({"w": p[0]["w"], "scale": 0.5}, "params leaf scale is a Python float"),
        (nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "params is a nnx Linear.*meshkit.from_nnx"),
        ({"w": p[0]["w"], "rngs": nnx.Rngs(0)}, "params leaf rngs is a nnx Rngs.*meshkit.from_nnx"),
        ({"w": p[0]["w"], "mean": nnx.BatchStat(jnp.zeros(3))}, "params leaf mean is a nnx BatchStat.*from_nnx"),
        (_Lin(), "params is a linen _Lin.*meshkit.from_linen"),
        (_Lin().init(jax.random.key(0), jnp.ones((1, 2))) | {"batch_stats": {}}, "collections \\['params', 'batch_stats'\\].*from_linen"),
        (eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0)), "params leaf .*activation is a .*not an array: use meshkit.from_equinox"),
        ({"w": p[0]["w"], "key": jax.random.key(0)}, "params leaf key is a PRNG key: pass it in state="),
        ({}, "params is empty"),
    ]  # fmt: skip


def test_bad_params_name_the_leaf_and_the_fix():
    for params, message in _bad_inputs():
        with pytest.raises(PlanError, match=message) as e:
            Trainer(mlp.loss, params, optax.adam(1e-3))
        assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match="state leaf n is a Python int"):
        Trainer(mlp.loss, _params(), optax.adam(1e-3), state={"n": 3})
    with pytest.raises(PlanError, match="rng must be an int seed"):
        Trainer(mlp.loss, _params(), optax.adam(1e-3), rng="zero")


def test_bad_loss_outputs_are_one_line():
    cases = [
        (lambda p, b: (mlp.loss(p, b), {"acc": 1.0}), {}, "returned a tuple: pass has_aux=True"),
        (lambda p, b: mlp.apply(p, b[0]), {}, "must return a float scalar loss, got shape \\(16, 4\\)"),
        (lambda p, b: mlp.loss(p, b), {"has_aux": True}, "must return \\(loss, aux\\)"),
        (
            lambda p, s, b: mlp.loss(p, b),
            {"state": {"n": jnp.zeros(())}},
            "must return \\(loss, new_state\\)",
        ),
    ]
    for fn, kw, message in cases:
        t = Trainer(fn, _params(), optax.adam(1e-3), **kw)
        with pytest.raises(PlanError, match=message):
            t.step(_batch())


def test_aux_state_and_a_fresh_key_per_step_match_a_single_device_loop():
    """zero3 (manual data region, 2 micro-batches off) with dropout from the step's key, an int
    counter in state and aux metrics, against the same loop on one device."""

    def loss_fn(p, state, batch, key):
        x, y = batch
        keep = jax.random.bernoulli(key, 0.8, x.shape)
        pred = mlp.apply(p, jnp.where(keep, x / 0.8, 0.0))
        err = jnp.mean((pred - y) ** 2)
        return (err, {"kept": jnp.mean(keep)}), {"calls": state["calls"] + 1}

    opt = optax.adamw(1e-2)
    p, s, st = _params(), {"calls": jnp.zeros((), jnp.int32)}, None
    st = opt.init(p)
    kept = []
    for i in range(4):
        key = jax.random.fold_in(jax.random.key(5), i)
        (_, aux), g = jax.value_and_grad(lambda q, k=key: loss_fn(q, s, _batch(), k)[0], has_aux=True)(p)
        kept.append(float(aux["kept"]))
        u, st = opt.update(g, st, p)
        p = optax.apply_updates(p, u)
    for plan in ("dp", "zero3"):
        t = Trainer(
            loss_fn, _params(), opt, plan=plan, state={"calls": jnp.zeros((), jnp.int32)}, rng=5, has_aux=True
        )
        got = [float(t.step(_batch())["kept"]) for _ in range(4)]
        assert got == pytest.approx(kept, abs=1e-7)
        assert int(t.state["calls"]) == 4 and t.steps_done == 4
        assert relative_difference(t.params, p) <= 1e-5


def test_any_mesh_explicit_auto_or_jax_made():
    results = []
    meshes = [
        "data=8",
        meshkit.make_mesh("data=8"),  # Explicit axes (meshkit's default)
        meshkit.make_mesh("data=8", axis_types=(AxisType.Explicit,)),  # JAX's own AxisType tuple
        jax.make_mesh((8,), ("data",)),
        jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)),
    ]
    for mesh in meshes:
        t = Trainer(mlp.loss, _params(), optax.adam(1e-2), plan="zero1", mesh=mesh)
        results.append(float(t.step(_batch())["loss"]))
    assert len(set(results)) == 1
    with pytest.raises(meshkit.MeshSpecError, match="one per axis"):
        meshkit.make_mesh("data=4,model=2", axis_types=(AxisType.Auto,))


def test_parameters_on_one_cpu_device_reach_the_mesh_through_the_host(caplog):
    """``init`` leaves a model's parameters on one device. Spread over the mesh from there, JAX compiled a
    slicing program per shape (0.07 s of CPU each: 478 in a run of this suite); on the CPU they go through
    the host, which is the device, and nothing is compiled for it. The caller's arrays are left as they
    were: the Trainer's are its own (its steps donate them)."""
    params = mlp.init(jax.random.key(3), [24, 40, 8])  # shapes no other test spreads: no cached program
    before = jax.tree.map(np.array, params)
    with jax.log_compiles(), caplog.at_level("WARNING"):
        t = Trainer(mlp.loss, params, optax.sgd(0.5), plan="zero3", mesh="data=8")
    assert "jit(<lambda>)" in caplog.text  # compiles were logged: the Trainer's copy of the parameters
    assert "_multi_slice" not in caplog.text
    x = np.random.default_rng(0).normal(size=(16, 24)).astype(np.float32)
    t.step((x, np.zeros((16, 8), np.float32)))
    assert not t.params[0]["w"].sharding.is_fully_replicated  # split over data, as zero3 places it
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), params, before))


def test_plans_on_meshes_with_a_size_one_axis():
    for plan, mesh in (
        ("dp+tp", "data=1,model=8"),
        ("fsdp+tp", "data=8,model=1"),
        ("zero3", "data=8,model=1"),
    ):
        axes = jax.tree.map(lambda a: ("embed", "mlp") if a.ndim == 2 else ("mlp",), _params())
        axes[-1] = {"w": ("mlp", "embed"), "b": ("embed",)}
        t = Trainer(mlp.loss, _params(), optax.adam(1e-2), plan=plan, mesh=mesh, logical_axes=axes)
        assert np.isfinite(float(t.step(_batch())["loss"]))


def test_report_prints_as_a_table():
    t = Trainer(mlp.loss, _params(), optax.adam(1e-2), plan="zero3")
    report = t.report(_batch())
    text = str(report)
    assert report.ok
    assert "plan zero3 on data=8" in text and "all-gather" in text and "reduce-scatter" in text
    assert "optimizer" in text and text.rstrip().endswith("ok")


def test_save_and_restore_continue_the_run(tmp_path):
    def loss_fn(p, batch, key):
        x, y = batch
        return mlp.loss(p, (x + 0.1 * jax.random.normal(key, x.shape), y))

    full = Trainer(loss_fn, _params(), optax.adam(1e-2), plan="zero1", rng=3)
    for _ in range(4):
        full.step(_batch())
    half = Trainer(loss_fn, _params(), optax.adam(1e-2), plan="zero1", rng=3)
    for _ in range(2):
        half.step(_batch())
    assert half.save(tmp_path / "ckpt") == 2
    again = Trainer.restore(tmp_path / "ckpt", loss_fn, _params(), optax.adam(1e-2), plan="zero3", rng=3)
    assert again.steps_done == 2
    for _ in range(2):
        again.step(_batch())
    assert relative_difference(again.params, full.params) <= 1e-6
    from meshkit.train.checkpoint import Checkpointer

    with Checkpointer(tmp_path / "ckpt") as ckpt:  # the CLI's reader sees a CLI-format step
        assert ckpt.all_steps() == [2]


def test_save_and_restore_an_nnx_model_with_state(tmp_path):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.lin(x)))

    def loss_fn(model, batch):
        return jnp.mean((model(batch[0]) - batch[1]) ** 2)

    t = Trainer(loss_fn, meshkit.from_nnx(Net(nnx.Rngs(0))), optax.adam(1e-2))
    t.step(_batch())
    t.save(tmp_path)
    t.step(_batch())
    back = Trainer.restore(tmp_path, loss_fn, meshkit.from_nnx(Net(nnx.Rngs(0))), optax.adam(1e-2))
    back.step(_batch())
    assert relative_difference(back.params, t.params) == 0
    assert relative_difference(back.state["bn"], t.state["bn"]) == 0
    model = back.model()
    assert isinstance(model, Net) and int(model.drop.rngs.count[...]) == 2


def test_mixed_precision_gathers_and_reduce_scatters_in_the_compute_dtype():
    def loss_fn(p, batch):  # the loss computes in bf16, as --precision bf16's GPT does
        return mlp.loss(jax.tree.map(lambda a: a.astype(jnp.bfloat16), p), batch).astype(jnp.float32)

    runs = {}
    for dtype in (None, "bfloat16"):
        t = Trainer(loss_fn, _params(), optax.adam(1e-2), plan="fsdp", compute_dtype=dtype)
        for _ in range(3):
            t.step(_batch())
        runs[dtype] = t
    low = runs["bfloat16"]
    program = low._step.lower(
        low.params, low.opt_state, low.state, low.put_batch(_batch()), low._step_key()
    ).as_text()
    moved = re.findall(r'"stablehlo\.(?:all_gather|reduce_scatter)".*?\) -> tensor<([^>]*)>', program, re.S)
    assert len(moved) == 2 and all(t.endswith("bf16") for t in moved), moved  # the program moves bf16
    assert low.report(_batch()).ok  # the model moves what XLA moves (CPU: as f32; GPU: bf16, half)
    assert jax.tree.leaves(low.params)[0].dtype == jnp.float32  # the optimizer updates float32
    assert relative_difference(low.params, runs[None].params) < 0.05
    with pytest.raises(PlanError, match="compute_dtype must be a floating dtype"):
        Trainer(loss_fn, _params(), optax.adam(1e-2), compute_dtype="int8")
