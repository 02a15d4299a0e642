"""Distilled from yang-song/score_sde sampling.py (see SOURCES), lines 439, 463, 472.

A predictor-corrector sampler returned as ``jax.pmap(pc_sampler, axis_name='batch')`` (a
``lax.fori_loop`` over timesteps; it also returns a Python int, the number of function
evaluations, which pmap stacks per device), and the ODE sampler's two bare ``@jax.pmap``
helpers (a denoising step and the drift).
"""

import jax
import jax.numpy as jnp
from jax import random

N, SNR = 4, 0.16


def score_fn(state, x, t):
    return -x * state["scale"] / (1.0 + t[:, None])


def get_pc_sampler(shape, n_steps=1, eps=1e-3):
    def pc_sampler(rng, state):
        rng, step_rng = random.split(rng)
        x = random.normal(step_rng, shape)
        timesteps = jnp.linspace(1.0, eps, N)

        def loop_body(i, val):
            rng, x, x_mean = val
            vec_t = jnp.ones(shape[0]) * timesteps[i]
            rng, step_rng = random.split(rng)
            grad = score_fn(state, x, vec_t)
            step_size = (SNR * jnp.linalg.norm(random.normal(step_rng, x.shape)) / jnp.linalg.norm(grad)) ** 2 * 2
            x = x + step_size * grad
            rng, step_rng = random.split(rng)
            x_mean = x + 0.1 * score_fn(state, x, vec_t)
            return rng, x_mean + 0.05 * random.normal(step_rng, x.shape), x_mean

        _, x, x_mean = jax.lax.fori_loop(0, N, loop_body, (rng, x, x))
        return x_mean, N * (n_steps + 1)

    return jax.pmap(pc_sampler, axis_name="batch")


def get_ode_sampler(eps=1e-3):
    @jax.pmap
    def denoise_update_fn(rng, state, x):
        vec_eps = jnp.ones((x.shape[0],)) * eps
        x_mean = x + 0.1 * score_fn(state, x, vec_eps)
        return x_mean + 0.0 * random.normal(rng, x.shape)

    @jax.pmap
    def drift_fn(state, x, t):
        return -0.5 * x * (1.0 + t[:, None]) - 0.5 * score_fn(state, x, t)

    return denoise_update_fn, drift_fn


n = jax.local_device_count()
rngs = random.split(random.PRNGKey(13), n)
state = {"scale": jnp.linspace(0.5, 1.0, n)}
out_samples, out_nfe = get_pc_sampler((3, 2))(rngs, state)
denoise_update_fn, drift_fn = get_ode_sampler()
x = jnp.arange(n * 3 * 2.0).reshape(n, 3, 2) / 10
out_denoised = denoise_update_fn(rngs, state, x)
out_drift = drift_fn(state, x, jnp.full((n, 3), 0.3))
