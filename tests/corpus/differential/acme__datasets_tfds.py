"""Distilled from google-deepmind/acme acme/datasets/tfds.py (see SOURCES), line 190.

Sampling from a dataset sharded over devices: each device draws indices from its shard with its
own key, the samples are gathered with ``lax.all_gather(..., tiled=True)`` so every device holds
the whole batch, and the key advances.
"""

import jax
import jax.numpy as jnp
import numpy as np

_PMAP_AXIS_NAME = "data"


def make_sampler(dataset_size, batch_size, num_devices):
    def sample_per_shard(data, key):
        key1, key2 = jax.random.split(key)
        indices = jax.random.randint(key1, (batch_size // num_devices,), minval=0, maxval=dataset_size // num_devices)
        data_sample = jax.tree.map(lambda d: jnp.take(d, indices, axis=0), data)
        return data_sample, key2

    def sample(data, key):
        data_sample, key = sample_per_shard(data, key)
        data_sample = jax.lax.all_gather(data_sample, axis_name=_PMAP_AXIS_NAME, axis=0, tiled=True)
        return data_sample, key

    pmapped_sample = jax.pmap(sample, axis_name=_PMAP_AXIS_NAME)
    return pmapped_sample


n = jax.local_device_count()
data = {"obs": np.arange(n * 4 * 3.0).reshape(n, 4, 3), "reward": np.arange(n * 4.0).reshape(n, 4)}
keys = jnp.stack(jax.random.split(jax.random.PRNGKey(4), n))
pmapped_sample = make_sampler(n * 4, 2 * n, n)
out_sample, out_keys = pmapped_sample(data, keys)
