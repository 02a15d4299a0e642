"""Real transformers from the frameworks' own examples, trained by meshkit (issue 22): tensor
parallel with logical axes or path rules, ``meshkit.layer`` (per-layer ZeRO-3 gathers and remat),
and pipeline stages; each equals a one-device loop written in the framework's own style.

- Flax linen: the decoder-only ``TransformerLM`` of Flax's lm1b example (flax/examples/lm1b/models.py,
  Apache-2.0), kept to its structure and partition metadata (``nn.with_logical_partitioning``);
  tiny sizes, no dropout (lm1b's config sets rates; they are 0 here so the pipeline can run it).
- Equinox: the transformer layer of Equinox's BERT example (docs/examples/bert.ipynb: an
  ``eqx.nn.MultiheadAttention`` block and an MLP block, each with LayerNorm, residual and dropout).

float32 with 1e-5 relative (the adapters' bound: the plans sum gradients in another order).
One compile per model x plan; the references are cached per module.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit.verify import relative_difference

VOCAB, SEQ, WIDTH, HEADS, MLP, LAYERS, STEPS, LR, TOL = 32, 8, 16, 2, 32, 2, 4, 1e-2, 1e-5


def _tokens():
    t = np.random.default_rng(0).integers(0, VOCAB, size=(8, SEQ + 1)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def _xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# -- Flax linen: lm1b's TransformerLM (decoder only) -------------------------------------------------
kinit = nn.initializers.xavier_uniform()


class MlpBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(MLP, kernel_init=nn.with_logical_partitioning(kinit, ("embed", "mlp")))(x)
        return nn.Dense(WIDTH, kernel_init=nn.with_logical_partitioning(kinit, ("mlp", "embed")))(nn.relu(h))


class EncoderDecoder1DBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask=None):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=HEADS, use_bias=False, broadcast_dropout=False, deterministic=True,
            kernel_init=nn.with_logical_partitioning(kinit, ("embed", "heads", "kv")),
            out_kernel_init=nn.with_logical_partitioning(kinit, ("heads", "kv", "embed")),
        )(h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])) if mask is None else mask)  # fmt: skip
        x = x + h
        return x + MlpBlock()(nn.LayerNorm()(x))


class Decoder(nn.Module):
    def setup(self):
        self.embed = nn.Embed(VOCAB, WIDTH, embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")))  # fmt: skip
        self.pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, SEQ, WIDTH))
        self.layers = [EncoderDecoder1DBlock(name=f"encoderdecoderblock_{i}") for i in range(LAYERS)]
        self.norm = nn.LayerNorm(name="encoderdecoder_norm")

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.embed.attend(self.norm(x))  # lm1b's shared embedding as the logits


class TransformerLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return Decoder(name="decoder")(tokens)


LM = TransformerLM()
LM_VARS = LM.init(jax.random.key(0), _tokens()[0][:1])


def linen_loss(model, batch):
    tokens, targets = batch
    return _xent(model(tokens), targets)


def each_block_a_layer(next_fun, args, kwargs, context):
    """A linen interceptor that runs every block through ``meshkit.layer`` (the block's own
    parameters, applied as a pure function), so ZeRO-3 gathers and remat act per block."""
    m = context.module
    if (
        isinstance(m, EncoderDecoder1DBlock)
        and context.method_name == "__call__"
        and isinstance(m.parent, nn.Module)
    ):
        # (the block applied on its own, below, has no parent module: it runs as it is)
        apply = lambda p, *a: m.clone(parent=None).apply({"params": p}, *a, **kwargs)  # noqa: E731
        return meshkit.layer(apply)(m.variables["params"], *args)
    return next_fun(*args, **kwargs)


def linen_layered_loss(model, batch):
    with nn.intercept_methods(each_block_a_layer):
        return linen_loss(model, batch)


_REF: dict = {}


def _linen_reference():
    if "linen" not in _REF:
        params, tx = nn.meta.unbox(LM_VARS["params"]), optax.adamw(LR)

        @jax.jit
        def step(params, opt, batch):
            g = jax.grad(lambda p: _xent(LM.apply({"params": p}, batch[0]), batch[1]))(params)
            u, opt = tx.update(g, opt, params)
            return optax.apply_updates(params, u), opt

        opt = tx.init(params)
        for _ in range(STEPS):
            params, opt = step(params, opt, _tokens())
        _REF["linen"] = params
    return _REF["linen"]


# Tiers: the layered case is core (fsdp+tp with the metadata's logical axes, and per-block gathers and
# remat on top); the plain loss sweeps (the linen MLP's fsdp+tp without hooks: test_adapters.py).
@pytest.mark.parametrize(
    ("loss", "plan", "mesh", "remat"),
    [
        pytest.param(
            linen_loss, "fsdp+tp", "data=4,model=2", "none", marks=pytest.mark.sweep
        ),  # logical axes from the metadata
        (linen_layered_loss, "fsdp+tp", "data=4,model=2", "layer"),  # + per-block gathers and remat
    ],
)
def test_flax_lm1b_transformer_under_tensor_parallel_and_per_layer_plans(loss, plan, mesh, remat):
    t = meshkit.Trainer(loss, meshkit.from_linen(LM, LM_VARS), optax.adamw(LR), plan=plan, mesh=mesh,
                        remat=remat, rules={"vocab": None})  # fmt: skip
    losses = [float(t.step(_tokens())["loss"]) for _ in range(STEPS)]
    assert losses[-1] < losses[0]
    q = t.params["decoder"]["encoderdecoderblock_0"]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
    assert q.sharding.spec[1] == "model"  # heads split over the model axis
    assert relative_difference(t.params, _linen_reference()) <= TOL
    if loss is linen_layered_loss:
        found = t.assembled.per_layer.found
        assert found.mode == "hook" and found.layers == LAYERS and found.layer_leaves, found.note


def _restack(tree, is_leaf=None):
    """lm1b's parameters (or their logical axes) as Stages holds them: the blocks stacked."""
    d = tree["decoder"]
    blocks = [d[f"encoderdecoderblock_{i}"] for i in range(LAYERS)]
    stack = (lambda *a: (None, *a[0])) if is_leaf else (lambda *a: jnp.stack(a))
    return {"embed": d["embed"], "pos": d["pos_embedding"], "norm": d["encoderdecoder_norm"],
            "blocks": jax.tree.map(stack, *blocks, is_leaf=is_leaf)}  # fmt: skip


