"""Distilled from dm_haiku__examples__imagenet__train.py (deepmind/dm-haiku, see ../legacy/SOURCES).

A decorated train step with donate_argnums and pmean'd gradients and state, and the initial
state made by an immediately called pmap over a broadcast raw PRNGKey.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def forward(params, state, images):
    h = images @ params["w"] + params["b"]
    new_state = {"mean": 0.9 * state["mean"] + 0.1 * jnp.mean(h, axis=0)}
    return h, new_state


def loss_fn(params, state, batch):
    logits, state = forward(params, state, batch["images"])
    labels = jax.nn.one_hot(batch["labels"], 3)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1)), state


@functools.partial(jax.pmap, axis_name="i", donate_argnums=(0, 1, 2))
def train_step(params, state, opt_state, batch):
    grads, new_state = jax.grad(loss_fn, has_aux=True)(params, state, batch)
    grads = jax.lax.pmean(grads, axis_name="i")
    new_state = jax.lax.pmean(new_state, axis_name="i")
    new_opt_state = jax.tree.map(lambda m, g: 0.9 * m + g, opt_state, grads)
    new_params = jax.tree.map(lambda p, m: p - 0.1 * m, params, new_opt_state)
    return new_params, new_state, new_opt_state


def make_initial_state(rng, batch):
    w = jax.random.normal(rng, (4, 3)) * 0.1
    params = {"w": w, "b": jnp.zeros(3)}
    _, state = forward(params, {"mean": jnp.zeros(3)}, batch["images"])
    opt_state = jax.tree.map(jnp.zeros_like, params)
    return params, state, opt_state


n = jax.local_device_count()
images = np.linspace(-1, 1, n * 5 * 4, dtype=np.float32).reshape(n, 5, 4)
batch = {"images": images, "labels": (np.arange(n * 5) % 3).reshape(n, 5)}
rng = jax.random.PRNGKey(428)
rng = jnp.broadcast_to(rng, (n,) + rng.shape)
params, state, opt_state = jax.pmap(make_initial_state)(rng, batch)
for _ in range(2):
    params, state, opt_state = train_step(params, state, opt_state, batch)
out = jax.device_get((params, state, opt_state))
