"""Distilled from lucidrains/progen progen_transformer/utils.py (see SOURCES), line 70.

``pmap`` imported from jax, applied to a ``jit(vmap(loss))`` with ``in_axes=(None, None, 0)`` and
``out_axes=0``: parameters and key broadcast, the data split over devices, then a value_and_grad
over the mean of the pmapped losses.
"""

import jax.numpy as np
from jax import jit, pmap, random, value_and_grad, vmap


def cross_entropy(logits, targets, axis=-1):
    logprobs = logits - np.log(np.sum(np.exp(logits), axis=axis, keepdims=True))
    nll = np.take_along_axis(logprobs, np.expand_dims(targets, axis=axis), axis=axis)
    return np.mean(-nll)


def apply(params, key, ids):
    emb = params["emb"][ids] + 0.0 * random.normal(key, ())
    return emb @ params["out"]


def get_loss_fn(data_parallel=False):
    def loss_fn(params, key, data):
        ids, labels = data[:-1], data[1:]
        return cross_entropy(apply(params, key, ids), labels, axis=-1)

    loss_fn = jit(vmap(loss_fn, in_axes=(None, None, 0), out_axes=0))
    if data_parallel:
        loss_fn = pmap(loss_fn, in_axes=(None, None, 0), out_axes=0)

    @value_and_grad
    def batched_loss_fn(params, key, data):
        return np.mean(loss_fn(params, key, data))

    return batched_loss_fn


params = {"emb": np.arange(10 * 4.0).reshape(10, 4) / 40, "out": np.ones((4, 10)) * 0.1}
data = np.arange(4 * 2 * 6).reshape(4, 2, 6) % 10
out_value, out_grads = get_loss_fn(data_parallel=True)(params, random.PRNGKey(0), data)
