"""Distilled from google-deepmind/kfac-jax examples/optimizers.py (see SOURCES), lines 581, 623.

An optax init pmapped through a lambda that ignores its extra arguments (``lambda p, *_``; the
function state passed is None), and a preconditioner init closing over the wrapper's settings,
both with ``axis_name`` read from an attribute. (The step pmap at line 575, ``in_axes`` built by
tuple arithmetic, and the key-splitting one at 585, ``static_broadcasted_argnums``, are left
with a recipe.)
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class OptaxAndPreconditionState(NamedTuple):
    optax_state: object
    precond_state: object = None


class Wrapper:
    def __init__(self, learning_rate, damping):
        self._optax_optimizer = optax.with_extra_args_support(optax.adam(learning_rate))
        self._batch_process_func = lambda batch: {"x": batch["x"] * 2.0}
        self.pmap_axis_name = "optax_axis"
        self._pmap_init = jax.pmap(
            lambda p, *_: OptaxAndPreconditionState(self._optax_optimizer.init(p)),
            axis_name=self.pmap_axis_name,
        )

        def _init_preconditioner(params, rng, batch, func_state=None):
            batch = self._batch_process_func(batch)
            x = batch["x"] + 0.01 * jax.random.normal(rng, batch["x"].shape)
            factor = jax.lax.pmean(x.T @ x / x.shape[0], self.pmap_axis_name)
            return {"factor": factor + damping * jnp.eye(x.shape[1]), "count": jnp.zeros([], jnp.int32)}

        self._pmap_init_preconditioner = jax.pmap(
            _init_preconditioner,
            axis_name=self.pmap_axis_name,
        )

    def init(self, params, rng, batch, func_state=None):
        return self._pmap_init(params, rng, batch, func_state), self._pmap_init_preconditioner(params, rng, batch)


n = jax.local_device_count()
params = {"w": jnp.ones((n, 3, 2))}
batch = {"x": jnp.arange(n * 4 * 3.0).reshape(n, 4, 3) / 12}
out = Wrapper(1e-3, 1e-2).init(params, jax.random.split(jax.random.PRNGKey(1), n), batch)
