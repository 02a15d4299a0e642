"""Distilled from yang-song/score_sde likelihood.py (see SOURCES), lines 67, 73, 74.

A bare ``@jax.pmap`` Hutchinson divergence (a ``jax.jvp`` of the drift through a closure over the
state), the drift pmapped by name, and a bound method (``sde.prior_logp``) pmapped.
"""

import jax
import jax.numpy as jnp
import numpy as np


class VPSDE:
    def prior_logp(self, z):
        shape = z.shape
        n = np.prod(shape[1:])
        return -n / 2.0 * np.log(2 * np.pi) - jnp.sum(z**2, axis=tuple(range(1, z.ndim))) / 2.0


def get_likelihood_fn(sde):
    def drift_fn(state, x, t):
        return -0.5 * x * state["beta"] * (1.0 + t[:, None]) + jnp.tanh(x) * state["scale"]

    def get_div_fn(fn):
        def div_fn(x, t, eps):
            _, jvp = jax.jvp(lambda xx: fn(xx, t), (x,), (eps,))
            return jnp.sum(jvp * eps, axis=tuple(range(1, x.ndim)))

        return div_fn

    @jax.pmap
    def p_div_fn(state, x, t, eps):
        div_fn = get_div_fn(lambda x, t: drift_fn(state, x, t))
        return div_fn(x, t, eps)

    p_drift_fn = jax.pmap(drift_fn)
    p_prior_logp_fn = jax.pmap(sde.prior_logp)
    return p_div_fn, p_drift_fn, p_prior_logp_fn


n = jax.local_device_count()
p_div_fn, p_drift_fn, p_prior_logp_fn = get_likelihood_fn(VPSDE())
pstate = {"beta": jnp.full((n,), 0.3), "scale": jnp.full((n,), 0.2)}
x = jnp.arange(n * 2 * 3.0).reshape(n, 2, 3) / 10
t = jnp.full((n, 2), 0.5)
eps = jnp.where(jnp.arange(n * 2 * 3).reshape(n, 2, 3) % 2 == 0, 1.0, -1.0)
out_div = p_div_fn(pstate, x, t, eps)
out_drift = p_drift_fn(pstate, x, t)
out_prior = p_prior_logp_fn(x)
