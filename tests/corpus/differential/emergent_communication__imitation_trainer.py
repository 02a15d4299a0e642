"""Distilled from deepmind/emergent_communication_at_scale trainers/imitation_trainer.py (see SOURCES), lines 25, 40.

A key-splitting ``@jax.pmap``, and an update function passed in, pmapped with ``axis_name='i'``
on an attribute and called with keyword arguments only (pmap maps them over axis 0).
"""

import jax
import jax.numpy as jnp


@jax.pmap
def _split_keys_pmap(key):
    return tuple(jax.random.split(key))


def imitation_update_fn(params_oracle, params_student, state_oracle, state_student, opt_state, games, rng):
    targets = games @ params_oracle + state_oracle

    def loss(p):
        return jnp.mean((games @ p + state_student - targets) ** 2)

    value, grads = jax.value_and_grad(loss)(params_student)
    grads = jax.lax.pmean(grads, axis_name="i")
    opt_state = opt_state + grads**2
    new_params = params_student - 0.1 * grads / jnp.sqrt(opt_state + 1e-6)
    noise = jax.random.uniform(rng, ()) * 0
    return new_params, state_student + noise, opt_state, jax.lax.pmean(value, "i")


class ImitateTrainer:
    def __init__(self, imitation_update_fn):
        self._pmap_imitation_learning = jax.pmap(imitation_update_fn, axis_name="i")

    def imitate(self, rng, oracle, student, games):
        rng_sampling, rng_training = _split_keys_pmap(rng)
        return rng_sampling, self._pmap_imitation_learning(
            params_oracle=oracle[0],
            params_student=student[0],
            state_oracle=oracle[1],
            state_student=student[1],
            opt_state=student[2],
            games=games,
            rng=rng_training,
        )


n = jax.local_device_count()
oracle = (jnp.ones((n, 3)) * 0.3, jnp.full((n, 5), 0.1))
student = (jnp.zeros((n, 3)), jnp.zeros((n, 5)), jnp.zeros((n, 3)))
games = jnp.arange(n * 5 * 3.0).reshape(n, 5, 3) / 15
out_sampling, out_update = ImitateTrainer(imitation_update_fn).imitate(
    jax.random.split(jax.random.PRNGKey(5), n), oracle, student, games
)
