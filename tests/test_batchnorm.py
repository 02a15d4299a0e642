"""A linen ResNet with cross-replica BatchNorm (``axis_name='batch'``, ``batch_stats`` mutable) trained
through meshkit equals one device on the whole batch under every data plan (issue 35, item 1).

The model is a tiny copy of Flax's ImageNet ResNet (google/flax at 97ca05d2, examples/imagenet/models.py:
``ResNetBlock`` with ``norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
epsilon=1e-5, axis_name='batch')``, zero-initialised last scale): 2 blocks, 8 channels, 8x8 images,
10 classes. "The vmap workaround" is the loss binding ``'batch'`` itself with a per-example
``jax.vmap(..., axis_name='batch')``: on one device that vmap spans the whole batch; under zero3
(a manual data region) meshkit used to leave the bound name alone, so each device averaged its own
rows (losses and params drifted: params max |diff| 0.08 after 4 steps).

hsdp splits the batch over two mesh axes (``replica`` x ``data``): the Equinox MLP's BatchNorm was
given them as one nested name (its own copy of the axis rule) and raised JAX's "unbound axis name:
('replica', 'data')"; every adapter now asks ``batch_norm_axis``. Linen and Equinox under hsdp equal
one device like the rest.
"""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import meshkit
from _tiers import tiered
from meshkit.verify import verify_model

STEPS, LR, TOL = 4, 1e-2, 2e-5
# Every plan's mesh is data=8, but hsdp's: the batch over two axes.
MESHES = {"hsdp": "replica=2,data=4"}


class Block(nn.Module):
    filters: int
    norm: functools.partial

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(x)
        y = nn.relu(self.norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        return nn.relu(x + y)


class ResNet(nn.Module):
    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train=True):
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name=self.axis_name
        )
        x = nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
        for _ in range(2):
            x = Block(8, norm)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def _loss(vmap):
    def loss(model, batch):
        x, y = batch
        if vmap:  # the loss binds 'batch' itself, one example per vmap lane
            logits = jax.vmap(lambda xi: model(xi[None], train=True)[0], axis_name="batch")(x)
        else:
            logits = model(x, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss


MODEL = ResNet()
VARIABLES = MODEL.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)), train=False)
BATCH = (jax.random.normal(jax.random.key(1), (16, 8, 8, 3)), jnp.arange(16) % 10)


class _Bound:
    """One device: ``module.apply`` with ``batch_stats`` mutable, as the loss sees meshkit's model."""

    def __init__(self, module, variables):
        self.module, self.variables, self.updates = module, variables, {}

    def __call__(self, *args, **kwargs):
        out, self.updates = self.module.apply(self.variables, *args, mutable=["batch_stats"], **kwargs)
        return out


@functools.cache
def _one_device(vmap):
    loss, tx = _loss(vmap), optax.adam(LR)
    # one device, the whole batch: the vmap binds 'batch'; without it the mean is the batch's own
    module = MODEL if vmap else MODEL.clone(axis_name=None)
    params, stats = VARIABLES["params"], {"batch_stats": VARIABLES["batch_stats"]}
    opt = tx.init(params)

    @jax.jit
    def step(params, stats, opt):
        def f(p):
            bound = _Bound(module, {"params": p, **stats})
            return loss(bound, BATCH), bound.updates

        (value, stats), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), stats, opt, value

    losses = []
    for _ in range(STEPS):
        params, stats, opt, value = step(params, stats, opt)
        losses.append(float(value))
    return losses, params, stats


def _max_diff(a, b):
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    assert pairs
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)


# Tiers: dp's plain form and zero2's vmap form are core (the vmap form's batch statistics over the data
# axis in zero2-vmap), zero3 and hsdp (the batch's statistics over two mesh axes) in
# test_equinox_batchnorm_equals_one_device[zero3] and [hsdp]; dp's vmap form, zero2's plain form (moved when
# make test measured 22 min: the plain form core in dp-plain, zero2's sharded update beside a carried
# BatchNorm state in zero2-vmap), zero1, zero3 and hsdp's forms sweep.
BN = [(plan, vmap) for plan in ("dp", "zero1", "zero2", "zero3", "hsdp") for vmap in (True, False)]
BN_IDS = [f"{plan}-{'vmap' if vmap else 'plain'}" for plan, vmap in BN]


@pytest.mark.parametrize(
    ("plan", "vmap"),
    tiered(BN, BN_IDS, core={"dp-plain", "zero2-vmap"}),
)
def test_resnet_batchnorm_equals_one_device(plan, vmap):
    want_losses, want_params, want_stats = _one_device(vmap)
    t = meshkit.Trainer(_loss(vmap), meshkit.from_linen(MODEL, VARIABLES), optax.adam(LR), plan=plan,
                        mesh=MESHES.get(plan, "data=8"))  # fmt: skip
    losses = [float(t.step(BATCH)["loss"]) for _ in range(STEPS)]
    assert losses == pytest.approx(want_losses, abs=TOL)
    assert _max_diff(t.params, want_params) <= TOL
    assert set(t.state) == {"batch_stats"}
    assert _max_diff(t.state, want_stats) <= TOL
    # the statistics moved (the comparison above is not of two initial states)
    assert _max_diff(t.state, {"batch_stats": VARIABLES["batch_stats"]}) > 1e-3


