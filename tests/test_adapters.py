"""Flax NNX, Flax linen and Equinox models, written as their docs write them, trained by meshkit.

Per framework an MLP with BatchNorm and dropout (non-trainable state and randomness) and a small
transformer (the framework's own attention layer, dropout on the residuals) train 10 adamw steps
under dp, zero1, zero3, dp+tp and fsdp+tp; parameters and BatchNorm statistics must equal a
single-device loop written in the framework's own style (relative difference <= 1e-5). One
compile per model x plan; tiny widths.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import meshkit
from _tiers import tiered
from meshkit.verify import relative_difference

#: The MLPs (BatchNorm, dropout) are the runnable examples' own (examples/*.py: 8 -> 32 -> 4).
_EXAMPLES = Path(__file__).parents[1] / "examples"
NNX_EX, LINEN_EX, EQX_EX = (
    runpy.run_path(str(_EXAMPLES / f"{n}_mlp.py")) for n in ("nnx", "linen", "equinox")
)
NnxMLP, nnx_mlp_loss = NNX_EX["MLP"], NNX_EX["loss_fn"]
LinenMLP, linen_mlp_loss = LINEN_EX["MLP"], LINEN_EX["loss_fn"]  # returns (loss, aux): has_aux=True
EqxMLP, eqx_mlp_loss = EQX_EX["MLP"], EQX_EX["loss_fn"]

STEPS, LR, TOL = 10, 1e-2, 1e-5
D_IN, HIDDEN, D_OUT = 8, 32, 4
VOCAB, SEQ, WIDTH, HEADS = 16, 8, 16, 2
PLANS = [("dp", "data=8"), ("zero1", "data=8"), ("zero3", "data=8"), ("dp+tp", "data=4,model=2"),
         ("fsdp+tp", "data=4,model=2")]  # fmt: skip


def _mlp_batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, D_IN)).astype(np.float32)
    return x, np.tanh(x @ rng.normal(size=(D_IN, D_OUT))).astype(np.float32)


def _tokens():
    t = np.random.default_rng(1).integers(0, VOCAB, size=(16, SEQ + 1)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def _floats(tree):
    return [
        np.asarray(a) for a in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)
    ]


def _xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# -- Flax NNX ------------------------------------------------------------------------------------
init = nnx.initializers.lecun_normal()


class NnxBlock(nnx.Module):
    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=d, decode=False, use_bias=False, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("embed", "heads", None)),
            out_kernel_init=nnx.with_partitioning(init, ("heads", None, "embed")),
        )  # fmt: skip
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp_in = nnx.Linear(
            d, 2 * d, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("embed", "mlp"))
        )
        self.mlp_out = nnx.Linear(
            2 * d, d, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("mlp", "embed"))
        )
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.dropout(self.attn(self.ln1(x), mask=mask))
        return x + self.dropout(self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x)))))


class NnxTransformer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (SEQ, WIDTH)))
        self.block = NnxBlock(WIDTH, HEADS, rngs=rngs)
        self.ln_f = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...]
        return self.head(self.ln_f(self.block(x, nnx.make_causal_mask(tokens))))


def nnx_lm_loss(model, batch):
    tokens, targets = batch
    return _xent(model(tokens), targets)


def _nnx_model(kind):
    with nnx.use_eager_sharding(False):  # partition metadata without a mesh at init
        return (
            NnxMLP(D_IN, HIDDEN, D_OUT, rngs=nnx.Rngs(0))
            if kind == "mlp"
            else NnxTransformer(rngs=nnx.Rngs(0))
        )


def _nnx_reference(kind, loss_fn, batch):
    model = _nnx_model(kind)
    optimizer = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    for _ in range(STEPS):
        train_step(model, optimizer, batch)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


# -- Flax linen ----------------------------------------------------------------------------------
class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask, train: bool = True):
        h = nn.MultiHeadDotProductAttention(
            num_heads=HEADS,
            use_bias=False,
            kernel_init=nn.with_logical_partitioning(init, ("embed", "heads", None)),
            out_kernel_init=nn.with_logical_partitioning(init, ("heads", None, "embed")),
        )(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dropout(0.1, deterministic=not train)(h)
        h = nn.Dense(2 * WIDTH, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(
            nn.LayerNorm()(x)
        )
        h = nn.Dense(WIDTH, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(nn.gelu(h))
        return x + nn.Dropout(0.1, deterministic=not train)(h)


class LinenTransformer(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (SEQ, WIDTH))
        x = LinenBlock()(x, nn.make_causal_mask(tokens), train)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def linen_lm_loss(model, batch, key):
    tokens, targets = batch
    return _xent(model(tokens, train=True), targets)


def _linen_model(kind):
    module = LinenMLP() if kind == "mlp" else LinenTransformer()
    x = _mlp_batch()[0] if kind == "mlp" else _tokens()[0]
    return module, module.init(jax.random.key(0), x[:1], train=False)


def _linen_reference(kind, loss_fn, batch):
    module, variables = _linen_model(kind)
    params = nn.meta.unbox(variables["params"])
    state = {k: v for k, v in variables.items() if k != "params"}
    tx = optax.adamw(LR)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, state, opt_state, batch, key):
        def loss(p):
            logits, updates = module.apply({"params": p, **state}, batch[0], train=True, rngs={"dropout": key},
                                           mutable=list(state))  # fmt: skip
            err = jnp.mean((logits - batch[1]) ** 2) if kind == "mlp" else _xent(logits, batch[1])
            return err, updates

        (_, updates), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates_p, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates_p), {**state, **updates}, opt_state

    for step in range(STEPS):
        params, state, opt_state = train_step(
            params, state, opt_state, batch, jax.random.fold_in(jax.random.key(7), step)
        )
    return params, state


# -- Equinox -------------------------------------------------------------------------------------
class EqxTransformer(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        ks = jax.random.split(key, 5)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=ks[0])
        self.pos = 0.02 * jax.random.normal(ks[1], (SEQ, WIDTH))
        self.ln1, self.ln2, self.ln_f = (
            eqx.nn.LayerNorm(WIDTH),
            eqx.nn.LayerNorm(WIDTH),
            eqx.nn.LayerNorm(WIDTH),
        )
        self.attn = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=ks[2])
        self.mlp_in = eqx.nn.Linear(WIDTH, 2 * WIDTH, key=ks[3])
        self.mlp_out = eqx.nn.Linear(2 * WIDTH, WIDTH, key=ks[4])
        self.head = eqx.nn.Linear(WIDTH, VOCAB, key=ks[4])
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, tokens, *, key):
        k1, k2 = jax.random.split(key)
        x = jax.vmap(self.embed)(tokens) + self.pos
        h = jax.vmap(self.ln1)(x)
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        x = x + self.dropout(self.attn(h, h, h, mask=mask), key=k1)
        h = jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(jax.vmap(self.ln2)(x))))
        x = x + self.dropout(h, key=k2)
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


#: Equinox has no partition metadata: tensor-parallel layout by path rules (Linear weights are (out, in)).
EQX_RULES = {
    "mlp": [(r"linear1/weight", ("model", None)), (r"linear2/weight", (None, "model"))],
    "lm": [(r"attn/(query|key|value)_proj/weight", ("model", None)), (r"attn/output_proj/weight", (None, "model")),
           (r"mlp_in/weight", ("model", None)), (r"mlp_in/bias", ("model",)), (r"mlp_out/weight", (None, "model"))],
}  # fmt: skip


def eqx_lm_loss(model, batch, key):
    tokens, targets = batch
    logits = jax.vmap(lambda t, k: model(t, key=k))(tokens, jax.random.split(key, tokens.shape[0]))
    return _xent(logits, targets)


def _eqx_model(kind):
    if kind == "mlp":
        return eqx.nn.make_with_state(EqxMLP)(jax.random.key(0))
    return EqxTransformer(jax.random.key(0)), None


def _eqx_reference(kind, loss_fn, batch):
    model, state = _eqx_model(kind)
    tx = optax.adamw(LR)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, state, opt_state, batch, key):
        if state is None:
            grads = eqx.filter_grad(loss_fn)(model, batch, key)
        else:
            grads, state = eqx.filter_grad(loss_fn, has_aux=True)(model, state, batch, key)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, opt_state

    for step in range(STEPS):
        model, state, opt_state = train_step(
            model, state, opt_state, batch, jax.random.fold_in(jax.random.key(7), step)
        )
    return eqx.filter(model, eqx.is_inexact_array), state


# -- the matrix ----------------------------------------------------------------------------------
CASES = {
    ("nnx", "mlp"): (nnx_mlp_loss, _mlp_batch),
    ("nnx", "lm"): (nnx_lm_loss, _tokens),
    ("linen", "mlp"): (linen_mlp_loss, _mlp_batch),
    ("linen", "lm"): (linen_lm_loss, _tokens),
    ("equinox", "mlp"): (eqx_mlp_loss, _mlp_batch),
    ("equinox", "lm"): (eqx_lm_loss, _tokens),
}
_REFS: dict = {}


def _reference(framework, kind):
    if (framework, kind) not in _REFS:
        loss_fn, data = CASES[framework, kind]
        ref = {"nnx": _nnx_reference, "linen": _linen_reference, "equinox": _eqx_reference}[framework]
        _REFS[framework, kind] = ref("mlp" if kind == "mlp" else "lm", loss_fn, data())
    return _REFS[framework, kind]


def _trainer(framework, kind, plan, mesh):
    loss_fn, _ = CASES[framework, kind]
    if framework == "nnx":
        return meshkit.Trainer(
            loss_fn, meshkit.from_nnx(_nnx_model(kind)), optax.adamw(LR), plan=plan, mesh=mesh
        )
    if framework == "linen":
        adapted = meshkit.from_linen(*_linen_model(kind))
        return meshkit.Trainer(loss_fn, adapted, optax.adamw(LR), plan=plan, mesh=mesh, rng=jax.random.key(7),
                               has_aux=kind == "mlp")  # fmt: skip
    model, state = _eqx_model(kind)
    rules = EQX_RULES[kind] if "tp" in plan else None
    return meshkit.Trainer(loss_fn, meshkit.from_equinox(model, state), optax.adamw(LR), plan=plan, mesh=mesh,
                           rng=jax.random.key(7), rules=rules)  # fmt: skip


# What an adapter meets under a plan: replicated leaves (dp), leaves and optimizer state sharded over
# data (zero3), tensor-parallel rules on top of that (fsdp+tp). zero1 (optimizer state only) and dp+tp
# (rules without data sharding) take paths zero3 and fsdp+tp also take, so they run for Equinox alone
# (modules as pytrees, static fields and rules given by the test); for Flax NNX and Linen those 8 cases
# only repeated paths their zero3 and fsdp+tp cases take.
SUBSUMED = {"zero1", "dp+tp"}
FRAMEWORK_PLANS = [(f, k, plan, mesh) for f, k in CASES for plan, mesh in PLANS
                   if f == "equinox" or plan not in SUBSUMED]  # fmt: skip


# Tiers: each framework's MLP under fsdp+tp (sharded leaves with tensor-parallel rules: dp's and zero3's
# paths and more) is core. The MLPs under dp and zero3 sweep (zero3's, 10.7 CPU s, moved when make test
# measured 22 min): each adapter's leaves and optimizer state sharded over data and its state carried are
# core in its fsdp+tp case here, dp's replicated leaves with a carried BatchNorm state as one device's in
# test_batchnorm.py's test_resnet_batchnorm_equals_one_device[dp-plain] (Linen). The Equinox MLP's zero1
# and dp+tp sweep (the paths of its zero3 and fsdp+tp, as above; zero1 also runs in
# test_examples_run[equinox_mlp]).
# The LMs sweep under every plan (the NNX LM under fsdp+tp, 11.3 CPU s, moved when make test measured 22
# min): each adapter under fsdp+tp is core in its MLP's case, a framework's attention layers under fsdp+tp
# in test_user_transformers.py (lm1b's nn.MultiHeadDotProductAttention from its metadata, layered case; the
# BERT layers' eqx.nn.MultiheadAttention by path rules), dropout under tp in the MLPs' fsdp+tp here.
FRAMEWORK_IDS = ["-".join(c) for c in FRAMEWORK_PLANS]


@pytest.mark.parametrize(
    ("framework", "kind", "plan", "mesh"),
    tiered(
        FRAMEWORK_PLANS,
        FRAMEWORK_IDS,
        core={
            i
            for i, c in zip(FRAMEWORK_IDS, FRAMEWORK_PLANS, strict=True)
            if c[1] == "mlp" and c[2] == "fsdp+tp"
        },
    ),
)
def test_framework_models_equal_a_single_device_loop(framework, kind, plan, mesh):
    ref_params, ref_state = _reference(framework, kind)
    t = _trainer(framework, kind, plan, mesh)
    _, data = CASES[framework, kind]
    batch = data()
    losses = [float(t.step(batch)["loss"]) for _ in range(STEPS)]
    assert losses[-1] < losses[0]
    assert relative_difference(t.params, ref_params) <= TOL
    got, want = _floats(t.state), _floats(ref_state)
    assert len(got) == len(want)
    if kind == "mlp":
        assert got, "the BatchNorm statistics are carried as state"
    assert relative_difference(got, want) <= TOL


@pytest.mark.parametrize("script", ["nnx_mlp", "linen_mlp", "equinox_mlp"])
def test_examples_run(script, capsys):
    {"nnx_mlp": NNX_EX, "linen_mlp": LINEN_EX, "equinox_mlp": EQX_EX}[script]["main"](steps=3)
    out = capsys.readouterr().out
    assert "loss after 3 steps" in out and "eval loss" in out
