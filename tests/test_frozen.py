"""Frozen parameters (``trainable=``): frozen leaves come out of steps bit for bit, have no optimizer
state and no gradient collective, and the trainable ones train as on one device."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from _reference import max_rel, one_device_frozen
from meshkit import MeshkitError
from meshkit.analysis import communication
from meshkit.models import llama
from meshkit.plans import Trainable
from meshkit.train import Trainer

CFG = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64)


def _attn(path: str) -> bool:
    return "/attn/" in path


def _paths(params):
    return [
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]


def _batch():
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(16, CFG.seq_len + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


# Tiers: zero3 is core; fsdp+tp sweeps (frozen leaves under fsdp+tp, float64 against one device, are core
# in test_lora.py's test_lora_under_the_plans_matches_one_device_in_float64[fsdp+tp]: the frozen base).
@pytest.mark.parametrize(
    ("plan", "mesh"),
    [("zero3", "data=8"), pytest.param("fsdp+tp", "data=4,model=2", marks=pytest.mark.sweep)],
)
def test_frozen_leaves_stay_put_have_no_state_and_train_the_rest_as_one_device(plan, mesh):
    with jax.enable_x64(True):
        cfg = dataclasses.replace(CFG, dtype="float64")
        params = llama.init(jax.random.key(0), cfg)
        t = Trainer(llama.make_loss(cfg), params, optax.adam(1e-2), plan=plan, mesh=mesh,
                    logical_axes=llama.logical_axes(params), units=llama.units(cfg), trainable=_attn)  # fmt: skip
        for _ in range(2):
            t.step(_batch())
        got = jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, t.params))[0]
        before = jax.tree.leaves(params)
        for (path, x), x0 in zip(got, before, strict=True):
            if "attn" not in jax.tree_util.keystr(path):
                assert np.array_equal(x, np.asarray(x0)), path  # bit for bit
        assert (
            max_rel(
                t.params,
                one_device_frozen(llama.make_loss(cfg), params, _batch(), 2, optax.adam(1e-2), _attn),
            )
            < 1e-10
        )
    mu = t.opt_state[0].mu  # Adam's first moment: the attention leaves alone (None for the frozen ones)
    assert mu["tok_embed"] is None and mu["blocks"][0]["mlp"]["w_up"] is None
    assert len(jax.tree.leaves(t.opt_state)) == 2 * 2 * 4 + 1  # mu and nu of 2 x 4 matrices, the count


@pytest.mark.parametrize(("plan", "remat"), [("zero2", "none"), ("zero3", "layer")])
def test_the_compiled_step_moves_no_gradient_of_a_frozen_leaf(plan, remat):
    """On data=8 full training reduce-scatters every gradient; with only the attention trainable the
    reduced bytes are the attention leaves' (and the loss), nothing of the frozen ones (zero3: their
    per-layer gathers' transposes are gone too)."""
    params = llama.init(jax.random.key(0), CFG)

    def reduced(trainable):
        t = Trainer(llama.make_loss(CFG), params, optax.adam(1e-2), plan=plan, mesh="data=8", remat=remat,
                    logical_axes=llama.logical_axes(params), trainable=trainable)  # fmt: skip
        totals = communication(t.compiled(_batch())).by_op()
        return sum(totals[k].size_bytes for k in ("all-reduce", "reduce-scatter") if k in totals)

    attn = sum(
        x.nbytes
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if "attn" in jax.tree_util.keystr(p)
    )
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    full, frozen = reduced(None), reduced(_attn)
    assert full >= total and frozen < attn + 1024 < total, (full, frozen, attn, total)


def test_trainable_as_a_tree_and_its_bad_forms_are_one_line():
    params = llama.init(jax.random.key(0), CFG)
    prefix = {k: k == "norm_f" for k in params}  # a prefix of the parameters' tree
    assert Trainable.of(prefix, params).mask == tuple(p.startswith("norm_f") for p in _paths(params))
    with pytest.raises(MeshkitError, match="tree of bools shaped like the parameters"):
        Trainable.of({"wrong": True}, params)
    with pytest.raises(MeshkitError, match="freezes every parameter"):
        Trainer(
            llama.make_loss(CFG),
            params,
            optax.adam(1e-2),
            plan="dp",
            mesh="data=8",
            trainable=lambda p: False,
        )
