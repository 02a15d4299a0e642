"""Distilled from google-research/vdm utils.py (see SOURCES), line 73.

A general-purpose wrapper: ``@functools.partial(jax.pmap, axis_name=axis_name)`` on a function of
``*args, **kwargs`` whose outputs are accumulated across devices (all-gather-and-reshape,
``pmean``, or nothing), used for both a metric (mean) and samples (concat).
"""

import functools

import jax
import jax.numpy as jnp


def allgather_and_reshape(x, axis_name="batch"):
    x = jax.lax.all_gather(x, axis_name)
    return x.reshape((-1,) + x.shape[2:])


def dist(fn, accumulate, axis_name="batch"):
    if accumulate == "concat":
        accumulate_fn = functools.partial(allgather_and_reshape, axis_name=axis_name)
    elif accumulate == "mean":
        accumulate_fn = functools.partial(jax.lax.pmean, axis_name=axis_name)
    else:
        accumulate_fn = None

    @functools.partial(jax.pmap, axis_name=axis_name)
    def pmapped_fn(*args, **kwargs):
        out = fn(*args, **kwargs)
        return out if accumulate_fn is None else jax.tree.map(accumulate_fn, out)

    return pmapped_fn


def bpd(params, x, rng):
    eps = jax.random.normal(rng, x.shape)
    return {"bpd": jnp.mean((x * params["scale"] - eps) ** 2), "kl": jnp.sum(params["scale"] ** 2)}


def sample(params, z, *, steps):
    for _ in range(steps):
        z = z - 0.1 * jnp.tanh(z * params["scale"])
    return z


n = jax.local_device_count()
params = {"scale": jnp.full((n, 3), 0.7)}
x = jnp.arange(n * 2 * 3.0).reshape(n, 2, 3) / 9
rng = jax.random.split(jax.random.PRNGKey(8), n)
out_metrics = dist(bpd, "mean")(params, x, rng)
out_samples = dist(functools.partial(sample, steps=3), "concat")(params, z=x)
out_raw = dist(bpd, "none", axis_name="devices")(params, x, rng=rng)
