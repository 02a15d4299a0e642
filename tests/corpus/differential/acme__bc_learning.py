"""Distilled from google-deepmind/acme acme/agents/jax/bc/learning.py (see SOURCES), line 153.

An SGD step wrapped by ``process_multiple_batches`` (a ``lax.scan`` over minibatches, carrying
the training state), gradients and metrics averaged with ``lax.pmean``, pmapped on an attribute
with the axis name from a module constant.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

_PMAP_AXIS_NAME = "data"


class TrainingState(NamedTuple):
    policy_params: jnp.ndarray
    momentum: jnp.ndarray
    key: jnp.ndarray
    steps: jnp.ndarray


def process_multiple_batches(process_one_batch, num_batches):
    def _process(state, data):
        data = jax.tree.map(lambda a: a.reshape(num_batches, a.shape[0] // num_batches, *a.shape[1:]), data)
        state, aux = jax.lax.scan(process_one_batch, state, data)
        return state, jax.tree.map(jnp.mean, aux)

    return _process


def sgd_step(state, transitions):
    key, key_input = jax.random.split(state.key)

    def loss_fn(params):
        noise = jax.random.normal(key_input, transitions["action"].shape) * 0.01
        return jnp.mean((transitions["obs"] @ params - transitions["action"] - noise) ** 2)

    loss, gradients = jax.value_and_grad(loss_fn)(state.policy_params)
    gradients = jax.lax.pmean(gradients, axis_name=_PMAP_AXIS_NAME)
    metrics = jax.lax.pmean({"loss": loss, "gradient_norm": jnp.linalg.norm(gradients)}, axis_name=_PMAP_AXIS_NAME)
    momentum = 0.9 * state.momentum + gradients
    new_state = TrainingState(state.policy_params - 0.1 * momentum, momentum, key, state.steps + 1)
    return new_state, metrics


class BCLearner:
    def __init__(self, num_sgd_steps_per_step):
        step = process_multiple_batches(sgd_step, num_sgd_steps_per_step)
        self._sgd_step = jax.pmap(step, axis_name=_PMAP_AXIS_NAME)


n = jax.local_device_count()
state = TrainingState(
    jnp.zeros((n, 4, 2)), jnp.zeros((n, 4, 2)), jax.random.split(jax.random.PRNGKey(0), n), jnp.zeros((n,), jnp.int32)
)
transitions = {"obs": jnp.arange(n * 6 * 4.0).reshape(n, 6, 4) / 50, "action": jnp.ones((n, 6, 2))}
out_state, out_metrics = BCLearner(3)._sgd_step(state, transitions)
