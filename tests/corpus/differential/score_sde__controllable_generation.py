"""Distilled from yang-song/score_sde controllable_generation.py (see SOURCES), lines 94, 208, 301.

Three predictor-corrector samplers built by factory functions and returned as
``jax.pmap(sampler, axis_name='batch')``: each runs a ``lax.fori_loop`` whose carry is
(key, x, x_mean), x drawn from the prior with the device's own key, and conditions on data
(inpainting with a mask), a grayscale image (colorization), or labels (class-conditional).
"""

import jax
import jax.numpy as jnp
from jax import random

N_STEPS = 4


class VPSDE:
    T, N = 1.0, N_STEPS

    def prior_sampling(self, rng, shape):
        return random.normal(rng, shape)

    def marginal_prob(self, x, t):
        mean = x * jnp.exp(-0.5 * t)[:, None]
        return mean, jnp.sqrt(1 - jnp.exp(-t))


def score(state, x, t):
    return -x * state["scale"] / (1.0 + t[:, None])


def update_fn(rng, state, x, vec_t):
    x_mean = x + 0.1 * score(state, x, vec_t)
    return x_mean + 0.05 * random.normal(rng, x.shape), x_mean


def get_pc_inpainter(sde, eps=1e-3):
    def inpaint_update_fn(rng, state, data, mask, x, t):
        rng, step_rng = random.split(rng)
        vec_t = jnp.ones(data.shape[0]) * t
        x, x_mean = update_fn(step_rng, state, x, vec_t)
        masked_data_mean, std = sde.marginal_prob(data, vec_t)
        masked_data = masked_data_mean + random.normal(rng, x.shape) * std[:, None]
        return x * (1.0 - mask) + masked_data * mask, x * (1.0 - mask) + masked_data_mean * mask

    def pc_inpainter(rng, state, data, mask):
        rng, step_rng = random.split(rng)
        x = data * mask + sde.prior_sampling(step_rng, data.shape) * (1.0 - mask)
        timesteps = jnp.linspace(sde.T, eps, sde.N)

        def loop_body(i, val):
            rng, x, x_mean = val
            rng, step_rng = random.split(rng)
            x, x_mean = inpaint_update_fn(step_rng, state, data, mask, x, timesteps[i])
            return rng, x, x_mean

        _, x, x_mean = jax.lax.fori_loop(0, sde.N, loop_body, (rng, x, x))
        return x_mean

    return jax.pmap(pc_inpainter, axis_name="batch")


def get_pc_colorizer(sde, eps=1e-3):
    def pc_colorizer(rng, state, gray_scale_img):
        rng, step_rng = random.split(rng)
        x = jnp.tile(gray_scale_img, (1, 3)) + sde.prior_sampling(step_rng, (gray_scale_img.shape[0], 3)) * 0.1
        timesteps = jnp.linspace(sde.T, eps, sde.N)

        def loop_body(i, val):
            rng, x, x_mean = val
            vec_t = jnp.ones(x.shape[0]) * timesteps[i]
            rng, step_rng = random.split(rng)
            x, x_mean = update_fn(step_rng, state, x, vec_t)
            x = x - (x.mean(-1, keepdims=True) - gray_scale_img)
            return rng, x, x_mean

        _, x, x_mean = jax.lax.fori_loop(0, sde.N, loop_body, (rng, x, x))
        return x

    return jax.pmap(pc_colorizer, axis_name="batch")


def get_pc_conditional_sampler(sde, shape, eps=1e-3):
    def pc_conditional_sampler(rng, score_state, labels):
        rng, step_rng = random.split(rng)
        x = sde.prior_sampling(step_rng, shape)
        timesteps = jnp.linspace(sde.T, eps, sde.N)

        def loop_body(i, val):
            rng, x, x_mean = val
            vec_t = jnp.ones(shape[0]) * timesteps[i]
            rng, step_rng = random.split(rng)
            x, x_mean = update_fn(step_rng, score_state, x + 0.01 * labels[:, None], vec_t)
            return rng, x, x_mean

        _, x, x_mean = jax.lax.fori_loop(0, sde.N, loop_body, (rng, x, x))
        return x_mean

    return jax.pmap(pc_conditional_sampler, axis_name="batch")


n = jax.local_device_count()
sde = VPSDE()
rngs = random.split(random.PRNGKey(12), n)
state = {"scale": jnp.full((n,), 0.8)}
data = jnp.arange(n * 3 * 2.0).reshape(n, 3, 2) / 10
mask = jnp.tile(jnp.array([[1.0, 0.0]]), (n, 3, 1))
out_inpainted = get_pc_inpainter(sde)(rngs, state, data, mask)
out_colorized = get_pc_colorizer(sde)(rngs, state, data[..., :1])
out_conditional = get_pc_conditional_sampler(sde, (3, 2))(rngs, state, jnp.arange(n * 3.0).reshape(n, 3))
