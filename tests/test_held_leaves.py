"""Leaves a model holds as read (``models.stack.HELD``: GLM-4.5's router correction bias, which no gradient
moves): ``meshkit train``'s AdamW (``train.optim.optimizer``) leaves them bit for bit as they were, weight
decay included, while every trained leaf moves. Before, AdamW decayed the bias by lr x decay a step."""

import jax
import numpy as np

from meshkit import Trainer
from meshkit.models import llama
from meshkit.spec.batch import TokenBatch
from meshkit.train import config as C
from meshkit.train.optim import decayed, optimizer


def test_adamw_never_moves_a_held_leaf_and_decays_the_rest():
    cfg = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64,
                            experts=4, experts_per_token=2, sigmoid_router=True, expert_groups=2, top_groups=1,
                            routed_scale=2.0, router_renormalize=True, capacity_factor=0.0)  # fmt: skip
    start = jax.tree.map(lambda x: x + 0.1, llama.init(jax.random.key(0), cfg))  # a bias away from zero
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(start)[0]]
    mask = jax.tree.leaves(decayed(start))
    assert [p for p, m in zip(paths, mask, strict=True) if not m] == [
        p for p in paths if p.endswith("['router_choice_bias']")
    ] and len(paths) - sum(mask) == cfg.layers  # one held bias a layer, nothing else
    opt = optimizer(C.tiny().replace(lr=0.05, weight_decay=0.5, steps=20, warmup=0))
    trainer = Trainer(llama.make_loss(cfg), start, opt, plan="dp", logical_axes=llama.logical_axes(start))
    tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
    for _ in range(3):
        trainer.step(TokenBatch(tokens[:, :-1], tokens[:, 1:]))
    for path, a, b, m in zip(
        paths, jax.tree.leaves(trainer.params), jax.tree.leaves(start), mask, strict=True
    ):
        if m:
            assert not np.array_equal(np.asarray(a), np.asarray(b)), path  # trained (and decayed)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)  # held, bit for bit
