"""Distilled from jax__examples__spmd_mnist_classifier_fromscratch.py (google/jax, see ../legacy/SOURCES).

``from jax import pmap`` applied through ``@partial(pmap, axis_name='batch')``, lax.psum of
gradients, parameters replicated with np.broadcast_to (so pmap's in_axes=0 hands each device
its copy), and raw PRNGKey splits feeding jax.random only.
"""

from functools import partial

import jax.numpy as jnp
import numpy as np
from jax import grad, lax, pmap, random
from jax.tree_util import tree_map


def init_random_params(scale, layer_sizes, rng):
    keys = random.split(rng, len(layer_sizes))
    return [
        (scale * random.normal(k, (m, n)), scale * random.normal(k, (n,)))
        for k, m, n in zip(keys, layer_sizes[:-1], layer_sizes[1:])
    ]


def predict(params, inputs):
    activations = inputs
    for w, b in params[:-1]:
        activations = jnp.tanh(jnp.dot(activations, w) + b)
    final_w, final_b = params[-1]
    logits = jnp.dot(activations, final_w) + final_b
    return logits - jax_logsumexp(logits)


def jax_logsumexp(logits):
    return jnp.log(jnp.sum(jnp.exp(logits), axis=1, keepdims=True))


def loss(params, batch):
    inputs, targets = batch
    return -jnp.mean(jnp.sum(predict(params, inputs) * targets, axis=1))


num_devices = 8
step_size = 0.1


@partial(pmap, axis_name="batch")
def spmd_update(params, batch):
    grads = grad(loss)(params, batch)
    grads = [(lax.psum(dw, "batch"), lax.psum(db, "batch")) for dw, db in grads]
    return [(w - step_size * dw, b - step_size * db) for (w, b), (dw, db) in zip(params, grads)]


init_params = init_random_params(0.1, [6, 5, 3], random.PRNGKey(0))
replicate_array = lambda x: np.broadcast_to(x, (num_devices,) + x.shape)  # noqa: E731
replicated_params = tree_map(replicate_array, init_params)
images = np.linspace(-1, 1, num_devices * 4 * 6, dtype=np.float32).reshape(num_devices, 4, 6)
labels = np.eye(3, dtype=np.float32)[np.arange(num_devices * 4) % 3].reshape(num_devices, 4, 3)
for _ in range(2):
    replicated_params = spmd_update(replicated_params, (images, labels))
out = tree_map(lambda x: x[0], replicated_params)
