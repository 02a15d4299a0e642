"""Distilled from google/evojax evojax/sim_mgr.py (see SOURCES), lines 229, 241.

A rollout (``lax.scan`` whose carry holds reward and mask accumulators that start as constants
and become per-device) bound with ``functools.partial``, pmapped with ``in_axes=(0, 0, 0, None)``
(observation-normaliser parameters broadcast) and wrapped in ``jax.jit``, once for training and
once for validation.
"""

from functools import partial

import jax
import jax.numpy as jnp


def step_once(carry, input_data, task_scale):
    task_state, policy_state, params, obs_params, accumulated_reward, valid_mask = carry
    obs = (task_state - obs_params["mean"]) / obs_params["std"]
    actions = jnp.tanh(obs * params)
    policy_state = policy_state + 1
    task_state = task_state + 0.1 * actions.sum(-1, keepdims=True)
    reward = -jnp.sum(actions**2, axis=-1) * task_scale
    done = (task_state[:, 0] > 1.0).astype(jnp.float32)
    accumulated_reward = accumulated_reward + reward * valid_mask
    valid_mask = valid_mask * (1 - done.ravel())
    return (task_state, policy_state, params, obs_params, accumulated_reward, valid_mask), (obs, valid_mask)


def rollout(task_states, policy_states, params, obs_params, step_once_fn, max_steps):
    accumulated_rewards = jnp.zeros(params.shape[0])
    valid_masks = jnp.ones(params.shape[0])
    (task_states, policy_states, params, obs_params, accumulated_rewards, valid_masks), (obs_set, obs_mask) = (
        jax.lax.scan(
            step_once_fn,
            (task_states, policy_states, params, obs_params, accumulated_rewards, valid_masks),
            (),
            max_steps,
        )
    )
    return accumulated_rewards, obs_set, obs_mask, task_states


class SimManager:
    def __init__(self):
        self._train_rollout_fn = partial(rollout, step_once_fn=partial(step_once, task_scale=1.0), max_steps=5)
        self._train_rollout_fn = jax.jit(jax.pmap(self._train_rollout_fn, in_axes=(0, 0, 0, None)))
        self._valid_rollout_fn = partial(rollout, step_once_fn=partial(step_once, task_scale=0.5), max_steps=3)
        self._valid_rollout_fn = jax.jit(jax.pmap(self._valid_rollout_fn, in_axes=(0, 0, 0, None)))


n = jax.local_device_count()
task_states = jnp.arange(n * 2 * 3.0).reshape(n, 2, 3) / 20
policy_states = jnp.zeros((n, 2))
params = jnp.ones((n, 2, 3)) * 0.2
obs_params = {"mean": jnp.full((3,), 0.1), "std": jnp.full((3,), 2.0)}
sim = SimManager()
out_train = sim._train_rollout_fn(task_states, policy_states, params, obs_params)
out_valid = sim._valid_rollout_fn(task_states, policy_states, params, obs_params)
