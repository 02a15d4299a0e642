"""Masked, packed next-token loss of the token families (issue 37): the GPT's, the Llama's and the
Gemma's ``small`` configs in float64 against the NumPy float64 reference (``reference_np.token_loss``),
a packed row's loss as the sum of its documents run alone, all-zero weights, and bad batches refused."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshkit.models import reference_np, registry
from meshkit.models.token_loss import BatchError
from meshkit.spec.batch import TokenBatch

FAMILIES = ("gpt", "llama", "gemma")
ROWS = ((5, 7, 4), (9, 7))
"""Documents' lengths packed in each row of 16 tokens."""


# Tiers: the plain pair and all-zero weights are core on the GPT and sweep on the Llama and the Gemma (the
# weighted mean is token_loss.cross_entropy, the families' one; each family reads a batch's weights in
# test_masked_packed_loss_equals_numpy_float64_and_its_documents_alone, a plain pair in its plan tests).
GPT_CORE = [pytest.param(name, marks=() if name == "gpt" else pytest.mark.sweep) for name in FAMILIES]


def packed(vocab: int, seed: int = 0) -> tuple[TokenBatch, list]:
    """A batch of ``ROWS`` packed documents: segment ids, positions reset per document, weights a mask of
    each document's second half scaled by tokens / masked tokens; and each document alone as
    ``(inputs, targets, mask)`` of its length."""
    rng = np.random.default_rng(seed)
    t = sum(ROWS[0])
    tokens = rng.integers(0, vocab, size=(len(ROWS), t + 1)).astype(np.int32)
    docs = []
    seg, pos = np.zeros((len(ROWS), t), np.int32), np.zeros((len(ROWS), t), np.int32)
    mask = np.zeros((len(ROWS), t))
    for r, lengths in enumerate(ROWS):
        start = 0
        for d, n in enumerate(lengths):
            seg[r, start : start + n] = d + 1
            pos[r, start : start + n] = np.arange(n)
            mask[r, start + n // 2 : start + n] = 1.0
            docs.append((tokens[r : r + 1, start : start + n], tokens[r : r + 1, start + 1 : start + n + 1],
                         mask[r : r + 1, start : start + n]))  # fmt: skip
            start += n
    scale = mask.size / mask.sum()
    return TokenBatch(tokens[:, :-1], tokens[:, 1:], mask * scale, seg, pos), [(*d, scale) for d in docs]


@functools.cache
def model(name: str):
    """(config, module, params) of the family's small config in float64, the loop form."""
    family = registry.family(name)
    cfg = dataclasses.replace(family.small(layers=1, heads=4, experts=0, scan_layers=False), dtype="float64")
    return cfg, family.module, family.module.init(jax.random.key(1), cfg)


@pytest.mark.parametrize("name", FAMILIES)
def test_masked_packed_loss_equals_numpy_float64_and_its_documents_alone(name):
    with jax.enable_x64(True):
        cfg, module, params = model(name)
        batch, docs = packed(cfg.vocab_size)
        loss = jax.jit(module.make_loss(cfg))
        value = float(loss(params, batch))
        assert value == pytest.approx(reference_np.token_loss(params, cfg, batch), rel=1e-10, abs=0)
        # each document alone, positions 0..n-1 and no segments: the packed mean is their weighted sum
        alone = (
            sum(float(loss(params, TokenBatch(x, y, m * scale))) * x.size for x, y, m, scale in docs)
            / batch.inputs.size
        )
        assert value == pytest.approx(alone, rel=1e-10, abs=0)
        # the segments change the loss, and so do the positions (a rotary's only across documents: it
        # sees relative positions): the test sees both
        assert abs(float(loss(params, batch._replace(segment_ids=None))) - value) > 1e-6
        whole = batch._replace(segment_ids=None)
        assert abs(float(loss(params, whole._replace(positions=None))) - float(loss(params, whole))) > 1e-6


@pytest.mark.parametrize("name", GPT_CORE)
def test_plain_pair_and_unit_weights_are_the_plain_mean(name):
    with jax.enable_x64(True):
        cfg, module, params = model(name)
        batch, _ = packed(cfg.vocab_size, seed=1)
        pair = (batch.inputs, batch.targets)
        loss = jax.jit(module.make_loss(cfg))
        value = float(loss(params, pair))
        assert value == pytest.approx(reference_np.token_loss(params, cfg, pair), rel=1e-10, abs=0)
        ones = TokenBatch(*pair, weights=np.ones(batch.inputs.shape))
        assert float(loss(params, ones)) == pytest.approx(value, rel=1e-12, abs=0)


@pytest.mark.parametrize("name", GPT_CORE)
def test_all_zero_weights_give_zero_loss_and_zero_gradients(name):
    with jax.enable_x64(True):
        cfg, module, params = model(name)
        batch, _ = packed(cfg.vocab_size)
        value, grads = jax.jit(jax.value_and_grad(module.make_loss(cfg)))(
            params, batch._replace(weights=np.zeros(batch.inputs.shape))
        )
        assert float(value) == 0.0
        leaves = jax.tree.leaves(grads)
        assert all(bool(jnp.all(g == 0)) for g in leaves), "a zero-weight batch moved a parameter"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"weights": np.ones((2, 8))}, "batch weights has shape (2, 8) but the inputs (2, 16)"),
        ({"weights": np.ones((2, 16), np.int32)}, "batch weights must be floats"),
        ({"segment_ids": np.zeros((2, 16))}, "batch segment_ids must be integers"),
        ({"positions": np.zeros((16,), np.int32)}, "batch positions has shape (16,)"),
    ],
)
def test_bad_batches_are_refused_in_one_line(change, says):
    cfg, module, params = model("llama")
    batch, _ = packed(cfg.vocab_size)
    with pytest.raises(BatchError) as e:
        module.make_loss(cfg)(params, batch._replace(**change))
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", FAMILIES)
def test_scanned_form_takes_the_packed_batch_as_the_loop_form(name):
    with jax.enable_x64(True):
        cfg, module, params = model(name)
        batch, _ = packed(cfg.vocab_size)
        scanned = dataclasses.replace(cfg, scan_layers=True)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])
        got = float(jax.jit(module.make_loss(scanned))({**params, "blocks": stacked}, batch))
        assert got == pytest.approx(float(jax.jit(module.make_loss(cfg))(params, batch)), rel=1e-12, abs=0)