#: lm1b's decoder as a pipeline sees it: the model's own modules, applied piece by piece.
LINEN_STAGES = meshkit.Stages(
    embed=lambda top, b: nn.Embed(VOCAB, WIDTH).apply({"params": top["embed"]}, b[0]) + top["pos"],
    block=lambda p, x: EncoderDecoder1DBlock().apply({"params": p}, x),
    head=lambda top, x: nn.Embed(VOCAB, WIDTH).apply(
        {"params": top["embed"]}, nn.LayerNorm().apply({"params": top["norm"]}, x), method="attend"
    ),
    loss=lambda logits, b: _xent(logits, b[1]),
)


def test_flax_lm1b_transformer_as_pipeline_stages_equals_the_models_own_loop():
    axes = _restack(meshkit.from_linen(LM, LM_VARS).logical_axes, is_leaf=lambda x: isinstance(x, tuple))
    t = meshkit.Trainer(LINEN_STAGES, _restack(nn.meta.unbox(LM_VARS["params"])), optax.adamw(LR),
                        plan="dp+tp+pp", mesh="stage=2,data=2,model=2", microbatches=2, logical_axes=axes,
                        rules={"vocab": None})  # fmt: skip
    losses = [float(t.step(_tokens())["loss"]) for _ in range(STEPS)]
    assert losses[-1] < losses[0]
    assert t.params["blocks"]["MlpBlock_0"]["Dense_0"]["kernel"].sharding.spec[0] == "stage"
    assert relative_difference(t.params, _restack(_linen_reference())) <= TOL


# -- Equinox: the transformer layer of Equinox's BERT example ---------------------------------------
class AttentionBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        # BERT's biases but the key's: softmax ignores it, its gradient is rounding, which adamw
        # turns into full-size steps of either sign (no two summation orders agree on them)
        self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, use_query_bias=True, use_key_bias=False,
                                                   use_value_bias=True, use_output_bias=True, key=key)  # fmt: skip
        self.layernorm = eqx.nn.LayerNorm(WIDTH)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, x, mask, key=None):
        h = self.attention(x, x, x, mask=mask)
        h = self.dropout(h, key=key, inference=key is None)
        return jax.vmap(self.layernorm)(h + x)


class FeedForwardBlock(eqx.Module):
    mlp: eqx.nn.Linear
    output: eqx.nn.Linear
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.mlp, self.output = eqx.nn.Linear(WIDTH, MLP, key=k1), eqx.nn.Linear(MLP, WIDTH, key=k2)
        self.layernorm, self.dropout = eqx.nn.LayerNorm(WIDTH), eqx.nn.Dropout(0.1)

    def __call__(self, x, key=None):
        h = self.output(jax.nn.gelu(self.mlp(x)))
        return self.layernorm(self.dropout(h, key=key, inference=key is None) + x)


class TransformerLayer(eqx.Module):
    attention_block: AttentionBlock
    ff_block: FeedForwardBlock

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attention_block, self.ff_block = AttentionBlock(k1), FeedForwardBlock(k2)

    def __call__(self, x, key=None):  # x: (SEQ, WIDTH), one example, as the BERT example has it
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        x = self.attention_block(x, jnp.tril(jnp.ones((SEQ, SEQ), bool)), key=k1)
        keys = None if k2 is None else jax.random.split(k2, SEQ)
        return jax.vmap(self.ff_block)(x, keys) if keys is not None else jax.vmap(self.ff_block)(x)


