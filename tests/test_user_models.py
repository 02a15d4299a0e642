"""Users' own models (issue 22): bfloat16 sums beside a model axis, and how tensor-parallel rules
combine and match.

bfloat16: XLA:CPU aborted the whole process (exit 134, "Invalid binary instruction opcode copy")
compiling a bf16 all-reduce / reduce-scatter over a manual axis while another mesh axis was left to
the partitioner (fsdp+tp, dp+tp with micro-batches, pipelines with tp: bf16 parameters there; its compile
costs ~25 s, so it is checked by hand, see the branch's commit); a two-matrix model whose
loss is bf16 is enough to reproduce it. Each case here aborted before the fix; now it trains and its
losses equal a one-device loop's (bf16 rounding: relative 2e-2).
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit.spec import PlanError
from meshkit.verify import bitwise_equal

BF16 = jnp.bfloat16
AXES = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}


def _params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 4)) * 0.3}
    return jax.tree.map(lambda a: a.astype(dtype), p)


def _bf16_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x.astype(BF16) @ p["w1"].astype(BF16))
    return jnp.mean((h @ p["w2"].astype(BF16) - y.astype(BF16)) ** 2)


def _batch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)


def _one_device_losses(params, batch, steps):
    tx = optax.sgd(0.1)
    state, out = tx.init(params), []
    for _ in range(steps):
        loss, g = jax.value_and_grad(_bf16_loss)(params, batch)
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append(float(loss))
    return out


@pytest.mark.parametrize(
    ("plan", "mesh", "dtype", "kwargs"),
    [
        ("fsdp+tp", "data=4,model=2", jnp.float32, {}),  # the loss's pmean over data
        ("fsdp+tp", "data=2,model=4", BF16, {}),  # the gradients' reduce-scatter and all-reduce
        ("dp+tp", "data=4,model=2", jnp.float32, {"accumulate": 2}),
    ],
)
def test_bf16_sums_beside_a_model_axis_compile_and_match_one_device(plan, mesh, dtype, kwargs):
    params, batch = _params(dtype), _batch()
    t = meshkit.Trainer(_bf16_loss, params, optax.sgd(0.1), plan=plan, mesh=mesh, logical_axes=AXES, **kwargs)
    got = [float(t.step(batch)["loss"]) for _ in range(3)]
    want = _one_device_losses(params, batch, 3)
    assert got[-1] < got[0]
    np.testing.assert_allclose(got, want, rtol=2e-2)


# -- rules: the user's logical rules update the defaults; path rules are searched for ---------------
ATTN_AXES = {"wq": ("embed", "kv"), "w1": ("embed", "mlp"), "w2": ("mlp", "embed")}


def _attn_params():
    return {"wq": jnp.ones((8, 16)), "w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 8))}


def _specs(**kwargs):
    t = meshkit.Trainer(lambda p, b: jnp.sum(p["w1"]), _attn_params(), optax.sgd(0.1), plan="tp",
                        mesh="model=8", **kwargs)  # fmt: skip
    return {k: tuple(v.sharding.spec) for k, v in t.params.items()}


def test_a_users_logical_rule_adds_to_the_defaults_and_none_removes_one():
    # before: rules={'kv': 'model'} replaced the defaults and silently dropped the MLP split
    specs = _specs(logical_axes=ATTN_AXES, rules={"kv": "model"})
    assert specs == {"wq": (None, "model"), "w1": (None, "model"), "w2": ("model", None)}
    specs = _specs(logical_axes=ATTN_AXES, rules={"kv": "model", "mlp": None})
    assert specs == {"wq": (None, "model"), "w1": (None, None), "w2": (None, None)}
    with pytest.raises(
        PlanError, match=r"rule\(s\) for \['experts'\] match no parameter: .*\['embed', 'kv', 'mlp'\]"
    ):
        _specs(logical_axes=ATTN_AXES, rules={"experts": "model"})
    with pytest.raises(PlanError, match="names mesh axis 'data'"):
        _specs(logical_axes=ATTN_AXES, rules={"kv": "data"})


def test_a_default_rule_that_matches_nothing_beside_unmapped_axes_warns():
    axes = {"wq": ("embed", "heads"), "w1": ("embed", "ffn"), "w2": ("ffn", "embed")}
    with pytest.warns(
        UserWarning, match=r"\['mlp'\] -> model match no logical axis.*rules=\{'ffn': 'model'\}"
    ):
        specs = _specs(logical_axes=axes)
    assert specs["w1"] == (None, None)  # kept whole, as the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rule named: no warning
        assert _specs(logical_axes=axes, rules={"ffn": "model"})["w1"] == (None, "model")


def test_path_rules_are_searched_for_and_the_first_match_decides():
    params = {"layers": [{"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 8))}]}
    t = meshkit.Trainer(lambda p, b: jnp.sum(p["layers"][0]["w1"]), params, optax.sgd(0.1), plan="tp",
                        mesh="model=8", rules=[(r"w1$", (None, "model")), (r"w", ("model", None))])  # fmt: skip
    layer = t.params["layers"][0]
    assert tuple(layer["w1"].sharding.spec) == (
        None,
        "model",
    )  # the first rule, searched (not anchored at the start)
    assert tuple(layer["w2"].sharding.spec) == ("model", None)
    with pytest.raises(PlanError, match=r"rule '\[' is not a regular expression"):
        meshkit.Trainer(
            lambda p, b: 0.0, params, optax.sgd(0.1), plan="tp", mesh="model=8", rules=[("[", ("model",))]
        )


# -- tokens per example: derived from the loss, so tensor-parallel reports of token models hold ----
def _token_loss(p, batch):
    tokens, targets = batch
    h = jax.nn.gelu(p["emb"][tokens] @ p["w1"]) @ p["w2"]  # (examples, sequence, width)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["emb"].T, targets).mean()


def test_a_tensor_parallel_report_derives_tokens_per_example():
    # before: model-axis traffic was expected for 1 token per example, off by the sequence length (8)
    ks = jax.random.split(jax.random.key(0), 3)
    params = {"emb": jax.random.normal(ks[0], (16, 8)), "w1": jax.random.normal(ks[1], (8, 16)) * 0.3,
              "w2": jax.random.normal(ks[2], (16, 8)) * 0.3}  # fmt: skip
    tokens = np.random.default_rng(1).integers(0, 16, size=(8, 9)).astype(np.int32)
    batch = tokens[:, :-1], tokens[:, 1:]
    t = meshkit.Trainer(_token_loss, params, optax.sgd(0.1), plan="dp+tp", mesh="data=4,model=2",
                        logical_axes={"emb": (None, None), **AXES})  # fmt: skip
    r = t.report(batch)
    model_rows = [c for c in r.communication if c.axes == "model"]
    assert model_rows and all(c.ratio == 1.0 for c in model_rows), str(r)


# -- a BatchNorm that names its axis (Flax's ResNet: axis_name='batch', for pmap) -----------------
class _NamedBN(nn.Module):
    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(
            16, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        )(x)
        h = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(h)
        return nn.Dense(
            4, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        )(nn.relu(h))


def _bn_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x, train=True) - y) ** 2)


def _bn_reference(variables, batch, steps):
    """One device, the one-device meaning of the statistics: BatchNorm over the whole batch."""
    module, tx = _NamedBN(axis_name=None), optax.sgd(0.1)
    params, stats = variables["params"], variables["batch_stats"]
    opt = tx.init(params)
    for _ in range(steps):

        def loss(p, stats=stats):
            out, upd = module.apply({"params": p, "batch_stats": stats}, batch[0], mutable=["batch_stats"])
            return jnp.mean((out - batch[1]) ** 2), upd

        (_, upd), g = jax.value_and_grad(loss, has_aux=True)(params)
        u, opt = tx.update(g, opt, params)
        params, stats = optax.apply_updates(params, u), upd["batch_stats"]
    return params, stats


@pytest.mark.parametrize(("plan", "mesh"), [("zero3", "data=8"), ("tp", "model=8")])
def test_a_batchnorm_that_names_its_axis_has_the_one_device_meaning(plan, mesh):
    # before: 'unbound axis name: batch' (and binding it by hand gave per-device statistics)
    x, y = _batch()
    module = _NamedBN()
    variables = nn.meta.unbox(module.init(jax.random.key(0), x[:2], train=False))
    t = meshkit.Trainer(_bn_loss, meshkit.from_linen(module, module.init(jax.random.key(0), x[:2], train=False)),
                        optax.sgd(0.1), plan=plan, mesh=mesh)  # fmt: skip
    for _ in range(3):
        t.step((x, y))
    params, stats = _bn_reference(variables, (x, y), 3)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)  # noqa: E731
    jax.tree.map(close, t.params, params)
    jax.tree.map(close, t.state["batch_stats"], stats)


def test_remat_on_a_loss_without_layers_is_refused_before_compiling():
    # before: accepted silently (only the report said no layers were found)
    t = meshkit.Trainer(_bf16_loss, _params(), optax.sgd(0.1), plan="dp", mesh="data=8", remat="layer")
    with pytest.raises(
        meshkit.PlanError,
        match=r"remat='layer' checkpoints per layer, but the loss has no layers .*meshkit.layer",
    ):
        t.step(_batch())


def test_rng_and_the_losss_key_argument_must_agree_in_one_line():
    with pytest.raises(
        meshkit.PlanError,
        match=r"rng= passes a key .* loss_fn\(params, batch\) takes none: write loss_fn\(params, batch, key\)",
    ):
        meshkit.Trainer(_bf16_loss, _params(), optax.sgd(0.1), plan="dp", rng=0)
    with pytest.raises(
        meshkit.PlanError, match=r"loss_fn takes a key after params, batch but no rng= is given"
    ):
        meshkit.Trainer(lambda p, batch, key: _bf16_loss(p, batch), _params(), optax.sgd(0.1), plan="dp")


def test_a_raw_equinox_models_int_leaf_points_to_the_adapter():
    import equinox as eqx

    class Model(eqx.Module):
        w: jax.Array
        n: int

    with pytest.raises(
        meshkit.PlanError,
        match=r"params leaf n is a Python int \(3\) of an Equinox module: use meshkit.from_equinox\(model\)",
    ):
        meshkit.Trainer(lambda m, b: jnp.sum(m.w), Model(jnp.ones(3), 3), optax.sgd(0.1), plan="dp")


# -- relative_difference: one scale per tree, leaves paired by path -----------------------------------
class _Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.MultiHeadDotProductAttention(num_heads=2)(x))


def test_relative_difference_of_linen_trees_equal_to_float_noise_is_float_noise():
    # before: 0.90 for trees equal to 6e-8, the attention's key bias (exactly 0 in exact arithmetic:
    # softmax ignores it, its gradient is rounding, ~4e-10) divided by its own size
    from meshkit.verify import relative_difference

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6, 8)).astype(np.float32), rng.normal(size=(16, 6, 4)).astype(np.float32)
    module = _Attention()
    variables = module.init(jax.random.key(0), x[:1])
    tx = optax.sgd(0.1)
    t = meshkit.Trainer(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), meshkit.from_linen(module, variables), tx,
                        plan="dp", mesh="data=8")  # fmt: skip

    @jax.jit
    def step(p, s):
        g = jax.grad(lambda p: jnp.mean((module.apply({"params": p}, x) - y) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    params, opt = variables["params"], tx.init(variables["params"])
    for _ in range(3):
        t.step((x, y))
        params, opt = step(params, opt)
    key_bias = np.abs(params["MultiHeadDotProductAttention_0"]["key"]["bias"]).max()
    assert key_bias < 1e-6  # the leaf that is noise
    largest = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                  zip(jax.tree.leaves(t.params), jax.tree.leaves(params), strict=True))  # fmt: skip
    assert largest < 1e-6
    assert relative_difference(t.params, params) < 1e-6
    # a real difference in any leaf still shows, on the tree's scale
    moved = jax.tree.map(lambda a: a, params)
    moved["Dense_0"]["kernel"] = moved["Dense_0"]["kernel"] * 1.01
    assert relative_difference(t.params, moved) > 1e-3


def test_relative_difference_pairs_leaves_by_path_and_compares_other_leaves_exactly():
    from meshkit.verify import relative_difference

    a = {"w": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}
    with pytest.raises(ValueError, match=r"differ in structure: \[\"\['c'\]\", \"\['w'\]\"\]"):
        relative_difference(a, {"c": np.ones(3), "b": np.zeros(2)})  # was paired by position: 0
    assert relative_difference({**a, "n": 3}, {**a, "n": 3}) == 0
    assert relative_difference({**a, "n": 3}, {**a, "n": 4}) == float("inf")
    keys = {"k": jax.random.key(0)}
    assert relative_difference({**a, **keys}, {**a, **keys}) == 0


# -- a model that sets its own sharding, under a plan that runs the loss manual over data -----------
def _own_sharding_loss(kind):
    from jax.sharding import PartitionSpec as P

    def loss(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w1"])
        if kind == "constraint":  # the user's mesh, as a model written for jit alone names it
            mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
            h = jax.lax.with_sharding_constraint(h, jax.sharding.NamedSharding(mesh, P("data", None)))
        else:  # what nnx.Embed(..., out_sharding=) does
            h = jax.sharding.auto_axes(jnp.tanh, out_sharding=P("data", None))(h)
        return jnp.mean((h @ p["w2"] - y) ** 2)

    return loss


@pytest.mark.parametrize("kind", ["constraint", "auto_axes"])
def test_a_loss_that_sets_its_own_sharding_under_a_manual_plan_fails_in_one_line(kind):
    # before: "Going from `Manual` AxisType to `Auto` ... Please file a bug" / "pspec ... contains a
    # manual axes" from deep inside JAX's lowering
    t = meshkit.Trainer(_own_sharding_loss(kind), _params(), optax.sgd(0.1), plan="zero3", mesh="data=8")
    with pytest.raises(PlanError) as e:
        t.step(_batch())
    line = str(e.value)
    assert "\n" not in line
    assert "test_user_models.py:" in line and "in loss" in line  # where the annotation is
    assert "plan zero3 runs it in jax.shard_map" in line and "use plan dp or tp without accumulate=" in line
    ok = meshkit.Trainer(_own_sharding_loss(kind), _params(), optax.sgd(0.1), plan="dp", mesh="data=8")
    assert np.isfinite(float(ok.step(_batch())["loss"]))  # the plan the line names trains it


def test_the_assembled_step_is_callable_as_the_jitted_step_it_wraps():
    # before: the wrapper that turns a loss's own sharding into one line defined lower() only, so
    # build_step(...)(...) and Trainer.assembled.step(...) raised "object is not callable"
    loss = lambda p, b: jnp.mean((jnp.tanh(b[0] @ p["w1"]) @ p["w2"] - b[1]) ** 2)  # noqa: E731
    t = meshkit.Trainer(loss, _params(), optax.sgd(0.1), plan="zero3", mesh="data=8")
    batch, key = t.put_batch(_batch()), t._step_key()
    fresh = lambda: jax.tree.map(jnp.copy, (t.params, t.opt_state, t.state))  # noqa: E731 (the step donates them)
    called = t.assembled.step(*fresh(), batch, key)
    assert bitwise_equal(called[0], t.compiled(_batch())(*fresh(), batch, key)[0])
