"""Distilled from ferminet__ferminet__constants.py and ferminet__ferminet__train.py (google-deepmind/ferminet).

A module-level pmap alias, ``pmap = functools.partial(jax.pmap, axis_name=PMAP_AXIS_NAME)``,
applied elsewhere with more arguments; plus a module-level pmapped function. Nothing may build
a mesh at import; the short call maps 4 walkers' blocks over 8 devices.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

PMAP_AXIS_NAME = "qmc_pmap_axis"
pmap = functools.partial(jax.pmap, axis_name=PMAP_AXIS_NAME)

energy = jax.pmap(lambda x: jax.lax.pmean(jnp.sum(x**2, axis=-1), PMAP_AXIS_NAME), axis_name=PMAP_AXIS_NAME)


@functools.partial(pmap, donate_argnums=(1,))
def step(params, data):
    e = jnp.sum((data * params) ** 2, axis=-1)
    mean = jax.lax.pmean(jnp.mean(e), axis_name=PMAP_AXIS_NAME)
    return params - 0.01 * mean, data * 0.5


n = jax.local_device_count()
walkers = np.linspace(-1, 1, n * 6 * 3, dtype=np.float32).reshape(n, 6, 3)
params = np.ones((n, 3), np.float32)
out_energy = energy(walkers)
out_step = step(params, walkers)
out_short = energy(walkers[:4])