class EqxLM(eqx.Module):
    embed: eqx.nn.Embedding
    layers: list
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, LAYERS + 2)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=ks[0])
        self.layers = [TransformerLayer(k) for k in ks[1:-1]]
        self.head = eqx.nn.Linear(WIDTH, VOCAB, key=ks[-1])


def eqx_layered_loss(model, batch, key):
    """Each TransformerLayer through meshkit.layer: the block (a module, static fields and all) is
    the layer's parameters."""
    tokens, targets = batch

    def one(t, k):
        x = jax.vmap(model.embed)(t)
        for i, layer in enumerate(model.layers):
            x = meshkit.layer(lambda blk, x, k: blk(x, key=k))(layer, x, jax.random.fold_in(k, i))
        return jax.vmap(model.head)(x)

    return _xent(jax.vmap(one)(tokens, jax.random.split(key, tokens.shape[0])), targets)


EQX_RULES = [(r"attention/(query|key|value)_proj/weight", ("model", None)),
             (r"attention/(query|key|value)_proj/bias", ("model",)),
             (r"attention/output_proj/weight", (None, "model")),
             (r"ff_block/mlp/weight", ("model", None)), (r"ff_block/mlp/bias", ("model",)),
             (r"ff_block/output/weight", (None, "model"))]  # fmt: skip


def test_equinox_bert_layers_through_meshkit_layer_and_tensor_parallel_equal_one_device():
    # before: meshkit.layer traced the block's non-array leaves (Dropout's inference flag, an
    # activation function): TypeError / TracerBoolConversionError under every plan
    model, tx, key = EqxLM(jax.random.key(0)), optax.adamw(LR), jax.random.key(7)
    t = meshkit.Trainer(eqx_layered_loss, meshkit.from_equinox(model), tx, plan="fsdp+tp", mesh="data=4,model=2",
                        remat="layer", rng=key, rules=EQX_RULES)  # fmt: skip
    losses = [float(t.step(_tokens())["loss"]) for _ in range(STEPS)]
    assert losses[-1] < losses[0]
    found = t.assembled.per_layer.found
    assert found.mode == "hook" and found.layers == LAYERS and found.layer_leaves, found.note
    q = t.params.layers[0].attention_block.attention.query_proj.weight
    assert q.sharding.spec[0] == "model"

    @eqx.filter_jit
    def step(model, opt, batch, key):
        g = eqx.filter_grad(eqx_layered_loss)(model, batch, key)
        u, opt = tx.update(g, opt, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, u), opt

    opt = tx.init(eqx.filter(model, eqx.is_inexact_array))
    for i in range(STEPS):
        model, opt = step(model, opt, _tokens(), jax.random.fold_in(key, i))
    assert relative_difference(t.params, eqx.filter(model, eqx.is_inexact_array)) <= TOL


# Tiers: sweeps: a user's Stages of a framework's modules under a pipeline are core in
# test_flax_lm1b_transformer_as_pipeline_stages_equals_the_models_own_loop (dp+tp+pp), dp+pp in
# test_pipeline.py.
@pytest.mark.sweep
def test_equinox_bert_layers_as_pipeline_stages_equal_one_device():
    keys = jax.random.split(jax.random.key(1), LAYERS + 2)
    layers = eqx.filter_vmap(TransformerLayer)(keys[:LAYERS])  # Equinox's way to stack identical layers
    blocks, block_static = eqx.partition(layers, eqx.is_inexact_array)
    embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[-2])
    head = eqx.nn.Linear(WIDTH, VOCAB, key=keys[-1])
    params = {"embed": embed.weight, "head": head, "blocks": blocks}
    stages = meshkit.Stages(
        embed=lambda top, b: top["embed"][b[0]],
        block=lambda p, x: jax.vmap(eqx.combine(p, block_static))(x),  # inference: no dropout key
        head=lambda top, x: jax.vmap(jax.vmap(top["head"]))(x),
        loss=lambda logits, b: _xent(logits, b[1]),
    )
    tx = optax.adamw(LR)
    t = meshkit.Trainer(stages, params, tx, plan="dp+pp", mesh="stage=2,data=4", microbatches=2)
    losses = [float(t.step(_tokens())["loss"]) for _ in range(STEPS)]
    assert losses[-1] < losses[0]

    @eqx.filter_jit
    def step(p, opt, batch):
        g = eqx.filter_grad(stages)(p, batch)
        u, opt = tx.update(g, opt, p)
        return eqx.apply_updates(p, u), opt

    opt = tx.init(params)
    for _ in range(STEPS):
        params, opt = step(params, opt, _tokens())
    assert relative_difference(t.params, params) <= TOL
