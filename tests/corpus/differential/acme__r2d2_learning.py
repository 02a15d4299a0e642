"""Distilled from google-deepmind/acme acme/agents/jax/r2d2/learning.py (see SOURCES), line 218.

A recurrent learner's SGD step: an unrolled ``lax.scan`` over time from a zero core state,
importance-weighted loss, priorities per sequence, gradients averaged with ``pmean``; pmapped on
an attribute.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

_PMAP_AXIS_NAME = "data"


class TrainingState(NamedTuple):
    params: jnp.ndarray
    target_params: jnp.ndarray
    steps: jnp.ndarray


def unroll(params, observations):
    def core(h, o):
        h = jnp.tanh(o @ params["w_in"] + h @ params["w_h"])
        return h, h @ params["w_out"]

    _, q = jax.lax.scan(core, jnp.zeros((observations.shape[1], params["w_h"].shape[0])), observations)
    return q


def sgd_step(state, samples):
    def loss(params):
        q = unroll(params, samples["obs"])
        q_target = unroll(state.target_params, samples["obs"])
        td = samples["reward"][:-1] + 0.99 * q_target[1:].max(-1) - jnp.take_along_axis(q[:-1], samples["action"][:-1, :, None], -1)[..., 0]
        priorities = jnp.abs(td).max(0)
        return jnp.mean(samples["weights"] * jnp.mean(td**2, 0)), priorities

    (value, priorities), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
    grads = jax.lax.pmean(grads, _PMAP_AXIS_NAME)
    params = jax.tree.map(lambda p, g: p - 0.05 * g, state.params, grads)
    steps = state.steps + 1
    target = jax.tree.map(lambda t, p: jnp.where(steps % 2 == 0, p, t), state.target_params, params)
    return TrainingState(params, target, steps), priorities, {"loss": jax.lax.pmean(value, _PMAP_AXIS_NAME)}


class R2D2Learner:
    def __init__(self):
        self._sgd_step = jax.pmap(sgd_step, axis_name=_PMAP_AXIS_NAME)


n = jax.local_device_count()
params = {"w_in": jnp.ones((n, 3, 4)) * 0.1, "w_h": jnp.ones((n, 4, 4)) * 0.05, "w_out": jnp.ones((n, 4, 2)) * 0.2}
state = TrainingState(params, jax.tree.map(lambda p: p * 0.5, params), jnp.zeros((n,), jnp.int32))
samples = {
    "obs": jnp.arange(n * 5 * 2 * 3.0).reshape(n, 5, 2, 3) / 30,
    "reward": jnp.ones((n, 5, 2)),
    "action": jnp.tile(jnp.array([[0, 1]]), (n, 5, 1)),
    "weights": jnp.ones((n, 2)),
}
out = R2D2Learner()._sgd_step(state, samples)
