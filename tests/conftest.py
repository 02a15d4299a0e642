"""Test set-up: 8 simulated CPU devices, configured once before JAX starts its backend.

The backend is started here, so no test can change the device count for the tests after it
(a CLI test that asks for another count must meet the "already started" error, in any order).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8