@pytest.mark.parametrize("plan", ["dp", "zero3"])
def test_accumulation_with_batch_statistics_is_refused(plan):
    """Micro-batches each have their own BatchNorm mean (one device has one): refused in one line."""
    t = meshkit.Trainer(_loss(True), meshkit.from_linen(MODEL, VARIABLES), optax.adam(LR), plan=plan,
                        mesh="data=8", accumulate=2)  # fmt: skip
    with pytest.raises(meshkit.PlanError, match="accumulate=2") as e:
        t.step(BATCH)
    assert "\n" not in str(e.value)


class ShardStats(nn.Module):
    """A deliberately wrong statistic: a running mean of the rows the call sees, with no axis name
    (no BatchNorm for meshkit to join to the data axis), so under a manual data region it is each
    device's own. It does not feed the output: only a comparison of the state can catch it."""

    @nn.compact
    def __call__(self, x, train=True):
        mean = self.variable("batch_stats", "mean", jnp.zeros, x.shape[-1:])
        if train and not self.is_initializing():
            mean.value = 0.9 * mean.value + 0.1 * jnp.mean(x, axis=(0, 1, 2))
        return ResNet(axis_name=None)(x, train)


def _certificate(module, plan):
    variables = module.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)), train=False)
    return verify_model(_loss(False), meshkit.from_linen(module, variables), BATCH, optax.adam(LR),
                                plan=plan, mesh="data=8", steps=2)  # fmt: skip


def test_certificate_compares_batch_statistics():
    right = _certificate(ResNet(axis_name=None), "zero3")
    assert right.state_exact_vs_single_device is not None
    assert right.checks["float64: state = one device"], right.state_exact_vs_single_device
    wrong = _certificate(ShardStats(), "zero3")
    assert wrong.checks["float64: plan = one device"]  # the parameters cannot see it
    assert not wrong.checks["float64: state = one device"], wrong.state_exact_vs_single_device
    assert not wrong.ok


class EqxNet(eqx.Module):
    """An Equinox MLP with a batch-mode BatchNorm whose ``axis_name`` the loss's vmap binds (as
    ``examples/equinox_mlp.py``)."""

    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        # No bias before the BatchNorm (as the example): its gradient is zero up to rounding, which
        # Adam scales up to steps of LR, different on every layout (one device and dp differ by 0.03).
        self.linear = eqx.nn.Linear(4, 8, use_bias=False, key=k1)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(8, 2, key=k2)

    def __call__(self, x, state):
        x, state = self.norm(self.linear(x), state)
        return self.head(jax.nn.relu(x)), state


def _eqx_loss(model, state, batch):
    x, y = batch
    out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.mean((out - y) ** 2), state


EQX_BATCH = (jax.random.normal(jax.random.key(2), (32, 4)), jax.random.normal(jax.random.key(3), (32, 2)))


@functools.cache
def _eqx_one_device():
    """One device, the whole batch: the loss's vmap spans it, so BatchNorm's mean is the batch's."""
    model, state = eqx.nn.make_with_state(EqxNet)(jax.random.key(0))
    tx = optax.adam(LR)
    opt = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, opt):
        (value, state), grads = eqx.filter_value_and_grad(_eqx_loss, has_aux=True)(model, state, EQX_BATCH)
        updates, opt = tx.update(grads, opt, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, opt, value

    losses = []
    for _ in range(STEPS):
        model, state, opt, value = step(model, state, opt)
        losses.append(float(value))
    return losses, eqx.filter(model, eqx.is_inexact_array), state


@pytest.mark.parametrize("plan", ["zero3", "hsdp"])
def test_equinox_batchnorm_equals_one_device(plan):
    """zero3 splits the batch over one mesh axis, hsdp over two (before: a raw NameError under hsdp)."""
    want_losses, want_params, want_state = _eqx_one_device()
    model, state = eqx.nn.make_with_state(EqxNet)(jax.random.key(0))
    t = meshkit.Trainer(_eqx_loss, meshkit.from_equinox(model, state), optax.adam(LR), plan=plan,
                        mesh=MESHES.get(plan, "data=8"))  # fmt: skip
    losses = [float(t.step(EQX_BATCH)["loss"]) for _ in range(STEPS)]
    assert losses == pytest.approx(want_losses, abs=TOL)
    assert _max_diff(t.params, want_params) <= TOL
    assert _max_diff(t.state, want_state) <= TOL
    # the statistics moved (the comparison above is not of two initial states)
    assert _max_diff(t.state, state) > 1e-3


@pytest.mark.parametrize("plan", ["dp", "zero3"])
def test_equinox_accumulation_with_batch_statistics_is_refused(plan):
    """As for Flax: an eqx.nn.BatchNorm's batch mean under accumulate=2 would be each micro-batch's own
    (unlike one device), refused in one line; in inference mode (its running statistics) it trains."""
    model, state = eqx.nn.make_with_state(EqxNet)(jax.random.key(0))
    t = meshkit.Trainer(_eqx_loss, meshkit.from_equinox(model, state), optax.adam(LR), plan=plan,
                        mesh="data=8", accumulate=2)  # fmt: skip
    with pytest.raises(meshkit.PlanError, match="accumulate=2") as e:
        t.step(EQX_BATCH)
    assert "\n" not in str(e.value)
    t = meshkit.Trainer(_eqx_loss, meshkit.from_equinox(eqx.nn.inference_mode(model), state), optax.adam(LR),
                        plan=plan, mesh="data=8", accumulate=2)  # fmt: skip
    assert jnp.isfinite(t.step(EQX_BATCH)["loss"])
