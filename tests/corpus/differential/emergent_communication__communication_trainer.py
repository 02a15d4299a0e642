"""Distilled from deepmind/emergent_communication_at_scale trainers/communication_trainer.py (see SOURCES), lines 29, 67.

A key-splitting ``@jax.pmap``, and an update pmapped as ``functools.partial`` of a function
with keyword-only flags, ``axis_name='i'``, donating the first three (per-device) arguments.
"""

import functools

import jax
import jax.numpy as jnp


@jax.pmap
def _split_keys_pmap(key):
    return tuple(jax.random.split(key))


def update_fn(params, states, opt_states, games, rng, training_mode, is_sharded_update):
    def loss(p):
        noise = jax.random.normal(rng, states["target"].shape)
        return jnp.mean((games @ p["w"] + noise * 0.1 - states["target"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    if is_sharded_update:
        grads = jax.lax.pmean(grads, axis_name="i")
    opt_states = jax.tree.map(lambda m, g: 0.9 * m + g, opt_states, grads)
    params = jax.tree.map(lambda p, m: p - 0.05 * training_mode * m, params, opt_states)
    scalars = {"loss": jax.lax.pmean(value, axis_name="i")}
    return params, {"target": states["target"] * 0.99}, opt_states, scalars


class Trainer:
    def __init__(self):
        self._pmap_update_fn = jax.pmap(
            functools.partial(update_fn, training_mode=1.0, is_sharded_update=True),
            axis_name="i",
            donate_argnums=(0, 1, 2),
        )

    def communicate(self, rng, params, states, opt_states, games):
        update_rng, rng = _split_keys_pmap(rng)
        return self._pmap_update_fn(params, states, opt_states, games, update_rng), rng


n = jax.local_device_count()
params = {"w": jnp.ones((n, 3, 2)) * 0.5}
states = {"target": jnp.arange(n * 4 * 2.0).reshape(n, 4, 2) / 10}
opt_states = {"w": jnp.zeros((n, 3, 2))}
games = jnp.arange(n * 4 * 3.0).reshape(n, 4, 3) / 7
out_step, out_rng = Trainer().communicate(jax.random.split(jax.random.PRNGKey(3), n), params, states, opt_states, games)
