"""Distilled from deepmind/emergent_communication_at_scale trainers/reset_trainer.py (see SOURCES), lines 94, 99, 100.

An init function pmapped through ``functools.partial`` (imported as ``fn``) and called with
keyword arguments, and two optimizer-init functions passed in and pmapped bare.
"""

import functools as fn

import jax
import jax.numpy as jnp


def game_init_fn(init_games, rng, training_mode):
    k1, k2 = jax.random.split(rng)
    speaker = {"w": jax.random.normal(k1, (init_games.shape[-1], 4)) * training_mode}
    listener = {"w": jax.random.normal(k2, (4, 2))}
    return (speaker, listener), {"steps": jnp.zeros((), jnp.int32)}


def adam_init(params):
    return jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params), jnp.zeros([], jnp.int32)


def sgd_init(params):
    return {"momentum": jax.tree.map(lambda p: p * 0.0 + 1.0, params)}


def reset_agents(rng_key, games, opt_speaker_init_fn, opt_listener_init_fn):
    params_init_pmap = jax.pmap(
        fn.partial(
            game_init_fn,
            training_mode=1.0,
        )
    )
    opt_speaker_init_pmap = jax.pmap(opt_speaker_init_fn)
    opt_listener_init_pmap = jax.pmap(opt_listener_init_fn)
    (speaker, listener), states = params_init_pmap(init_games=games, rng=rng_key)
    return (speaker, listener), states, opt_speaker_init_pmap(speaker), opt_listener_init_pmap(listener)


n = jax.local_device_count()
rng = jnp.broadcast_to(jax.random.PRNGKey(2), (n, 2))  # same init on every device
out = reset_agents(rng, jnp.ones((n, 6, 3)), adam_init, sgd_init)
