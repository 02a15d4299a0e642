"""Distilled from deepmind/emergent_communication_at_scale lewis_experiment.py (see SOURCES), line 47.

A bare ``@jax.pmap`` that splits each device's raw key into three and returns them as a tuple.
"""

import jax


@jax.pmap
def _split_three_keys_pmap(key):
    return tuple(jax.random.split(key, num=3))


rng = jax.random.split(jax.random.PRNGKey(11), jax.local_device_count())
out_communicate, out_imitate, out_reset = _split_three_keys_pmap(rng)
