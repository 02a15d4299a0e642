"""Distilled from deepmind/emergent_communication_at_scale utils/population_storage.py (see SOURCES), lines 155, 160.

The same init pmaps built in a loop over agent kinds (``zip`` of names and init functions), the
keys broadcast to every device first.
"""

import functools as fn

import jax
import jax.numpy as jnp


def game_init_fn(init_games, rng, training_mode):
    return {"w": jax.random.normal(rng, (init_games.shape[-1], 2)) * training_mode}, {"count": jnp.zeros(())}


def opt_init_a(params):
    return jax.tree.map(jnp.zeros_like, params)


def opt_init_b(params):
    return jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)


def initialize(rng_key, games, num_agents=(2, 1)):
    stored = {"params": [], "states": [], "opt_states": []}
    for num, opt_init_fn in zip(num_agents, (opt_init_a, opt_init_b), strict=True):
        params_init_pmap = jax.pmap(
            fn.partial(
                game_init_fn,
                training_mode=2.0,
            )
        )
        opt_init_pmap = jax.pmap(opt_init_fn)
        for _ in range(num):
            rng_key, rng = jax.random.split(rng_key)
            rng = jnp.broadcast_to(rng, (games.shape[0], *rng.shape))
            params, states = params_init_pmap(init_games=games, rng=rng)
            stored["params"].append(params)
            stored["states"].append(states)
            stored["opt_states"].append(opt_init_pmap(params))
    return stored


out = initialize(jax.random.PRNGKey(9), jnp.ones((jax.local_device_count(), 3, 4)))
