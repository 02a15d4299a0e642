"""Distilled from deepmind_research__byol__byol_experiment.py (deepmind/deepmind-research, see ../legacy/SOURCES).

pmaps of bound methods kept on the experiment object, called with keyword arguments
(``init_byol(rng=init_rng, dummy_input=inputs)``): pmap maps keyword arguments over axis 0.
"""

import jax
import jax.numpy as jnp
import numpy as np


class Experiment:
    def __init__(self):
        self.update_pmap = jax.pmap(self._update_fn, axis_name="i")

    def _make_initial_state(self, rng, dummy_input):
        w = jax.random.uniform(rng, (dummy_input.shape[-1], 2))
        return {"online": w, "target": w}

    def _update_fn(self, state, global_step, rng, inputs):
        def loss(w):
            return jnp.mean((inputs @ w - jax.random.normal(rng, (inputs.shape[0], 2))) ** 2)

        grads = jax.lax.pmean(jax.grad(loss)(state["online"]), axis_name="i")
        online = state["online"] - 0.1 * grads
        tau = 1 - 0.5 / (1.0 + global_step)
        target = jax.tree.map(lambda x, y: x + (1 - tau) * (y - x), state["target"], online)
        scalars = {"loss": jax.lax.pmean(loss(online), axis_name="i")}
        return {"online": online, "target": target}, scalars

    def init(self, inputs):
        init_rng = jax.random.split(jax.random.PRNGKey(7), jax.local_device_count())
        init_byol = jax.pmap(self._make_initial_state, axis_name="i")
        self.state = init_byol(rng=init_rng, dummy_input=inputs)

    def step(self, step, inputs):
        n = jax.local_device_count()
        rngs = jax.random.split(jax.random.PRNGKey(step), n)
        self.state, scalars = self.update_pmap(
            self.state, global_step=jnp.full((n,), step, jnp.float32), rng=rngs, inputs=inputs
        )
        return scalars


n = jax.local_device_count()
inputs = np.linspace(0, 1, n * 3 * 5, dtype=np.float32).reshape(n, 3, 5)
experiment = Experiment()
experiment.init(inputs)
out_scalars = [experiment.step(s, inputs) for s in range(2)]
out_state = jax.device_get(experiment.state)
