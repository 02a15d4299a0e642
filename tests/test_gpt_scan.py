"""The GPT's scanned form (stacked blocks under lax.scan) against its Python-loop form, and the converters."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshkit
from meshkit.models import gpt

CFG = gpt.GPTConfig(vocab_size=13, seq_len=8, layers=3, width=16, heads=4)
SCAN = dataclasses.replace(CFG, scan_layers=True)


def _batch(seed=0, b=4):
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, CFG.seq_len + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def test_scanned_init_is_the_stacked_loop_init_and_the_converters_invert():
    loop = gpt.init(jax.random.key(0), CFG)
    scanned = gpt.init(jax.random.key(0), SCAN)
    assert gpt.blocks_form(loop) == "layers" and gpt.blocks_form(scanned) == "scanned"
    assert scanned["blocks"]["attn"]["wq"].shape == (CFG.layers, CFG.width, CFG.width)
    assert jax.tree.all(jax.tree.map(np.array_equal, gpt.to_scanned(loop), scanned))
    back = gpt.to_layers(scanned)
    assert jax.tree.structure(back) == jax.tree.structure(loop)
    assert jax.tree.all(jax.tree.map(np.array_equal, back, loop))
    assert gpt.to_scanned(scanned) is scanned and gpt.to_layers(loop) is loop  # idempotent


def test_both_forms_give_the_same_loss_and_gradients_in_float64():
    with jax.enable_x64(True):
        c64, s64 = (dataclasses.replace(c, dtype="float64") for c in (CFG, SCAN))
        loop = jax.tree.map(lambda a: np.asarray(a, np.float64), gpt.init(jax.random.key(1), CFG))
        batch = _batch(1)
        l1, g1 = jax.jit(jax.value_and_grad(gpt.make_loss(c64)))(
            loop, batch
        )  # jitted: one compile, not one per op
        l2, g2 = jax.jit(jax.value_and_grad(gpt.make_loss(s64)))(gpt.to_scanned(loop), batch)
        assert abs(float(l1) - float(l2)) < 1e-13
        diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), gpt.to_scanned(g1), g2)
        assert max(jax.tree.leaves(diffs)) < 1e-12
        assert (
            max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g2)) > 1e-3
        )  # gradients are not all zero


def test_the_form_must_match_the_config():
    loop = gpt.init(jax.random.key(0), CFG)
    tokens, _ = _batch()
    with pytest.raises(ValueError, match=r"cfg.scan_layers=True: convert with gpt.to_scanned\(params\)"):
        gpt.apply(loop, tokens, SCAN)
    with pytest.raises(ValueError, match=r"gpt.to_layers\(params\)"):
        gpt.apply(gpt.to_scanned(loop), tokens, CFG)


def test_scanned_logical_axes_lead_with_layers():
    scanned = gpt.init(jax.random.key(0), SCAN)
    axes = gpt.logical_axes(scanned)
    assert axes["blocks"]["attn"]["wq"] == ("layers", "embed", "heads")
    assert axes["blocks"]["ln1"]["scale"] == ("layers", "embed")
    assert axes["tok_embed"] == ("vocab", "embed")
    for leaf, names in zip(
        jax.tree.leaves(scanned), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)), strict=True
    ):
        assert len(names) == leaf.ndim


def test_layer_hook_is_a_plain_call_outside_a_plan():
    calls = []

    def block(p, x):
        calls.append(1)
        return x * p["s"]

    out = meshkit.layer(block)({"s": jnp.float32(3.0)}, jnp.ones(2))
    assert calls == [1] and np.array_equal(out, [3.0, 3.0])


def test_optimizer_state_converts_with_the_parameters():
    import optax

    loop = gpt.init(jax.random.key(0), CFG)
    opt = optax.adamw(1e-3)
    state = opt.init(loop)
    g = jax.jit(jax.grad(gpt.make_loss(CFG)))(loop, _batch())
    update = jax.jit(opt.update)  # one compile per form, not one per op
    _, state = update(g, state, loop)
    scanned_state = gpt.to_form(state, scan_layers=True)
    assert scanned_state[0].mu["blocks"]["mlp"]["w_in"].shape == (CFG.layers, CFG.width, CFG.mlp_width)
    assert int(scanned_state[0].count) == int(state[0].count)  # non-parameter leaves untouched
    back = gpt.to_form(scanned_state, scan_layers=False)
    assert jax.tree.all(jax.tree.map(np.array_equal, back, state))
    # the scanned model continues from the converted state exactly as the loop model would
    s_params = gpt.to_scanned(loop)
    u1, _ = update(g, state, loop)
    u2, _ = update(gpt.to_scanned(g), scanned_state, s_params)
    assert jax.tree.all(jax.tree.map(np.allclose, gpt.to_scanned(u1), u2))
